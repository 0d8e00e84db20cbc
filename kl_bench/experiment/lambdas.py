"""The control variate cv(λ) = −log r + λ(r − 1) over a λ grid, from one pass of draws.

With a = −log r and b = r − 1, cv(λ) = a + λb, so E[cv(λ)] is linear and Var[cv(λ)] quadratic in λ:
the five per-batch sums of (a, b, a², b², ab) that the engine accumulates give the whole curve, the
empirical λ* = −Cov(a, b)/Var(b), and batch-means standard errors at every λ (docs/lambda.md).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..engine.monte_carlo import CaseRun
from ..kinds.protocols import JointMoments
from ..core.stats import batch_means_se, jackknife_se
from ..results.schema import SWEEP_SCHEMA



def mc_joint(run: CaseRun, aggregate: str = "") -> tuple[JointMoments, np.ndarray, np.ndarray, np.ndarray]:
    """Monte Carlo joint moments of (a, b) plus per-batch centred means a_k, b_k and sizes n_k."""
    s = run.joint_sums(aggregate).numpy()
    n_k = run.sizes.numpy().astype(np.float64)
    n = n_k.sum()
    ca, cb = run.joint_shift(aggregate)
    sa, sb, saa, sbb, sab = s.sum(axis=0) / n
    # A draw with p(x) = 0 makes a = −log r infinite (KL(q‖p) = ∞): its mean is +inf and its variance
    # inf − inf; report the variance as +inf and the covariance as NaN, without a numpy warning.
    with np.errstate(invalid="ignore", over="ignore"):
        jm = JointMoments(mean_a=ca + sa, mean_b=cb + sb,
                          var_a=saa - sa * sa if np.isfinite(sa) else np.inf,
                          var_b=sbb - sb * sb if np.isfinite(sb) else np.inf, cov_ab=sab - sa * sb)
        return jm, s[:, 0] / n_k - sa, s[:, 1] / n_k - sb, n_k


def lambda_star_mc(run: CaseRun, aggregate: str = "") -> tuple[float, float]:
    """(λ̂*, standard error): the ratio −Cov(a, b)/Var(b) on the draws, its SE by the batch jackknife."""
    s = run.joint_sums(aggregate).numpy()
    n_k = run.sizes.numpy().astype(np.float64)

    def ratio(tot: np.ndarray, n: float) -> np.ndarray:
        sa, sb, _, sbb, sab = (tot[..., i] / n for i in range(5))
        return -(sab - sa * sb) / (sbb - sb * sb)

    total = s.sum(axis=0)
    # r − 1 may overflow to inf on far-apart pairs (or Var(b) be 0): the ratio is then NaN, not a warning.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        est = float(ratio(total, n_k.sum()))
        loo = ratio(total[None, :] - s, n_k.sum() - n_k)     # leave one batch out: [K]
        return est, jackknife_se(loo)


def lambda_grid(center: float, extra: list[float], points: int = 401) -> np.ndarray:
    """A fine grid containing 0 (k1), 1 (k3), λ* and the spec's λs.

    The fine part spans [min(0, λ*) − ½, max(1.5, λ* + ½)], widened to take in the spec's λs that lie
    within twice its width; a λ farther out (|λ| up to spec_experiment.MAX_LAMBDA) is one more point, so that it
    does not stretch the fine part into a few coarse steps."""
    lo, hi = min(0.0, center) - 0.5, max(1.5, center + 0.5)
    width = hi - lo
    near = [x for x in extra if lo - 2 * width <= x <= hi + 2 * width]
    lo, hi = min([lo, *(x - 0.5 for x in near)]), max([hi, *near])
    return np.unique(np.concatenate([np.linspace(lo, hi, points), [0.0, 1.0, center], extra]))


def sweep_frame(run: CaseRun, aggregate: str, exact: JointMoments, true_kl: float, p_negative_exact,
                measured_neg: dict[float, float]) -> pd.DataFrame:
    """The λ curve of one case and aggregate: MC (from the joint moments) next to exact, on a fine grid."""
    mc, a_k, b_k, n_k = mc_joint(run, aggregate)
    star = exact.lambda_star
    star_mc, _ = lambda_star_mc(run, aggregate)
    center = star if math.isfinite(star) else star_mc if math.isfinite(star_mc) else 0.0
    grid = lambda_grid(center, sorted(measured_neg))
    n = n_k.sum()
    # Far λs on heavy-tailed pairs: λ²·Var(r) may pass float64's range, which is an infinite std here.
    with np.errstate(over="ignore"):
        se = batch_means_se(a_k[None, :] + grid[:, None] * b_k[None, :], n_k / n)
        std = np.sqrt(np.maximum(mc.var(grid), 0.0))
        exact_std = np.sqrt(exact.var(grid))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = 1 / true_kl if true_kl and math.isfinite(true_kl) else math.nan
    return pd.DataFrame({
        "case": run.pair.name, "aggregate": aggregate, "lambda": grid, "true_kl": true_kl,
        "mean": mc.mean(grid), "se": se, "std": std, "rel_std": std * rel,
        "exact_mean": exact.mean(grid), "exact_std": exact_std, "exact_rel_std": exact_std * rel,
        "p_negative_exact": [p_negative_exact(x) for x in grid],
        "frac_negative": [measured_neg.get(float(x), math.nan) for x in grid],
        "lambda_star": star, "lambda_star_mc": star_mc,
    }, columns=list(SWEEP_SCHEMA))
