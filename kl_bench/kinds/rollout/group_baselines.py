"""Group baselines on rollouts (kl_bench.experiment.group_baselines, docs/weights.md#group-baselines-reward-mode): the pieces of
a reward-mode row W·(F − b)·S with F = f(L) (``seq``, polynomial f) or Σ_t f_t (``tok``), W the sequence
weight (1 without one) and S the sequence's score.

Exact: E_b[W F S] (the reward row's expected gradient), E_b[W S] and E_b[F] by the phased program; the
second moments are measured (|S|² couples the steps: kl_bench.kinds.rollout.gradients). Monte Carlo: per
path (F, W, S·u, |S|²) from recorded paths, on the sampling device.
"""
from __future__ import annotations

import numpy as np
import torch

from ...core.aggregates import AGGREGATES
from ...foundation.errors import SpecError
from ...core.modes import GradItem
from ...sampling.seeding import piece_draws
from ..protocols import BaselineDraws
from . import dp
from .accumulator import SortedPaths
from .gradients import count_moment, exact_mean, host_vector, score_part
from .model import RolloutModel
from .sampler import paths


def check(model: RolloutModel, case: str) -> None:
    """A rollout's baseline rows centre the sequence's value F and multiply by its sequence weight W: token
    weights (each token's ratio inside F), rounded log-probs and rejection masks are not modelled."""
    if not model.weighting.baselines:
        raise SpecError(f"group baselines on rollouts need weights = \"none\" or \"sequence\", not "
                        f"\"{model.weighting.name}\" (only the sequence's product weight W is modelled: W·(F − b)·S)",
                        key="sampler.weights", case=case)
    if model.precision is not None:
        raise SpecError("group baselines on rollouts are not available with rounded log-probs: drop precision "
                        "or baseline_groups", key="precision", case=case)
    if model.rejection is not None:
        raise SpecError("group baselines on rollouts with a rejection mask (reject) are not modelled: drop "
                        "reject or baseline_groups", key="sampler.reject", case=case)


def exact(model: RolloutModel, est, aggregate: str) -> tuple[np.ndarray, np.ndarray, float] | None:
    """(E_b[W F S] [C·V], E_b[W S] [C·V], E_b[F]) of a reward row; None where the first has no exact value.
    E_b[W S] is zero on x ~ q and under weights that undo a full-support sampler; under truncation it is
    the gradient of the mass q puts on what b can draw. E_b[F] is unweighted: a trainer's group mean is
    the plain mean of the group's values."""
    mean = exact_mean(model, GradItem.of(est, "reward", aggregate))
    if mean is None:
        return None
    score = host_vector(score_part(model, count_moment(model, model.sequence_weight, torch.ones_like, [1.0])))
    g = model.logr_table
    if AGGREGATES[aggregate].token:
        f = est.fn(g)
        mu = dp.b_moments(model, torch.ones_like, lambda lb: f, 1)[1]
    else:
        mu = sum(a * dp.b_moments(model, lambda lb, s=s: torch.exp(s * g), lambda lb: g, k)[k]
                 for (s, k), a in est.poly.items())
    return mean, score, float(mu)


def draws(model: RolloutModel, est, aggregate: str, u: np.ndarray, device: torch.device) -> BaselineDraws:
    """(n, generator) → (F, W, S·u, |S|²) per rollout [n] on ``device`` (kl_bench.kinds.protocols.BaselineDraws),
    from recorded paths: F = f(L) or Σ_t f_t, W = Π_t w_t with sequence weights (else 1)."""
    q = model.log_q.exp()
    ut = torch.as_tensor(u, dtype=torch.float64, device=q.device).reshape(q.shape)
    hu = (ut - (q * ut).sum(-1, keepdim=True)).reshape(-1).to(device)      # u(c, x) − ⟨q_c, u_c⟩
    q_flat, qq, g_flat = q.reshape(-1).to(device), (q * q).sum(-1).to(device), model.logr_table.reshape(-1).to(device)
    token = AGGREGATES[aggregate].token

    def draw(n: int, gen: torch.Generator):
        p = paths(model, n, gen, device)
        logr_t = g_flat[p.keys] * p.alive                 # 0 after the end: f(0) = 0 adds nothing there
        f = (est.fn(logr_t) * p.alive).sum(1) if token else est.fn(logr_t.sum(1))
        w = torch.ones_like(f) if p.weights is None else torch.where(
            p.alive > 0, p.weights, torch.ones_like(p.alive)).prod(1)
        su = (hu[p.keys] * p.alive).sum(1)
        s2 = SortedPaths.of(p.keys, q_flat, qq, model.vocab).sq_norm(p.alive)
        return f, w, su, s2
    return draw


def piece(model: RolloutModel, device: torch.device) -> int:
    """Draws per piece: [n, T] recorded steps stay within 2^21 entries, as in the gradient pass."""
    return max(1, min(piece_draws(device), 2**21 // max(1, model.length)))
