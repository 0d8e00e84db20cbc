"""A Gaussian case's frozen parameters: q = N(μq, diag σq²), p = N(μp, diag σp²), the sampler b (q with its std
scaled) and its importance weights, and log r as a quadratic in q's standard normal. The oracle, the sampler
and the gradients are functions of this object; nothing here draws."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...core import oracles as exact


@dataclass(frozen=True)
class GaussianModel:
    """``params``: (μq, σq, μp, σp) float64 [D] each. The sampler b = N(μq, (std_scale·σq)²) draws while the
    estimators keep using q's and p's densities; ``weighted``: every estimate is multiplied by q/b (capped at
    ``weight_cap``). ``logr_coefficients``: (c0, c1, c2) [D] on the host (see :meth:`build`)."""
    params: exact.GaussianPairParams
    std_scale: float
    weighted: bool
    weight_cap: float | None
    logr_coefficients: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    @classmethod
    def build(cls, mq, sq, mp, sp, std_scale: float = 1.0, weights: str = "none",
              weight_cap: float | None = None) -> "GaussianModel":
        g = exact.GaussianPairParams(*(np.asarray(a, dtype=np.float64) for a in (mq, sq, mp, sp)))
        # log r as a quadratic in the standard normal z (x = μq + σq z), per dimension:
        #   log r = c0 + c1 z + c2 z²,  c0 = ln(σq/σp) − d²/(2σp²),  c1 = −σq d/σp²,  c2 = ½(1 − σq²/σp²).
        # Writing it this way avoids subtracting two nearly equal squares when q ≈ p.
        # host: moved to the draws' device by the sampler
        c = tuple(torch.as_tensor(c, dtype=torch.float64) for c in exact.logr_quadratic(g, g.mq, g.sq**2))
        return cls(g, float(std_scale), weights == "token", weight_cap, c)

    @property
    def has_sampler(self) -> bool:
        return self.std_scale != 1.0 or self.weighted

    @property
    def dim(self) -> int:
        return int(self.params.mq.shape[0])

    @property
    def sampler_params(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean [D], std [D]) of the sampler b (b = q without one)."""
        return self.params.mq, self.std_scale * self.params.sq
