"""Step audits: a trainer's KL estimate against the exact value of the policy its loss scores (docs/audit.md
§3: the six parts of logged − Σ w KL, why the SE from the exact conditional variances is valid, the
consistency check of log g).

A step's estimate is Σ_t w_t f(x_t) over the masked tokens (weights of its aggregation,
kl_bench.audit.aggregate); logged − Σ w KL splits exactly into the estimator's, the sampler's, the
mismatch's, the formula's and the precision's bias and the noise (mean 0, SE² = Σ w² Var_g f). own = Σ w f
(the trainer's own log r), from its log-probs where the adapter has them, else emulated at the dtype of its
values; the formula part is named only where that dtype cannot explain it (:func:`formula_fit`).
b is the sampler on the scored policy's logits, g on those of the pass that drew the tokens (g = b when
that pass was not captured). Steps and ranks combine through additive sums (:func:`step_sums`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..foundation.errors import SpecError
from ..foundation.formatting import fmt, measured_cells
from ..core.estimators import resolve_estimator
from ..core.stats import z_score
from ..foundation.output_paths import check_output_dir
from ..results import folders
from ..results.schema import AUDIT_COLUMNS, ENGINE_COLUMNS
from .aggregate import aggregation_units
from .exact import PositionValues

# The additive sums of one step (one float64 vector; ranks add theirs).
# The formulas a trainer's values are tested against: its declared estimator, and k1, k2, k3, each of log r
# and of −log r = log q − log p (the sign swapped, or a function of (logp, logq) called with them swapped).
FORMULAS = ((None, 1.0), (None, -1.0), ("k1", 1.0), ("k1", -1.0), ("k2", 1.0), ("k2", -1.0), ("k3", 1.0), ("k3", -1.0))
SUMS = ("denominator", "logged", "recomputed", "exact", "expected_q", "expected_b", "noise_var", "tokens",
        "sequences", "logged_negative", "p_negative", "miss", "consistency_sum", "consistency_var", "impossible",
        "expected_g", "sampling_pass", "own", "formula_tol", *(f"fit_{k}" for k in range(len(FORMULAS))),
        "own_given")


def formula_name(estimator: str, k: int) -> str:
    """FORMULAS[k] in words, for the trainer's ``estimator``."""
    name, sign = FORMULAS[k]
    return f"{name or estimator} of {'log p − log q' if sign > 0 else 'log q − log p (the sign of log r swapped)'}"


def _formula_sums(fn, values: PositionValues, logged: torch.Tensor, um: torch.Tensor,
                  own: torch.Tensor, dtype: torch.dtype) -> list:
    """Σ u f(own log r); the rounding envelope Σ u s, with s what the trainer's dtype (unit roundoff ε)
    can move f by: f over log r ± δ, δ = 8ε(1 + |log q| + |log p|) (the log-probs' rounding, with room for
    their normalisers), plus 4ε|f| (f's own); and Σ u |logged − g(±own)| for every formula g."""
    eps = torch.finfo(dtype).eps / 2
    delta = 8 * eps * (1 + values.tok_logq.abs() + values.tok_logp.abs())
    f_own = fn(own)
    tol = (fn(own + delta) - fn(own - delta)).abs() / 2 + 4 * eps * f_own.abs()
    fits = [(um * (logged - (resolve_estimator(name).fn if name else fn)(sign * own)).abs()).sum()
            for name, sign in FORMULAS]
    return [(um * f_own).sum(), (um * tol).sum(), *fits]


def formula_fit(s: dict) -> int:
    """Which formula the trainer's values fit (sums of :func:`step_sums`, any common denominator): 0 its
    declared one (the gap to f of float64 log-probs is then precision), k ≥ 1 FORMULAS[k] (it fits at least
    twice as well), −1 none (the declared one misses by over 100 times what the dtype explains)."""
    fits = [s[f"fit_{k}"] for k in range(len(FORMULAS))]
    tol = s["formula_tol"]
    if fits[0] <= tol:
        return 0
    low = min(fits[1:])
    # ties (trl.grpo is k3): the first; none where the fits are NaN (then nothing fits)
    best = next((k for k in range(1, len(fits)) if fits[k] <= low + tol), None)
    if best is None:
        return -1
    if fits[best] < fits[0] / 2:
        return best
    return -1 if fits[0] > 100 * tol else 0


