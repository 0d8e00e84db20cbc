"""Group baselines for an estimator in the reward: GRPO's group mean and RLOO's leave-one-out. The per-draw
gradient ρ_i (f_i − b_i)·s_i, how groups are drawn, the exact moments (leave-one-out's, and the group mean's
as (1 − 1/G) and (1 − 1/G)² times them) and why the PPO clip is refused: docs/weights.md#group-baselines-reward-mode.

Each kind supplies the pieces (kl_bench.kinds.protocols.BaselineOracle): the exact E[ρ F s], E[ρ s], μ and, where
it has them, the second moments; and per-draw (F, ρ, s·u, |s|²) for the Monte Carlo rows. Categoricals are
exact throughout. Rollouts (F = f(L) on ``seq``, Σ_t f_t on ``tok``; ρ the sequence weight) have exact
expected gradients by the dynamic program and measured second moments.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..foundation.errors import SpecError
from ..kinds.protocols import BaselineExact, baseline_oracle
from ..foundation.registry import Registry
from ..sampling.seeding import PIECE_DRAWS, batch_sizes, batch_streams
from ..core.stats import mean_and_se
from ..core.targets import REVERSE


@dataclass(frozen=True)
class Baseline:
    """``centre(f, G)``: f − b for f [N] in groups of G consecutive draws (N a multiple of G), [N];
    ``factor(G)``: the per-draw gradient is factor × the leave-one-out one (exactly, draw by draw)."""
    name: str
    label: str
    centre: Callable[[torch.Tensor, int], torch.Tensor]
    factor: Callable[[int], float]


def _group_mean(f: torch.Tensor, g: int) -> torch.Tensor:
    v = f.view(-1, g)
    return (v - v.mean(1, keepdim=True)).reshape(-1)


def _leave_one_out(f: torch.Tensor, g: int) -> torch.Tensor:
    v = f.view(-1, g)
    return (v - (v.sum(1, keepdim=True) - v) / (g - 1)).reshape(-1)


BASELINES: Registry[Baseline] = Registry("baseline")
BASELINES.add("group_mean", Baseline("group_mean", "GRPO: minus the group's mean (i included)", _group_mean,
                                     lambda g: 1 - 1 / g))
BASELINES.add("leave_one_out", Baseline("leave_one_out", "RLOO: minus the mean of the other G − 1",
                                        _leave_one_out, lambda g: 1.0))


# Groups are drawn within pieces of whole groups: a spec's G may not exceed the smallest piece of any device
# (a kind may have smaller pieces still: BaselineOracle.baseline_piece, checked per case).
MAX_GROUP = min(PIECE_DRAWS.values())


def check_group(group: int, piece: int = MAX_GROUP, key: str = "group") -> None:
    """Groups are drawn within pieces of whole groups, so a group may not exceed the case's piece size."""
    if not 2 <= group <= piece:
        raise SpecError(f"a group baseline needs 2 ≤ G ≤ {piece} draws per group, got {group}", key=key)


def check_pair(pair, groups: tuple[int, ...] = ()) -> None:
    """Refuse (SpecError, one line) a case whose kind has no baseline rows, whose options they do not model,
    or whose pieces are smaller than a group in ``groups``."""
    oracle = baseline_oracle(pair)
    if oracle is None:
        raise SpecError(f"group baselines (baseline_groups) are not available on {pair.kind} cases (categorical "
                        "and rollout cases have them)", key="experiment.baseline_groups", case=pair.name)
    oracle.baseline_check()
    piece = oracle.baseline_piece(torch.device("cpu"))
    if groups and max(groups) > piece:
        raise SpecError(f"group baselines on this case need G ≤ {piece:,} (a group is drawn within one piece of "
                        f"{piece:,} draws), got {max(groups)}", key="experiment.baseline_groups", case=pair.name)


def exact_second(ex: BaselineExact, baseline: str | None, group: int) -> float:
    """E[ρ²(F − b)²|s|²] from the exact pieces (docs/weights.md); ``baseline`` None: E[ρ²F²|s|²]; NaN
    where the kind has no exact second moments."""
    if ex.phi is None:
        return math.nan
    f2, f1, f0 = ex.phi
    if baseline is None:
        return f2
    loo = f2 - 2 * ex.mu * f1 + (ex.mu**2 + ex.var / (group - 1)) * f0
    return BASELINES[baseline].factor(group) ** 2 * loo


def exact_mean(ex: BaselineExact, baseline: str | None, group: int) -> np.ndarray:
    """E[ρ(F − b)s] [P]: factor·(E[ρ F s] − μ E[ρ s]); ``baseline`` None: E[ρ F s]."""
    if baseline is None:
        return ex.rho_f_s
    return BASELINES[baseline].factor(group) * (ex.rho_f_s - ex.mu * ex.rho_s)


