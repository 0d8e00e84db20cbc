"""Diagonal Gaussian pairs: q = N(μq, diag σq²), p = N(μp, diag σp²)."""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import exact
from ..draws import Draws
from ..estimators import Estimator
from ..spec import GaussianCase
from .base import BatchSums, Features, JointMoments, Pair


class GaussianPair(Pair):
    kind = "gaussian"

    def __init__(self, name: str, mq, sq, mp, sp, std_scale: float = 1.0, weights: str = "none",
                 weight_cap: float | None = None, sampler_label: str = ""):
        """``std_scale`` ≠ 1 draws from b = N(μq, (std_scale·σq)²) while the estimators keep using q's
        and p's densities; ``weights`` = "token" multiplies by q/b (capped at ``weight_cap``)."""
        self.name = name
        self.params = exact.GaussianPairParams(*(np.asarray(a, dtype=np.float64) for a in (mq, sq, mp, sp)))
        self.std_scale, self.weighted, self.weight_cap = float(std_scale), weights == "token", weight_cap
        self.weights = weights
        self.sampler_label = sampler_label
        g = self.params
        # log r as a quadratic in the standard normal z (x = μq + σq z), per dimension:
        #   log r = c0 + c1 z + c2 z²,  c0 = ln(σq/σp) − d²/(2σp²),  c1 = −σq d/σp²,  c2 = ½(1 − σq²/σp²).
        # Writing it this way avoids subtracting two nearly equal squares when q ≈ p.
        self._c = [torch.as_tensor(c, dtype=torch.float64) for c in exact._logr_quadratic(g, g.mq, g.sq**2)]

    @classmethod
    def from_case(cls, case: GaussianCase) -> "GaussianPair":
        sp = case.sampler
        if sp is None:
            return cls(case.name, case.q.mean, case.q.std, case.p.mean, case.p.std)
        return cls(case.name, case.q.mean, case.q.std, case.p.mean, case.p.std, std_scale=sp.std_scale,
                   weights=sp.weights, weight_cap=sp.weight_cap, sampler_label=sp.describe())

    @property
    def has_sampler(self) -> bool:  # noqa: F811 (a property here, a class attribute on the base)
        return self.std_scale != 1.0 or self.weighted

    @property
    def _b(self):
        return self.params.mq, self.std_scale * self.params.sq

    @property
    def dim(self) -> int:
        return int(self.params.mq.shape[0])

    def kl(self) -> float:
        g = self.params
        return exact.gaussian_kl(g.mq, g.sq, g.mp, g.sp)

    def kl_forward(self) -> float:
        g = self.params
        return exact.gaussian_kl(g.mp, g.sp, g.mq, g.sq)

    def exact_moments(self, est: Estimator, aggregate: str = "") -> tuple[float, float]:
        if est.name == "full" and not self.weighted:
            return self.kl(), 0.0          # one context: the analytic KL, a constant
        if self.has_sampler:
            if est.name == "full":          # KL·w: E_b[w] = 1, Var_b[w] = E_q[q/b] − 1
                m2 = math.exp(exact._tilt(self.params, 0, self._b, 2)[0]) if exact._tilt(
                    self.params, 0, self._b, 2) else math.inf
                return self.kl(), self.kl() ** 2 * (m2 - 1)
            return exact.gaussian_sampler_moments(self.params, est, self._b, self.weighted, self.weight_cap)
        return exact.gaussian_estimator_moments(self.params, est)

    def exact_joint(self, aggregate: str = "") -> JointMoments:
        g = self.params
        # Cov(−log r, r − 1) = E[log r] − E[r log r] = −[KL(q‖p) + KL(p‖q)]; Var(r) = χ²(p‖q).
        return JointMoments(mean_a=self.kl(), mean_b=0.0, var_a=exact.gaussian_var_k1(g),
                            var_b=exact.gaussian_chi2(g), cov_ab=-(self.kl() + self.kl_forward()))

    def fourth_moment_finite(self, est: Estimator, aggregate: str = "") -> bool:
        # f is a polynomial in r^s (log r)^k; f⁴ reaches r^{4·s_max}, finite iff the tilt normalises.
        s_max = max((s for (s, _), c in est.poly.items() if c != 0), default=0) if est.poly is not None else 0
        if self.has_sampler:
            return exact._tilt(self.params, 4 * s_max, self._b, 4 if self.weighted and not self.weight_cap else 0) \
                is not None
        return exact._tilt(self.params, 4 * s_max) is not None

    def describe(self) -> str:
        return self._describe_pair() + (f"; {self.sampler_label}" if self.sampler_label else "")

    def _describe_pair(self) -> str:
        g = self.params

        def fmt(m, s):
            if self.dim == 1:
                return f"N({m[0]:g}, {s[0]:g}²)"
            return f"N([{', '.join(f'{x:g}' for x in m)}], diag[{', '.join(f'{x:g}' for x in s)}]²)"
        return f"q = {fmt(g.mq, g.sq)}, p = {fmt(g.mp, g.sp)}"

    def sample_logr(self, n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """log r for ``n`` draws x ~ b (b = q unless a sampler scales the std); float64 [n]."""
        return self._sample(n, generator, device)[0]

    def _sample(self, n: int, generator: torch.Generator, device: torch.device):
        """(log r [n], weight q/b [n] or None, q's standard score (x − μq)/σq [n, D]) for x ~ b."""
        z = torch.randn(n, self.dim, dtype=torch.float64, generator=generator, device=device)
        zq = z * self.std_scale                     # x = μq + s·σq·z, i.e. q's standard score is s·z
        c0, c1, c2 = (c.to(device) for c in self._c)
        logr = (c0 + zq * (c1 + zq * c2)).sum(-1)
        weight = None
        if self.weighted:                            # log q/b = Σ log s + ½ z² (1 − s²)
            s = self.std_scale
            weight = torch.exp((math.log(s) + 0.5 * z * z * (1 - s * s)).sum(-1))
            if self.weight_cap is not None:
                weight = weight.clamp(max=self.weight_cap)
        return logr, weight, zq

    def sample_draws(self, n, generator, device, tok_rows=()) -> Draws:
        logr, weight, _ = self._sample(n, generator, device)
        return Draws(logr, torch.full_like(logr, self.kl()), weight=weight)

    def batch_sums(self, features: Features, tok_rows, device: torch.device) -> BatchSums:
        def run(sizes: list[int], gens: list[torch.Generator]) -> torch.Tensor:
            # One reduction per batch (not a scatter-add), so the sums are deterministic on CUDA too.
            return torch.stack([features(self.sample_draws(n, g, device)).sum(0) for n, g in zip(sizes, gens)])
        return run

    def batches_per_chunk(self, batch_size: int, chunk_draws: int) -> int:
        return max(1, chunk_draws // max(1, batch_size * self.dim))
