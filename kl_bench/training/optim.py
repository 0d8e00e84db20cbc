"""Optimisers as small pure functions: (θ, ascent direction g, state) → (θ', state'). No torch.optim, no
hidden state, nothing mutated in place, so a trajectory is a function of its inputs alone.

Both climb the objective (θ' = θ + step): the direction handed in is the trainer's estimate of ∇J.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.stats import rescale_exponent, times_two_to

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class AdamState:
    """First and second moment estimates (shape of θ) and the number of steps taken. ``v`` is stored divided
    by 4^``scale``: gradients beyond 2^500 (a β of 1e200) square past float64 (an infinite v stopped the
    policy); 0 until one comes, so that every ordinary trajectory is the textbook one, bit for bit."""
    m: torch.Tensor
    v: torch.Tensor
    t: int
    scale: int = 0


@dataclass(frozen=True)
class Optimizer:
    """``name``: "sgd" or "adam"; ``lr``: the learning rate; ``betas``/``eps``: Adam's constants."""
    name: str
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def init(self, theta: torch.Tensor) -> AdamState | None:
        """The state before the first step (None for SGD)."""
        return AdamState(torch.zeros_like(theta), torch.zeros_like(theta), 0) if self.name == "adam" else None

    def step(self, theta: torch.Tensor, g: torch.Tensor, state: AdamState | None) -> tuple[torch.Tensor, AdamState | None]:
        """One ascent step along ``g`` (shape of θ)."""
        if self.name == "sgd":
            return sgd(theta, g, self.lr), None
        return adam(theta, g, state, self.lr, self.betas, self.eps)


def sgd(theta: torch.Tensor, g: torch.Tensor, lr: float) -> torch.Tensor:
    """θ + lr·g. Any shape."""
    return theta + lr * g


def adam(theta: torch.Tensor, g: torch.Tensor, state: AdamState, lr: float, betas: tuple[float, float],
         eps: float) -> tuple[torch.Tensor, AdamState]:
    """Adam (Kingma & Ba, 2015) as an ascent step, bias-corrected moments. Any shape, float64."""
    b1, b2 = betas
    t = state.t + 1
    m = b1 * state.m + (1 - b1) * g
    # v in units of 4^k (AdamState): k grows when a gradient's square would overflow, never shrinks
    k = max(state.scale, rescale_exponent(float(g.abs().max())) if g.numel() else 0)
    v_before = times_two_to(times_two_to(state.v, state.scale - k), state.scale - k)
    g_scaled = times_two_to(g, -k)
    v = b2 * v_before + (1 - b2) * g_scaled * g_scaled
    m_hat = m / (1 - b1**t)
    v_hat = v / (1 - b2**t)
    return theta + lr * m_hat / (times_two_to(v_hat.sqrt(), k) + eps), AdamState(m, v, t, k)
