"""Step audits: a trainer's KL estimate against the exact value of the policy its loss scores.

A step's estimate is Σ_t w_t f(x_t) over the masked tokens (weights of its aggregation,
kl_bench.audit.aggregate). With KL_t, E_q[f]_t, E_b[f]_t, Var_b[f]_t the exact per-position values
(kl_bench.audit.exact), it splits exactly as

    logged − Σ w KL = Σ w (E_q f − KL)            estimator bias
                    + Σ w (E_b f − E_q f)          sampler bias (b ≠ q: temperature, top-k, top-p, ...)
                    + Σ w (E_g f − E_b f)          mismatch: the pass that drew the tokens is not the
                                                   scored one (dropout, position ids, a cache, precision)
                    + Σ w (f(x) − E_g f)           noise: mean 0, SE² = Σ w² Var_g f
                    + (logged − recomputed)        precision (the trainer's log-probs against float64
                                                   ones from the audited logits).

b is the sampler applied to the scored policy's logits, g the same sampler applied to the logits of the
pass that drew the tokens (its hidden states, when the trainer's adapter captured them; otherwise g = b,
the mismatch is not measured and lands in the noise, which the consistency check then flags).
The noise terms d_t = w_t (f(x_t) − E_g[f | h_t]) form a martingale difference sequence along each
sampled path (x_t ~ g(·|h_t) given the history), so Var(Σ d_t) = E Σ w_t² Var_g[f | h_t]: the SE from
the exact conditional variances is a valid standard error, and z = bias / SE is ≈ N(0, 1) when the
estimate is unbiased for the exact KL (docs/audit.md). The consistency check applies the same argument
to log g: Σ (log g(x_t) − E_g[log g]) / √Σ Var_g[log g] is ≈ N(0, 1) when the tokens were drawn from
the g computed from the audited logits, and a token g cannot draw (g(x) = 0) is a certain mismatch.

Steps and ranks combine through additive sums (:func:`step_sums`): summing the vectors of two ranks
gives the sums of their union.
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
SUMS = ("denominator", "logged", "recomputed", "exact", "expected_q", "expected_b", "noise_var", "tokens",
        "sequences", "logged_negative", "p_negative", "miss", "consistency_sum", "consistency_var", "impossible",
        "expected_g", "sampling_pass")


def step_sums(values: PositionValues, trainer: torch.Tensor, mask: torch.Tensor, *, estimator: str,
              aggregation: str) -> torch.Tensor:
    """The additive sums [len(SUMS)] of one step on one rank, float64 on the values' device (the caller
    moves this one small vector to the host; selecting the masked tokens is the step's one sync).

    ``values``: exact values at the masked positions of ``mask`` [B, T], in row-major order;
    ``trainer`` [B, T]: the trainer's per-token values of ``estimator`` (any dtype; padding ignored)."""
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
    return torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device) for x in sums])


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

    @classmethod
    def from_sums(cls, sums: torch.Tensor, *, step: int, source: str, estimator: str, aggregation: str) -> "StepAudit":
        s = dict(zip(SUMS, sums.cpu().tolist()))
        d = max(s["denominator"], 1.0)
        logged, rec, exact = s["logged"] / d, s["recomputed"] / d, s["exact"] / d
        e_pi, e_b, e_g, se = s["expected_q"] / d, s["expected_b"] / d, s["expected_g"] / d, math.sqrt(s["noise_var"]) / d
        tokens = max(s["tokens"], 1.0)
        return cls(step, source, estimator, aggregation, int(s["sequences"]), int(s["tokens"]), logged, rec, exact,
                   e_pi, e_b, se, logged - exact, z_score(logged, exact, se, abs(exact) + abs(logged)),
                   e_pi - exact, e_b - e_pi, logged - rec, rec - e_g, s["logged_negative"] / tokens,
                   s["p_negative"] / tokens, s["miss"] / tokens, consistency_z(s["consistency_sum"], s["consistency_var"],
                                                                              s["impossible"]),
                   int(s["impossible"]), s["consistency_sum"], s["consistency_var"], e_g, e_g - e_b,
                   int(s["sampling_pass"]))


def step_line(a: "StepAudit") -> str:
    """One line per audited step (``kl-bench audit`` and the TRL callback print it)."""
    # the one vocabulary of numbers (kl_bench.foundation.formatting): the bias to its SE's precision, the parts
    # of the bias to 3 significant digits with a sign (an exact 0 as "0", not "+0"), powers of ten as e-9
    bias, se, _ = measured_cells(a.bias, a.se, sign=True)
    mismatch = f"mismatch {fmt(a.bias_mismatch, 3, sign=True)}, " if a.sampling_pass else ""
    return (f"step {a.step} {a.source} ({a.estimator}, {a.aggregation}, {a.tokens} tokens): logged {fmt(a.logged, 5)}, "
            f"exact {fmt(a.exact, 5)}, bias {bias} ± {se} (z = {fmt(a.z, 2, sign=True)}); "
            f"sampler {fmt(a.bias_sampler, 3, sign=True)}, {mismatch}precision {fmt(a.bias_precision, 3, sign=True)}; "
            f"consistency z = {fmt(a.consistency_z, 2, sign=True)}")


def consistency_z(total: float, var: float, impossible: float) -> float:
    """z of Σ (log b(x) − E_b log b) over √Σ Var_b log b; −inf when some token had b(x) = 0."""
    if impossible > 0:
        return -math.inf
    return total / math.sqrt(var) if var > 0 else 0.0


def audit_step(values: PositionValues, trainer: torch.Tensor, mask: torch.Tensor, *, estimator: str,
               aggregation: str = "token-mean", step: int = 0, source: str = "kl") -> StepAudit:
    """Audit one step on one process (see :func:`step_sums` for the inputs)."""
    sums = step_sums(values, trainer, mask, estimator=estimator, aggregation=aggregation)
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
            files["engine.csv"] = _csv([list(ENGINE_COLUMNS)] + [list(r.row().values()) for r in self.engine])
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
