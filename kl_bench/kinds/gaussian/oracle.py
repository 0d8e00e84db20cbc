"""A Gaussian case's exact truth: the targets in closed form, every row's moments by tilted Gaussians (a
polynomial estimator) or 1-D quadrature (any other function of log r, a sampler's weights), the joint moments
of the λ curve and the kurtosis proxy (kl_bench.core.oracles; docs/exact.md)."""
from __future__ import annotations

import math

import torch

from ...core import oracles as exact
from ...core.estimators import Estimator, Poly, RowSource
from ...core.targets import FORWARD, REVERSE
from ..protocols import JointMoments
from .model import GaussianModel


def kl(m: GaussianModel) -> float:
    g = m.params
    return exact.gaussian_kl(g.mq, g.sq, g.mp, g.sp)


def kl_forward(m: GaussianModel) -> float:
    g = m.params
    return exact.gaussian_kl(g.mp, g.sp, g.mq, g.sq)


def true_values(m: GaussianModel) -> dict[str, float]:
    return {REVERSE: kl(m), FORWARD: kl_forward(m)}


def unsupported(m: GaussianModel, sources: list[RowSource]) -> list[str]:
    """What has no exact oracle here: multivariate Gaussians have closed forms for polynomial estimators and
    |log r|, but any other function of log r (clamped variants, plug-ins), a weight cap or a weighted |log r|
    needs quadrature, which is 1-D."""
    if m.dim == 1:
        return []
    what = [e.name for e in sources if not e.analytic and e.poly is None and exact.abs_logr_scale(e) is None]
    what += [f"{e.name} with importance weights" for e in sources
             if m.weighted and exact.abs_logr_scale(e) is not None]
    return what + (["weight_cap"] if m.weight_cap is not None else [])


def _analytic_under_sampler(m: GaussianModel) -> tuple[float, float]:
    """The analytic row's moments under a sampler that weights: KL·w, w = q/b (capped or not)."""
    if m.weight_cap is not None:
        # KL·min(w, cap): E_b[min(w, cap)] < 1, by 1-D quadrature of the constant times the capped
        # weight (caps on D > 1 are refused by validate()).
        value = kl(m)
        const = Estimator("full", lambda logr: torch.full_like(logr, value), REVERSE, True, True, "KL",
                          {(0, 0): value})
        return exact.gaussian_sampler_moments(m.params, const, m.sampler_params, True, m.weight_cap)
    # KL·w: E_b[w] = 1, Var_b[w] = E_q[q/b] − 1
    t = exact.tilt(m.params, 0, m.sampler_params, 2)
    m2 = math.exp(t[0]) if t else math.inf
    return kl(m), kl(m) ** 2 * (m2 - 1)


def exact_moments(m: GaussianModel, est: RowSource) -> tuple[float, float]:
    if est.analytic and not m.weighted:
        return kl(m), 0.0                # one context: the analytic KL, a constant
    if est.analytic:                     # weighted implies a sampler
        return _analytic_under_sampler(m)
    if m.has_sampler:
        return exact.gaussian_sampler_moments(m.params, est, m.sampler_params, m.weighted, m.weight_cap)
    return exact.gaussian_estimator_moments(m.params, est)


def exact_joint(m: GaussianModel) -> JointMoments:
    g = m.params
    # Cov(−log r, r − 1) = E[log r] − E[r log r] = −[KL(q‖p) + KL(p‖q)]; Var(r) = χ²(p‖q).
    return JointMoments(mean_a=kl(m), mean_b=0.0, var_a=exact.gaussian_var_k1(g), var_b=exact.gaussian_chi2(g),
                        cov_ab=-(kl(m) + kl_forward(m)))


def fourth_finite(m: GaussianModel, poly: Poly | None) -> bool:
    """Whether E_b[f⁴] < ∞ for f a polynomial in r^s (log r)^k: f⁴ reaches r^{4·s_max}, finite iff the tilt
    normalises (with the weight's fourth power under an uncapped weighted sampler)."""
    s_max = max((s for (s, _), c in poly.items() if c != 0), default=0) if poly is not None else 0
    if m.has_sampler:
        return exact.tilt(m.params, 4 * s_max, m.sampler_params, 4 if m.weighted and not m.weight_cap else 0) \
            is not None
    return exact.tilt(m.params, 4 * s_max) is not None


def kurtosis_proxy(m: GaussianModel, est: RowSource) -> float:
    """E_b[v⁴]/E_b[v²]² of the row's value v (exact: closed form or 1-D quadrature); NaN for the analytic
    row (a constant, or the constant times w) and where no oracle applies."""
    if est.analytic:
        return math.nan
    return exact.gaussian_fourth_ratio(m.params, est, m.sampler_params, m.weighted, m.weight_cap)
