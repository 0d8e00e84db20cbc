"""The results schema (one row per case × estimator × λ × aggregate), summary statistics, and
atomic writing of ``summary.csv`` and ``run.json``.
"""
from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from .engine import CaseRun
# Persistence lives in kl_bench.storage; re-exported for callers of the results API.
from .storage import atomic_write_bytes, write_results  # noqa: F401

# Column → meaning. The order here is the column order of summary.csv.
SCHEMA: dict[str, str] = {
    "case": "case name from the spec",
    "kind": "case kind: gaussian | categorical | rollout",
    "estimator": "estimator name from the registry (kl-bench list)",
    "lambda": "λ of the control variate cv(λ); empty for other estimators",
    "aggregate": "rollouts: seq (estimator of L = Σ log r_t; k3 uses R = e^L) or tok (per-token estimator "
                 "summed over the generated tokens); empty for single draws",
    "target": "what the estimator estimates: KL(q||p) or KL(p||q)",
    "true_kl": "exact value of the target",
    "draws": "number of Monte Carlo draws x ~ q",
    "batches": "number of batches used for the batch-means standard error",
    "mean": "Monte Carlo mean of the estimator over all draws",
    "std": "Monte Carlo standard deviation of one draw's estimate",
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
    "frac_negative": "fraction of draws whose estimate is < 0",
    "sampler": "how draws were made when not from q (temperature, top-k/p, EOS suppression, stale policy, "
               "IS weights); empty for x ~ q. exact_mean is then E_b of the estimator, bias against KL(q||p)",
    "support_miss": "mass of q (worst context or step) that the sampler never draws; > 0 biases every estimate",
    "heavy_tail": "'infinite variance' or 'infinite 4th moment' (exact: the measured std is unreliable, "
                  "usually too low), 'kurtosis > draws' (rollouts: exact E[R⁴ˢ]/E[R²ˢ]² exceeds the draws, so "
                  "the measured std is unreliable), 'unstable batches' (one batch carries most of Σ(f − c)²), "
                  "or empty",
    "lambda_star": "cv rows: exact variance-optimal λ* = Cov(log r, r)/Var(r) (empty if unknown)",
    "lambda_star_mc": "cv rows: empirical λ* from this run's draws",
    "lambda_star_mc_se": "cv rows: standard error of lambda_star_mc (batch jackknife; unreliable when "
                         "E_q[r⁴] = ∞, see heavy_tail of cv rows)",
    "excess_std": "cv rows: exact_std at this λ / exact_std at λ* − 1 (0 at the optimum)",
    "n_for_10pct": "draws a batch needs for its mean to be within 10% of true_kl with 95% probability "
                   "(normal approximation, exact bias and std where known; inf if the bias alone exceeds 10%)",
    "rmse_b64": "root-mean-square error of a batch mean of 64 draws, bias included",
    "rmse_b1024": "the same for 1024 draws",
    "rmse_b16384": "the same for 16384 draws",
    "p_neg_b64": "probability that a batch mean of 64 draws is negative, simulated on min(4096, max(256, "
                 "draws/256)) batches of 64 independent draws",
}
COLUMNS = list(SCHEMA)


# Two different exact float64 sums (or a sum and a closed form) agree to ~1e-15 relative; differences
# below this fraction of the compared quantity's scale are rounding, not statistics.
ROUNDING = 1e-12


def z_score(value: float, ref: float, se: float, scale: float) -> float:
    """(value − ref)/se with float64 rounding (ROUNDING × scale) added to the standard error in
    quadrature, so that a zero-noise quantity compares equal at rounding level and never gives NaN."""
    if not (math.isfinite(value) and math.isfinite(ref)):
        return 0.0 if value == ref else math.copysign(math.inf, value - ref) if not math.isnan(value - ref) else math.nan
    se_eff = math.hypot(se if math.isfinite(se) else 0.0, ROUNDING * abs(scale))
    if se_eff == 0:
        return 0.0 if value == ref else math.copysign(math.inf, value - ref)
    return (value - ref) / se_eff


def _div(a: float, b: float) -> float:
    """a / b for relative columns: empty when b is 0, inf or NaN; inf stays inf."""
    if b == 0 or not math.isfinite(b) or math.isnan(a):
        return math.nan
    return a / b


