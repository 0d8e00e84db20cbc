"""The interface every distribution pair implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from ..estimators import FORWARD, Estimator

# Per-draw features: logr [...] float64 → [..., P] float64 (see engine.features).
Features = Callable[[torch.Tensor], torch.Tensor]
# Per-batch sums: (batch sizes [k], one generator per batch) → [k, P] float64.
BatchSums = Callable[[list[int], list[torch.Generator]], torch.Tensor]


class Pair(ABC):
    name: str
    kind: str

    @abstractmethod
    def kl(self) -> float:
        """Exact KL(q‖p) (the reverse KL that trainers penalise); may be +inf."""

    @abstractmethod
    def kl_forward(self) -> float:
        """Exact KL(p‖q); may be +inf."""

    @abstractmethod
    def exact_moments(self, est: Estimator) -> tuple[float, float]:
        """(E_q[f], Var_q[f]) per draw, exactly; NaN where unknown, +inf where divergent."""

    @abstractmethod
    def describe(self) -> str:
        """One line describing q and p, for captions and tables."""

    @abstractmethod
    def batch_sums(self, features: Features, device: torch.device) -> BatchSums:
        """Return a function that draws each batch from its own generator, x ~ q, and sums the
        per-draw features of log r over the batch."""

    @abstractmethod
    def batches_per_chunk(self, batch_size: int, chunk_draws: int) -> int:
        """How many batches to process at once without exceeding the memory budget."""

    def true_value(self, target: str) -> float:
        return self.kl_forward() if target == FORWARD else self.kl()
