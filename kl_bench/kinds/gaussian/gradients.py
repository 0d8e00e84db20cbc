"""Exact gradients of a Gaussian case for θ = (μq, log σq) per dimension (docs/gradients.md): the score is
s = (z/σq, z² − 1) per dimension, z q's standard score, so every expectation E_b[(w) c s] is a sum of tilted
Gaussian moments of z (kl_bench.core.oracles.gaussian_score_moment). The Monte Carlo side is the default
accumulator of kl_bench.kinds.defaults.ScoreGradients over :func:`scores`."""
from __future__ import annotations

import math

import numpy as np
import torch

from ...core import oracles as exact
from ...core.estimators import Poly, poly_square
from ...core.targets import FORWARD, REVERSE
from ..protocols import ExactGrad, GradItem
from . import oracle
from .model import GaussianModel


def gradient_references(m: GaussianModel) -> dict[str, np.ndarray]:
    """∇(μq, log σq) of KL(q‖p) = (d/σp², σq²/σp² − 1) and of KL(p‖q) = (d/σq², 1 − (σp² + d²)/σq²)."""
    g = m.params
    d = g.mq - g.mp
    return {REVERSE: np.concatenate([d / g.sp**2, g.sq**2 / g.sp**2 - 1]),
            FORWARD: np.concatenate([d / g.sq**2, 1 - (g.sp**2 + d**2) / g.sq**2])}


def _combine(*terms: tuple[float, float]) -> float:
    """Σ of (coefficient, moment) products; ∞ when a moment is (no ∞ − ∞ = NaN)."""
    return math.inf if any(math.isinf(t) for _, t in terms) else sum(a * t for a, t in terms)


def gradient_exact(m: GaussianModel, item: GradItem, directions: dict[str, np.ndarray]) -> ExactGrad | None:
    """E_b[(w) c s] with s = (z/σ per dimension, z² − 1 per dimension), b the case's sampler (q when
    none); None for non-polynomial c or capped weights."""
    cpoly = item.cpoly
    if cpoly is None or m.weight_cap is not None:
        return None
    g, dim = m.params, m.dim
    b = m.sampler_params if m.has_sampler else None     # under a sampler: E_b[w^m ·], m = 1 with weights
    wm = 1 if m.weighted else 0

    def e(poly: Poly, i: int, j: int, power: int = 1) -> float:
        """E_b[w^{m·power} poly(r, log r) z_i^j]: power 2 for second moments (they carry w²)."""
        return sum(a * exact.gaussian_score_moment(g, s, k, i, j, b, wm * power)
                   for (s, k), a in poly.items() if a != 0)
    mean = np.array([e(cpoly, i, 1) / g.sq[i] for i in range(dim)] +
                    [e(cpoly, i, 2) - e(cpoly, i, 0) for i in range(dim)])
    c2 = poly_square(cpoly)

    def e2(i: int, j: int) -> float:
        return e(c2, i, j, 2)
    # |s|² = Σ_i z_i²/σ_i² + (z_i² − 1)² = Σ_i z_i²/σ_i² + z_i⁴ − 2 z_i² + 1
    second = sum(_combine((1 / g.sq[i] ** 2, e2(i, 2)), (1, e2(i, 4)), (-2, e2(i, 2)), (1, e2(i, 0)))
                 for i in range(dim))
    proj_var = {}
    for name, u in directions.items():
        # (c s·u)² = c² (Σ_i u_μi z_i/σ_i + u_σi (z_i² − 1))²: needs cross-dimension terms; exact for D = 1.
        if dim != 1:
            proj_var[name] = math.nan
            continue
        um, us = u[0] / g.sq[0], u[1]
        ex = _combine((um**2, e2(0, 2)), (us**2, e2(0, 4)), (-2 * us**2, e2(0, 2)), (us**2, e2(0, 0)),
                      (2 * um * us, e2(0, 3)), (-2 * um * us, e2(0, 1)))
        proj_var[name] = ex - float(mean @ u) ** 2
    return ExactGrad(mean, second, proj_var)


def gradient_self(m: GaussianModel, item: GradItem) -> np.ndarray | None:
    """∇θ E_q[f(log r)] = E_q[(f − f′)·s]: loss_is's exact expected gradient on-policy (polynomial f);
    None under a sampler (its oracle takes expectations under b)."""
    if m.has_sampler:
        return None
    ex = gradient_exact(m, GradItem.of(item.est, "loss_is"), {})
    return None if ex is None else ex.mean


def fourth_moment_finite(m: GaussianModel, item: GradItem) -> bool:
    """E|c s|⁴ < ∞ iff q^{1−4s} p^{4s} (under a sampler: b^{1−4m} q^{4m−4s} p^{4s}) normalises, s the
    largest power of r in c (|s|⁴ is a polynomial in z)."""
    return item.cpoly is not None and oracle.fourth_finite(m, item.cpoly)


def scores(m: GaussianModel, z: torch.Tensor) -> torch.Tensor:
    """∇θ log q(x) for θ = (μq, log σq): (z/σq, z² − 1) per dimension [n, 2D], z q's standard score [n, D]."""
    sq = torch.as_tensor(m.params.sq, dtype=torch.float64, device=z.device)
    return torch.cat([z / sq, z * z - 1], dim=-1)
