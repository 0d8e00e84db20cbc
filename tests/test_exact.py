"""Exact oracles against independent known answers: the closed forms of docs/exact.md, numerical quadrature of
the estimator functions themselves, and brute-force sums."""
import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from kl_bench.core import oracles as exact
from kl_bench.core.estimators import ESTIMATORS, lookup
from kl_bench.kinds import CategoricalPair, GaussianPair

# (μq, σq, μp, σp): equal variances (Schulman), σp > σq, σp < σq, heavy (2σq² ≤ σp²).
GAUSS_1D = [(0.0, 1.0, 0.1, 1.0), (0.0, 1.0, 1.0, 1.0), (0.3, 1.0, -0.2, 1.3), (0.5, 1.2, 0.0, 0.8),
            (0.0, 1.0, 0.0, 1.5)]


def quad_moments(mq, sq, mp, sp, fn, second=True):
    """E_q[f] and E_q[f²] by adaptive quadrature over x of the estimator function itself."""
    def logr(x):
        return stats.norm.logpdf(x, mp, sp) - stats.norm.logpdf(x, mq, sq)

    def f(x):
        return float(fn(torch.tensor([logr(x)], dtype=torch.float64))[0])

    lo, hi = mq - 40 * sq, mq + 40 * sq
    m1 = integrate.quad(lambda x: f(x) * stats.norm.pdf(x, mq, sq), lo, hi, points=[mq, mp], limit=400,
                        epsabs=1e-13)[0]
    if not second:
        return m1, math.nan
    m2 = integrate.quad(lambda x: f(x) ** 2 * stats.norm.pdf(x, mq, sq), lo, hi, points=[mq, mp], limit=400,
                        epsabs=1e-13)[0]
    return m1, m2


LOGR_ESTIMATORS = [n for n in ESTIMATORS.names() if n != "full"   # `full` is not a function of log r
                   and not ESTIMATORS[n].source               # library presets: tests/test_presets.py
                   and not ESTIMATORS[n].needs_logq]          # of log q(x) too: tests/test_proxies.py