def _batch_sums(draw, names: list[str], group: int, stream, piece: int) -> np.ndarray:
    """[(Σ g·u, Σ |g|²) per baseline in ``names`` (None: none)] over one batch of whole groups, drawn piece
    by piece (pieces of whole groups), every baseline on the same draws: [len(names), 2]."""
    out = np.zeros((len(names), 2))
    for n, gen in stream.pieces(piece // group * group):
        f, rho, su, s2 = draw(n, gen)
        for i, name in enumerate(names):
            c = (f if name is None else BASELINES[name].centre(f, group)) * rho
            out[i] += float((c * su).sum()), float((c**2 * s2).sum())
    return out


def baseline_rows(pair, estimators, baselines, groups, *, draws: int, seed: int, batches: int = 100,
                  device=torch.device("cpu")) -> list[dict]:
    """One row per (aggregate, estimator, baseline, G): exact and Monte Carlo reward-mode gradients with
    the baseline, against the same estimator with no baseline (from the same draws). ``draws`` is rounded
    down to whole groups; batches hold whole groups. Estimators without an exact expected gradient on an
    aggregate (a non-polynomial f of a rollout's sequence log-ratio) get no row there."""
    check_pair(pair)
    rev = pair.gradient_references()[REVERSE]
    u = rev / np.linalg.norm(rev)
    piece = pair.baseline_piece(device)
    # The exact pieces do not depend on G: once per (aggregate, estimator) (a dynamic program on rollouts).
    exacts = {(agg, j): pair.baseline_exact(est, agg) if agg in pair.aggregates_for(est) else None
              for agg in pair.baseline_aggregates for j, est in enumerate(estimators)}
    rows = []
    for g in groups:
        check_group(g, piece)
        sizes = [k * g for k in batch_sizes(draws // g, batches)]
        for agg in pair.baseline_aggregates:
            streams = batch_streams(seed, f"{pair.name}/baseline-G{g}" + (f"/{agg}" if agg else ""), sizes, device)
            for j, est in enumerate(estimators):
                ex = exacts[agg, j]
                if ex is not None:
                    rows += _rows(pair, est, agg, ex, list(baselines), g, (streams, piece), u, device)
    return rows


def _rows(pair, est, agg, ex: BaselineExact, names: list[str], g: int, streams, u, device) -> list[dict]:
    """The rows of one (estimator, aggregate, G): each baseline against none, on the same draws.
    ``streams``: (the batches' streams, the piece size)."""
    streams, piece = streams
    draw = pair.baseline_draws(est, agg, u, device)
    sums = np.stack([_batch_sums(draw, [None] + names, g, s, piece) for s in streams])   # [K, 1 + |names|, 2]
    sizes = np.array([s.size for s in streams], dtype=float)
    plain = exact_mean(ex, None, g)
    plain_norm = float(np.linalg.norm(plain))
    m2_none, _ = mean_and_se(sums[:, 0, 1], sizes)
    trace_none = m2_none - plain_norm**2
    exact_trace_none = exact_second(ex, None, g) - plain_norm**2
    rows = []
    for i, name in enumerate(names, start=1):
        mean = exact_mean(ex, name, g)
        second = exact_second(ex, name, g)
        m, se = mean_and_se(sums[:, i, 0], sizes)
        m2, se2 = mean_and_se(sums[:, i, 1], sizes)
        ref_u = float(mean @ u)
        trace, exact_trace = m2 - float(mean @ mean), second - float(mean @ mean)
        ratio = exact_trace / exact_trace_none if math.isfinite(exact_trace_none) else trace / trace_none
        rows.append({
            "case": pair.name, "sampler": pair.sampler_label, "estimator": est.name, "aggregate": agg,
            "mode": "reward", "baseline": name, "group": g, "draws": int(sizes.sum()),
            "exact_shrink": float(np.linalg.norm(mean)) / plain_norm if plain_norm > 0 else math.nan,
            "mc_along_reverse": m, "exact_along_reverse": ref_u,
            "z_reverse": (m - ref_u) / se if se > 0 else math.nan,
            "mc_second": m2, "exact_second": second,
            "z_second": (m2 - second) / se2 if se2 > 0 and math.isfinite(second) else math.nan,
            "trace_cov": trace, "trace_cov_none": trace_none,
            "exact_trace_cov": exact_trace, "exact_trace_cov_none": exact_trace_none,
            "variance_ratio": ratio if (exact_trace_none if math.isfinite(exact_trace_none) else trace_none) > 0
            else math.nan})
    return rows
