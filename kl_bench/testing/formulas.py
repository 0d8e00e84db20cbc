"""The reference of a check: a named estimator in float64, the caller's declared clamps, and the rounding
bound that a correct implementation in a given floating-point format meets.

Notation: log q = the policy's log-prob (``logprobs``), log p = the reference's (``ref_logprobs``),
ℓ = log r = log p − log q.

The rounding bound (:meth:`Reference.tolerance`). An implementation in a format of unit roundoff u
receives log q and log p already in that format (their rounding is not its fault: the reference is
evaluated at the rounded inputs), then

1. forms ℓ = log p − log q: one rounding, |δℓ| ≤ u·|ℓ|, which moves f by |f′(ℓ)|·u·|ℓ|;
2. evaluates f as a short sum of terms c·r^s·ℓ^k (k3: r, −ℓ, −1): exp, a product and at most three
   additions, each rounding relative to the magnitudes it combines, so the error is at most
   (a few)·u·Σ|terms|; cancellation between the terms (k3 near ℓ = 0, where r − 1 − ℓ ≈ ℓ²/2) is paid
   in the terms' magnitude, not in the result's.

So tol(ℓ) = 4u·T_f(ℓ) + 2u·|ℓ|·T_f′(ℓ), with T_g(ℓ) = Σ|c|·r^s·|ℓ|^k over the terms of g (its
condition bound); 4 counts the roundings of step 2 (exp, product, two additions) and 2 those of step 1
(the subtraction, and exp's own rounding of its argument's error). Below the format's smallest normal
number (``tiny``) a rounding is absolute rather than relative, and e^ℓ may flush to 0 before it is
multiplied by ℓ: 4·tiny·(1 + |ℓ|) more (negligible in float32, it matters in float16). An output clamp only shrinks
differences (|clamp a − clamp b| ≤ |a − b|), so the same bound holds for a clamped formula. The bound is
a few times loose; the mistakes it separates (a dropped constant, a swapped direction, a cast to
bfloat16 in float32 code) are orders of magnitude above it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..core.estimators import ESTIMATORS, Estimator, poly_derivative

F64 = torch.float64
Poly = dict  # {(s, k): c}: Σ c · r^s · (log r)^k

# Roundings counted in the bound (module docstring): step 2 (evaluating the terms) and step 1 (forming ℓ).
TERM_ROUNDINGS = 4
LOGR_ROUNDINGS = 2


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^−p for a format with p significant bits (float32: 2^−24, bfloat16: 2^−8, float64: 2^−53)."""
    return torch.finfo(dtype).eps / 2


def poly_terms(poly: Poly, logr: torch.Tensor) -> torch.Tensor:
    """T(ℓ) = Σ |c|·r^s·|ℓ|^k, the sum of the terms' magnitudes (float64, shape of ``logr``). r^s is
    exp(s·ℓ), so s = 0 gives 1 even where r overflows."""
    out = torch.zeros_like(logr)
    for (s, k), c in poly.items():
        out = out + abs(c) * torch.exp(s * logr) * logr.abs() ** k
    return out