@pytest.mark.parametrize("params", GAUSS_1D)
@pytest.mark.parametrize("name", LOGR_ESTIMATORS)
def test_gaussian_moments_match_quadrature(params, name):
    pair = GaussianPair("g", [params[0]], [params[1]], [params[2]], [params[3]])
    est = lookup(name)
    mean, var = pair.exact_moments(est)
    m1, m2 = quad_moments(*params, est.fn, second=math.isfinite(var))
    assert mean == pytest.approx(m1, rel=1e-7, abs=1e-10)
    if math.isinf(var):
        # Divergent second moment: E_q[r²] = ∞ exactly when 2σq² ≤ σp².
        # (only an estimator with a term in r has one: its square holds r²)
        assert any(s >= 1 for s, _ in est.poly) and 2 * params[1] ** 2 <= params[3] ** 2
    else:
        assert var == pytest.approx(m2 - m1 * m1, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("params", GAUSS_1D)
def test_gaussian_closed_forms_from_design(params):
    mq, sq, mp, sp = params
    g = exact.GaussianPairParams(*(np.array([v]) for v in params))
    pair = GaussianPair("g", [mq], [sq], [mp], [sp])
    d = mq - mp
    assert pair.kl() == pytest.approx(math.log(sp / sq) + (sq**2 + d**2) / (2 * sp**2) - 0.5, rel=1e-12)
    _, var_k1 = pair.exact_moments(lookup("k1"))
    assert var_k1 == pytest.approx(sq**2 * d**2 / sp**4 + (sp**2 - sq**2) ** 2 / (2 * sp**4), rel=1e-10)
    chi2 = exact.gaussian_chi2(g)
    _, var_k3 = pair.exact_moments(lookup("k3"))
    if 2 * sq**2 <= sp**2:
        assert math.isinf(chi2) and math.isinf(var_k3)
    else:
        assert var_k3 == pytest.approx(chi2 - 2 * (pair.kl() + pair.kl_forward()) + var_k1, rel=1e-9)


def test_schulman_known_values():
    """q = N(0,1), p = N(μ,1): KL = μ²/2, Var(k1) = μ², E[k2] = ½(μ² + μ⁴/4)."""
    for mu in (0.1, 1.0):
        pair = GaussianPair("g", [0.0], [1.0], [mu], [1.0])
        assert pair.kl() == pytest.approx(mu**2 / 2, rel=1e-14)
        m, v = pair.exact_moments(lookup("k1"))
        assert (m, v) == (pytest.approx(mu**2 / 2), pytest.approx(mu**2))
        assert pair.exact_moments(lookup("k2"))[0] == pytest.approx(0.5 * (mu**2 + mu**4 / 4))


def test_multivariate_gaussian_adds_up():
    dims = [(0.0, 1.0, 0.1, 1.0), (0.3, 1.0, -0.2, 1.3), (0.5, 1.2, 0.0, 0.8)]
    cols = list(zip(*dims))
    joint = GaussianPair("g", *cols)
    singles = [GaussianPair("g", [a], [b], [c], [d]) for a, b, c, d in dims]
    assert joint.kl() == pytest.approx(sum(s.kl() for s in singles), rel=1e-13)
    assert joint.kl_forward() == pytest.approx(sum(s.kl_forward() for s in singles), rel=1e-13)
    k1 = lookup("k1")
    assert joint.exact_moments(k1)[1] == pytest.approx(sum(s.exact_moments(k1)[1] for s in singles), rel=1e-12)
    # E_q[r²] multiplies across dimensions.
    g = joint.params
    prod = math.prod(1 + exact.gaussian_chi2(s.params) for s in singles)
    assert 1 + exact.gaussian_chi2(g) == pytest.approx(prod, rel=1e-12)


def test_abs_characteristic_function_matches_direct_integral():
    """The multivariate |log r| path (characteristic function) against the 1D quadrature path:
    a second dimension with q = p adds nothing to log r."""
    for mq, sq, mp, sp in GAUSS_1D:
        one = GaussianPair("g", [mq], [sq], [mp], [sp])
        two = GaussianPair("g", [mq, 0.0], [sq, 1.0], [mp, 0.0], [sp, 1.0])
        a = lookup("abs")
        assert two.exact_moments(a)[0] == pytest.approx(one.exact_moments(a)[0], rel=1e-7)


def _brute(lq, lp, fn):
    """Plain Python sums over (context, token) for the mixture that picks a context uniformly."""
    b, v = lq.shape
    vals = [(math.exp(lq[i, x]) / b, float(fn(torch.tensor([lp[i, x] - lq[i, x]], dtype=torch.float64))[0]))
            for i in range(b) for x in range(v) if lq[i, x] > -math.inf]
    m = sum(w * f for w, f in vals)
    return m, sum(w * (f - m) ** 2 for w, f in vals)


@pytest.mark.parametrize("name", LOGR_ESTIMATORS)
def test_categorical_moments_match_brute_force(name):
    g = torch.Generator().manual_seed(5)
    lq = torch.log_softmax(torch.randn(3, 7, generator=g, dtype=torch.float64) * 2, -1)
    lp = torch.log_softmax(torch.randn(3, 7, generator=g, dtype=torch.float64) * 2, -1)
    est = lookup(name)
    mean, var = CategoricalPair("c", lq, lp).exact_moments(est)
    bm, bv = _brute(lq, lp, est.fn)
    assert mean == pytest.approx(bm, rel=1e-12) and var == pytest.approx(bv, rel=1e-12)


def test_categorical_kl_brute_force_and_law_of_total_variance():
    g = torch.Generator().manual_seed(6)
    lq = torch.log_softmax(torch.randn(4, 9, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(torch.randn(4, 9, generator=g, dtype=torch.float64), -1)
    pair = CategoricalPair("c", lq, lp)
    per_ctx = [sum(math.exp(lq[b, x]) * float(lq[b, x] - lp[b, x]) for x in range(9)) for b in range(4)]
    assert pair.kl() == pytest.approx(sum(per_ctx) / 4, rel=1e-12)
    # Var over the mixture = mean within-context variance + variance of the context means.
    k1 = lookup("k1")
    within = [CategoricalPair("c", lq[b:b + 1], lp[b:b + 1]).exact_moments(k1) for b in range(4)]
    means = [m for m, _ in within]
    total = sum(v for _, v in within) / 4 + float(np.var(means))
    assert pair.exact_moments(k1)[1] == pytest.approx(total, rel=1e-12)


def test_categorical_zero_probability_gives_inf_not_nan():
    lq = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64))
    lp = torch.log(torch.tensor([[0.6, 0.4, 0.0]], dtype=torch.float64))
    pair = CategoricalPair("c", lq, lp)
    assert pair.kl() == math.inf
    assert pair.exact_moments(lookup("k1")) == (math.inf, math.inf)
    for name in ("fwd_k1", "fwd_k3"):
        m, v = pair.exact_moments(lookup(name))
        assert math.isfinite(m) and math.isfinite(v)
    # q(x) = 0 < p(x): KL(p‖q) is infinite, KL(q‖p) finite.
    rev = CategoricalPair("c", lp, lq)
    assert math.isinf(rev.kl_forward()) and math.isfinite(rev.kl())


def test_permuting_the_vocabulary_changes_nothing_exact():
    g = torch.Generator().manual_seed(7)
    lq = torch.log_softmax(torch.randn(1, 1000, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(lq + 0.3 * torch.randn(1, 1000, generator=g, dtype=torch.float64), -1)
    perm = torch.randperm(1000, generator=g)
    a, b = CategoricalPair("a", lq, lp), CategoricalPair("b", lq[:, perm], lp[:, perm])
    assert a.kl() == pytest.approx(b.kl(), rel=1e-12)
    for e in ESTIMATORS.names():
        for x, y in zip(a.exact_moments(lookup(e)), b.exact_moments(lookup(e))):
            assert x == pytest.approx(y, rel=1e-10)


def test_full_estimator_is_the_per_context_kl():
    g = GaussianPair("g", [0.3], [1.0], [-0.2], [1.3])
    assert g.exact_moments(lookup("full")) == (g.kl(), 0.0)
    gen = torch.Generator().manual_seed(8)
    lq = torch.log_softmax(torch.randn(4, 9, generator=gen, dtype=torch.float64), -1)
    lp = torch.log_softmax(torch.randn(4, 9, generator=gen, dtype=torch.float64), -1)
    per_ctx = [CategoricalPair("c", lq[b:b + 1], lp[b:b + 1]).kl() for b in range(4)]
    mean, var = CategoricalPair("c", lq, lp).exact_moments(lookup("full"))
    assert mean == pytest.approx(np.mean(per_ctx), rel=1e-12)
    assert var == pytest.approx(np.var(per_ctx), rel=1e-10)   # contexts are picked uniformly
