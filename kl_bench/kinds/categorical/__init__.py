"""Case kind ``categorical``: categoricals over a vocabulary, one context ([V]) or B contexts ([B, V]).

A draw picks a context uniformly, then a token x ~ q_b. Every per-draw statistic is a function of the
(context, token) id, so every per-batch sum is a linear function of the batch's count vector over the
ids, and that vector is exactly Multinomial(n, w) (w: the sampling mixture). A batch therefore never
materialises per-draw values. Its count vector comes one of two ways (``sampling``):
- ``counts``: drawn directly as conditional binomials, O(ids) per batch whatever n (every sum is then a
  "draw-equivalent": identical in distribution to drawing each token): on the CPU by numpy's sequential
  multinomial on the host, on other devices by kl_bench.sampling.multinomial's binary tree on the device, a chunk's
  batches in one call (:data:`COUNTS_ON_HOST`);
- ``tokens``: each token drawn with an alias table, piece by piece (kl_bench.sampling.seeding.token_piece_draws),
  and counted;
- ``auto`` (default): counts for a batch with at least as many draws as ids, tokens below that.
The sums are then one fixed-shape product of the count vector with a per-id feature table.
Exact moments are float64 sums over the vocabulary (docs/exact.md); gradients take θ = q's logits
[B, V] (docs/gradients.md).

In parts, as every kind: :mod:`.config` (the case's keys), :mod:`.model` (the frozen tables), :mod:`.oracle`
(the exact truth), :mod:`.sampler` (the draws), :mod:`.gradients`, :mod:`.group_baselines`, :mod:`.training`,
composed by the thin :class:`CategoricalPair` (:mod:`.pair`), which registers the kind.
"""
from .config import CategoricalCase
from .pair import CategoricalPair

__all__ = ["CategoricalCase", "CategoricalPair"]
