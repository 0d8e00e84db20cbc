"""Group-baseline rows of a categorical case (kl_bench.experiment.group_baselines, docs/weights.md): exact
pieces as sums over the drawn (context, token) ids under the draw mixture, and per-draw values for the Monte
Carlo rows."""
from __future__ import annotations

import numpy as np
import torch

from ..protocols import BaselineExact
from .gradients import exact_gradient_of_table
from .model import CategoricalModel
from .sampler import CategoricalSampler


def _tables(m: CategoricalModel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per drawn id: ρ (ones without token weights), |s|², the context and token indices."""
    q = m.log_q.exp()
    ctx, tok = m.ids
    rho = m.is_weight if m.is_weight is not None else torch.ones_like(m.logr)
    return rho, 1 - 2 * q[ctx, tok] + (q * q).sum(-1)[ctx], ctx, tok, q


def baseline_exact(m: CategoricalModel, est) -> BaselineExact:
    """Sums over the drawn ids under the draw mixture w = (1/B)·b: every moment is exact."""
    w, logr = m.weights(), m.logr
    rho, s2, _, _, _ = _tables(m)
    f = est.fn(logr)
    phi = rho**2 * s2
    mu = float((w * f).sum())
    return BaselineExact(exact_gradient_of_table(m, rho * f, {}).mean,
                         exact_gradient_of_table(m, rho, {}).mean, mu, float((w * (f - mu) ** 2).sum()),
                         (float((w * f**2 * phi).sum()), float((w * f * phi).sum()), float((w * phi).sum())))


def baseline_draws(sampler: CategoricalSampler, est, u: np.ndarray, device: torch.device):
    m = sampler.model
    rho, s2, ctx, tok, q = _tables(m)
    ut = torch.as_tensor(u, dtype=torch.float64).reshape(q.shape)  # host: the pair's exact tables live on the host
    tables = (est.fn(m.logr), rho, ut[ctx, tok] - (q * ut).sum(-1)[ctx], s2)     # F, ρ, s·u, |s|² per id

    def draw(n: int, gen: torch.Generator):
        ids = sampler.sample_ids(n, gen, device).cpu()
        return tuple(t[ids] for t in tables)
    return draw
