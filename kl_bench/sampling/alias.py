"""Walker/Vose alias tables: O(1) categorical sampling after O(M) setup.

Sampling one token costs one uniform float64 draw, two gathers and a compare, instead of the
O(log M) binary search of an inverse-CDF sampler (torch.multinomial). One table holds one categorical
(:func:`build_alias`) or R categoricals of M outcomes each, flattened to [R·M] (:func:`build_alias_rows`: a
rollout's per-bucket next-token laws); :func:`pick` draws from either, given the uniforms.

Vose's construction is sequential: it runs on the host, and the table is then made on the device of the
weights (its only crossing: the weights once, at set-up).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class AliasTable:
    prob: torch.Tensor   # [M] float64: keep column j with this probability...
    alias: torch.Tensor  # [M] int64: ...otherwise return alias[j]

    @property
    def size(self) -> int:
        return self.prob.shape[0]

    def to(self, device: torch.device) -> "AliasTable":
        return AliasTable(self.prob.to(device), self.alias.to(device))


def build_alias(weights: np.ndarray, device: torch.device | str = "cpu") -> AliasTable:
    """Vose's method for non-negative ``weights`` [M] (normalised here), in float64, on ``device``."""
    w = np.asarray(weights, dtype=np.float64)
    m = w.shape[0]
    scaled = (w * (m / w.sum())).tolist()
    prob = [1.0] * m
    alias = list(range(m))
    small = [i for i, x in enumerate(scaled) if x < 1.0]
    large = [i for i, x in enumerate(scaled) if x >= 1.0]
    while small and large:
        s, l_ = small.pop(), large.pop()
        prob[s] = scaled[s]
        alias[s] = l_
        scaled[l_] = (scaled[l_] + scaled[s]) - 1.0
        (small if scaled[l_] < 1.0 else large).append(l_)
    # Whatever is left holds probability 1 up to rounding: keep it with certainty.
    return AliasTable(torch.tensor(prob, dtype=torch.float64, device=device),
                      torch.tensor(alias, dtype=torch.int64, device=device))


def build_alias_rows(weights: torch.Tensor) -> AliasTable:
    """One alias table per row of ``weights`` [R, M] (each normalised on its own), flattened to [R·M] on the
    device of ``weights``: row r's table is entries r·M .. r·M + M − 1, its aliases indices in [0, M)."""
    host = weights.detach().to("cpu", torch.float64).numpy()
    tables = [build_alias(host[r], weights.device) for r in range(host.shape[0])]
    return AliasTable(torch.cat([t.prob for t in tables]), torch.cat([t.alias for t in tables]))


def pick(table: AliasTable, u: torch.Tensor, width: int, base: torch.Tensor | None = None) -> torch.Tensor:
    """Indices in [0, ``width``) drawn with ``u`` = uniforms [n] × width (float64): column j = ⌊u⌋ and the
    coin u − j of row ``base``/width (``base`` [n] int64, a multiple of width; None: a one-row table).
    int64 [n] on the device of ``u``."""
    j = u.long().clamp_(max=width - 1)
    at = j if base is None else base + j
    return torch.where(u - j < table.prob[at], j, table.alias[at])


def sample_alias(table: AliasTable, n: int, generator: torch.Generator) -> torch.Tensor:
    """Draw ``n`` indices in [0, M) from ``table``; returns int64 [n] on the table's device.

    One float64 uniform u gives both the column j = ⌊u·M⌋ and the coin u·M − j: with M ≤ 2^20
    that coin still has ≥ 32 random bits.
    """
    m = table.size
    return pick(table, torch.rand(n, dtype=torch.float64, generator=generator, device=table.prob.device) * m, m)