def step_sums(values: PositionValues, trainer: torch.Tensor, mask: torch.Tensor, *, estimator: str,
              aggregation: str, own_logr: torch.Tensor | None = None,
              precision: torch.dtype | None = None) -> torch.Tensor:
    """The additive sums [len(SUMS)] of one step on one rank, float64 on the values' device (the caller
    moves this one small vector to the host; selecting the masked tokens is the step's one sync).

    ``values``: exact values at the masked positions of ``mask`` [B, T], in row-major order;
    ``trainer`` [B, T]: the trainer's per-token values of ``estimator`` (any dtype; padding ignored);
    ``own_logr`` [B, T]: log p − log q from the trainer's own log-probs, where known (else emulated: the
    float64 log-probs rounded to the dtype of ``trainer``, or ``precision``, the dtype of the logits or
    hidden states the audit was given, where that is less precise)."""
    device = values.kl.device
    mask = mask.to(device).bool()
    if trainer.shape != mask.shape:
        raise SpecError(f"the trainer's values have shape {list(trainer.shape)} but the mask {list(mask.shape)}")
    if values.n != int(mask.sum()):
        raise SpecError(f"{values.n} audited positions for {int(mask.sum())} masked tokens")
    col = values.column(resolve_estimator(estimator).name)
    u, d = aggregation_units(mask, aggregation)
    um = u[mask]
    fn = resolve_estimator(estimator).fn
    recomputed = fn(values.tok_logp - values.tok_logq)          # float64 log r of the sampled tokens
    logged = trainer.detach().to(device=device, dtype=torch.float64)[mask]
    drew = values.sampled                                       # the distribution the tokens came from
    possible = torch.isfinite(drew.tok_log)
    cons = torch.where(possible, drew.tok_log - drew.log_mean, torch.zeros_like(drew.tok_log))
    sums = [d, (um * logged).sum(), (um * recomputed).sum(), (um * values.kl).sum(),
            (um * values.mean_q[:, col]).sum(), (um * values.mean_b[:, col]).sum(),
            (um.square() * drew.var[:, col]).sum(), mask.sum(), mask.shape[0], (logged < 0).sum(),
            drew.neg[:, col].sum(), values.miss.sum(), cons.sum(),
            torch.where(possible, drew.log_var, torch.zeros_like(drew.log_var)).sum(),
            (~possible & ~torch.isnan(drew.tok_log)).sum(), (um * drew.mean[:, col]).sum(),
            mask.sum() if values.g is not None else 0]
    dtype = trainer.dtype if trainer.dtype.is_floating_point else torch.float32
    if precision is not None and precision.is_floating_point and torch.finfo(precision).eps > torch.finfo(dtype).eps:
        dtype = precision                          # bf16 logits: the trainer's log-probs carry their rounding
    if own_logr is None:
        own = (values.tok_logp.to(dtype) - values.tok_logq.to(dtype)).to(torch.float64)
    else:
        own = own_logr.detach().to(device=device)[mask].to(torch.float64)
        dtype = own_logr.dtype if torch.finfo(own_logr.dtype).eps > torch.finfo(dtype).eps else dtype
    sums += _formula_sums(fn, values, logged, um, own, dtype) + [0 if own_logr is None else mask.sum()]
    return torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device) for x in sums])


# The sums that are per-token weighted (Σ u·x over the step's tokens, divided by the denominator later).
WEIGHTED = ("logged", "recomputed", "exact", "expected_q", "expected_b", "expected_g", "own", "formula_tol",
            *(f"fit_{k}" for k in range(len(FORMULAS))))


def combine_micro_batches(rows: torch.Tensor) -> torch.Tensor:
    """The sums [len(SUMS)] of a step from its micro-batches' sums [J, len(SUMS)] when the number is the
    mean of the micro-batches' aggregates (Metric.micro_batches = "mean"): with D_j micro-batch j's
    denominator, the weights are u / (J·D_j), so each weighted sum becomes (1/J) Σ_j S_j / D_j and the noise
    variance (1/J²) Σ_j V_j / D_j² (the micro-batches' noises are independent given their histories, as
    steps' are); the result has denominator 1. Counts (tokens, sequences, consistency sums) add. A row
    with no sequences is a process's zero padding, not a micro-batch. One row is returned as it is."""
    if rows.shape[0] == 1:
        return rows[0]
    index = {name: i for i, name in enumerate(SUMS)}
    rows = rows[rows[:, index["sequences"]] > 0]
    if rows.shape[0] == 0:
        return torch.zeros(len(SUMS), dtype=torch.float64, device=rows.device)
    if rows.shape[0] == 1:
        return rows[0]
    j = rows.shape[0]
    d = rows[:, index["denominator"]].clamp(min=1.0)          # as StepAudit.from_sums and TRL: max(D, 1)
    out = rows.sum(0)
    for name in WEIGHTED:
        out[index[name]] = (rows[:, index[name]] / d).sum() / j
    out[index["noise_var"]] = (rows[:, index["noise_var"]] / d.square()).sum() / j ** 2
    out[index["denominator"]] = 1.0
    return out


