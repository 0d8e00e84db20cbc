"""The rows of summary.csv (one per case × estimator × λ × aggregate) from a case's Monte Carlo sums and
its exact oracle: summary statistics, z, heavy-tail classes (columns: :data:`kl_bench.results.schema.SCHEMA`).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..core.aggregates import AGGREGATES
from ..engine.monte_carlo import CaseRun, as_rows
from ..core.stats import HeavyTail, batch_means_se, classify_heavy_tail, kish_ess, z_score
from ..core.targets import REVERSE
from ..foundation.formatting import ROUNDING


def _div(a: float, b: float) -> float:
    """a / b for relative columns: empty when b is 0, inf or NaN; inf stays inf."""
    if b == 0 or not math.isfinite(b) or math.isnan(a):
        return math.nan
    return a / b


def _ess(run: CaseRun, row) -> float:
    """Kish's effective sample size of the importance weights that multiply the row (NaN: none do)."""
    sums = run.weight_sums()
    agg = AGGREGATES[row.aggregate]
    # token sums of a case that weights each token carry the tokens' own q/b, not the product W
    per_token = agg.weight == "draw unless token" and run.pair.weights == "token"
    if sums is None or row.group > 1 or not agg.carries_draw_weight or per_token:
        return math.nan
    return kish_ess(*sums)


def _seen_share(ess: float, n: float, mean: float, var: float, exact_var: float, batches: int) -> float:
    """A weighted row's effective sample size: Kish's ESS of the drawn weights, or, where it falls below the
    number of batches, the draws' share of the row's exact variance N·var/exact var. Kish's ESS sees only
    the weights that were drawn: a near-greedy sampler (temperature 0.05) draws one token every time, its
    weights are all equal, Kish says N, and the sum's large weights (q/b where b is tiny) were never drawn
    (issue 44: "± 0", z = 1.9·10¹¹). Where every draw gave one value (a measured variance within float64
    rounding of 0: at most ROUNDING·mean²) and the exact variance is not (beyond that rounding: a truncating
    sampler's IS weight q/b is one constant, so `full` is constant too), nothing of the spread was seen:
    ESS 0, whether that variance is finite or not. Above the batches Kish's ESS stands (the share's own
    noise does not move the column); NaN (no weights) stays NaN; an unknown exact variance leaves Kish's."""
    if not (math.isfinite(ess) and exact_var > ROUNDING * mean * mean and math.isfinite(var)):
        return ess              # no weights, an unknown exact variance, or a constant row (exact var at rounding)
    if var <= ROUNDING * mean * mean:        # Σf²/N − mean² cancels to ~1e-16·mean²: rounding, not spread
        return 0.0
    share = n * var / exact_var if math.isfinite(exact_var) else math.inf
    return min(ess, share) if share < batches else ess


def _heavy_tail(run: CaseRun, row, exact_var: float, n: float, s2, ess: float) -> str:
    """The row's heavy_tail class (kl_bench.core.stats.classify_heavy_tail) from its pair and its batches' Σ(f − c)²."""
    return classify_heavy_tail(
        support_miss_weighted=run.pair.support_miss > 0 and run.pair.weights != "none",
        exact_var=exact_var, fourth_finite=run.pair.fourth_moment_finite(row.est, row.aggregate),
        kurtosis=run.pair.kurtosis_proxy(row.est, row.aggregate), draws=n, batch_sq=s2, ess=ess).value


def _variance_z(s2, n_k, n: float, exact_mean: float, exact_var: float) -> tuple[float, float]:
    """(z of the variance, SE of the std) of a row whose sums are shifted by its exact mean (NaN, NaN where the
    exact variance is infinite). Σ(f − c)²/N with c = exact mean is an unbiased estimate of the exact variance,
    so its batch-means SE gives a z for the variance as well (meaningful when E[f⁴] < ∞)."""
    if not math.isfinite(exact_var):
        return math.nan, math.nan
    m2_k = s2 / n_k
    m2 = float(s2.sum()) / n
    se_m2 = batch_means_se(m2_k - m2, n_k / n)
    std_se = se_m2 / (2 * math.sqrt(m2)) if m2 > 0 else 0.0
    # the scale of a variance computed from shifted sums: the squared mean and the variance
    return z_score(m2, exact_var, se_m2, exact_mean**2 + exact_var), std_se


