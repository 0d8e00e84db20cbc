"""Case kind ``gaussian``: diagonal Gaussians q = N(μq, diag σq²), p = N(μp, diag σp²).

Everything about the kind lives here: its config and parser, sampler keys (``std_scale``, token
weights), oracle validation, sampling, exact moments (closed forms and tilted Gaussians, kl_bench.core.oracles;
docs/exact.md) and gradient oracles with θ = (μq, log σq) per dimension (docs/gradients.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core import oracles as exact
from ..foundation.typed_toml import Table, positive
from ..core.draws import Draws
from ..foundation.errors import SpecError
from ..core.estimators import Estimator, Poly, RowSource, poly_square
from ..sampling.mismatch import WEIGHT_KEYS
from ..core.targets import FORWARD, REVERSE
from .protocols import CaseConfig, ExactGrad, GradItem, JointMoments, register_kind
from .defaults import Pair, ScoreGradientOracle


@dataclass(frozen=True)
class GaussianParams:
    """A diagonal Gaussian; ``mean`` and ``std`` have one entry per dimension."""
    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class GaussianCase(CaseConfig):
    q: GaussianParams
    p: GaussianParams


# Range of the parameters: the closed forms square σ and d = μq − μp and multiply squares (σq²d²/σp⁴),
# so every mean and std stays within 1e±30 and, per dimension, σq/σp and |μq − μp|/σ within 1e±10 (then
# KL ≤ ~1e20 and the fourth moments of log r, ~(d/σ)⁸, stay far inside float64). Beyond that the exact
# values would overflow or lose every digit, so such a case is refused rather than answered with inf/NaN.
MAX_ABS = 1e30
MIN_STD = 1e-30
MAX_RATIO = 1e10


def _check_mean(v: tuple[float, ...]) -> str | None:
    bad = next((x for x in v if abs(x) > MAX_ABS), None)
    return None if bad is None else f"must lie in [−{MAX_ABS:g}, {MAX_ABS:g}] (exact values in float64), got {bad:g}"


def _check_std(v: tuple[float, ...]) -> str | None:
    msg = positive(v)
    if msg:
        return msg
    bad = next((x for x in v if not MIN_STD <= x <= MAX_ABS), None)
    return None if bad is None else f"must lie in [{MIN_STD:g}, {MAX_ABS:g}] (exact values in float64), got {bad:g}"


def _params(t: Table) -> GaussianParams:
    mean = t.get("mean", "float_or_list", check=_check_mean)
    std = t.get("std", "float_or_list", check=_check_std)
    t.finish()
    return GaussianParams(mean, std)


def _check_ratios(t: Table, q: GaussianParams, p: GaussianParams) -> None:
    """Per dimension: σq/σp and |μq − μp|/min(σq, σp) within MAX_RATIO (see above)."""
    for i, (mq, sq, mp, sp) in enumerate(zip(q.mean, q.std, p.mean, p.std)):
        dim = f" (dimension {i + 1})" if len(q.mean) > 1 else ""
        ratio = sq / sp
        if not 1 / MAX_RATIO <= ratio <= MAX_RATIO:
            raise t.error(f"σq/σp = {sq:g}/{sp:g} = {ratio:.3g}{dim} must lie in [{1 / MAX_RATIO:g}, {MAX_RATIO:g}]: "
                          "the exact moments of log r would leave float64's range", key="p.std")
        if abs(mq - mp) > MAX_RATIO * min(sq, sp):
            raise t.error(f"|μq − μp| = {abs(mq - mp):g}{dim} must be ≤ {MAX_RATIO:g} × min(σq, σp) = "
                          f"{MAX_RATIO * min(sq, sp):g}: the exact moments of log r would leave float64's range",
                          key="p.mean")


@register_kind("gaussian", description="diagonal Gaussians q = N(μq, σq²), p = N(μp, σp²); closed forms",
               sampler_keys=("std_scale", *WEIGHT_KEYS))
class GaussianPair(ScoreGradientOracle, Pair):

    def __init__(self, name: str, mq, sq, mp, sp, std_scale: float = 1.0, weights: str = "none",
                 weight_cap: float | None = None, sampler_label: str = ""):
        """``std_scale`` ≠ 1 draws from b = N(μq, (std_scale·σq)²) while the estimators keep using q's
        and p's densities; ``weights`` = "token" multiplies by q/b (capped at ``weight_cap``)."""
        self.name = name
        self.params = exact.GaussianPairParams(*(np.asarray(a, dtype=np.float64) for a in (mq, sq, mp, sp)))
        self.std_scale, self.weighted, self.weight_cap = float(std_scale), weights == "token", weight_cap
        self.weights = weights
        self.sampler_label = sampler_label
        self.has_sampler = self.std_scale != 1.0 or self.weighted
        g = self.params
        # log r as a quadratic in the standard normal z (x = μq + σq z), per dimension:
        #   log r = c0 + c1 z + c2 z²,  c0 = ln(σq/σp) − d²/(2σp²),  c1 = −σq d/σp²,  c2 = ½(1 − σq²/σp²).
        # Writing it this way avoids subtracting two nearly equal squares when q ≈ p.
        # host: moved to the draws' device in sample()
        self._c = [torch.as_tensor(c, dtype=torch.float64) for c in exact.logr_quadratic(g, g.mq, g.sq**2)]

    # ---------------------------------------------------------------- spec
    @classmethod
    def parse(cls, t: Table, common: dict[str, Any], spec_dir: Path) -> GaussianCase:
        if t.has("precision"):
            raise t.error("rounded log-probs have no exact oracle on a Gaussian (rounding changes the continuous "
                          "law of log r); use a categorical or rollout case", key="precision")
        q = _params(t.sub("q"))
        p = _params(t.sub("p"))
        t.finish()
        lengths = {len(x) for x in (q.mean, q.std, p.mean, p.std)}
        dim = max(lengths)
        if lengths - {1, dim}:
            raise t.error(f"q.mean, q.std, p.mean, p.std must be scalars or lists of one length; "
                          f"got lengths {len(q.mean)}, {len(q.std)}, {len(p.mean)}, {len(p.std)}", key="q/p")

        def broadcast(g: GaussianParams) -> GaussianParams:
            return GaussianParams(g.mean * dim if len(g.mean) == 1 else g.mean,
                                  g.std * dim if len(g.std) == 1 else g.std)
        q, p = broadcast(q), broadcast(p)
        _check_ratios(t, q, p)
        return GaussianCase(q=q, p=p, **common)

    @classmethod
    def from_config(cls, case: GaussianCase) -> "GaussianPair":
        sp = case.sampler
        if sp is None:
            return cls(case.name, case.q.mean, case.q.std, case.p.mean, case.p.std)
        return cls(case.name, case.q.mean, case.q.std, case.p.mean, case.p.std, std_scale=sp.std_scale,
                   weights=sp.weights, weight_cap=sp.weight_cap, sampler_label=sp.describe())

    def validate(self, sources: list[RowSource]) -> None:
        """Multivariate Gaussians have closed forms for polynomial estimators and |log r|, but any other
        function of log r (clamped variants, plug-ins), a weight cap or a weighted |log r| needs
        quadrature, which is 1-D here."""
        super().validate(sources)
        if self.dim == 1:
            return
        what = [e.name for e in sources if not e.analytic and e.poly is None and exact.abs_logr_scale(e) is None]
        what += [f"{e.name} with importance weights" for e in sources
                 if self.weighted and exact.abs_logr_scale(e) is not None]
        what += ["weight_cap"] if self.weight_cap is not None else []
        if what:
            raise SpecError(f"no exact oracle for {', '.join(what)} on a {self.dim}-dimensional Gaussian "
                            "(quadrature is 1-D only): use a 1-D case or drop them", case=self.name)

    @property
    def sampler_params(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean [D], std [D]) of the sampler b (b = q without one)."""
        return self.params.mq, self.std_scale * self.params.sq


    @property
    def dim(self) -> int:
        return int(self.params.mq.shape[0])

    # ---------------------------------------------------------------- truth and exact moments
    def true_values(self) -> dict[str, float]:
        return {REVERSE: self.kl(), FORWARD: self.kl_forward()}

    def kl(self) -> float:
        g = self.params
        return exact.gaussian_kl(g.mq, g.sq, g.mp, g.sp)

    def kl_forward(self) -> float:
        g = self.params
        return exact.gaussian_kl(g.mp, g.sp, g.mq, g.sq)

    def exact_moments(self, est: RowSource, aggregate: str = "") -> tuple[float, float]:
        if est.analytic and not self.weighted:
            return self.kl(), 0.0          # one context: the analytic KL, a constant
        if self.has_sampler:
            if est.analytic and self.weight_cap is not None:
                # KL·min(w, cap): E_b[min(w, cap)] < 1, by 1-D quadrature of the constant times the capped
                # weight (caps on D > 1 are refused by validate()).
                kl = self.kl()
                const = Estimator("full", lambda logr: torch.full_like(logr, kl), REVERSE, True, True, "KL", {(0, 0): kl})
                return exact.gaussian_sampler_moments(self.params, const, self.sampler_params, True, self.weight_cap)
            if est.analytic:                # KL·w: E_b[w] = 1, Var_b[w] = E_q[q/b] − 1
                t = exact.tilt(self.params, 0, self.sampler_params, 2)
                m2 = math.exp(t[0]) if t else math.inf
                return self.kl(), self.kl() ** 2 * (m2 - 1)
            return exact.gaussian_sampler_moments(self.params, est, self.sampler_params, self.weighted, self.weight_cap)
        return exact.gaussian_estimator_moments(self.params, est)

    def exact_joint(self, aggregate: str = "") -> JointMoments:
        g = self.params
        # Cov(−log r, r − 1) = E[log r] − E[r log r] = −[KL(q‖p) + KL(p‖q)]; Var(r) = χ²(p‖q).
        return JointMoments(mean_a=self.kl(), mean_b=0.0, var_a=exact.gaussian_var_k1(g),
                            var_b=exact.gaussian_chi2(g), cov_ab=-(self.kl() + self.kl_forward()))

    def _fourth_finite(self, poly: Poly | None) -> bool:
        # f is a polynomial in r^s (log r)^k; f⁴ reaches r^{4·s_max}, finite iff the tilt normalises.
        s_max = max((s for (s, _), c in poly.items() if c != 0), default=0) if poly is not None else 0
        if self.has_sampler:
            return exact.tilt(self.params, 4 * s_max, self.sampler_params, 4 if self.weighted and not self.weight_cap else 0) \
                is not None
        return exact.tilt(self.params, 4 * s_max) is not None

    def fourth_moment_finite(self, est: RowSource, aggregate: str = "") -> bool:
        return self._fourth_finite(est.poly)

    def kurtosis_proxy(self, est: RowSource, aggregate: str = "") -> float:
        """E_b[v⁴]/E_b[v²]² of the row's value v (exact: closed form or 1-D quadrature); NaN for the analytic
        row (a constant, or the constant times w) and where no oracle applies."""
        if est.analytic:
            return math.nan
        return exact.gaussian_fourth_ratio(self.params, est, self.sampler_params, self.weighted, self.weight_cap)

    def describe(self) -> str:
        g = self.params

        def fmt(m, s):
            if self.dim == 1:
                return f"N({m[0]:g}, {s[0]:g}²)"
            return f"N([{', '.join(f'{x:g}' for x in m)}], diag[{', '.join(f'{x:g}' for x in s)}]²)"
        return f"q = {fmt(g.mq, g.sq)}, p = {fmt(g.mp, g.sp)}" + (f"; {self.sampler_label}" if self.sampler_label else "")

    # ---------------------------------------------------------------- sampling
    def sample(self, n: int, generator: torch.Generator, device: torch.device):
        """(log r [n], weight q/b [n] or None, q's standard score (x − μq)/σq [n, D]) for n draws x ~ b
        (b = q unless a sampler scales the std). The one place Gaussian draws are made."""
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
        logr, weight, _ = self.sample(n, generator, device)
        return Draws(logr, torch.full_like(logr, self.kl()), weight=weight)

    def piece_draws(self, device: torch.device) -> int:
        # A piece holds [m, dim] float64 draws: keep m·dim within one default piece.
        return max(1024, super().piece_draws(device) // self.dim)

    def batches_per_chunk(self, batch_size: int, chunk_draws: int) -> int:
        return max(1, chunk_draws // max(1, batch_size * self.dim))

    # ---------------------------------------------------------------- gradients
    @property
    def gradient_params(self) -> int:
        return 2 * self.dim

    def gradient_references(self) -> dict[str, np.ndarray]:
        """∇(μq, log σq) of KL(q‖p) = (d/σp², σq²/σp² − 1) and of KL(p‖q) = (d/σq², 1 − (σp² + d²)/σq²)."""
        g = self.params
        d = g.mq - g.mp
        return {REVERSE: np.concatenate([d / g.sp**2, g.sq**2 / g.sp**2 - 1]),
                FORWARD: np.concatenate([d / g.sq**2, 1 - (g.sp**2 + d**2) / g.sq**2])}

    def gradient_exact(self, item: GradItem, directions: dict[str, np.ndarray]) -> ExactGrad | None:
        """E_b[(w) c s] with s = (z/σ per dimension, z² − 1 per dimension), b the case's sampler (q when
        none); None for non-polynomial c or capped weights."""
        cpoly = item.cpoly
        if cpoly is None or self.weight_cap is not None:
            return None
        g, dim = self.params, self.dim
        b = self.sampler_params if self.has_sampler else None     # under a sampler: E_b[w^m ·], m = 1 with weights
        wm = 1 if self.weighted else 0

        def e(poly: Poly, i: int, j: int, power: int = 1) -> float:
            """E_b[w^{m·power} poly(r, log r) z_i^j]: power 2 for second moments (they carry w²)."""
            return sum(a * exact.gaussian_score_moment(g, s, k, i, j, b, wm * power)
                       for (s, k), a in poly.items() if a != 0)
        mean = np.array([e(cpoly, i, 1) / g.sq[i] for i in range(dim)] +
                        [e(cpoly, i, 2) - e(cpoly, i, 0) for i in range(dim)])
        c2 = poly_square(cpoly)

        def e2(i: int, j: int) -> float:
            return e(c2, i, j, 2)

        def combine(*terms: float) -> float:
            """Σ of (coefficient, moment) products; ∞ when a moment is (no ∞ − ∞ = NaN)."""
            return math.inf if any(math.isinf(t) for _, t in terms) else sum(a * t for a, t in terms)
        # |s|² = Σ_i z_i²/σ_i² + (z_i² − 1)² = Σ_i z_i²/σ_i² + z_i⁴ − 2 z_i² + 1
        second = sum(combine((1 / g.sq[i] ** 2, e2(i, 2)), (1, e2(i, 4)), (-2, e2(i, 2)), (1, e2(i, 0)))
                     for i in range(dim))
        proj_var = {}
        for name, u in directions.items():
            # (c s·u)² = c² (Σ_i u_μi z_i/σ_i + u_σi (z_i² − 1))²: needs cross-dimension terms; exact for D = 1.
            if dim != 1:
                proj_var[name] = math.nan
                continue
            um, us = u[0] / g.sq[0], u[1]
            ex = combine((um**2, e2(0, 2)), (us**2, e2(0, 4)), (-2 * us**2, e2(0, 2)), (us**2, e2(0, 0)),
                         (2 * um * us, e2(0, 3)), (-2 * um * us, e2(0, 1)))
            proj_var[name] = ex - float(mean @ u) ** 2
        return ExactGrad(mean, second, proj_var)

    def gradient_self(self, item: GradItem) -> np.ndarray | None:
        """∇θ E_q[f(log r)] = E_q[(f − f′)·s]: loss_is's exact expected gradient on-policy (polynomial f);
        None under a sampler (its oracle takes expectations under b)."""
        if self.has_sampler:
            return None
        ex = self.gradient_exact(GradItem.of(item.est, "loss_is"), {})
        return None if ex is None else ex.mean

    def gradient_fourth_moment_finite(self, item: GradItem) -> bool:
        """E|c s|⁴ < ∞ iff q^{1−4s} p^{4s} (under a sampler: b^{1−4m} q^{4m−4s} p^{4s}) normalises, s the
        largest power of r in c (|s|⁴ is a polynomial in z)."""
        return item.cpoly is not None and self._fourth_finite(item.cpoly)

    def sample_scores(self, n: int, generator: torch.Generator, device: torch.device):
        """(log r, weight, score): for θ = (μq, log σq), ∇θ log q(x) = (z/σq, z² − 1) per dimension."""
        logr, weight, z = self.sample(n, generator, device)                  # z: q's standard score
        sq = torch.as_tensor(self.params.sq, dtype=torch.float64, device=device)
        return logr, weight, torch.cat([z / sq, z * z - 1], dim=-1)       # [n, 2D]