@dataclass(frozen=True)
class StepAudit:
    """One audited step of one KL term (``source``); the fields are audit.csv's columns (AUDIT_COLUMNS)."""
    step: int
    source: str
    estimator: str
    aggregation: str
    sequences: int
    tokens: int
    logged: float
    recomputed: float
    exact: float
    expected_q: float
    expected_b: float
    se: float
    bias: float
    z: float
    bias_estimator: float
    bias_sampler: float
    bias_precision: float
    noise: float
    frac_negative: float
    p_negative: float
    miss: float
    consistency_z: float
    impossible: int
    consistency_sum: float
    consistency_var: float
    expected_g: float
    bias_mismatch: float
    sampling_pass: int
    bias_formula: float = 0.0
    formula_fit: int = 0
    own_logprobs: int = 0

    @classmethod
    def from_sums(cls, sums: torch.Tensor, *, step: int, source: str, estimator: str, aggregation: str) -> "StepAudit":
        s = dict(zip(SUMS, sums.cpu().tolist()))
        d = max(s["denominator"], 1.0)
        logged, rec, exact = s["logged"] / d, s["recomputed"] / d, s["exact"] / d
        e_pi, e_b, e_g, se = s["expected_q"] / d, s["expected_b"] / d, s["expected_g"] / d, math.sqrt(s["noise_var"]) / d
        tokens = max(s["tokens"], 1.0)
        fit = formula_fit(s)
        own = s["own"] / d if fit else logged                  # no formula part where the dtype explains it
        return cls(step, source, estimator, aggregation, int(s["sequences"]), int(s["tokens"]), logged, rec, exact,
                   e_pi, e_b, se, logged - exact, z_score(logged, exact, se, abs(exact) + abs(logged)),
                   e_pi - exact, e_b - e_pi, own - rec, rec - e_g, s["logged_negative"] / tokens,
                   s["p_negative"] / tokens, s["miss"] / tokens, consistency_z(s["consistency_sum"], s["consistency_var"],
                                                                              s["impossible"]),
                   int(s["impossible"]), s["consistency_sum"], s["consistency_var"], e_g, e_g - e_b,
                   int(s["sampling_pass"]), logged - own, fit, int(s["own_given"]))


def step_line(a: "StepAudit") -> str:
    """One line per audited step (``kl-bench audit`` and the TRL callback print it)."""
    # the one vocabulary of numbers (kl_bench.foundation.formatting): the bias to its SE's precision, the parts
    # of the bias to 3 significant digits with a sign (an exact 0 as "0", not "+0"), powers of ten as e-9
    bias, se, _ = measured_cells(a.bias, a.se, sign=True)
    mismatch = f"mismatch {fmt(a.bias_mismatch, 3, sign=True)}, " if a.sampling_pass else ""
    formula = f"formula {fmt(a.bias_formula, 3, sign=True)}, " if a.formula_fit else ""
    return (f"step {a.step} {a.source} ({a.estimator}, {a.aggregation}, {a.tokens} tokens): logged {fmt(a.logged, 5)}, "
            f"exact {fmt(a.exact, 5)}, bias {bias} ± {se} (z = {fmt(a.z, 2, sign=True)}); "
            f"sampler {fmt(a.bias_sampler, 3, sign=True)}, {mismatch}{formula}precision {fmt(a.bias_precision, 3, sign=True)}; "
            f"consistency z = {fmt(a.consistency_z, 2, sign=True)}")


def consistency_z(total: float, var: float, impossible: float) -> float:
    """z of Σ (log b(x) − E_b log b) over √Σ Var_b log b; −inf when some token had b(x) = 0."""
    if impossible > 0:
        return -math.inf
    return total / math.sqrt(var) if var > 0 else 0.0


def audit_step(values: PositionValues, trainer: torch.Tensor, mask: torch.Tensor, *, estimator: str,
               aggregation: str = "token-mean", step: int = 0, source: str = "kl",
               own_logr: torch.Tensor | None = None) -> StepAudit:
    """Audit one step on one process (see :func:`step_sums` for the inputs)."""
    sums = step_sums(values, trainer, mask, estimator=estimator, aggregation=aggregation, own_logr=own_logr)
    return StepAudit.from_sums(sums, step=step, source=source, estimator=estimator, aggregation=aggregation)





