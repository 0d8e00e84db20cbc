"""The interface every distribution pair implements."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from ..draws import Draws, Row
from ..estimators import FORWARD, Estimator

# Per-draw features: Draws [n] → [n, P] float64 (see engine.make_features).
Features = Callable[[Draws], torch.Tensor]
# Per-batch sums: (batch sizes [k], one generator per batch) → [k, P] float64.
BatchSums = Callable[[list[int], list[torch.Generator]], torch.Tensor]


@dataclass(frozen=True)
class JointMoments:
    """Moments of a = −log r and b = r − 1 under q: all that cv(λ) = a + λb needs.

    E[cv(λ)] = mean_a + λ·mean_b,  Var[cv(λ)] = var_a + 2λ·cov_ab + λ²·var_b,
    λ* = −cov_ab/var_b = Cov(log r, r)/Var(r) = [KL(p‖q) + KL(q‖p)]/χ²(p‖q).
    """
    mean_a: float
    mean_b: float
    var_a: float
    var_b: float      # χ²(p‖q) when supp p ⊆ supp q; may be +inf
    cov_ab: float

    @property
    def lambda_star(self) -> float:
        if math.isinf(self.var_b):
            return 0.0            # any λ ≠ 0 has infinite variance: k1 is the only finite choice
        return -self.cov_ab / self.var_b if self.var_b > 0 else math.nan

    def mean(self, lam):
        return self.mean_a + lam * self.mean_b

    def var(self, lam):
        """Var[cv(λ)]; +inf for λ ≠ 0 when var_b is infinite. Works on floats and numpy arrays."""
        import numpy as np
        lam = np.asarray(lam, dtype=np.float64)
        if math.isinf(self.var_b):
            out = np.where(lam == 0, self.var_a, np.inf)
        else:
            out = np.maximum(self.var_a + 2 * lam * self.cov_ab + lam * lam * self.var_b, 0.0)
        return float(out) if out.ndim == 0 else out


class Pair(ABC):
    name: str
    kind: str
    aggregates: tuple[str, ...] = ("",)   # rollouts: ("seq", "tok")
    has_sampler: bool = False             # draws come from b ≠ q (see SamplerSpec)
    sampler_label: str = ""
    support_miss: float = 0.0             # mass of q (per context/step, worst case) that b never draws
    weights: str = "none"

    @abstractmethod
    def kl(self) -> float:
        """Exact KL(q‖p) (the reverse KL that trainers penalise); may be +inf."""

    @abstractmethod
    def kl_forward(self) -> float:
        """Exact KL(p‖q); may be +inf."""

    @abstractmethod
    def exact_moments(self, est: Estimator, aggregate: str = "") -> tuple[float, float]:
        """(E_q[f], Var_q[f]) per draw, exactly; NaN where unknown, +inf where divergent."""

    @abstractmethod
    def describe(self) -> str:
        """One line describing q and p, for captions and tables."""

    @abstractmethod
    def batch_sums(self, features: Features, tok_rows: list[Row], device: torch.device) -> BatchSums:
        """Return a function that draws each batch from its own generator, x ~ q, and sums the
        per-draw features of log r over the batch."""

    @abstractmethod
    def batches_per_chunk(self, batch_size: int, chunk_draws: int) -> int:
        """How many batches to process at once without exceeding the memory budget."""

    @abstractmethod
    def exact_joint(self, aggregate: str = "") -> JointMoments:
        """Exact moments of (−log r, r − 1) under q (for rollouts: of (−L, R − 1) with "seq" and of
        (−L, Σ_t (r_t − 1)) with "tok")."""

    @abstractmethod
    def sample_draws(self, n: int, generator: torch.Generator, device: torch.device,
                     tok_rows: list[Row] = ()) -> Draws:
        """``n`` explicit draws x ~ q (for small-batch simulations and tests)."""

    def fourth_moment_finite(self, est: Estimator, aggregate: str = "") -> bool:
        """Whether E_q[f⁴] < ∞. Without it a measured variance converges slowly, is usually too low,
        and batch-means errors of variances (and of λ*) are unreliable."""
        return True

    def kurtosis_proxy(self, est: Estimator, aggregate: str = "") -> float:
        """An exact scale for E[f⁴]/E[f²]² where it can be huge though finite, else NaN. When it
        exceeds the number of draws, a measured variance cannot be trusted."""
        return math.nan

    def exact_prob_negative(self, fn: Callable[[torch.Tensor], torch.Tensor], aggregate: str = "") -> float:
        """Exact P_q(f(log r) < 0), or NaN where no exact method exists."""
        return math.nan

    def true_value(self, target: str) -> float:
        return self.kl_forward() if target == FORWARD else self.kl()
