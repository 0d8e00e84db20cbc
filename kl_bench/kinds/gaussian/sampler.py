"""A Gaussian case's draws: z ~ N(0, I) per dimension, log r evaluated as the model's quadratic in q's standard
score (never as a difference of log-densities), and the importance weight q/b of a scaled sampler."""
from __future__ import annotations

import math

import torch

from .model import GaussianModel


def sample(m: GaussianModel, n: int, generator: torch.Generator, device: torch.device):
    """(log r [n], weight q/b [n] or None, q's standard score (x − μq)/σq [n, D]) for n draws x ~ b
    (b = q unless a sampler scales the std)."""
    z = torch.randn(n, m.dim, dtype=torch.float64, generator=generator, device=device)
    zq = z * m.std_scale                        # x = μq + s·σq·z, i.e. q's standard score is s·z
    c0, c1, c2 = (c.to(device) for c in m.logr_coefficients)
    logr = (c0 + zq * (c1 + zq * c2)).sum(-1)
    weight = None
    if m.weighted:                               # log q/b = Σ log s + ½ z² (1 − s²)
        s = m.std_scale
        weight = torch.exp((math.log(s) + 0.5 * z * z * (1 - s * s)).sum(-1))
        if m.weight_cap is not None:
            weight = weight.clamp(max=m.weight_cap)
    return logr, weight, zq


def piece_draws(m: GaussianModel, default: int) -> int:
    # A piece holds [m, dim] float64 draws: keep m·dim within one default piece.
    return max(1024, default // m.dim)


def batches_per_chunk(m: GaussianModel, batch_size: int, chunk_draws: int) -> int:
    return max(1, chunk_draws // max(1, batch_size * m.dim))
