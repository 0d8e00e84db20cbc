"""Training a rollout policy: θ = q's per-bucket logits [C, V], exact by the rollout dynamic program.

A path y = (x_1, …, x_|y|) earns Σ_t reward(c_{t−1}, x_t). The true objective is
J(θ) = E_q[Σ_t reward] − β KL(q‖p) with KL(q‖p) = E_q[Σ_t log q − log p]; J and ∇J come from autograd of
the dynamic program (:func:`kl_bench.kinds.rollout.dp.path_moments`), with θ both in the sampling law and in
the summand. The trainer's expected direction is ∇E_q[Σ_t reward] (the score function of the
sequence, exact) minus β times the combination's exact expected gradient
(:func:`kl_bench.kinds.rollout.gradients.exact_mean`). The optimum of J over all sequence laws is
q*(y) ∝ p(y) exp(Σ_t reward/β); KL(q‖q*) = log Z − J/β with Z = E_p[exp(Σ_t reward/β)]. A per-bucket
policy reaches q* only where q* is itself per-bucket (T = 1, or no reward), so the final distance is how
close each combination gets within the family.

A reward of whole sequences R(y) (:class:`SequenceRolloutProblem`) is not a sum over steps: its exact values
come from enumerating every sequence (:mod:`.sequences`).

This is the rollout kind's :class:`kl_bench.kinds.trainable.TrainingOracle` (``RolloutPair.training_problem``):
it uses the model (:class:`kl_bench.kinds.rollout.RolloutModel`, the tables of the policy q_θ against p) and
the functions that take one; never a pair.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ...foundation.errors import SpecError
from ...sampling.seeding import BatchStream
from ..trainable import Combo
from . import dp, gradients, sampler
from .accumulator import RolloutGradients
from .model import RolloutModel
from .sequences import Sequences


@dataclass(frozen=True)
class RolloutProblem:
    """One rollout case to train: θ0 = log q [C, V], log p [C, V], a reward table [C, V], β, and the case's
    buckets [V], length T and EOS token."""
    name: str
    theta0: torch.Tensor
    log_p: torch.Tensor
    reward: torch.Tensor
    beta: float
    bucket: torch.Tensor
    length: int
    eos: int | None

    def model(self, lq: torch.Tensor) -> RolloutModel:
        """The rollout model of the policy log q [C, V] against p (nothing sampled: building it is O(C·V))."""
        return RolloutModel.build(lq.detach(), self.log_p, self.bucket, self.length, self.eos)

    def _log_z(self, model: RolloutModel) -> float:
        """log E_p[exp(Σ_t reward/β)]: the normaliser of q*. Directly where Z is a positive float64 (the values
        every committed result holds); else in log space: exp(Σ_t reward/β) overflows once a path's Σ
        reward/β passes ~709 (β = 0.05 at 64 steps of reward 0.6) and underflows below −745, so the dynamic
        program runs on m' = exp(reward/β − c) ≤ 1 with c = max reward/β, split by length ℓ (a path of
        length ℓ has ℓ factors): log Z = logsumexp_ℓ [c·ℓ + log E_p[Π m' ; |y| = ℓ]]."""
        s = self.reward / self.beta
        z = float(dp.path_moments(model, self.log_p, torch.exp(s), torch.zeros_like(s), 0)[0])
        if 0 < z < math.inf:
            return math.log(z)
        c = float(s.max())
        by_length = dp.path_by_length(model, self.log_p, torch.exp(s - c), torch.zeros_like(s), 0)[:, 0]   # [T]
        lengths = torch.arange(1, by_length.shape[0] + 1, dtype=torch.float64, device=by_length.device)
        log_z = float(torch.logsumexp(torch.log(by_length) + c * lengths, 0))
        return log_z if math.isfinite(log_z) else math.nan

    def evaluate(self, theta: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
        """Exact values at θ and ∇J [C, V] (autograd through the dynamic program)."""
        th = theta.detach().clone().requires_grad_(True)
        lq = torch.log_softmax(th, -1)
        model = self.model(lq)
        j = dp.path_moments(model, th, torch.ones_like(lq), self.reward - self.beta * (lq - self.log_p))[1]
        (grad_j,) = torch.autograd.grad(j, th)
        lq = lq.detach()
        ones = torch.ones_like(lq)
        reward = float(dp.path_moments(model, lq, ones, self.reward)[1])
        # First moments only (the kind's oracle also computes higher ones for its estimator rows).
        kl_rev = float(dp.path_moments(model, lq, ones, lq - self.log_p)[1])
        objective = reward - self.beta * kl_rev
        out = {"kl_rev": kl_rev, "kl_fwd": float(dp.path_moments(model, self.log_p, ones, self.log_p - lq)[1]),
               "entropy": float(dp.path_moments(model, lq, ones, -lq)[1]), "reward": reward, "objective": objective,
               # log Z − J/β: rounding of order 1e-16·|J|/β, far below the distances reported.
               "kl_opt": self._log_z(model) - objective / self.beta}
        return out, grad_j

    @property
    def has_reward(self) -> bool:
        return bool(self.reward.any())

    def reward_gradient(self, lq: torch.Tensor) -> torch.Tensor:
        """∇θ E_q[Σ_t reward] at θ with log softmax θ = lq, [C, V] (the score function's expectation)."""
        if not self.has_reward:
            return torch.zeros_like(lq)
        th = lq.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(dp.path_moments(self.model(lq), th, torch.ones_like(lq), self.reward)[1], th)
        return g

    def expected_update(self, theta: torch.Tensor, combo: Combo) -> torch.Tensor:
        """The trainer's expected ascent direction at θ, exact, [C, V]."""
        lq = torch.log_softmax(theta, -1)
        g = gradients.exact_mean(self.model(lq), combo.item)
        if g is None and not torch.equal(theta, self.theta0):
            # The policy has gone where the moments leave float64 (or θ is no longer finite): the trajectory
            # has diverged, and says so (NaN from here on: kl_bench.training.result.diverged), while the
            # other trajectories are written. At θ0 it is the spec's combination that cannot be computed.
            return torch.full_like(lq, math.nan)
        if g is None:
            raise SpecError(f"'{combo.label}' has no exact expected gradient on this rollout (moments beyond "
                            "float64 or a non-polynomial sequence-level estimator)", case=self.name, key="train.combinations")
        return self.reward_gradient(lq) - self.beta * torch.as_tensor(g, device=lq.device).reshape(lq.shape)

    def sampled_update(self, theta: torch.Tensor, combo: Combo, batch: BatchStream, piece: int,
                       chunk: int) -> torch.Tensor:
        """The trainer's ascent direction from ``batch.size`` rollouts of q_θ, [C, V]: the combination's
        per-draw gradients (kl_bench.kinds.rollout.accumulator.RolloutGradients) and the reward's score
        function Σ_t reward · S on the same paths (drawn again from the same piece generators)."""
        lq = torch.log_softmax(theta, -1)
        model = self.model(lq)
        acc = RolloutGradients(model, [combo.item], [np.zeros(lq.numel())], batch.device, case=self.name)
        acc.add(batch)
        g_kl = torch.as_tensor(acc.total()[0], device=lq.device).reshape(lq.shape)
        g_r = self._sampled_reward_gradient(model, lq, batch, acc.piece) if self.has_reward else torch.zeros_like(lq)
        return (g_r - self.beta * g_kl) / batch.size

    def path_rewards(self, keys: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """The reward of each sampled path: Σ_t reward(c_{t−1}, x_t) over its steps, [n] (keys, alive: [n, T])."""
        return (self.reward.reshape(-1)[keys] * alive).sum(1)

    def _sampled_reward_gradient(self, model: RolloutModel, lq: torch.Tensor, batch: BatchStream,
                                 piece: int) -> torch.Tensor:
        """Σ_paths R(y) S(y), [C, V], S(y) = Σ_t e_{x_t} − q_{c_{t−1}}: the paths drawn again from the batch's
        piece generators (the very paths the KL term's accumulator drew). The reward and the sums live with
        the policy's tables, on the host where the spec loads them (float sums in draw order)."""
        w = torch.zeros(lq.numel(), dtype=torch.float64, device=lq.device)
        for m, g in batch.pieces(piece):
            p = sampler.paths(model, m, g, batch.device)
            keys, alive = p.keys.to(lq.device), p.alive.to(lq.device)
            total = self.path_rewards(keys, alive)[:, None]
            w.index_add_(0, keys.reshape(-1), (total * alive).reshape(-1))
        wm = w.reshape(lq.shape)
        return wm - wm.sum(-1, keepdim=True) * lq.exp()


@dataclass(frozen=True)
class SequenceRolloutProblem(RolloutProblem):
    """A rollout case trained against R(y) (its per-token ``reward`` table is zero): ``sequence`` R
    (kl_bench.kinds.trainable.Reward.sequence), ``seqs`` every sequence, ``values`` R on each [M]."""
    sequence: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    seqs: Sequences | None = None
    values: torch.Tensor | None = None

    @property
    def has_reward(self) -> bool:
        return True

    def _log_probs(self, lq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log q(y), log p(y)) of every sequence, [M] each."""
        s = self.seqs
        lq_y = torch.where(s.mask, lq.reshape(-1)[s.keys], 0.0).sum(-1)
        lp_y = torch.where(s.mask, self.log_p.reshape(-1)[s.keys], 0.0).sum(-1)
        return lq_y, lp_y

    def _score(self, lq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Σ_y w(y) S(y), [C, V], with S(y) = ∇θ log q(y) = Σ_t e_{c_{t−1}, x_t} − q(·|c_{t−1}) in row c_{t−1}."""
        s = self.seqs
        # Past a sequence's end the key is 0 and the weight 0.0: adding it changes nothing.
        acc = torch.zeros(lq.numel(), dtype=torch.float64, device=lq.device).index_add_(
            0, s.keys.reshape(-1), (w[:, None] * s.mask).reshape(-1))
        acc = acc.reshape(lq.shape)
        return acc - acc.sum(-1, keepdim=True) * lq.exp()

    def evaluate(self, theta: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
        """Exact values at θ and ∇J = Σ_y q(y)(R(y) − β log(q(y)/p(y))) S(y), by enumeration. KL(q‖q*) is
        summed directly (log q* = log p + R/β − log Z), not as log Z − J/β."""
        lq = torch.log_softmax(theta.detach(), -1)
        lq_y, lp_y = self._log_probs(lq)
        q_y, r = lq_y.exp(), self.values
        log_opt = lp_y + r / self.beta
        log_opt = log_opt - torch.logsumexp(log_opt, 0)
        kl_rev, reward = float((q_y * (lq_y - lp_y)).sum()), float((q_y * r).sum())
        out = {"kl_rev": kl_rev, "kl_fwd": float((lp_y.exp() * (lp_y - lq_y)).sum()),
               "entropy": float(-(q_y * lq_y).sum()), "reward": reward, "objective": reward - self.beta * kl_rev,
               "kl_opt": float((q_y * (lq_y - log_opt)).sum())}
        return out, self._score(lq, q_y * (r - self.beta * (lq_y - lp_y)))

    def reward_gradient(self, lq: torch.Tensor) -> torch.Tensor:
        """∇θ E_q[R] = Σ_y q(y) R(y) S(y), exact by enumeration, [C, V]."""
        lq = lq.detach()
        return self._score(lq, self._log_probs(lq)[0].exp() * self.values)

    def path_rewards(self, keys: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """R of each sampled path (the reward called on the paths' tokens), [n]."""
        mask = alive > 0
        # R is evaluated on the host (a user's function); its values join the paths on their device
        return self.sequence(torch.where(mask, keys % self.log_p.shape[1], -1), mask).to(alive.device)
