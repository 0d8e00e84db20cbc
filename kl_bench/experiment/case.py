"""One case of an experiment, end to end: pilot pass (for cv_opt), main pass, small-batch
simulation, summary rows with planning and λ columns, and the λ sweep."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import pandas as pd
import torch

from . import gradient_rows as G
from .gates import check_gates, gate_frame
from .group_baselines import BASELINES, baseline_rows, check_pair as check_baselined_pair
from ..engine.distributed import SINGLE, Ranks
from ..core.draws import Row
from ..foundation.memory import out_of_memory_said
from ..foundation.errors import SpecError
from ..foundation.formatting import fmt_count
from ..engine.monte_carlo import CaseRun, as_rows, run_case, small_batch_negative
from ..core.estimators import FULL, make_cv
from .lambdas import lambda_star_mc, sweep_frame
from ..kinds.protocols import CasePair, require_gradients
from ..core.planning import add_planning
from ..results import BATCH_SCHEMA, SWEEP_PREFIX, frame_to_csv_bytes, to_frame
from ..results.reservoir import reservoir_key
from ..results.schema import GROUP_BASELINE_SCHEMA
from .rows import summarize
from ..sampling.seeding import batch_sizes
from .spec_experiment import Experiment

SMALL_BATCH = 64            # p_neg_b64: batch size ...
SMALL_BATCHES = (256, 4096)  # ... and number of simulated batches: draws/256 within these bounds,
                             # so the simulation costs at most a quarter of the main pass
RESERVOIR = 20_000          # per-draw values kept per row (float32) for the report's ECDF plots


@dataclass
class CaseOutcome:
    run: CaseRun
    rows: list[dict]
    sweep: pd.DataFrame | None
    pilot_lambda: float | None
    reservoir: torch.Tensor      # [≤ RESERVOIR, rows] per-draw values from an independent stream
    pilot_drawn: list = dataclasses.field(default_factory=list)  # per rank: pilot batch ranges it drew

    def batch_frame(self) -> pd.DataFrame:
        """Per-batch means of every row (the report's convergence plot), long format."""
        return batch_means_frame(self.run, self.rows)


def small_batches(draws: int, pair: CasePair | None = None) -> int:
    lo, hi = SMALL_BATCHES
    if pair is not None and pair.expensive_draws:
        # A model forward per token: the simulation takes at most a quarter of the main pass (≥ 2 batches).
        return max(2, min(hi, draws // (4 * SMALL_BATCH)))
    return min(hi, max(lo, draws // 256))


def pilot_draws(draws: int, pair: CasePair | None = None) -> int:
    """Draws of the independent pilot pass that picks cv_opt's λ: a tenth of the run, ≥ 10^4 (a tenth,
    ≥ 64, where a draw costs model forward passes)."""
    if pair is not None and pair.expensive_draws:
        return min(draws, max(64, draws // 10))
    return min(draws, max(10_000, draws // 10))


def with_reference_row(rows: list[Row], pair: CasePair) -> list[Row]:
    """The rows, plus the pair's Monte Carlo reference row (e.g. ``tok:full``) where the case has no exact
    value and the spec's estimators leave it out: every row's ref_kl and z_ref need it."""
    ref = pair.reference_row()
    if ref is None or ref in {r.label for r in rows}:
        return rows
    return rows + [r for r in as_rows([pair.adapt(FULL)], pair) if r.label == ref]


def run_experiment_case(pair: CasePair, exp: Experiment, device: torch.device,
                        progress: Callable[[int], None] | None = None, draws: int | None = None,
                        resume: torch.Tensor | None = None,
                        on_sums: Callable[[torch.Tensor], None] | None = None,
                        ranks: Ranks = SINGLE) -> CaseOutcome | None:
    """``draws``: this case's number of draws (default: the experiment's). ``resume``/``on_sums``:
    checkpointing of the main pass (see :func:`kl_bench.engine.monte_carlo.run_case`). ``ranks``: the pilot and main
    passes are split across processes; rank 0 does the rest and returns the outcome, the others None."""
    if draws is not None:
        exp = dataclasses.replace(exp, draws=draws)
    rows = with_reference_row(as_rows([pair.adapt(e) for e in exp.sources], pair), pair)
    cvs = as_rows([make_cv(lam) for lam in exp.lambdas], pair)
    # The λ curve and λ* describe draws from q; under a sampler b ≠ q the cv rows are still measured
    # (against their exact E_b), but no sweep or cv_opt is made.
    joint = (bool(cvs) or exp.optimal) and not pair.has_sampler
    pilot_lambda, pilot_drawn = None, []
    if exp.optimal and joint:
        fitted, pilot_drawn = _pilot_rows(pair, exp, device, ranks)
        cvs += fitted
        pilot_lambda = fitted[-1].est.lam
    run = run_case(pair, rows + cvs, draws=exp.draws, seed=exp.seed, batches=exp.batches, chunk=exp.chunk,
                   device=device, joint=joint, progress=progress, resume=resume, on_sums=on_sums, ranks=ranks)
    if not ranks.root:
        return None
    out, sweep, values = _summarized(pair, exp, run, joint, device)
    return CaseOutcome(run, out, sweep, pilot_lambda, values[:RESERVOIR], pilot_drawn)


def _summarized(pair: CasePair, exp: Experiment, run: CaseRun, joint: bool, device: torch.device):
    """(summary rows with their planning columns and P(<0) at batch 64, the λ sweep's frame or None, the
    small-batch simulation's values) of a case's main pass."""
    small, values = small_batch_negative(pair, run.rows, batch=SMALL_BATCH, batches=small_batches(exp.draws, pair),
                                         seed=exp.seed, device=device)
    out = summarize(run)
    for r, row in zip(run.rows, out):
        add_planning(row, r.group)
        row["p_neg_b64"] = small[r.label]
    sweeps = [_lambda_sweep(pair, run, out, agg) for agg in (pair.aggregates if joint else ())]
    return out, pd.concat(sweeps, ignore_index=True) if sweeps else None, values


def _pilot_rows(pair: CasePair, exp: Experiment, device: torch.device, ranks: Ranks) -> tuple[list[Row], list]:
    """cv_opt's rows, one per aggregate, with λ fitted on an independent pilot stream, so that its scored
    variance is honest (a λ fitted on the very draws it is scored on would look better than it is)."""
    pilot = run_case(pair, [], draws=pilot_draws(exp.draws, pair), seed=exp.seed, batches=exp.batches,
                     chunk=exp.chunk, device=device, joint=True, stream="pilot", ranks=ranks)
    # Rank 0 holds the pilot's sums; every rank needs the λ (the cv_opt row is drawn everywhere).
    lams = ranks.broadcast([lambda_star_mc(pilot, agg)[0] for agg in pair.aggregates] if ranks.root else None)
    fitted = [Row(make_cv(lam if math.isfinite(lam) else 0.0, fitted=True), agg)
              for agg, lam in zip(pair.aggregates, lams)]
    return fitted, pilot.drawn


def _lambda_sweep(pair: CasePair, run: CaseRun, out: list[dict], agg: str) -> pd.DataFrame:
    """λ*'s columns of the cv rows on one aggregate (exact, and measured with its SE), and the sweep's
    frame: the exact std and P(<0) of cv(λ) over a grid, with the measured values of the rows run."""
    exact_joint = pair.exact_joint(agg)
    star, (star_mc, star_se) = exact_joint.lambda_star, lambda_star_mc(run, agg)
    best_std = math.sqrt(exact_joint.var(star)) if math.isfinite(star) else math.nan
    for r, row in zip(run.rows, out):
        if r.est.lam is not None and r.aggregate == agg:
            row.update(lambda_star=star, lambda_star_mc=star_mc, lambda_star_mc_se=star_se,
                       excess_std=_excess(row["exact_std"], best_std))
    measured = {float(r.est.lam): row["frac_negative"] for r, row in zip(run.rows, out)
                if r.est.lam is not None and not r.est.fitted and r.aggregate == agg}
    return sweep_frame(run, agg, exact_joint, pair.kl(),
                       lambda lam, a=agg: pair.exact_prob_negative(make_cv(float(lam)).fn, a), measured)




def batch_means_frame(run: CaseRun, rows: list[dict]) -> pd.DataFrame:
    parts = []
    for j, (r, row) in enumerate(zip(run.rows, rows)):
        n_k = run.counts[:, j]       # values per batch: draws, or whole groups of a token-mean row
        parts.append(pd.DataFrame({
            "case": row["case"], "estimator": row["estimator"], "lambda": row["lambda"],
            "aggregate": row["aggregate"], "batch": range(len(n_k)), "draws": (n_k * r.group).long().numpy(),
            "batch_mean": (run.shifts[j] + run.sums[:, j] / n_k).numpy()}))
    return pd.concat(parts, ignore_index=True)[list(BATCH_SCHEMA)]


def _excess(std: float, best: float) -> float:
    if not (math.isfinite(best) and best > 0):
        return math.nan
    return math.inf if math.isinf(std) else std / best - 1


@dataclass
class SpecOutcome:
    """Everything a run of a whole spec produced, before anything is written."""
    summary: pd.DataFrame
    cases: list[CaseOutcome]
    case_draws: list[int]
    wall: float
    gradients: pd.DataFrame | None = None
    world_size: int = 1
    drawn: dict[str, dict[str, list]] = dataclasses.field(default_factory=dict)  # case → pass → per rank ranges
    gradient_vectors: dict[str, Any] = dataclasses.field(default_factory=dict)  # gradients.npz
    group_baselines: pd.DataFrame | None = None        # group_baselines.csv (kl_bench.experiment.group_baselines)
    gates: pd.DataFrame | None = None                  # gates.csv (kl_bench.experiment.gates)

    def files(self) -> dict[str, bytes]:
        """The data files of a results folder (run.json is built by the caller)."""
        import io

        import numpy as np
        reservoir = {}
        for o in self.cases:
            for j, r in enumerate(o.run.rows):
                if r.est.lam is None:      # the report plots these; float32 is plenty for an ECDF
                    reservoir[reservoir_key(o.run.pair.name, r.label)] = o.reservoir[:, j].float().numpy()
        buf = io.BytesIO()
        np.savez_compressed(buf, **reservoir)
        files = {"summary.csv": frame_to_csv_bytes(self.summary),
                 "batches.csv": frame_to_csv_bytes(pd.concat([o.batch_frame() for o in self.cases],
                                                             ignore_index=True)),
                 "reservoir.npz": buf.getvalue()}
        sweeps = [o.sweep for o in self.cases if o.sweep is not None]
        if sweeps:
            files["lambda_sweep.csv"] = frame_to_csv_bytes(pd.concat(sweeps, ignore_index=True))
        if self.gradients is not None:
            files["gradients.csv"] = frame_to_csv_bytes(self.gradients)
        if self.group_baselines is not None:
            files["group_baselines.csv"] = frame_to_csv_bytes(self.group_baselines)
        if self.gates is not None:
            files["gates.csv"] = frame_to_csv_bytes(self.gates)
        if self.gradient_vectors:       # exact vectors, float64 (kl_bench.experiment.gradient_rows.vector_key)
            buf = io.BytesIO()
            np.savez_compressed(buf, **self.gradient_vectors)
            files["gradients.npz"] = buf.getvalue()
        return files


def validate_oracles(spec, pairs: list[CasePair], spec_file: str | None = None) -> None:
    """Every number needs an exact oracle: each pair refuses the estimators it has none for (and, with
    gradients, a kind without gradient oracles is refused), before any sampling."""
    sources = list(spec.experiment.sources)
    for case, pair in zip(spec.cases, pairs):
        try:
            pair.validate(sources)
            truth = pair.true_values()
            for s in sources:
                if s.target not in truth:
                    raise SpecError(f"estimator '{s.name}' estimates {s.target}, which a {pair.kind} case has no "
                                    f"exact value of (it has: {', '.join(truth)})", key="experiment.estimators")
            if spec.experiment.gradients:
                require_gradients(pair)
            _check_baseline_groups(spec, case, pair)
            check_gates(spec, pair)
        except SpecError as e:
            raise e.located(file=spec_file, case=case.name) from None


def _check_baseline_groups(spec, case, pair: CasePair) -> None:
    """Group-baseline rows: a kind with their oracle (categoricals, rollouts), whole groups in every batch."""
    groups = spec.experiment.baseline_groups
    if not groups:
        return
    check_baselined_pair(pair, groups)
    draws, batches = case.draws or spec.experiment.draws, spec.experiment.batches
    if draws // max(groups) < batches:
        raise SpecError(f"baseline_groups up to G = {max(groups)} need whole groups in each of the {batches} batches: "
                        f"give the case at least {max(groups) * batches:,} draws", key="draws")


def check_group_draws(spec, pairs: list[CasePair], spec_file: str | None = None) -> None:
    """Rows with one value per group of B draws (token-mean) need a whole group in every batch, before
    any sampling: refuse a case whose smallest batch is smaller."""
    sources = list(spec.experiment.sources)
    for case, pair, draws in zip(spec.cases, pairs, spec.case_draws()):
        group = max((pair.row_group(a) for s in sources for a in pair.aggregates_for(pair.adapt(s))), default=1)
        sizes = batch_sizes(draws, spec.experiment.batches)
        if min(sizes) < group:
            raise SpecError(f"tok_batch rows take one value per {group} draws (token_mean_batch), and {draws:,} "
                            f"draws in {len(sizes)} batches give batches of {min(sizes):,}: give the case at least "
                            f"{group * spec.experiment.batches:,} draws (its own draws or [experiment] draws), or "
                            "lower [experiment] batches", file=spec_file, case=case.name, key="draws")


def total_draws(spec) -> int:
    """Draws the progress bar counts: every case's main pass, and its gradient pass when asked for."""
    return sum(spec.case_draws()) * (2 if spec.experiment.gradients else 1)


def run_spec(spec, pairs: list[CasePair], device: torch.device, progress: Callable[[int], None] | None = None,
             resume: dict[str, torch.Tensor] | None = None,
             on_sums: Callable[[str, torch.Tensor], None] | None = None,
             on_phase: Callable[[str], None] | None = None, ranks: Ranks = SINGLE) -> SpecOutcome | None:
    """Run every case of a validated spec. ``resume``: {case: sums so far} from a checkpoint;
    ``on_sums(case, sums)`` is called after every chunk of a main pass; ``on_phase(text)`` when a case or
    phase starts; ``progress(n)`` after every n draws (main and gradient passes). ``ranks``: this
    process's share of a multi-process run (kl_bench.engine.distributed); only rank 0 gets the outcome (the
    others None), identical to a one-process run's."""

    exp = spec.experiment
    case_draws = spec.case_draws()
    t0 = time.perf_counter()
    outcomes = [_main_pass(spec, pair, n, device, progress, (resume or {}).get(pair.name), on_sums, on_phase, ranks)
                for pair, n in zip(pairs, case_draws)]
    rows = [row for o in outcomes if o is not None for row in o.rows]
    drawn = {o.run.pair.name: {**({"pilot": o.pilot_drawn} if o.pilot_drawn else {}), "main": o.run.drawn}
             for o in outcomes if o is not None}
    vectors: dict = {}
    grads = _gradient_pass(spec, pairs, device, progress, on_phase, ranks, drawn, vectors) if exp.gradients else None
    if not ranks.root:
        return None
    summary = add_sweep_columns(to_frame(rows), spec)
    return SpecOutcome(summary, outcomes, case_draws, time.perf_counter() - t0, grads, ranks.world_size, drawn,
                       vectors, _baseline_pass(spec, pairs, device, on_phase), gate_frame(spec, pairs))


def _main_pass(spec, pair: CasePair, n: int, device: torch.device, progress, resume: torch.Tensor | None, on_sums,
               on_phase, ranks: Ranks) -> CaseOutcome | None:
    """One case's pilot and main passes (:func:`run_experiment_case`), its errors located in the spec."""
    if on_phase is not None:
        on_phase(pair.name)
    chunk = spec.experiment.chunk
    with out_of_memory_said(f"sampling the case ({fmt_count(n)} draws, {fmt_count(min(n, chunk))} at once)",
                            "a smaller case, or fewer draws at once (a smaller [experiment] chunk, more batches)",
                            file=str(spec.path), case=pair.name):
        try:
            return run_experiment_case(
                pair, spec.experiment, device, progress=progress, draws=n, resume=resume,
                on_sums=None if on_sums is None else (lambda sums, name=pair.name: on_sums(name, sums)), ranks=ranks)
        except SpecError as e:              # e.g. a plug-in that returns NaN on some draws: name where
            raise e.located(file=str(spec.path), case=pair.name) from None


def _gradient_pass(spec, pairs: list[CasePair], device: torch.device, progress, on_phase, ranks: Ranks,
                   drawn: dict, vectors: dict) -> pd.DataFrame:
    """gradients.csv's rows: every estimator × mode of every case, on its own draws. ``vectors`` receives
    gradients.npz's exact vectors of the kinds that export them (:attr:`GradientOracle.exports_gradient_vectors`)."""
    exp = spec.experiment
    ests = [*exp.sources] + [make_cv(lam) for lam in exp.lambdas]
    grad_rows = []
    for pair, n in zip(pairs, spec.case_draws()):
        if on_phase is not None:
            on_phase(f"{pair.name} (gradients)")
        grad_rows += G.gradient_rows(pair, ests, draws=n, seed=exp.seed, batches=exp.batches, device=device,
                                     progress=progress, ranks=ranks, drawn=drawn.get(pair.name),
                                     vectors=vectors if pair.exports_gradient_vectors else None)
    return G.to_frame(grad_rows)


def _baseline_pass(spec, pairs: list[CasePair], device: torch.device, on_phase) -> pd.DataFrame | None:
    """group_baselines.csv's rows: every estimator (functions of log r) × {group_mean, leave_one_out} × G
    of every case, on their own streams (made on the root process alone: the same bytes for any number
    of processes)."""
    exp = spec.experiment
    if not exp.baseline_groups:
        return None
    ests = [e for e in exp.sources if not e.analytic]
    rows = []
    for pair, n in zip(pairs, spec.case_draws()):
        if on_phase is not None:
            on_phase(f"{pair.name} (group baselines)")
        rows += baseline_rows(pair, ests, list(BASELINES), exp.baseline_groups, draws=n, seed=exp.seed,
                              batches=exp.batches, device=device)
    return pd.DataFrame(rows, columns=list(GROUP_BASELINE_SCHEMA))


def add_sweep_columns(summary: pd.DataFrame, spec) -> pd.DataFrame:
    """summary.csv with one ``sweep.<key>`` column per swept case key (kl_bench.results.SWEEP_PREFIX),
    after the schema's columns; unchanged for a spec without ``[[sweep]]`` tables."""
    values = spec.sweep_values
    keys = list(dict.fromkeys(k for v in values.values() for k in v))
    for key in keys:
        summary[SWEEP_PREFIX + key] = [values.get(c, {}).get(key, math.nan) for c in summary["case"]]
    return summary