def _clamp_pair(value) -> tuple[float, float] | None:
    """None, a bound b (meaning ±b) or a pair (lo, hi) → (lo, hi) or None."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return (-float(value), float(value))
    lo, hi = value
    return (float(lo), float(hi))


@dataclass(frozen=True)
class Reference:
    """A registered estimator with the caller's declared clamps: ``input_clamp`` on log r before the
    formula, ``clamp`` on the value after it, as (lo, hi). ``poly`` is the formula's Σ c r^s ℓ^k (for an
    |·| estimator, of the quantity inside the absolute value), which the rounding bound reads."""
    est: Estimator = field(compare=False)
    poly: Poly = field(compare=False)
    clamp: tuple[float, float] | None = None
    input_clamp: tuple[float, float] | None = None

    @property
    def name(self) -> str:
        return self.est.name

    @property
    def label(self) -> str:
        """The estimator with its declared clamps, as failure messages name it."""
        bits = ([f"log r clamped to [{self.input_clamp[0]:g}, {self.input_clamp[1]:g}]"] if self.input_clamp else []) + \
            ([f"clamped to [{self.clamp[0]:g}, {self.clamp[1]:g}]"] if self.clamp else [])
        return self.name + (f" ({', '.join(bits)})" if bits else "")

    def clamped_logr(self, logr: torch.Tensor) -> torch.Tensor:
        return logr.clamp(*self.input_clamp) if self.input_clamp else logr

    def value(self, logr: torch.Tensor) -> torch.Tensor:
        """The declared formula in float64 (shape of ``logr``): clamp(f(clamp(ℓ))). kl-bench's own
        estimator functions, which are exact to float64 rounding (expm1 for k3)."""
        v = self.est.fn(self.clamped_logr(logr.to(F64)))
        return v.clamp(*self.clamp) if self.clamp else v

    def derivative(self, logr: torch.Tensor) -> torch.Tensor:
        """d/dℓ of :meth:`value` by autograd in float64 (0 where a clamp fires, as in trainers' code)."""
        with torch.enable_grad():
            x = logr.detach().to(F64).clone().requires_grad_(True)
            (g,) = torch.autograd.grad(self.value(x).sum(), x)
        return g

    def tolerance(self, logr: torch.Tensor, u: float, tiny: float = 0.0) -> torch.Tensor:
        """tol(ℓ) = 4u·T_f(ℓ) + 2u·|ℓ|·T_f′(ℓ) at the (clamped) log r: the rounding bound of an
        implementation in a format of unit roundoff u (module docstring), plus 4·tiny·(1 + |ℓ|) where
        a term underflows (``tiny``: the format's smallest normal number; below it a rounding is absolute,
        and r = e^ℓ may flush to 0 before it is multiplied by ℓ). float64, shape of ``logr``."""
        x = self.clamped_logr(logr.to(F64))
        return (TERM_ROUNDINGS * u * poly_terms(self.poly, x)
                + LOGR_ROUNDINGS * u * x.abs() * poly_terms(poly_derivative(self.poly), x)
                + TERM_ROUNDINGS * tiny * (1 + x.abs()))

    def slope_bound(self, logr: torch.Tensor, order: int = 1) -> torch.Tensor:
        """T_f′(ℓ) (``order`` 1), a bound on |f′(ℓ)|: how far f moves per unit of error in ℓ; order 2: T_f″,
        the same for f′ (float64)."""
        poly = self.poly
        for _ in range(order):
            poly = poly_derivative(poly)
        return poly_terms(poly, self.clamped_logr(logr.to(F64)))


def reference(estimator: str, clamp=None, input_clamp=None) -> Reference:
    """The named estimator (kl_bench's registry: k1, k2, k3, abs, fwd_k1, fwd_k3, ...) with its clamps.
    Only estimators with a polynomial form have a derivable rounding bound; a library's clamped formula
    is checked as its base estimator with ``clamp=`` and ``input_clamp=``."""
    est = ESTIMATORS[estimator]
    poly = est.poly if est.poly is not None else est.abs_poly
    if poly is None:
        raise ValueError(f"estimator '{estimator}' has no polynomial form (Σ c r^s (log r)^k), so no rounding "
                         "bound can be derived for it: name its base estimator (k1, k2, k3, ...) and declare the "
                         "clamps with clamp= and input_clamp=")
    return Reference(est, dict(poly), _clamp_pair(clamp), _clamp_pair(input_clamp))


# ----------------------------------------------------------------------------- what a wrong function looks like
@dataclass(frozen=True)
class Lookalike:
    """A formula a wrong function may compute instead, with the words that name the mistake.
    ``value(logr) → float64``; ``tolerance(logr, u) → float64``: the same rounding rule as the reference."""
    what: str
    value: Callable[[torch.Tensor], torch.Tensor] = field(compare=False)
    tolerance: Callable[[torch.Tensor, float], torch.Tensor] = field(compare=False)


NAMED = ("k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3")


def lookalikes(ref: Reference) -> list[Lookalike]:
    """The mistakes a diagnosis tries, in order: another estimator passed off as this one, log r negated
    (logprobs and ref_logprobs swapped), the sign flipped, and the other estimators with the same clamps."""
    out = [Lookalike(f"the values are {ref.name} of −log r: direction swapped (logprobs and ref_logprobs "
                     "exchanged, log r = log q − log p)",
                     lambda x: ref.value(-x), lambda x, u: ref.tolerance(-x, u)),
           Lookalike(f"the values are −{ref.name}: sign flipped",
                     lambda x: -ref.value(x), ref.tolerance)]
    for name in NAMED:
        if name != ref.name:
            other = reference(name, ref.clamp, ref.input_clamp)
            out.append(Lookalike(f"the values are {other.label} ({other.est.formula}): {name} passed off as "
                                 f"{ref.name}", other.value, other.tolerance))
    return out


def diagnose(ref: Reference, logr: torch.Tensor, got: torch.Tensor, u: float, ok: torch.Tensor) -> str:
    """Words for what ``got`` (float64, finite where ``ok``) is instead of the reference at ``logr``: a
    lookalike it matches everywhere, a constant offset, a clamp, or a precision lower than declared;
    '' when none fits."""
    x, y = logr[ok], got[ok]
    if x.numel() == 0:
        return ""
    for alt in lookalikes(ref):
        if bool(((y - alt.value(x)).abs() <= alt.tolerance(x, u)).all()):
            return alt.what
    return _offset(ref, x, y, u) or _clamp(ref, x, y, u) or _precision(ref, x, y, u)


def _offset(ref: Reference, x: torch.Tensor, y: torch.Tensor, u: float) -> str:
    d = y - ref.value(x)
    c = float(d.median())
    tol = ref.tolerance(x, u) + 2 * u * abs(c)
    if abs(c) > float(tol.min()) and bool(((d - c).abs() <= tol).all()):
        hint = " (the −1 of k3 dropped?)" if ref.name == "k3" and abs(c - 1) < 0.5 else ""
        return f"the values are {ref.name} {'+' if c > 0 else '−'} {abs(c):.6g}: off by a constant{hint}"
    return ""


def _clamp(ref: Reference, x: torch.Tensor, y: torch.Tensor, u: float) -> str:
    lo, hi = float(y.min()), float(y.max())
    bounded = Reference(ref.est, ref.poly, (lo, hi), ref.input_clamp)
    if not bool(((y - bounded.value(x)).abs() <= ref.tolerance(x, u)).all()):
        return ""
    # A side binds where the formula goes beyond it; a side that never binds is the values' own range.
    v = ref.value(x)
    low, high = bool((v < lo).any()), bool((v > hi).any())
    sides = " and ".join(s for s, b in ((f"below at {lo:g}", low), (f"above at {hi:g}", high)) if b)
    pair = (lo, hi) if low and high else ((lo, -lo) if low else (-hi, hi))
    return (f"the values are {ref.name} clamped {sides}: a clamp that was not declared (declare it, "
            f"e.g. clamp=({pair[0]:g}, {pair[1]:g}))")


def _precision(ref: Reference, x: torch.Tensor, y: torch.Tensor, u: float) -> str:
    """A narrower format whose rounding bound the errors meet (the narrowest-error one first)."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        w = unit_roundoff(dtype)
        if w > u and bool(((y - ref.value(x)).abs() <= ref.tolerance(x, w, torch.finfo(dtype).tiny)).all()):
            name = str(dtype).replace("torch.", "")
            return (f"the errors are within {name}'s rounding bound (u = {w:.3g}): the function computes in "
                    f"{name} (a cast to {name} in the middle?)")
    return ""


def fmt(x: float) -> str:
    """A number in a failure message: 6 significant digits, inf and nan spelled as Python does."""
    return f"{x:.6g}" if math.isfinite(x) else str(x)
