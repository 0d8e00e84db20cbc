"""A categorical case's exact truth: the targets and every row's moments, as float64 sums over the drawn
(context, token) ids under the sampling mixture (docs/exact.md)."""
from __future__ import annotations

import math

import torch

from ...core import gates, oracles as exact
from ...core.estimators import RowSource
from ...core.targets import FORWARD, REVERSE, TV
from ..protocols import JointMoments
from .model import CategoricalModel


def true_values(m: CategoricalModel) -> dict[str, float]:
    return {REVERSE: exact.categorical_kl(m.log_q, m.log_p), FORWARD: exact.categorical_kl(m.log_p, m.log_q),
            TV: exact.categorical_tv(m.log_q, m.log_p)}


def exact_moments(m: CategoricalModel, est: RowSource) -> tuple[float, float]:
    return exact.weighted_moments(m.weights(), m.values(est))


def kurtosis_proxy(m: CategoricalModel, est: RowSource) -> float:
    """E_b[v⁴]/E_b[v²]² of the row's value v, exactly (sums over the drawn ids, scaled by the largest |v|
    so that neither sum overflows): beyond the draws, the draws have not met the few tokens that make
    E[v²] (IS weights q/b of 1e50 where a cold sampler leaves b tiny but not 0), and the measured std
    is far too low. NaN for a row of zeros."""
    v, w = m.values(est).abs(), m.weights()
    top = float(v.max()) if v.numel() else 0.0
    if not (top > 0 and math.isfinite(top)):
        return math.nan
    x = v / top
    second = float((w * x * x).sum())
    return float((w * x**4).sum()) / second / second if second > 0 else math.inf


def exact_joint(m: CategoricalModel) -> JointMoments:
    w, logr = m.weights(), m.logr
    a, b = -logr, torch.expm1(logr)
    if torch.isinf(a).any():                      # p(x) = 0 < q(x): KL(q‖p) = ∞
        return JointMoments(math.inf, float((w * b).sum()), math.inf, math.nan, math.nan)
    ma, mb = float((w * a).sum()), float((w * b).sum())
    # Second passes around the means: no E[x²] − E[x]² cancellation.
    return JointMoments(ma, mb, float((w * (a - ma) ** 2).sum()), float((w * (b - mb) ** 2).sum()),
                        float((w * (a - ma) * (b - mb)).sum()))


def exact_prob_negative(m: CategoricalModel, fn) -> float:
    v = fn(m.logr) if m.is_weight is None else fn(m.logr) * m.is_weight
    return float((m.weights() * (v < 0)).sum())


def gate_rates(m: CategoricalModel, gate, delta: float):
    """A gate's exact rates (kl_bench.core.gates) on the float64 tables, each context a draw's with probability 1/B."""
    return gates.gate_rates(m.log_q, m.log_p, torch.full((m.contexts,), 1.0 / m.contexts, dtype=torch.float64,
                                                             device=m.log_q.device),
                            gate, delta)
