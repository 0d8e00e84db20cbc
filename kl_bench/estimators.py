"""Monte Carlo KL estimators as pure tensor functions of the per-draw log-ratio.

Notation: x ~ q, log r = log p(x) − log q(x), r = exp(log r). Reference: J. Schulman,
"Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html.

Every estimator maps ``logr: Tensor[...]`` (float64) to a tensor of the same shape. ``logr`` may be
−inf where p(x) = 0 < q(x); every function returns a well-defined value there (+inf or 0), never NaN.

Each estimator also carries ``poly``: its value written as Σ c · r^s · (log r)^k, as a dict
{(s, k): c}. The exact oracles use it to get E_q[f] and E_q[f²] from the moments E_q[r^s (log r)^k]
(closed forms for Gaussians). ``poly`` is None when f is not such a polynomial (abs).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .registry import Registry

REVERSE = "KL(q||p)"
FORWARD = "KL(p||q)"

Poly = dict[tuple[int, int], float]


@dataclass(frozen=True)
class Estimator:
    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    target: str          # REVERSE or FORWARD: what the estimator estimates
    unbiased: bool       # E_q[f] equals the target exactly
    nonnegative: bool    # f ≥ 0 for every draw
    formula: str
    poly: Poly | None
    lam: float | None = None   # λ of a control variate cv(λ); None otherwise

    @property
    def token_only(self) -> bool:
        """On rollouts, estimators that are not polynomials in (R, L) (abs, clamped variants) get
        token-level rows only: that is where trainers apply them, and where an exact oracle exists."""
        return self.poly is None and self.name != "full"


ESTIMATORS: Registry[Estimator] = Registry("estimator")


def _r(logr: torch.Tensor) -> torch.Tensor:
    # exp of float64 log-ratios: r overflows only past log r ≈ 709, far beyond any sane pair.
    return torch.exp(logr)


def _r_logr(logr: torch.Tensor) -> torch.Tensor:
    # r·log r → 0 as log r → −inf (p(x) = 0); the plain product would give 0·(−inf) = NaN.
    return torch.where(torch.isneginf(logr), torch.zeros_like(logr), _r(logr) * logr)


def k1(logr: torch.Tensor) -> torch.Tensor:
    """k1 = −log r. Shape-preserving. Unbiased for KL(q‖p); high variance when KL is small."""
    return -logr


def k2(logr: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log r)². Shape-preserving. Biased (an f-divergence), low variance, ≥ 0."""
    return 0.5 * logr * logr


def k3(logr: torch.Tensor) -> torch.Tensor:
    """k3 = (r − 1) − log r. Shape-preserving. Unbiased for KL(q‖p) and ≥ 0.

    Written as expm1(log r) − log r: for |log r| ≪ 1 the two terms nearly cancel, and expm1 keeps
    the full float64 precision of r − 1 that exp(log r) − 1 would lose.
    """
    return torch.expm1(logr) - logr


def abs_logr(logr: torch.Tensor) -> torch.Tensor:
    """abs = |log r|. Shape-preserving. Biased upward as an estimate of KL(q‖p)."""
    return logr.abs()


def fwd_k1(logr: torch.Tensor) -> torch.Tensor:
    """fwd_k1 = r log r. Shape-preserving. Importance-weighted, unbiased for KL(p‖q)."""
    return _r_logr(logr)


def fwd_k3(logr: torch.Tensor) -> torch.Tensor:
    """fwd_k3 = r log r − (r − 1). Shape-preserving. Unbiased for KL(p‖q) and ≥ 0."""
    return _r_logr(logr) - torch.expm1(logr)


def full_kl(logr: torch.Tensor) -> torch.Tensor:
    """``full`` is not a function of log r: its per-draw value is the analytic KL of the draw's
    context(s), supplied by the pair (see kl_bench.draws.Draws.full)."""
    raise TypeError("the 'full' estimator takes its value from the pair, not from log r")


for _est in [
    Estimator("k1", k1, REVERSE, True, False, "−log r", {(0, 1): -1.0}),
    Estimator("k2", k2, REVERSE, False, True, "½(log r)²", {(0, 2): 0.5}),
    Estimator("k3", k3, REVERSE, True, True, "(r−1) − log r", {(1, 0): 1.0, (0, 0): -1.0, (0, 1): -1.0}),
    Estimator("abs", abs_logr, REVERSE, False, True, "|log r|", None),
    Estimator("fwd_k1", fwd_k1, FORWARD, True, False, "r·log r", {(1, 1): 1.0}),
    Estimator("fwd_k3", fwd_k3, FORWARD, True, True, "r·log r − (r−1)",
              {(1, 1): 1.0, (1, 0): -1.0, (0, 0): 1.0}),
    Estimator("full", full_kl, REVERSE, True, True, "Σ_x q log(q/p) per context", None),
]:
    ESTIMATORS.add(_est.name, _est)

DEFAULT_ESTIMATORS: tuple[str, ...] = tuple(ESTIMATORS.names())


def cv(logr: torch.Tensor, lam: float) -> torch.Tensor:
    """cv(λ) = −log r + λ(r − 1). Shape-preserving. Unbiased for KL(q‖p) for every λ because
    E_q[r] = 1; ≥ 0 for all r only at λ = 1, where it is k3. λ* = Cov(log r, r)/Var(r) minimises
    its variance."""
    return -logr + lam * torch.expm1(logr)


def make_cv(lam: float, name: str = "cv") -> Estimator:
    """The control variate at a fixed λ, as an Estimator (a functools.partial of :func:`cv`)."""
    return Estimator(name, functools.partial(cv, lam=lam), REVERSE, True, lam == 1.0,
                     f"−log r + {lam:g}(r−1)", {(0, 1): -1.0, (1, 0): lam, (0, 0): -lam}, lam=lam)


def poly_square(poly: Poly) -> Poly:
    """Coefficients of f² given those of f (products of r^s (log r)^k terms)."""
    out: Poly = {}
    for (s1, k1_), c1 in poly.items():
        for (s2, k2_), c2 in poly.items():
            key = (s1 + s2, k1_ + k2_)
            out[key] = out.get(key, 0.0) + c1 * c2
    return out


def clamped(logr: torch.Tensor, base: Callable[[torch.Tensor], torch.Tensor], logr_clamp: float | None,
            clamp: float | None) -> torch.Tensor:
    """``base`` as trainers compute it: log r clamped to ±logr_clamp before (so that exp cannot
    overflow), the estimate clamped to ±clamp after. Shape-preserving."""
    x = logr.clamp(-logr_clamp, logr_clamp) if logr_clamp is not None else logr
    f = base(x)
    return f.clamp(-clamp, clamp) if clamp is not None else f


def resolve_estimator(item) -> Estimator:
    """A registry name, or a spec EstimatorOption (a clamped variant reported under its label)."""
    if isinstance(item, Estimator):
        return item
    if isinstance(item, str):
        return ESTIMATORS.get(item)
    base = ESTIMATORS.get(item.name)
    fn = functools.partial(clamped, base=base.fn, logr_clamp=item.logr_clamp, clamp=item.clamp)
    bits = ([f"log r clamped to ±{item.logr_clamp:g}"] if item.logr_clamp is not None else []) + \
        ([f"estimate clamped to ±{item.clamp:g}"] if item.clamp is not None else [])
    return Estimator(item.label, fn, base.target, False, base.nonnegative,
                     f"{base.formula}, {', '.join(bits)}", None)
