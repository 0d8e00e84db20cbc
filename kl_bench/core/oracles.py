"""Exact oracles: KL divergences and per-draw moments of every estimator, no sampling.

Gaussians (diagonal, D dimensions) use closed forms. The key identity: for x ~ q,
    E_q[r^s (log r)^k] = Z_s · E_{q_s}[(log r)^k],   Z_s = E_q[r^s],   q_s ∝ q^{1−s} p^s,
and the "tilted" q_s is again a diagonal Gaussian (precision (1−s)/σq² + s/σp² per dimension) as long
as that precision is > 0; otherwise Z_s = ∞. Under q_s, log r is a quadratic c0 + c1·z + c2·z² of a
standard normal z in each dimension, so its raw moments are polynomial sums of E[z^j] = (j−1)!!.
Any estimator written as Σ c · r^s (log r)^k (``Estimator.poly``) then has an exact mean and, via its
squared polynomial, an exact second moment. |c·log r| (``Estimator.abs_poly``) is handled by the
characteristic function of log r. See docs/exact.md.

Categoricals sum over the vocabulary in float64. With B contexts a draw picks a context uniformly,
so moments are taken under the mixture (1/B)·q_b(x); this is the law of total variance across contexts.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from .estimators import Estimator, poly_square

INF = math.inf


# ----------------------------------------------------------------------------- Gaussians
@dataclass(frozen=True)
class GaussianPairParams:
    """q = N(mq, diag(sq²)), p = N(mp, diag(sp²)); arrays of shape [D], float64."""
    mq: np.ndarray
    sq: np.ndarray
    mp: np.ndarray
    sp: np.ndarray


def gaussian_kl(mq, sq, mp, sp) -> float:
    """KL(N(mq, sq²) ‖ N(mp, sp²)) summed over dimensions: ln(σp/σq) + (σq² + d²)/(2σp²) − ½."""
    mq, sq, mp, sp = (np.asarray(a, dtype=np.float64) for a in (mq, sq, mp, sp))
    d = mq - mp
    return float(np.sum(np.log(sp / sq) + (sq**2 + d**2) / (2 * sp**2) - 0.5))


def gaussian_var_k1(g: GaussianPairParams) -> float:
    """Var_q(log r) = Σ σq²d²/σp⁴ + (σp² − σq²)²/(2σp⁴) (docs/exact.md#gaussian-closed-forms); used as an independent check."""
    d = g.mq - g.mp
    return float(np.sum(g.sq**2 * d**2 / g.sp**4 + (g.sp**2 - g.sq**2) ** 2 / (2 * g.sp**4)))


def gaussian_chi2(g: GaussianPairParams) -> float:
    """χ²(p‖q) = E_q[r²] − 1 from σq²/(σp √(2σq² − σp²)) · exp(d²/(2σq² − σp²)); ∞ if 2σq² ≤ σp²."""
    den = 2 * g.sq**2 - g.sp**2
    if np.any(den <= 0):
        return INF
    d = g.mq - g.mp
    log_er2 = float(np.sum(np.log(g.sq**2 / (g.sp * np.sqrt(den))) + d**2 / den))
    return _exp_times(log_er2, 1.0, minus_one=True)


def _exp_times(log_z: float, total: float, minus_one: bool = False) -> float:
    """exp(log_z)·total (or expm1(log_z) with ``minus_one``), +-inf past float64's range instead of an
    OverflowError or an overflow warning (E_q[r^s] = e^{log Z} can exceed 1.8e308 for a finite log Z)."""
    if total == 0:
        return 0.0
    if log_z + math.log(abs(total)) > 709.0:
        return math.copysign(INF, total)
    # np.expm1, as before: math.expm1 can differ in the last bit, and the numbers must not move
    return float(np.expm1(log_z)) * total if minus_one else math.exp(log_z) * total


def product_tilt(parts) -> tuple[float, np.ndarray, np.ndarray] | None:
    """log ∫ Π_i N(x; μ_i, σ_i²)^{e_i} dx and the mean and variance of the normalised product, per
    dimension summed (log) / [D] arrays; None when the product is not normalisable (precision ≤ 0).
    ``parts``: [(μ [D], σ [D], e)]."""
    tau = sum(e / sd**2 for m, sd, e in parts)
    if np.any(tau <= 0):
        return None
    eta = sum(e * m / sd**2 for m, sd, e in parts)
    log_z = np.sum(sum(e * (-np.log(sd) - 0.5 * np.log(2 * np.pi)) - e * m**2 / (2 * sd**2) for m, sd, e in parts)
                   + 0.5 * np.log(2 * np.pi / tau) + eta**2 / (2 * tau))
    return float(log_z), eta / tau, 1.0 / tau


def tilt(g: GaussianPairParams, s: int, b: tuple[np.ndarray, np.ndarray] | None = None, m: int = 0):
    """(log Z, mean [D], var [D]) of the tilted Gaussian behind E_b[w^m r^s (·)], w = q/b:
    ∝ b^{1−m} q^{m−s} p^s (b = q when ``b`` is None); None when it is not normalisable."""
    if b is None or m == 1:
        if s == 0:
            return 0.0, g.mq, g.sq**2
        if s == 1:
            return 0.0, g.mp, g.sp**2
        parts = [(g.mq, g.sq, 1 - s), (g.mp, g.sp, s)]
    else:
        parts = [(b[0], b[1], 1 - m), (g.mq, g.sq, m - s), (g.mp, g.sp, s)]
    return product_tilt([pt for pt in parts if pt[2] != 0])


def logr_quadratic(g: GaussianPairParams, m: np.ndarray, v: np.ndarray):
    """Coefficients [D] of log r = c0 + c1 z + c2 z² when x = m + √v · z."""
    sv = np.sqrt(v)
    c2 = v * (1 / (2 * g.sq**2) - 1 / (2 * g.sp**2))
    c1 = sv * ((m - g.mq) / g.sq**2 - (m - g.mp) / g.sp**2)
    c0 = np.log(g.sq / g.sp) + (m - g.mq) ** 2 / (2 * g.sq**2) - (m - g.mp) ** 2 / (2 * g.sp**2)
    return c0, c1, c2


def std_normal_moment(j: int) -> float:
    return 0.0 if j % 2 else float(np.prod(np.arange(j - 1, 0, -2))) if j else 1.0


def quadratic_raw_moments(c0: float, c1: float, c2: float, kmax: int) -> list[float]:
    """E[(c0 + c1 z + c2 z²)^k] for k = 0..kmax, z ~ N(0, 1), by expanding the polynomial."""
    out, poly = [1.0], np.array([1.0])
    base = np.array([c0, c1, c2])
    for _ in range(kmax):
        poly = np.convolve(poly, base)
        out.append(float(sum(c * std_normal_moment(j) for j, c in enumerate(poly))))
    return out


def sum_raw_moments(per_dim: list[list[float]], kmax: int) -> list[float]:
    """Raw moments of a sum of independent terms: E[(S+Y)^n] = Σ_j C(n,j) E[S^j] E[Y^{n−j}]."""
    acc = [1.0] + [0.0] * kmax
    for m in per_dim:
        acc = [sum(math.comb(n, j) * acc[j] * m[n - j] for j in range(n + 1)) for n in range(kmax + 1)]
    return acc


def gaussian_logr_moment(g: GaussianPairParams, s: int, k: int,
                         b: tuple[np.ndarray, np.ndarray] | None = None, m: int = 0) -> float:
    """E_q[r^s (log r)^k] exactly, or E_b[w^m r^s (log r)^k] with w = q/b for a sampler b = N(μ_b, σ_b²);
    +inf when the expectation diverges."""
    tilted = tilt(g, s, b, m)
    if tilted is None:
        return INF
    log_z, m, v = tilted
    c0, c1, c2 = logr_quadratic(g, m, v)
    per_dim = [quadratic_raw_moments(a, b, c, k) for a, b, c in zip(c0, c1, c2)]
    return _exp_times(log_z, sum_raw_moments(per_dim, k)[k])


def poly_expectation(g: GaussianPairParams, poly: dict[tuple[int, int], float],
                      b: tuple[np.ndarray, np.ndarray] | None = None, m: int = 0) -> float:
    terms = [(c, gaussian_logr_moment(g, s, k, b, m)) for (s, k), c in poly.items() if c != 0.0]
    if any(math.isinf(m) for _, m in terms):
        # Only squared polynomials reach s ≥ 2, and there the diverging r^{2s} term dominates with
        # a positive coefficient: the second moment is +∞.
        return INF
    return sum(c * m for c, m in terms)


def gaussian_abs_logr_mean(g: GaussianPairParams, b: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """E_q|log r| from the characteristic function φ of log r:  E|X| = (2/π)∫₀^∞ (1 − Re φ(t))/t² dt.

    Per dimension log r = c0 + c1 z + c2 z² and
    φ(t) = exp(i t c0) (1 − 2 i t c2)^(−½) exp(−t² c1² / (2(1 − 2 i t c2))); dimensions multiply.
    """
    from scipy import integrate          # imported where used: keeps `import kl_bench` fast
    mb, sb = (g.mq, g.sq) if b is None else b
    c0, c1, c2 = logr_quadratic(g, mb, sb**2)       # log r as a quadratic of x = μ_b + σ_b z
    if g.mq.shape[0] == 1:   # one dimension: integrate directly over z, split at the roots
        a, b, c = float(c0[0]), float(c1[0]), float(c2[0])
        roots = np.roots([c, b, a]) if c != 0 else (np.array([-a / b]) if b != 0 else np.array([]))
        pts = sorted(float(x.real) for x in np.atleast_1d(roots) if abs(x.imag) < 1e-12 and abs(x.real) < 60)
        f = lambda z: abs(a + b * z + c * z * z) * math.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)  # noqa: E731
        edges = [-np.inf] + pts + [np.inf]
        return float(sum(integrate.quad(f, lo, hi, epsabs=1e-14, epsrel=1e-12, limit=200)[0]
                         for lo, hi in zip(edges[:-1], edges[1:])))

    def integrand(t: float) -> float:
        w = 1 - 2j * t * c2
        phi = np.prod(np.exp(1j * t * c0) / np.sqrt(w) * np.exp(-(t**2) * c1**2 / (2 * w)))
        return (1 - phi.real) / (t * t) if t > 0 else 0.5 * scale * scale

    scale = math.sqrt(gaussian_logr_moment(g, 0, 2, b, 0) if b is not None else gaussian_logr_moment(g, 0, 2))
    if scale == 0:          # q = p: log r ≡ 0
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", integrate.IntegrationWarning)
        head = integrate.quad(integrand, 0, 50 / scale, limit=2000, epsabs=1e-13, epsrel=1e-10)[0]
        # Past t = 50/scale, φ has decayed and (1 − Re φ)/t² ≈ 1/t², whose tail integral is scale/50.
        tail = integrate.quad(integrand, 50 / scale, np.inf, limit=2000)[0]
    return 2 / math.pi * (head + tail)


def abs_logr_scale(est: Estimator) -> float | None:
    """|c| when the estimator is |c·log r| (its ``abs_poly`` is one log r term), else None."""
    ap = est.abs_poly
    if ap is not None and set(ap) == {(0, 1)}:
        return abs(ap[(0, 1)])
    return None


def gaussian_sampler_moments(g: GaussianPairParams, est: Estimator, b: tuple[np.ndarray, np.ndarray],
                             weighted: bool, cap: float | None) -> tuple[float, float]:
    """(E_b[v], Var_b[v]) for v = f (or w·f with w = q/b, capped) under a sampler b = N(μ_b, σ_b²).

    Polynomial estimators without a cap: closed forms (tilted Gaussians). Otherwise, one dimension:
    adaptive quadrature of the estimator function itself; more dimensions: unknown (NaN)."""
    m = 1 if weighted else 0
    scale = abs_logr_scale(est)
    if scale is not None and not weighted:           # characteristic function of log r under b
        mean = scale * gaussian_abs_logr_mean(g, b)
        return mean, max(scale**2 * gaussian_logr_moment(g, 0, 2, b, 0) - mean * mean, 0.0)
    if est.poly is not None and cap is None:
        mean = poly_expectation(g, est.poly, b, m)
        second = poly_expectation(g, poly_square(est.poly), b, 2 * m)
        return mean, (INF if math.isinf(second) else max(second - mean * mean, 0.0))
    if g.mq.shape[0] != 1:
        return math.nan, math.nan
    m1, m2 = _quadrature_raw_moments(g, est, b, weighted, cap, (1, 2))
    return m1, max(m2 - m1 * m1, 0.0)


def gaussian_fourth_ratio(g: GaussianPairParams, est: Estimator, b: tuple[np.ndarray, np.ndarray], weighted: bool,
                          cap: float | None) -> float:
    """E_b[v⁴] / E_b[v²]² for v = f (or w·f, as :func:`gaussian_sampler_moments`): the kurtosis scale behind
    HeavyTail.KURTOSIS (beyond the number of draws, a measured variance is usually far too low: the draws
    have not yet met the values that make E[v²]). Closed forms for polynomial estimators without a cap,
    1-D quadrature otherwise (a clamp at log r = ±20 puts E[v²] in draws of probability ~1e-14); NaN where
    neither applies or E_b[v²] = 0, inf where E_b[v⁴] = ∞."""
    m = 1 if weighted else 0
    if est.poly is not None and cap is None:
        square = poly_square(est.poly)
        second = poly_expectation(g, square, b, 2 * m)
        fourth = poly_expectation(g, poly_square(square), b, 4 * m)
    elif g.mq.shape[0] == 1:
        second, fourth = _quadrature_raw_moments(g, est, b, weighted, cap, (2, 4))
    else:
        return math.nan
    if not second > 0 or math.isinf(second):
        return math.nan
    # Divided twice, not by second²: E[v²] beyond 1e154 squares to inf (and E[v⁴] has then overflowed to inf
    # too: inf/inf was NaN, a row with a kurtosis far beyond any draws left unflagged).
    return fourth / second / second


def _quadrature_raw_moments(g: GaussianPairParams, est: Estimator, b: tuple[np.ndarray, np.ndarray], weighted: bool,
                            cap: float | None, powers: tuple[int, ...]) -> list[float]:
    """E_b[v^k] for each k of ``powers`` by adaptive quadrature of the estimator function itself, 1-D (v = f,
    or w·f with w = q/b capped at ``cap``)."""
    from scipy import integrate
    mb, sb = float(b[0][0]), float(b[1][0])
    mq, sq, mp, sp = (float(a[0]) for a in (g.mq, g.sq, g.mp, g.sp))

    def value(x: float) -> float:
        logq = -0.5 * ((x - mq) / sq) ** 2 - math.log(sq)
        logp = -0.5 * ((x - mp) / sp) ** 2 - math.log(sp)
        v = float(est.fn(torch.tensor([logp - logq], dtype=torch.float64))[0])  # host: a scalar of quadrature
        if weighted:
            w = math.exp(logq + 0.5 * ((x - mb) / sb) ** 2 + math.log(sb))
            v *= min(w, cap) if cap is not None else w
        return v

    def pdf(x: float) -> float:
        return math.exp(-0.5 * ((x - mb) / sb) ** 2) / (sb * math.sqrt(2 * math.pi))

    def safe(k: int):
        # Far out, b's density underflows to 0 while the estimator may overflow: 0 · inf is 0 here.
        def wrapped(x: float) -> float:
            d = pdf(x)
            if d == 0.0:
                return 0.0
            try:
                return value(x) ** k * d
            except OverflowError:
                return math.inf
        return wrapped

    def integral(fn) -> float:
        # Whole line, split at b's mean and at q's and p's: the weighted integrand can be much wider
        # than b (b·p/q), and quad's infinite-range transform resolves wide tails that a finite cut-off
        # would under-sample.
        cuts = sorted({mb, mq, mp})
        edges = [-np.inf, *cuts, np.inf]
        return sum(integrate.quad(fn, lo, hi, limit=500, epsabs=1e-14, epsrel=1e-11)[0]
                   for lo, hi in zip(edges[:-1], edges[1:]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", integrate.IntegrationWarning)
        return [integral(safe(k)) for k in powers]


def gaussian_estimator_moments(g: GaussianPairParams, est: Estimator) -> tuple[float, float]:
    """(E_q[f], E_q[(f − E_q f)²]) exactly; the variance may be +inf."""
    scale = abs_logr_scale(est)
    if est.poly is None and scale is None and g.mq.shape[0] == 1:
        return gaussian_sampler_moments(g, est, (g.mq, g.sq), False, None)   # any other function: quadrature
    if est.poly is not None:
        mean = poly_expectation(g, est.poly)
        second = poly_expectation(g, poly_square(est.poly))
    elif scale is not None:
        mean = scale * gaussian_abs_logr_mean(g)
        second = scale**2 * gaussian_logr_moment(g, 0, 2)
    else:
        return math.nan, math.nan
    var = INF if math.isinf(second) else max(second - mean * mean, 0.0)
    return mean, var


def gaussian_score_moment(g: GaussianPairParams, s: int, k: int, i: int, j: int, b=None, m: int = 0) -> float:
    """E_b[w^m r^s (log r)^k z_i^j] with z_i = (x_i − μq_i)/σq_i and w = q/b (b = q when None), via the
    tilted Gaussian ∝ b^{1−m} q^{m−s} p^s: per dimension log r and z are polynomials of one standard
    normal; dimensions are independent under the tilt. The gradient oracles' building block
    (docs/gradients.md)."""
    t = tilt(g, s, b, m)
    if t is None:
        return math.inf
    log_z, mean, var = t
    c0, c1, c2 = logr_quadratic(g, mean, var)
    sd = np.sqrt(var)
    zi = np.array([(mean[i] - g.mq[i]) / g.sq[i], sd[i] / g.sq[i]])      # z_i = a + b ζ
    li = np.array([c0[i], c1[i], c2[i]])
    others = [quadratic_raw_moments(a, b_, c, k) for d, (a, b_, c) in enumerate(zip(c0, c1, c2)) if d != i]
    rest = sum_raw_moments(others, k) if others else [1.0] + [0.0] * k
    total = 0.0
    for a in range(k + 1):
        poly = np.array([1.0])
        for _ in range(a):
            poly = np.convolve(poly, li)
        for _ in range(j):
            poly = np.convolve(poly, zi)
        e = sum(cf * std_normal_moment(n) for n, cf in enumerate(poly))
        total += math.comb(k, a) * e * rest[k - a]
    return _exp_times(log_z, total)


# ----------------------------------------------------------------------------- categoricals
def categorical_kl(lq: torch.Tensor, lp: torch.Tensor) -> float:
    """Mean over contexts of KL(q_b ‖ p_b) = Σ_x q log(q/p), for normalised log-probs [B, V].

    Terms with q(x) = 0 contribute 0; q(x) > 0 = p(x) makes it +inf.
    """
    q = lq.exp()
    terms = torch.where(q > 0, q * (lq - lp), torch.zeros_like(q))
    return float(terms.sum(-1).mean())


def categorical_tv(lq: torch.Tensor, lp: torch.Tensor) -> float:
    """Mean over contexts of TV(q_b, p_b) = ½ Σ_x |q − p|, for normalised log-probs [B, V]; per context it is
    also Σ_x (q − p)⁺, the form used here (one sign, no ½ of two nearly equal halves)."""
    return float(context_tv(lq, lp).mean())


def context_tv(lq: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """TV(q(·|c), p(·|c)) = Σ_x (q − p)⁺ per context: [..., V] log-probs → [...]."""
    return (lq.exp() - lp.exp()).clamp(min=0).sum(-1)


def weighted_moments(w: torch.Tensor, f: torch.Tensor) -> tuple[float, float]:
    """(E[f], Var[f]) under weights ``w`` (summing to 1) in float64.

    The variance is a second pass around the mean, Σ w (f − E f)², not E[f²] − E[f]², which would
    cancel catastrophically when the variance is tiny relative to the mean.
    """
    if torch.isinf(f).any():
        return float((w * f).sum()), INF     # ±inf: the estimator's expectation diverges
    mean = float((w * f).sum())
    return mean, float((w * (f - mean) ** 2).sum())
