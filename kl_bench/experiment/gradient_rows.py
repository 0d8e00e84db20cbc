"""Gradients of KL estimators: what each estimator optimises in each place a trainer puts it.

The rows only: modes and their coefficients are kl_bench.core.modes, each case kind supplies its reference
gradients, exact expected gradients and per-draw gradient sums (the gradient protocol,
kl_bench.kinds.protocols.GradientOracle), and the engine seeds and batches the draws (kl_bench.engine.monte_carlo.run_gradients).
Every mode's per-draw gradient is c(log r) · ∇θ log q(x) (docs/gradients.md); the exact expected gradient
is compared with ∇KL(q‖p) and ∇KL(p‖q), and the ``equals`` column names the one it is.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..core.draws import row_key
from ..core.aggregates import AGGREGATES
from ..engine.monte_carlo import run_gradients
from ..core.modes import MODES, GradItem, modes_for
from ..kinds.protocols import GradientCase, require_gradients
from ..core.stats import mean_and_se
from ..results.schema import GRAD_SCHEMA
from ..core.targets import FORWARD, REVERSE



def gradient_items(pair: GradientCase, sources) -> list[GradItem]:
    """Every (estimator, mode, aggregate) row of a case, on the aggregates the pair gives each estimator
    (rollouts: token-only estimators have no sequence rows); pair-supplied rows only where the kind gives them
    one (:meth:`~kl_bench.kinds.protocols.GradientOracle.gradient_pair_rows`: rollouts' Rao–Blackwellised row)."""
    ests = [pair.adapt(e) for e in sources if not e.analytic]
    return [GradItem.of(e, m, a) for a in pair.gradient_aggregates for e in ests if a in pair.aggregates_for(e)
            for m in modes_for(e, token=AGGREGATES[a].token) if _gets_row(pair, m, a)] \
        + pair.gradient_pair_rows(list(sources))


def _gets_row(pair: GradientCase, mode: str, aggregate: str) -> bool:
    """Whether a (mode, aggregate) of an estimator that has it gets a row on this pair.

    A mode defined on-policy only (NeMo-RL's clamp order: w = q/sg(q) has value 1; under a sampler the
    clamp sees w·f with w = q/b, which a per-draw coefficient c(log r) cannot express): a row only where
    the pair applies the weight inside the clamp's test (categoricals: GradientOracle.clamp_sees_weight).
    Token-only modes (reward+loss, reward_to_go, reward_partial) get rows on token aggregates only (``modes_for``):
    on one draw or a sequence log-ratio they equal loss_is or reward (kl_bench.core.modes). A group aggregate
    (the token-mean over B sequences, a loss aggregation) gets the modes whose tokens each carry their
    own term (local); a value shared by the group times each sequence's score is no trainer's form."""
    m = MODES[mode]
    return ((m.off_policy or not pair.has_sampler or pair.clamp_sees_weight)
            and (not AGGREGATES[aggregate].grouped or m.token == "local") and not pair.gradient_excludes(mode, aggregate))


def unit(v: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(v)
    return v / n if n > 0 else v


def gradient_rows(pair: GradientCase, estimators, *, draws: int, seed: int, batches: int, device,
                  progress=None, ranks=None, drawn: dict | None = None, vectors: dict | None = None) -> list[dict]:
    """gradients.csv rows for one case. ``ranks``: split the pass across processes (the rows are made on
    rank 0; the others get []). ``drawn``: a dict that receives the batches each rank drew, as "gradients".
    ``vectors``: a dict that receives the exact vectors [P] (:func:`vector_key`): every row's expected
    gradient, the references ∇KL(q‖p), ∇KL(p‖q) and ∇UKL(q_S‖p), and each row's ``self`` target."""
    require_gradients(pair)
    refs = pair.gradient_references()
    rev, fwd, ukl = refs[REVERSE], refs[FORWARD], pair.gradient_ukl()
    dirs = {"reverse": unit(rev), "forward": unit(fwd)}
    items = gradient_items(pair, estimators)
    run = run_gradients(pair, items, dirs, draws=draws, seed=seed, batches=batches, device=device, progress=progress,
                        **({} if ranks is None else {"ranks": ranks}))
    if run is None:
        return []
    if drawn is not None:
        drawn["gradients"] = run.drawn
    exacts = [pair.gradient_exact(it, dirs) for it in items]
    selves = self_references(pair, items)
    if vectors is not None:
        vectors.update(exact_vectors(pair, items, exacts, selves, rev, fwd, ukl))
    return [_row(pair, item, ex, run, j, dirs, _scaled(pair, item, rev, fwd, ukl), draws, selves[j])
            for j, (item, ex) in enumerate(zip(items, exacts))]


def vector_key(case: str, what: str, item: GradItem | None = None) -> str:
    """A key of gradients.npz: "case|reference|reverse", "case|reference|forward", "case|reference|ukl",
    "case|self|<row>" and "case|exact|<row>|<mode>" with <row> the row's key ('k3', 'cv@0.5', 'tok:k3', kl_bench.core.draws.row_key)."""
    if item is None:
        return f"{case}|reference|{what}"
    row = row_key(item.est.name, item.est.lam, item.aggregate)
    return f"{case}|self|{row}" if what == "self" else f"{case}|{what}|{row}|{item.mode}"


def exact_vectors(pair: GradientCase, items: list[GradItem], exacts: list, selves: list, rev: np.ndarray,
                  fwd: np.ndarray, ukl: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """gradients.npz's arrays of one case (float64 [P], θ flattened as the kind documents it)."""
    out = {vector_key(pair.name, "reverse"): rev, vector_key(pair.name, "forward"): fwd}
    if ukl is not None:
        out[vector_key(pair.name, "ukl")] = ukl
    for it, ex, own in zip(items, exacts, selves):
        if ex is not None:
            out[vector_key(pair.name, "exact", it)] = ex.mean
        if own is not None:
            out[vector_key(pair.name, "self", it)] = own
    return out


def self_references(pair: GradientCase, items: list[GradItem]) -> list[np.ndarray | None]:
    """∇θ E_q[v] of each row's value v (the ``self`` target), computed once per (estimator, aggregate);
    None where the kind has no exact value or it is not finite."""
    cache: dict = {}
    out = []
    for it in items:
        key = (it.est.name, it.est.lam, it.aggregate)
        if key not in cache:
            g = pair.gradient_self(it)
            cache[key] = g if g is not None and np.isfinite(g).all() else None
        out.append(cache[key])
    return out


def _scaled(pair: GradientCase, item: GradItem, rev: np.ndarray, fwd: np.ndarray,
            ukl: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The references a row is compared with: a row divided by lengths (a rate per token) against the
    KL gradients over E_q|y|, the same scaling as its value's truth (kl_bench.kinds.rollout true_value)."""
    if not AGGREGATES[item.aggregate].per_token:
        return rev, fwd, ukl
    whole = pair.true_value(REVERSE)
    if whole == 0:          # KL = 0 (p = q): the references are ∇KL = 0 at any scale, and 0/0 is no scale
        return rev, fwd, ukl
    scale = pair.true_value(REVERSE, item.aggregate) / whole
    return rev * scale, fwd * scale, None if ukl is None else ukl * scale


EXACT_COLUMNS = ("exact_cos_reverse", "exact_cos_forward", "exact_relerr_reverse", "exact_relerr_forward",
                 "exact_trace_cov", "n_for_cos90", "exact_along_reverse", "exact_norm")


def _row(pair: GradientCase, item: GradItem, ex, run, j: int, dirs: dict, refs: tuple,
         draws: int, own: np.ndarray | None = None) -> dict:
    """One gradients.csv row: the Monte Carlo columns of item j, then the exact ones (empty without ``ex``).
    ``refs``: (∇KL(q‖p), ∇KL(p‖q), ∇UKL(q_S‖p) or None) as this row is compared with them; ``own``: the
    ``self`` target."""
    row = _measured_columns(pair, item, ex, run, j, dirs, refs, draws)
    if ex is None:
        return {**row, **{c: math.nan for c in EXACT_COLUMNS}, "equals": ""}
    return {**row, **_exact_columns(ex, run, j, dirs, refs, draws, own, row["trace_cov"])}


def _measured_columns(pair: GradientCase, item: GradItem, ex, run, j: int, dirs: dict, refs: tuple,
                      draws: int) -> dict:
    """The Monte Carlo columns of item j, with their z against the exact values ``ex`` (NaN without)."""
    est = item.est
    rev, fwd, _ = refs
    mc_mean = run.total[j] / draws
    row = {"case": pair.name, "estimator": est.name, "aggregate": item.aggregate, "sampler": pair.sampler_label,
           "lambda": est.lam if est.lam is not None else math.nan,
           "mode": item.mode, "params": pair.gradient_params, "draws": draws}
    row.update(compare(mc_mean, rev, fwd))
    m2, se_m2 = mean_and_se(run.sq[:, j], run.sizes)
    row["trace_cov"] = m2 - float(mc_mean @ mc_mean)
    # E|g|² from batch means of Σ|g|²; its SE makes the trace testable against the exact value.
    row["z_trace"] = (m2 - ex.second) / se_m2 if ex is not None and se_m2 > 0 and math.isfinite(ex.second) \
        and pair.gradient_fourth_moment_finite(item) else math.nan
    for d, name in enumerate(("reverse", "forward")):
        m, se = mean_and_se(run.proj[:, j, d], run.sizes)
        ref = float(ex.mean @ dirs[name]) if ex is not None else math.nan
        row[f"z_{name}"] = (m - ref) / se if se > 0 and math.isfinite(ref) else math.nan
    return row


def _exact_columns(ex, run, j: int, dirs: dict, refs: tuple, draws: int, own: np.ndarray | None,
                   measured_trace: float) -> dict:
    """The exact columns of item j (EXACT_COLUMNS and ``equals``); ``measured_trace``: the row's trace_cov,
    the spread n_for_cos90 takes where the kind's exact mean comes with a measured spread."""
    rev, fwd, ukl = refs
    out = compare(ex.mean, rev, fwd, "exact_")
    out["exact_trace_cov"] = ex.second - float(ex.mean @ ex.mean)
    out["equals"] = equals(ex.mean, rev, fwd, own, ukl)
    var_u, trace = ex.proj_var.get("reverse", math.nan), out["exact_trace_cov"]
    if run.proj2 is not None:       # exact mean, measured spread (e.g. rollouts)
        mu_u = float(run.proj[:, j, 0].sum() / draws)
        var_u, trace = float(run.proj2[:, j, 0].sum() / draws) - mu_u**2, measured_trace
    out["n_for_cos90"] = n_for_cosine(ex.mean, dirs["reverse"], var_u, trace)
    out["exact_along_reverse"] = float(ex.mean @ dirs["reverse"])
    out["exact_norm"] = float(np.linalg.norm(ex.mean))
    if out["equals"] == "zero":          # the cosine of a zero vector is rounding noise
        for c in ("exact_cos_reverse", "exact_cos_forward"):
            out[c] = math.nan
    return out


def compare(g: np.ndarray, rev: np.ndarray, fwd: np.ndarray, prefix: str = "") -> dict:
    """Cosine and relative error of the gradient ``g`` [P] against both references, as gradients.csv's
    ``{prefix}cos_*`` and ``{prefix}relerr_*`` columns."""
    out = {}
    for name, ref in (("reverse", rev), ("forward", fwd)):
        gn, rn = np.linalg.norm(g), np.linalg.norm(ref)
        out[f"{prefix}cos_{name}"] = float(g @ ref / (gn * rn)) if gn > 0 and rn > 0 else math.nan
        out[f"{prefix}relerr_{name}"] = float(np.linalg.norm(g - ref) / rn) if rn > 0 else math.nan
    return out


def equals(g: np.ndarray, rev: np.ndarray, fwd: np.ndarray, own: np.ndarray | None = None,
           ukl: np.ndarray | None = None) -> str:
    """Which exact gradient the expectation equals (to float64 rounding of exact sums): ∇KL(q‖p), ∇KL(p‖q),
    zero, ``ukl`` = ∇UKL(q_S‖p), the unnormalised KL over what a truncating sampler can draw (e.g. k1 in
    the reward or k3 in loss_is under top-k with token weights), or ``self`` = ∇E_q[v] of the row's own
    value v (``own``): what the value follows used as an objective, e.g. k2 in loss_is or reward+loss
    on-policy (the earlier ones win where they coincide: ukl is reverse when S holds all of q's mass)."""
    scale = max(np.linalg.norm(rev), np.linalg.norm(fwd))
    tol = 1e-9 * scale
    if np.linalg.norm(g - rev) <= tol:
        return "reverse"
    if np.linalg.norm(g - fwd) <= tol:
        return "forward"
    if np.linalg.norm(g) <= tol:
        return "zero"
    if ukl is not None and np.linalg.norm(g - ukl) <= tol:
        return "ukl"
    if own is not None and np.linalg.norm(g - own) <= 1e-9 * max(scale, np.linalg.norm(own)):
        return "self"
    return "other"


def n_for_cosine(mean: np.ndarray, u: np.ndarray, var_u: float, trace_cov: float, target: float = 0.9,
                 prob: float = 0.95) -> float:
    """Smallest n with P(cos(batch mean, u) ≥ target) ≥ prob, normal approximation: the component along
    u is N(m·u, Var_u/n), the squared norm concentrates at |m|² + tr(Σ)/n."""
    mu = float(mean @ u)
    m2 = float(mean @ mean)
    if math.isnan(var_u) or math.isnan(trace_cov):
        return math.nan            # a variance without a value (e.g. D > 1 Gaussians): unknown, not ∞
    if not (math.isfinite(var_u) and math.isfinite(trace_cov)) or m2 == 0 or mu / math.sqrt(m2) <= target:
        return math.inf
    from scipy import special          # ndtri: the normal quantile (stats.norm.ppf, without scipy.stats)
    zq = special.ndtri(prob)

    def ok(n: float) -> bool:
        return (mu - zq * math.sqrt(max(var_u, 0) / n)) / math.sqrt(m2 + max(trace_cov, 0) / n) >= target
    lo, hi = 0.0, 1.0
    while not ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1e18:
            return math.inf
    while hi - lo > 1:
        mid = math.floor((lo + hi) / 2)
        lo, hi = (mid, hi) if not ok(mid) else (lo, mid)
    return float(max(hi, 1))


def to_frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(GRAD_SCHEMA))
