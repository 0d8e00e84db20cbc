"""The results schema (one row per case × estimator × λ × aggregate), summary statistics, and
atomic writing of ``summary.csv`` and ``run.json``.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from .engine import CaseRun, as_rows
from .stats import batch_means_se, classify_heavy_tail, z_score
from .targets import REVERSE

if TYPE_CHECKING:
    import pandas as pd

# Column → meaning. The order here is the column order of summary.csv.
SCHEMA: dict[str, str] = {
    "case": "case name from the spec",
    "kind": "case kind: gaussian | categorical | rollout",
    "estimator": "estimator name from the registry (kl-bench list)",
    "lambda": "λ of the control variate cv(λ); empty for other estimators",
    "aggregate": "rollouts: seq (estimator of L = Σ log r_t; k3 uses R = e^L), tok (per-token estimator "
                 "summed over the generated tokens), tok_mean (that sum / |y|), tok_batch (token-mean over a "
                 "trainer batch of B sequences: Σ over its tokens / their number; one value per batch of B, "
                 "so std, frac_negative and the planning columns are per batch of B), tok_gm (the sum times "
                 "TRL's geometric sequence weight); empty for single draws",
    "target": "what the estimator estimates: KL(q||p) or KL(p||q)",
    "true_kl": "exact value of the target; tok_mean and tok_batch rows (divided by lengths): the target per "
               "generated token, true value / E_q|y|, which a token-mean of any unbiased per-token estimator "
               "tends to",
    "draws": "number of Monte Carlo draws x ~ q (tok_batch rows: the draws in whole batches of B)",
    "batches": "number of batches used for the batch-means standard error",
    "mean": "Monte Carlo mean of the estimator over all draws",
    "std": "Monte Carlo standard deviation of one draw's estimate (tok_batch: of one batch of B's value)",
    "se": "standard error of `mean`, from batch means",
    "std_se": "standard error of `std` (batch means of the squared deviations from the exact mean, delta method)",
    "bias": "mean − true_kl",
    "rel_bias": "bias / true_kl (empty when true_kl is 0 or inf)",
    "rel_std": "std / true_kl: per-draw noise relative to the truth (Schulman's stdev/true)",
    "exact_mean": "exact E_q[estimator] (closed form or exact sum)",
    "exact_std": "exact per-draw standard deviation; inf when the variance diverges",
    "exact_rel_bias": "(exact_mean − true_kl) / true_kl",
    "exact_rel_std": "exact_std / true_kl",
    "z": "(mean − exact_mean) / se: |z| < 5 is agreement with the exact value",
    "z_var": "(Σ(f − exact_mean)²/N − exact_std²) / its batch-means SE: the variance against the exact one",
    "frac_negative": "fraction of draws whose estimate is < 0 (tok_batch rows: of groups of B)",
    "sampler": "how draws were made when not from q (temperature, top-k/p, EOS suppression, stale policy, "
               "IS weights); empty for x ~ q. exact_mean is then E_b of the estimator, bias against KL(q||p)",
    "support_miss": "mass of q (worst context or step) that the sampler never draws; > 0 biases every estimate",
    "heavy_tail": "'infinite variance' or 'infinite 4th moment' (exact: the measured std is unreliable, "
                  "usually too low), 'kurtosis > draws' (rollouts: exact E[R⁴ˢ]/E[R²ˢ]² exceeds the draws, so "
                  "the measured std is unreliable), 'infinite IS weight (b misses q's support)' (weighted rows of a "
                  "sampler that never draws some of q's mass), 'unstable batches' (one batch carries most of Σ(f − c)²), "
                  "or empty",
    "lambda_star": "cv rows: exact variance-optimal λ* = Cov(log r, r)/Var(r) (empty if unknown)",
    "lambda_star_mc": "cv rows: empirical λ* from this run's draws",
    "lambda_star_mc_se": "cv rows: standard error of lambda_star_mc (batch jackknife; unreliable when "
                         "E_q[r⁴] = ∞, see heavy_tail of cv rows)",
    "excess_std": "cv rows: exact_std at this λ / exact_std at λ* − 1 (0 at the optimum)",
    "n_for_10pct": "draws a batch needs for its mean to be within 10% of true_kl with 95% probability "
                   "(normal approximation, exact bias and std where known; inf if the bias alone exceeds 10%; "
                   "tok_batch rows: B × the groups needed)",
    "rmse_b64": "root-mean-square error of a batch mean of 64 draws, bias included (tok_batch rows: of the "
                "mean of 64/B batch values; empty when B > 64)",
    "rmse_b1024": "the same for 1024 draws",
    "rmse_b16384": "the same for 16384 draws",
    "p_neg_b64": "probability that a batch mean of 64 draws is negative, simulated on min(4096, max(256, "
                 "draws/256)) batches of 64 independent draws (tok_batch rows: the mean of max(1, 64/B) "
                 "consecutive batch values)",
    "ref_kl": "cases without an exact value (model continuations, logged log-probs): the reference for KL(q||p), "
              "the measured mean of the Rao–Blackwellised `full` row (Monte Carlo, NOT exact); empty elsewhere",
    "ref_se": "standard error of ref_kl (batch means)",
    "z_ref": "(mean − ref_kl) / SE of the difference (batch means of the paired difference, same paths): "
             "|z_ref| < 5 is agreement with the reference; KL(q||p) rows only",
}
COLUMNS = list(SCHEMA)
# Cases made by [[sweep]] tables (kl_bench.spec.expand_sweeps) add one column per swept key after the
# columns above, named SWEEP_PREFIX + key (e.g. "sweep.p.noise", "sweep.sampler.temperature"): the key's
# value in that case, empty for a case not swept over it. A spec without [[sweep]] has none.
SWEEP_PREFIX = "sweep."
# `kl-bench exact` / kl_bench.exact(): the columns that need no sampling (planning from exact moments).
_MEASURED = {"draws", "batches", "mean", "std", "se", "std_se", "bias", "rel_bias", "rel_std", "z", "z_var",
             "frac_negative", "lambda_star_mc", "lambda_star_mc_se", "p_neg_b64", "heavy_tail", "excess_std"}
EXACT_COLUMNS = [c for c in COLUMNS if c not in _MEASURED]
# Text columns of every results CSV: read as strings, empty cells as "" (not NaN).
TEXT_COLUMNS = ["case", "kind", "estimator", "aggregate", "target", "heavy_tail", "sampler", "mode", "equals"]


def _div(a: float, b: float) -> float:
    """a / b for relative columns: empty when b is 0, inf or NaN; inf stays inf."""
    if b == 0 or not math.isfinite(b) or math.isnan(a):
        return math.nan
    return a / b


def summarize(run: CaseRun) -> list[dict[str, Any]]:
    """Rows of the summary table for one case (see :data:`SCHEMA`)."""
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
        # Σ(f − c)²/N with c = exact mean is an unbiased estimate of the exact variance, so its
        # batch-means SE gives a z for the variance as well (meaningful when E[f⁴] < ∞).
        z_var, std_se = math.nan, math.nan
        if math.isfinite(exact_var) and shift == exact_mean and k > 1:
            m2_k = s2 / n_k
            m2 = float(s2.sum()) / n
            se_m2 = batch_means_se(m2_k - m2, n_k / n)
            std_se = se_m2 / (2 * math.sqrt(m2)) if m2 > 0 else 0.0
            # the scale of a variance computed from shifted sums: the squared mean and the variance
            z_var = z_score(m2, exact_var, se_m2, exact_mean**2 + exact_var)
        heavy = classify_heavy_tail(
            support_miss_weighted=run.pair.support_miss > 0 and run.pair.weights != "none",
            exact_var=exact_var, fourth_finite=run.pair.fourth_moment_finite(est, row.aggregate),
            kurtosis=run.pair.kurtosis_proxy(est, row.aggregate), draws=n, batch_sq=s2).value
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
        })
    ref = run.pair.reference_row()
    if ref is not None:
        add_reference(run, rows, ref)
    return rows


def add_reference(run: CaseRun, rows: list[dict[str, Any]], ref: str) -> None:
    """Fill ref_kl, ref_se and z_ref (see :data:`SCHEMA`) from the row labelled ``ref``: where no exact
    value exists, the measured mean of an unbiased lower-variance estimator is the yardstick. z_ref uses
    the batch means of the paired difference (every row sees the same paths), so the correlation
    between a row and the reference is accounted for."""
    labels = [r.label for r in run.rows]
    if ref not in labels:
        return
    j_ref = labels.index(ref)
    n_k = run.sizes.to(torch.float64)
    n = float(n_k.sum())
    s_ref = run.sums[:, j_ref]
    ref_mean = run.shifts[j_ref] + float(s_ref.sum()) / n
    ref_se = batch_means_se(s_ref / n_k - float(s_ref.sum()) / n, n_k / n)
    for j, (row, out) in enumerate(zip(run.rows, rows)):
        if row.group > 1:          # the paired differences below are per draw
            continue
        fixed = run.pair.reference_comparison(row.est, row.aggregate)
        if fixed is not None:
            out["ref_kl"], out["ref_se"], out["z_ref"] = fixed
            continue
        out["ref_kl"], out["ref_se"] = ref_mean, ref_se
        if row.est.target != REVERSE:
            continue
        diff = (run.sums[:, j] - s_ref) / n_k                      # per batch: mean_j − mean_ref − shifts
        se = batch_means_se(diff - float((run.sums[:, j] - s_ref).sum()) / n, n_k / n)
        out["z_ref"] = z_score(out["mean"], ref_mean, se, max(abs(out["mean"]), abs(ref_mean)))


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


def to_frame(rows: list[dict[str, Any]]) -> "pd.DataFrame":
    import pandas as pd
    return pd.DataFrame(rows, columns=COLUMNS)


def frame_to_csv_bytes(df: "pd.DataFrame") -> bytes:
    # repr-exact floats (17 significant digits) so that re-reading gives identical numbers;
    # NaN is written as an empty field, ±inf as inf/-inf.
    return df.to_csv(index=False, float_format="%.17g").encode()




def read_frame(source) -> "pd.DataFrame":
    """A results CSV (bytes or a path) as written by :func:`frame_to_csv_bytes`: text columns as strings
    with "" for empty cells, numbers as float64 or int64. The one reader of results tables, so that a
    DataFrame in memory and the file on disk read back identically."""
    import io

    import pandas as pd
    data = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    head = pd.read_csv(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source, nrows=0)
    text = [c for c in TEXT_COLUMNS if c in head.columns]
    df = pd.read_csv(data, dtype={c: object for c in text})
    for c in text:
        df[c] = df[c].fillna("")
    return df