def summarize(run: CaseRun) -> list[dict[str, Any]]:
    """Rows of the summary table for one case (see :data:`SCHEMA`). A row whose importance weights are
    degenerate (effective sample size below the number of batches) keeps its measured mean and std, but
    its SEs and z scores are unknown (NaN), never the zero or tiny SE that a few draws carrying the whole
    sum leave in the batch means."""
    e_count = len(run.rows)
    k = run.sizes.shape[0]
    rows = []
    for j, row in enumerate(run.rows):
        est = row.est
        n_k = run.counts[:, j]           # values per batch: draws, or whole groups for a group row
        n = float(n_k.sum())
        s1, s2, neg = run.sums[:, j], run.sums[:, e_count + j], run.sums[:, 2 * e_count + j]
        shift = run.shifts[j]
        centred_mean = float(s1.sum()) / n
        mean = shift + centred_mean
        var = float(s2.sum()) / n - centred_mean**2
        std = math.sqrt(max(var, 0.0)) if math.isfinite(var) else math.inf
        # Batch means (docs/statistics.md#batch-means); sizes may differ by one draw.
        se = batch_means_se(s1 / n_k - centred_mean, n_k / n) if math.isfinite(centred_mean) else math.nan
        exact_mean, exact_var = run.exact[row.label]
        exact_std = math.sqrt(exact_var) if exact_var >= 0 else math.nan
        true = run.pair.true_value(est.target, row.aggregate)
        bias = mean - true if math.isfinite(true) else math.nan
        z = z_score(mean, exact_mean, se, max(abs(mean), abs(exact_mean)))
        z_var, std_se = _variance_z(s2, n_k, n, exact_mean, exact_var) if shift == exact_mean and k > 1 \
            else (math.nan, math.nan)
        ess = _seen_share(_ess(run, row), n, mean, var, exact_var, k)
        heavy = _heavy_tail(run, row, exact_var, n, s2, ess)
        if heavy == HeavyTail.DEGENERATE:        # nothing is known of the mean: no SE, no z
            se = std_se = z = z_var = math.nan
        rows.append({
            "case": run.pair.name, "kind": run.pair.kind, "estimator": est.name,
            "lambda": math.nan if est.lam is None else est.lam, "aggregate": row.aggregate, "target": est.target,
            "true_kl": true, "draws": int(n) * row.group, "batches": k, "mean": mean, "std": std, "se": se, "std_se": std_se,
            "bias": bias, "rel_bias": _div(bias, true), "rel_std": _div(std, true),
            "exact_mean": exact_mean, "exact_std": exact_std,
            "exact_rel_bias": _div(exact_mean - true, true) if math.isfinite(exact_mean) else math.nan,
            "exact_rel_std": _div(exact_std, true),
            "z": z,
            "z_var": z_var,
            "frac_negative": float(neg.sum()) / n,
            **sampler_columns(run.pair),
            "heavy_tail": heavy,
            "ess": ess,
        })
    ref = run.pair.reference_row()
    if ref is not None:
        add_reference(run, rows, ref)
    return rows


def add_reference(run: CaseRun, rows: list[dict[str, Any]], ref: str) -> None:
    """Fill ref_kl, ref_se, ref_diff, ref_diff_se and z_ref (see :data:`SCHEMA`) from the row labelled
    ``ref``: where no exact value exists, the measured mean of an unbiased lower-variance estimator is the
    yardstick. ref_diff_se comes from the batch means of the paired difference (every row sees the same
    paths), so the correlation between a row and the reference is accounted for; a pair whose reference
    is not the run's (logged data) gives its own (:meth:`Pair.reference_comparison`). z_ref is always
    ref_diff / ref_diff_se (with the rounding floor): the SE printed beside a bias is the one its z uses."""
    labels = [r.label for r in run.rows]
    if ref not in labels:
        return
    j_ref = labels.index(ref)
    n_k = run.sizes.to(torch.float64)
    n = float(n_k.sum())
    s_ref = run.sums[:, j_ref]
    ref_mean = run.shifts[j_ref] + float(s_ref.sum()) / n
    ref_se = batch_means_se(s_ref / n_k - float(s_ref.sum()) / n, n_k / n)
    unknown = rows[j_ref]["heavy_tail"] == HeavyTail.DEGENERATE
    for j, (row, out) in enumerate(zip(run.rows, rows)):
        # the paired differences below are per draw; the reference is KL(q||p)'s: a KL(p||q) row has none
        # (issue 44: it printed the reverse reference as its own and divided by it)
        if row.group > 1 or row.est.target != REVERSE:
            continue
        fixed = run.pair.reference_comparison(row.est, row.aggregate)
        if fixed is not None:
            out["ref_kl"], out["ref_se"], diff, se = fixed
        else:
            out["ref_kl"], out["ref_se"] = ref_mean, (math.nan if unknown else ref_se)
            pair = (run.sums[:, j] - s_ref) / n_k                      # per batch: mean_j − mean_ref − shifts
            diff = out["mean"] - ref_mean
            se = batch_means_se(pair - float((run.sums[:, j] - s_ref).sum()) / n, n_k / n)
            if unknown or out["heavy_tail"] == HeavyTail.DEGENERATE:
                se = math.nan
        if math.isnan(diff):
            continue
        out["ref_diff"], out["ref_diff_se"] = diff, se
        out["z_ref"] = z_score(diff, 0.0, se, max(abs(out["ref_kl"] + diff), abs(out["ref_kl"]))) \
            if not math.isnan(se) else math.nan


def sampler_columns(pair) -> dict[str, Any]:
    """The sampler and support_miss columns of a pair's rows (summary and exact tables alike)."""
    return {"sampler": (pair.sampler_label.removeprefix("sampler b: ") or "b ≠ q") if pair.has_sampler else "",
            "support_miss": pair.support_miss}


def exact_rows(pair, estimators) -> list[dict[str, Any]]:
    """Rows with only the exact columns filled: `kl-bench exact`."""
    rows = []
    for row in as_rows(estimators, pair):
        est = row.est
        mean, var = pair.exact_moments(est, row.aggregate)
        std = math.sqrt(var) if var >= 0 else math.nan
        true = pair.true_value(est.target, row.aggregate)
        rows.append({"case": pair.name, "kind": pair.kind, "estimator": est.name,
                     "lambda": math.nan if est.lam is None else est.lam, "aggregate": row.aggregate,
                     "target": est.target, "true_kl": true, "exact_mean": mean, "exact_std": std,
                     "exact_rel_bias": _div(mean - true, true) if math.isfinite(mean) else math.nan,
                     "exact_rel_std": _div(std, true), **sampler_columns(pair)})
    return rows
