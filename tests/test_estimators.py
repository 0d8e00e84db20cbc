"""Every registered estimator, whatever is registered (built-in, library presets, plug-ins registered at import):
a function of log r that keeps its input's shape and dtype, is finite on finite input and never NaN on any
input, is ≥ 0 where it says so, has a registered target, and is unbiased for that target where it says so
(against the exact sum over a small vocabulary, which needs no oracle), with the pair's exact moments equal
to that sum for every estimator."""
import math

import pytest
import torch

from kl_bench.core.estimators import ESTIMATORS, Estimator
from kl_bench.core.targets import FORWARD, REVERSE, TARGETS
from kl_bench.kinds import CategoricalPair

# The functions of log r among the registered entries (a PairRow such as `full` is supplied by the pair).
REGISTERED = [name for name in ESTIMATORS.names() if isinstance(ESTIMATORS.get(name), Estimator)
              and not ESTIMATORS[name].needs_logq]      # functions of log q(x) too: tests/test_proxies.py

# Finite log-ratios over the range a float64 r holds, ±0 and ±1e-300; and p(x) = 0 (log r = −∞). (The
# library presets reproduce their library's rounding: exp(x) − x − 1 is −1.1e-16 at x = 1e-8.)
FINITE = torch.cat([torch.linspace(-700, 700, 20001, dtype=torch.float64),
                    torch.tensor([0.0, -0.0, 1e-300, -1e-300], dtype=torch.float64)])
EXTREME = torch.tensor([-math.inf], dtype=torch.float64)


def _pair(v: int = 40, seed: int = 3) -> CategoricalPair:
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(1, v, generator=g, dtype=torch.float64) * 1.5, -1)
    lp = torch.log_softmax(lq + 0.7 * torch.randn(1, v, generator=g, dtype=torch.float64), -1)
    return CategoricalPair("c", lq, lp)


def test_the_registry_holds_the_documented_estimators():
    assert len(REGISTERED) >= 6 and {e.target for e in map(ESTIMATORS.get, REGISTERED)} <= set(TARGETS)


@pytest.mark.parametrize("name", REGISTERED)
def test_shape_and_dtype_are_preserved(name):
    fn = ESTIMATORS[name].fn
    for shape in [(7,), (3, 5), (2, 1, 4)]:        # the engine's tensors: 1-d and more (a 0-d one gives 1-d)
        x = torch.linspace(-2, 2, math.prod(shape), dtype=torch.float64).reshape(shape)
        y = fn(x)
        assert y.shape == x.shape and y.dtype == x.dtype, (name, shape, y.shape, y.dtype)
    y = fn(torch.linspace(-2, 2, 9, dtype=torch.float32))
    assert y.dtype == torch.float32, (name, y.dtype)


@pytest.mark.parametrize("name", REGISTERED)
def test_finite_on_finite_input_never_nan_and_nonnegative_where_claimed(name):
    est = ESTIMATORS[name]
    v = est.fn(FINITE)
    # r = exp(log r) overflows float64 past log r ≈ 709.8: up to 700 every value is finite
    assert torch.isfinite(v).all(), (name, FINITE[~torch.isfinite(v)][:5])
    w = est.fn(EXTREME)
    assert not torch.isnan(w).any(), name
    if est.nonnegative:
        assert (v >= 0).all() and (w >= 0).all(), (name, FINITE[v < 0][:5])


@pytest.mark.parametrize("name", REGISTERED)
def test_unbiased_where_claimed_and_the_exact_moments_are_the_exact_sum(name):
    """E_q[f(log r)] summed over the vocabulary: the target exactly where the estimator says it is unbiased;
    and the pair's exact mean and variance are that sum, for every estimator."""
    est, pair = ESTIMATORS[name], _pair()
    q = pair.model.log_q[0].exp()
    f = est.fn(pair.model.log_p[0] - pair.model.log_q[0])
    mean = float((q * f).sum())
    var = float((q * (f - mean) ** 2).sum())
    if est.unbiased:
        target = {REVERSE: pair.kl(), FORWARD: pair.kl_forward()}[est.target]
        assert mean == pytest.approx(target, rel=1e-10), (name, mean, target)
    em, ev = pair.exact_moments(est)
    assert em == pytest.approx(mean, rel=1e-10, abs=1e-14) and ev == pytest.approx(var, rel=1e-9, abs=1e-14), name
