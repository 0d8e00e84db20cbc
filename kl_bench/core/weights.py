"""Corrections of the importance weight ρ = q/b that trainers apply against a sampler b ≠ q (docs/weights.md).

Two kinds, both options of :class:`kl_bench.sampling.mismatch.SamplerSpec` (``weights = "token"`` needed):
- transforms of the **detached** weight, which multiply every value and every per-draw gradient:
  truncation min(ρ, C) (``weight_cap``), a lower bound max(ρ, ``weight_floor``), and a token mask that
  zeroes ρ outside [``mask_low``, ``mask_high``] (IcePop; verl's ``token_k1`` rejection band on log ρ);
- the PPO clipped surrogate, which changes only the gradient of the reward and loss_is rows: with the cost
  v = f(log r) (the negated advantage), the per-draw loss max(ρ·v, clip(ρ, 1 − ε_low, 1 + ε_high)·v) and,
  with a dual clip c > 1, min(·, c·v) where v > 0 (verl's ``compute_policy_loss``, A < 0).

Where the unclipped branch is the one selected the gradient is the mode's own, times ρ; where a clipped
branch is selected ρ is a constant there and only the gradient of v itself remains (zero in reward mode,
where v is detached; −f′ in loss_is mode). :data:`CLIPPED_BRANCH` is that table; a mode not in it is not
clipped (its rows keep ρ·c, and the sampler's description says so).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .estimators import Estimator
from .modes import MODES, Coefficient

# The gradient of the cost v in a mode where ρ is held fixed by a clip: reward mode's v = sg(f) has none;
# loss_is's v = f(log r) keeps −f′(log r)·s (the loss mode's coefficient).
CLIPPED_BRANCH: dict[str, Callable[[Estimator], Coefficient]] = {
    "reward": lambda est: torch.zeros_like,
    "loss_is": lambda est: MODES["loss"].coefficient(est),
}


@dataclass(frozen=True)
class WeightCorrection:
    """The weight options of a sampler. ``cap``/``floor``: truncation bounds of ρ; ``mask``: the band
    (a, b) outside which ρ is zeroed (None: no mask); ``clip``: (ε_low, ε_high) of the PPO surrogate (None:
    none); ``dual``: its dual clip c (None: none)."""
    cap: float | None = None
    floor: float | None = None
    mask: tuple[float, float] | None = None
    clip: tuple[float, float] | None = None
    dual: float | None = None

    @classmethod
    def of(cls, sp) -> "WeightCorrection":
        """From a :class:`kl_bench.sampling.mismatch.SamplerSpec` (its weight options)."""
        mask = None if sp.mask_low is None and sp.mask_high is None else \
            (sp.mask_low if sp.mask_low is not None else 0.0, sp.mask_high if sp.mask_high is not None else torch.inf)
        clip = None if sp.clip_low is None and sp.clip_high is None else \
            (sp.clip_low or 0.0, sp.clip_high if sp.clip_high is not None else torch.inf)
        return cls(sp.weight_cap, sp.weight_floor, mask, clip, sp.dual_clip)

    def detached(self, rho: torch.Tensor) -> torch.Tensor:
        """The weight that multiplies values and gradients, from raw ρ [n] (float64): the mask tests the
        raw ratio (as IcePop and verl's rejection do), then ρ is bounded to [floor, cap]."""
        w = rho
        if self.floor is not None:
            w = w.clamp(min=self.floor)
        if self.cap is not None:
            w = w.clamp(max=self.cap)
        if self.mask is not None:
            w = torch.where((rho >= self.mask[0]) & (rho <= self.mask[1]), w, torch.zeros_like(w))
        return w

    def clips(self, mode: str) -> bool:
        """Whether the PPO surrogate changes this mode's gradient."""
        return (self.clip is not None or self.dual is not None) and mode in CLIPPED_BRANCH

    def coefficient(self, est: Estimator, mode: str, logr: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
        """Per-draw coefficient [n] of ∇θ log q(x) under the clipped surrogate, from log r [n] and the raw
        ρ [n]; modes the surrogate does not clip get ρ'·c (ρ' = :meth:`detached`)."""
        c = MODES[mode].coefficient(est)(logr)
        w = self.detached(rho)
        if not self.clips(mode):
            return w * c
        v = est.fn(logr)                                   # the cost: −advantage
        lo, hi = (1 - self.clip[0], 1 + self.clip[1]) if self.clip is not None else (0.0, torch.inf)
        rc = rho.clamp(lo, hi)
        free = rho * v >= rc * v                           # the unclipped branch is the max (ties: it)
        clipped = CLIPPED_BRANCH[mode](est)(logr)
        out = torch.where(free, rho * c, rc * clipped)
        if self.dual is not None:                          # min(·, c·v) where v > 0 fires above ρ = c
            fires = (v > 0) & (torch.maximum(rho, rc) > self.dual)
            out = torch.where(fires, self.dual * clipped, out)
        # The masks and bounds of ρ' gate the surrogate too: a masked draw contributes nothing.
        return torch.where(w > 0, out, torch.zeros_like(out)) if self.mask is not None else out

    def words(self) -> str:
        bits = []
        if self.floor is not None:
            bits.append(f"floored at {self.floor:g}")
        if self.mask is not None:
            bits.append(f"masked outside [{self.mask[0]:g}, {self.mask[1]:g}]")
        if self.clip is not None:
            bits.append(f"PPO clip [{1 - self.clip[0]:g}, {1 + self.clip[1]:g}]")
        if self.dual is not None:
            bits.append(f"dual clip {self.dual:g}")
        text = ", ".join(bits)
        if self.clip is not None or self.dual is not None:
            text += " (clip on " + " and ".join(CLIPPED_BRANCH) + " rows)"
        return text
