"""The rollout kind's phased dynamic program: a :class:`~kl_bench.kinds.rollout.model.RolloutModel`'s tables
turned into the moment matrices of :mod:`kl_bench.core.rollout_dp`, phase by phase, and propagated
(docs/rollouts.md#dynamic-program). Every exact number of the kind (oracles, gradients, baselines, training)
goes through these functions.

E[M · S^k] with M = Π_t m(c_{t−1}, x_t) and S = Σ_t h(c_{t−1}, x_t) is asked for with per-phase tables:
``m_fn(log b)`` and ``h_fn(log b)`` map a phase's log b [C, V] to m and h [C, V]. Under the sampler the
tables are zeroed where b never draws (never 0·inf) and m carries the rejection mask's per-token factor.

Tensors are made on the model's device; the only crossing to the host is :func:`to_host` (small results:
a few moments), the one place a test on ``meta`` tensors replaces.
"""
from __future__ import annotations

from typing import Callable

import torch

from ...core import rollout_dp
from .model import RolloutModel

TableFn = Callable[[torch.Tensor], torch.Tensor]    # a phase's log b [C, V] → a table [C, V]


def to_host(t: torch.Tensor) -> list[float] | float:
    """The values of a small result on the host (a list for a vector, a float for a scalar)."""
    return t.tolist()


Program = list[tuple[torch.Tensor, torch.Tensor, int]]     # [(A [K+1, C, C], E [K+1, C], steps)] in order


def matrices(model: RolloutModel, tables, kmax: int) -> Program:
    """The program of per-phase tables [(law, m, h, steps)], each [C, V] (law: the probabilities the
    phase's tokens are drawn with), with the model's buckets and EOS."""
    return [(*rollout_dp.moment_matrices(law, m, h, model.bucket, model.buckets, model.eos, kmax), steps)
            for law, m, h, steps in tables]


def phase_matrices(model: RolloutModel, m_fn: TableFn, h_fn: TableFn, kmax: int, eta: torch.Tensor | None = None,
                   phase: int | None = None) -> Program:
    """Per sampler phase, the program's moment matrices and its steps. ``eta`` [C, V]: a per-step log-weight
    e^η multiplied into m (the counts' generating variable, kl_bench.kinds.rollout.gradients), in every
    phase or in ``phase`` alone."""
    tables = []
    for i, (lb, steps) in enumerate(model.phases):
        b = lb.exp()
        # Where b never draws, weights are irrelevant (and may be inf): zero them, never 0·inf. The
        # rejection mask's per-token factor multiplies M (a sub-stochastic b: paths through a rejected
        # token contribute 0; its square is itself, so second moments take it once too).
        m = torch.where(b > 0, m_fn(lb) * model.keep_table(lb), torch.zeros_like(b))
        if eta is not None and (phase is None or phase == i):
            m = m * torch.exp(eta)
        tables.append((b, m, torch.where(b > 0, h_fn(lb), torch.zeros_like(b)), steps))
    return matrices(model, tables, kmax)


def sampled(model: RolloutModel, m_fn: TableFn, h_fn: TableFn, kmax: int) -> torch.Tensor:
    """E_b[M S^k], k = 0..kmax, [kmax + 1], under the sampler's phases (b = q without one)."""
    return rollout_dp.propagate_tensor(phase_matrices(model, m_fn, h_fn, kmax))


def b_moments(model: RolloutModel, m_fn: TableFn, h_fn: TableFn, kmax: int) -> list[float]:
    """:func:`sampled` on the host."""
    return to_host(sampled(model, m_fn, h_fn, kmax))


def by_length(model: RolloutModel, m_fn: TableFn, h_fn: TableFn, kmax: int) -> torch.Tensor:
    """[T, kmax + 1]: E_b[M S^k ; |y| = ℓ] for ℓ = 1..T under the sampler's phases (b = q without one)."""
    return rollout_dp.propagate_by_length(phase_matrices(model, m_fn, h_fn, kmax))


def length_law(model: RolloutModel) -> torch.Tensor:
    """P_b(|y| = ℓ) for ℓ = 1..T, [T], under the sampler's phases (b = q without one)."""
    return by_length(model, torch.ones_like, torch.ones_like, 0)[:, 0]


def under_q(model: RolloutModel, m: torch.Tensor, h: torch.Tensor, kmax: int) -> torch.Tensor:
    """E_q[M S^k], k = 0..kmax, [kmax + 1], for tables m, h [C, V]: paths drawn from q itself (no sampler
    involved: the truth)."""
    return rollout_dp.propagate_tensor(matrices(model, [(model.log_q.exp(), m, h, model.length)], kmax))


def path_moments(model: RolloutModel, log_sample: torch.Tensor, m: torch.Tensor, h: torch.Tensor,
                 kmax: int = 1) -> torch.Tensor:
    """E[M S^k], k = 0..kmax, for paths drawn from softmax(``log_sample``) [C, V] with the model's buckets,
    length and EOS (M = Π_t m, S = Σ_t h; m, h: [C, V]): a tensor [kmax + 1], differentiable with respect
    to ``log_sample``, m and h (the reference gradients and kl_bench.training differentiate through it)."""
    return rollout_dp.propagate_tensor(matrices(model, [(torch.softmax(log_sample, -1), m, h, model.length)], kmax))


def path_by_length(model: RolloutModel, log_sample: torch.Tensor, m: torch.Tensor, h: torch.Tensor,
                   kmax: int = 1) -> torch.Tensor:
    """:func:`path_moments` split by the final length: [T, kmax + 1] (kl_bench.core.rollout_dp.propagate_by_length)."""
    return rollout_dp.propagate_by_length(matrices(model, [(torch.softmax(log_sample, -1), m, h, model.length)], kmax))
