"""Case kind ``gaussian``: diagonal Gaussians q = N(μq, diag σq²), p = N(μp, diag σp²).

A draw is z ~ N(0, I) and log r = c0 + c1 z + c2 z² per dimension, summed (no subtraction of two nearly equal
log-densities); a sampler b = N(μq, (std_scale·σq)²) may draw instead, with or without the weight q/b. Exact
moments are closed forms and tilted Gaussians, or 1-D quadrature (kl_bench.core.oracles; docs/exact.md);
gradients take θ = (μq, log σq) per dimension (docs/gradients.md).

In parts, as every kind: :mod:`.config` (the case's keys and range checks), :mod:`.model` (the frozen
parameters), :mod:`.oracle` (the exact truth), :mod:`.sampler` (the draws), :mod:`.gradients`, composed by the
thin :class:`GaussianPair` (:mod:`.pair`), which registers the kind.
"""
from .config import GaussianCase, GaussianParams
from .pair import GaussianPair

__all__ = ["GaussianCase", "GaussianParams", "GaussianPair"]
