"""Walker/Vose alias tables: O(1) categorical sampling after O(M) setup.

Sampling one token costs one uniform float64 draw, two gathers and a compare, instead of the
O(log M) binary search of an inverse-CDF sampler (torch.multinomial).
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


def build_alias(weights: np.ndarray) -> AliasTable:
    """Vose's method for non-negative ``weights`` [M] (normalised here), in float64."""
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
    return AliasTable(torch.tensor(prob, dtype=torch.float64), torch.tensor(alias, dtype=torch.int64))


def sample_alias(table: AliasTable, n: int, generator: torch.Generator) -> torch.Tensor:
    """Draw ``n`` indices in [0, M) from ``table``; returns int64 [n] on the table's device.

    One float64 uniform u gives both the column j = ⌊u·M⌋ and the coin u·M − j: with M ≤ 2^20
    that coin still has ≥ 32 random bits.
    """
    m = table.size
    u = torch.rand(n, dtype=torch.float64, generator=generator, device=table.prob.device) * m
    j = u.long().clamp_(max=m - 1)
    coin = u - j
    return torch.where(coin < table.prob[j], j, table.alias[j])