class AuditLog:
    """Steps pooled per source: pooled bias z and consistency z over all steps, and the results folder.

    Pooling: the steps' noises are independent given the history (a martingale again), so the mean bias
    over S steps has SE √Σ se² / S and the pooled z = Σ bias / √Σ se²."""

    def __init__(self):
        self.rows: list[StepAudit] = []
        self.engine: list = []                              # EngineAudit rows (kl_bench.audit.rollout_engine), if any

    def add(self, audit: StepAudit) -> StepAudit:
        self.rows.append(audit)
        return audit

    def pooled(self) -> dict[str, dict]:
        """source → steps, mean bias, its SE, pooled z, mean sampler bias, pooled consistency z, impossible."""
        return {source: pooled_row([r for r in self.rows if r.source == source])
                for source in dict.fromkeys(r.source for r in self.rows)}

    def csv_bytes(self) -> bytes:
        import csv
        import io
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(AUDIT_COLUMNS)
        for r in self.rows:
            w.writerow([repr(v) if isinstance(v, float) else v for v in asdict(r).values()])
        return buf.getvalue().encode()

    def write(self, directory, **envelope) -> Path:
        """Write ``audit.csv`` and ``run.json`` (``envelope`` merged in: settings, versions) atomically
        (kl_bench.foundation.storage: staged folder swapped in whole, under the folder's lock)."""
        import datetime as dt

        directory = check_output_dir(Path(directory))
        env = {"created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "columns": AUDIT_COLUMNS, "pooled": self.pooled(), **envelope}
        files = {"audit.csv": self.csv_bytes()}
        if self.engine:                                      # a rollout engine's mismatch, per step
            files["engine.csv"] = _csv([list(ENGINE_COLUMNS)] + [[r.row()[c] for c in ENGINE_COLUMNS] for r in self.engine])
            env["engine_columns"] = ENGINE_COLUMNS
        return folders.write("audit", directory, files, env)


def _csv(rows: list[list]) -> bytes:
    import csv
    import io
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for row in rows:
        w.writerow([repr(v) if isinstance(v, float) else v for v in row])
    return buf.getvalue().encode()


def pooled_row(rows: list[StepAudit]) -> dict:
    """The pooled row of one source's steps (see :meth:`AuditLog.pooled`)."""
    n = len(rows)
    bias = sum(r.bias for r in rows)
    var = sum(r.se ** 2 for r in rows)
    return {
        "steps": n, "estimator": rows[-1].estimator, "mean_logged": sum(r.logged for r in rows) / n,
        "mean_exact": sum(r.exact for r in rows) / n, "mean_bias": bias / n, "se": math.sqrt(var) / n,
        "z": z_score(bias, 0.0, math.sqrt(var), sum(abs(r.exact) for r in rows)),
        "mean_bias_sampler": sum(r.bias_sampler for r in rows) / n,
        "mean_bias_precision": sum(r.bias_precision for r in rows) / n,
        "consistency_z": consistency_z(sum(r.consistency_sum for r in rows),
                                       sum(r.consistency_var for r in rows), sum(r.impossible for r in rows)),
        "impossible": sum(r.impossible for r in rows)}


def read_audit_folder(directory) -> tuple[dict, list[StepAudit]]:
    """An audit folder read back through kl_bench.results.folders (run.json and every file verified against
    its sha256; one line naming the file for anything wrong): its envelope and audit.csv's steps. Files written
    before a column existed get kl_bench.results.schema.AUDIT_DEFAULTS (expected_g: expected_b)."""
    stored = folders.read(directory, "audit")
    df = folders.read_table(stored, "audit.csv")
    out = []
    for i, row in enumerate(df.to_dict("records"), start=2):
        try:
            values = {f.name: f.type_cast(row[f.name]) for f in _FIELDS}
        except (ValueError, TypeError) as e:
            raise SpecError(f"line {i}: {e}", file=str(stored.path / "audit.csv")) from None
        out.append(StepAudit(**values))
    return stored.envelope, out


class _Field:
    def __init__(self, name: str, kind: str):
        self.name = name
        self.type_cast = {"int": lambda x: int(float(x)), "float": float, "str": str}[kind]


_FIELDS = [_Field(name, {"int": "int", "float": "float"}.get(str(t).split(".")[-1].strip("'>"), "str"))
           for name, t in StepAudit.__annotations__.items()]