def summarize(run: CaseRun) -> list[dict[str, Any]]:
    """Rows of the summary table for one case (see :data:`SCHEMA`)."""
    e_count = len(run.rows)
    n_k = run.sizes.to(torch.float64)
    n = float(n_k.sum())
    k = n_k.shape[0]
    rows = []
    for j, row in enumerate(run.rows):
        est = row.est
        s1, s2, neg = run.sums[:, j], run.sums[:, e_count + j], run.sums[:, 2 * e_count + j]
        shift = run.shifts[j]
        centred_mean = float(s1.sum()) / n
        mean = shift + centred_mean
        var = float(s2.sum()) / n - centred_mean**2
        std = math.sqrt(max(var, 0.0)) if math.isfinite(var) else math.inf
        # Batch means: Var(mean) ≈ K/(K−1) Σ_k (n_k/N)² (m_k − m)², exact for unequal batch sizes.
        batch_means = s1 / n_k
        se = math.sqrt(k / (k - 1) * float(((n_k / n) ** 2 * (batch_means - centred_mean) ** 2).sum())) \
            if k > 1 and math.isfinite(centred_mean) else math.nan
        exact_mean, exact_var = run.exact[row.label]
        exact_std = math.sqrt(exact_var) if exact_var >= 0 else math.nan
        true = run.pair.true_value(est.target)
        bias = mean - true if math.isfinite(true) else math.nan
        z = z_score(mean, exact_mean, se, max(abs(mean), abs(exact_mean)))
        # Σ(f − c)²/N with c = exact mean is an unbiased estimate of the exact variance, so its
        # batch-means SE gives a z for the variance as well (meaningful when E[f⁴] < ∞).
        z_var, std_se = math.nan, math.nan
        if math.isfinite(exact_var) and shift == exact_mean and k > 1:
            m2_k = s2 / n_k
            m2 = float(s2.sum()) / n
            se_m2 = math.sqrt(k / (k - 1) * float(((n_k / n) ** 2 * (m2_k - m2) ** 2).sum()))
            std_se = se_m2 / (2 * math.sqrt(m2)) if m2 > 0 else 0.0
            # the scale of a variance computed from shifted sums: the squared mean and the variance
            z_var = z_score(m2, exact_var, se_m2, exact_mean**2 + exact_var)
        heavy = ""
        if run.pair.support_miss > 0 and run.pair.weights != "none":
            heavy = "infinite IS weight (b misses q's support)"
        elif math.isinf(exact_var):
            heavy = "infinite variance"
        elif not run.pair.fourth_moment_finite(est, row.aggregate):
            heavy = "infinite 4th moment"
        elif run.pair.kurtosis_proxy(est, row.aggregate) > n:
            heavy = "kurtosis > draws"
        elif k > 1 and float(s2.sum()) > 0 and float(s2.max()) / float(s2.sum()) > max(0.2, 5 / k):
            heavy = "unstable batches"
        rows.append({
            "case": run.pair.name, "kind": run.pair.kind, "estimator": est.name,
            "lambda": math.nan if est.lam is None else est.lam, "aggregate": row.aggregate, "target": est.target,
            "true_kl": true, "draws": int(n), "batches": k, "mean": mean, "std": std, "se": se, "std_se": std_se,
            "bias": bias, "rel_bias": _div(bias, true), "rel_std": _div(std, true),
            "exact_mean": exact_mean, "exact_std": exact_std,
            "exact_rel_bias": _div(exact_mean - true, true) if math.isfinite(exact_mean) else math.nan,
            "exact_rel_std": _div(exact_std, true),
            "z": z,
            "z_var": z_var,
            "frac_negative": float(neg.sum()) / n,
            "sampler": (run.pair.sampler_label.removeprefix("sampler b: ") or "b ≠ q") if run.pair.has_sampler else "",
            "support_miss": run.pair.support_miss,
            "heavy_tail": heavy,
        })
    return rows


def exact_rows(pair, estimators) -> list[dict[str, Any]]:
    """Rows with only the exact columns filled: `kl-bench exact`."""
    from .engine import as_rows
    rows = []
    for row in as_rows(estimators, pair.aggregates):
        est = row.est
        mean, var = pair.exact_moments(est, row.aggregate)
        std = math.sqrt(var) if var >= 0 else math.nan
        true = pair.true_value(est.target)
        rows.append({"case": pair.name, "kind": pair.kind, "estimator": est.name,
                     "lambda": math.nan if est.lam is None else est.lam, "aggregate": row.aggregate,
                     "target": est.target, "true_kl": true, "exact_mean": mean, "exact_std": std,
                     "exact_rel_bias": _div(mean - true, true) if math.isfinite(mean) else math.nan,
                     "exact_rel_std": _div(std, true)})
    return rows


def to_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=COLUMNS)


def frame_to_csv_bytes(df: pd.DataFrame) -> bytes:
    # repr-exact floats (17 significant digits) so that re-reading gives identical numbers;
    # NaN is written as an empty field, ±inf as inf/-inf.
    return df.to_csv(index=False, float_format="%.17g").encode()


