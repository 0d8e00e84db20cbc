"""Sums of T i.i.d. tokens' log-ratios, exactly: a clamp on the sequence log-weight (docs/gates.md#a-clamp-on-the-sequence-log-weight)
and OPSM's mask on the mean log-ratio of a sequence.

verl clamps the sequence log importance weight L = Σ_t log(q(x_t)/b(x_t)) to [−C, C] (C = 20, its SAFETY_BOUND,
volcengine/verl b178a3c ``verl/trainer/ppo/rollout_corr_helper.py``) before exp. Unclamped, E_b[W] = 1; clamped,

    E_b[e^{clamp(L, −C, C)}] = P_q(−C ≤ L ≤ C) + e^C·P_b(L > C) + e^{−C}·P_b(L < −C),

since E_b[W·1{A}] = P_q(A). Under b the mean of L is −T·KL(b‖q) and under q it is +T·KL(q‖b): once T·KL(q‖b) nears
C, most of q's mass lies beyond the clamp, and the clamped weight's mean falls towards e^C·P_b(L > C) ≪ 1 (the
"collapse" of sequence importance sampling).

Exact for T steps drawn i.i.d. from one distribution over V tokens: L depends on the path only through the token
counts n (a composition of T into V parts), whose law is multinomial, so the probabilities above are sums over the
C(T + V − 1, V − 1) compositions, each weighted in log space (lgamma) and summed in float64. Small V only: the
count of compositions grows like T^(V−1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Compositions enumerated at most (memory: a few int arrays of this length).
MAX_COMPOSITIONS = 5_000_000


def compositions(total: int, parts: int) -> np.ndarray:
    """Every vector of ``parts`` non-negative integers summing to ``total``, [N, parts] int64."""
    if parts == 1:
        return np.array([[total]], dtype=np.int64)
    rows = [np.concatenate([np.full((len(rest), 1), first, dtype=np.int64), rest], axis=1)
            for first in range(total + 1) for rest in [compositions(total - first, parts - 1)]]
    return np.concatenate(rows)


def _counts(logs: tuple[np.ndarray, ...], steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(every composition n of ``steps`` into V parts [N, V], log of its multinomial coefficient [N]) after checking
    that each log-prob vector in ``logs`` [V] gives every token a probability > 0 and that N is not too large."""
    v = logs[0].shape[0]
    if not all(np.isfinite(lp).all() for lp in logs):
        raise ValueError("the distributions must give every token a probability > 0 (finite log-probs)")
    if math.comb(steps + v - 1, v - 1) > MAX_COMPOSITIONS:
        raise ValueError(f"{math.comb(steps + v - 1, v - 1):,} compositions of T = {steps} into V = {v} parts: "
                         f"more than {MAX_COMPOSITIONS:,}")
    n = compositions(steps, v)
    # log multinomial coefficient: lgamma(T + 1) − Σ lgamma(n_x + 1)
    return n, math.lgamma(steps + 1) - np.vectorize(math.lgamma)(n + 1.0).sum(1)


@dataclass(frozen=True)
class ClampedWeight:
    """The clamped sequence weight at T steps: ``mean`` E_b[e^{clamp(L)}] (1 unclamped), ``bias`` mean − 1,
    ``above`` P_q(L > C) (q's mass beyond the upper clamp), ``t_kl`` T·KL(q‖b)."""
    steps: int
    clamp: float
    mean: float
    bias: float
    above: float
    t_kl: float


def clamped_weight(log_q: np.ndarray, log_b: np.ndarray, steps: int, clamp: float = 20.0) -> ClampedWeight:
    """Exact :class:`ClampedWeight` for ``steps`` i.i.d. tokens from b (log-probs ``log_b`` [V], b > 0 wherever
    q > 0) weighted towards q (``log_q`` [V]), L clamped to ±``clamp``; both with full support."""
    log_q, log_b = np.asarray(log_q, dtype=np.float64), np.asarray(log_b, dtype=np.float64)
    n, log_coef = _counts((log_q, log_b), steps)
    ell = log_q - log_b                                       # per-token log-weight
    big_l = n @ ell

    def prob(log_p: np.ndarray, mask: np.ndarray) -> float:
        """P(mask) under i.i.d. draws from exp(log_p): Σ over the compositions in mask of coef·Π p^n."""
        terms = log_coef + n @ log_p
        return float(np.exp(terms[mask]).sum())
    above, below = big_l > clamp, big_l < -clamp
    inside = ~(above | below)
    mean = prob(log_q, inside) + math.exp(clamp) * prob(log_b, above) + math.exp(-clamp) * prob(log_b, below)
    kl = float(np.sum(np.exp(log_q) * ell))
    return ClampedWeight(steps, clamp, mean, mean - 1.0, prob(log_q, above), steps * kl)


def opsm_share(log_old: np.ndarray, log_new: np.ndarray, steps: int, delta: float) -> float:
    """DeepSeek-V3.2's off-policy sequence masking (OPSM) of T i.i.d. tokens drawn from the old policy
    (``log_old`` [V]): the share of sequences whose mean log(π_old/π_new) over their tokens exceeds ``delta``,
    exactly by compositions (:func:`compositions`). OPSM masks those among the negative-advantage sequences: with
    an advantage independent of the ratio, the share of all sequences masked is this times P(A < 0). As T grows
    the mean concentrates at KL(π_old‖π_new) per token, so the share goes to 1 above δ and to 0 below it."""
    log_old, log_new = np.asarray(log_old, dtype=np.float64), np.asarray(log_new, dtype=np.float64)
    n, log_coef = _counts((log_old, log_new), steps)
    above = (n @ (log_old - log_new)) / steps > delta
    return float(np.exp((log_coef + n @ log_old)[above]).sum())
