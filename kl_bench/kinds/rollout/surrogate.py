"""The exact surrogate error of an off-policy update on a rollout, and Trust Region Masking's bounds on it
(Li et al., arXiv 2512.23075): the error J(p) − J(q) − E_q[Σ_t ρ_t A_t], the performance-difference identity
that gives it and the bounds are in docs/gates.md#the-surrogate-error-and-trms-bounds.

Two dynamic programs over (step, bucket) give the error exactly: V_t and Q_t backwards under q, d_t^q and
d_t^p forwards. Every table is float64 on the device of the model's tables; the results are host floats (the
DP is O(T·C·V)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...core.rollout_dp import not_eos_mask
from .model import RolloutModel


@dataclass(frozen=True)
class SurrogateError:
    """The exact terms of one rollout's surrogate error and TRM's bounds on it (docs/gates.md)."""
    j_roll: float            # J(q): the rollout policy's expected reward
    j_theta: float           # J(p): the trained policy's expected reward
    surrogate: float         # L(p) − J(q) = E_q[Σ_t ρ_t A_t]: the improvement the surrogate predicts
    error: float             # J(p) − J(q) − (L(p) − J(q)): what the surrogate misses
    kl_max: float            # δ: the largest per-bucket KL(q‖p) among the buckets reached
    tv_max: float            # ε: the largest per-bucket TV(q, p) among the buckets reached
    kl_seq: float            # D_seq: KL(q‖p) of whole sequences = Σ_t E_{d_t^q}[KL(c_t)]
    bounds: dict[str, float]  # classical_tv, classical_kl, pinsker_marginal, mixed, coupling

    @property
    def tightest(self) -> tuple[str, float]:
        """The smallest bound and its name (the paper's unified bound is the minimum)."""
        name = min(self.bounds, key=self.bounds.__getitem__)
        return name, self.bounds[name]


def trm_bounds(length: int, kl_max: float, tv_max: float, kl_seq: float) -> dict[str, float]:
    """TRM's bounds on |Error| for sequences of at most ``length`` steps and rewards in [0, 1]."""
    t, eps = length, tv_max
    return {"classical_tv": 2 * t * (t - 1) * eps ** 2,
            "classical_kl": t * (t - 1) * kl_max,
            "pinsker_marginal": 4 / 3 * t ** 1.5 * kl_max,
            "mixed": 2 * t * math.sqrt(kl_max * kl_seq),
            "coupling": 4 * min(1.0, eps) * sum(min(1.0, (s - 1) * eps) for s in range(1, t + 1))}


def surrogate_error(model: RolloutModel, reward: torch.Tensor) -> SurrogateError:
    """The exact surrogate error of π_θ = p on sequences of π_roll = q, with ``reward`` [C, V] per token.

    Raises ValueError unless every sequence's reward lies in [0, 1] (what the bounds assume)."""
    q, p = model.log_q.exp(), model.log_p.exp()
    reward = reward.to(dtype=q.dtype, device=q.device)
    if tuple(reward.shape) != tuple(q.shape):
        raise ValueError(f"reward: shape {tuple(reward.shape)}, the model's tables are {tuple(q.shape)}")
    lo, hi = _reward_range(model, reward)
    if lo < 0 or hi > 1:
        raise ValueError(f"reward: a sequence's reward ranges over [{lo:.3g}, {hi:.3g}]; the bounds need [0, 1]")
    alive = not_eos_mask(q.shape[1], model.eos, q.dtype, q.device)
    step = torch.nn.functional.one_hot(model.bucket, q.shape[0]).to(q.dtype)      # [V, C]: token → next bucket
    move_q, move_p = (q * alive) @ step, (p * alive) @ step        # [C, C]: bucket → next bucket, EOS leaves
    # Backwards under q: V_{T+1} = 0, Q_t(c, x) = r(c, x) + [x ≠ EOS]·V_{t+1}(bucket(x)), V_t = Σ_x q Q_t.
    value = torch.zeros(q.shape[0], dtype=q.dtype, device=q.device)
    gains = []
    for _ in range(model.length):
        qv = reward + alive * value[model.bucket][None, :]
        value = (q * qv).sum(1)
        gains.append((p * qv).sum(1) - value)                                    # g_t(c), last step first
    gains.reverse()
    # Forwards: the law of step t's bucket among the running sequences, under q and under p (start: bucket 0).
    d_q = torch.zeros_like(value)
    d_q[0] = 1.0
    d_p, reached = d_q.clone(), torch.zeros_like(d_q)
    sums = torch.zeros(3, dtype=q.dtype, device=q.device)      # the surrogate's gain, the error, D_seq
    for g in gains:
        reached = reached + d_q + d_p
        sums = sums + torch.stack([d_q @ g, (d_p - d_q) @ g, d_q @ model.kl_ctx])
        d_q, d_p = d_q @ move_q, d_p @ move_p
    seen = reached > 0                         # the buckets a step of either policy reaches within T steps
    tv = 0.5 * (q - p).abs().sum(1)
    # one host read for every result
    surrogate, shift, kl_seq, kl_max, tv_max, j_roll = torch.cat(
        [sums, model.kl_ctx[seen].max()[None], tv[seen].max()[None], value[:1]]).tolist()
    return SurrogateError(j_roll=j_roll, j_theta=j_roll + surrogate + shift, surrogate=surrogate, error=shift,
                          kl_max=kl_max, tv_max=tv_max, kl_seq=kl_seq,
                          bounds=trm_bounds(model.length, kl_max, tv_max, kl_seq))


def _reward_range(model: RolloutModel, reward: torch.Tensor) -> tuple[float, float]:
    """The smallest and largest reward of any sequence (max-plus and min-plus programs over the steps)."""
    alive = not_eos_mask(reward.shape[1], model.eos, reward.dtype, reward.device) > 0
    hi = torch.zeros(reward.shape[0], dtype=reward.dtype, device=reward.device)
    lo = hi.clone()
    for _ in range(model.length):
        hi = (reward + torch.where(alive, hi[model.bucket], 0.0)[None, :]).amax(1)
        lo = (reward + torch.where(alive, lo[model.bucket], 0.0)[None, :]).amin(1)
    return float(lo[0]), float(hi[0])
