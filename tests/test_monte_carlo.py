"""Monte Carlo against exact values (|z| < 5 at a fixed seed), and metamorphic properties."""
import math

import pytest
import torch

from kl_bench.core import oracles as exact
from kl_bench.engine.monte_carlo import run_case
from kl_bench.core.estimators import ESTIMATORS, lookup
from kl_bench.sampling.logits import zipf_logits
from kl_bench.kinds import CategoricalPair, GaussianPair

from .conftest import CPU, mc_frame

# library presets: tests/test_presets.py; functions of log q(x) too (no Gaussian has them): tests/test_proxies.py
ALL = [n for n in ESTIMATORS.names() if not ESTIMATORS[n].source and not ESTIMATORS[n].needs_logq]


def _categorical(name="cat", vocab=2000, contexts=1, noise=0.4, seed=1):
    lq = torch.log_softmax(zipf_logits(vocab, 1.1, seed, contexts), -1)
    g = torch.Generator().manual_seed(seed + 100)
    lp = torch.log_softmax(lq + noise * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    return CategoricalPair(name, lq, lp)


PAIRS = {
    "gauss-schulman": lambda: GaussianPair("g", [0.0], [1.0], [0.1], [1.0]),
    "gauss-unequal": lambda: GaussianPair("g", [0.3], [1.0], [-0.2], [1.3]),
    "gauss-wide-p": lambda: GaussianPair("g", [0.0], [1.0], [0.5], [0.9]),
    "gauss-3d": lambda: GaussianPair("g", [0.0, 0.2, -0.1], [1.0, 0.9, 1.1], [0.3, 0.0, 0.0], [1.1, 1.0, 1.0]),
    "categorical": lambda: _categorical(),
    "categorical-8ctx": lambda: _categorical(contexts=8),
}


def _fourth_moment_finite(pair) -> bool:
    """E_q[r⁴] < ∞: needed for the batch-means SE of a variance involving r² terms to be valid."""
    return not isinstance(pair, GaussianPair) or exact.tilt(pair.params, 4) is not None


@pytest.mark.parametrize("pair_name", PAIRS)
def test_every_estimator_mean_and_variance_match_exact(pair_name):
    pair = PAIRS[pair_name]()
    df = mc_frame(pair, ALL, draws=400_000, seed=11, batches=200)
    assert len(df) == len(ALL)
    for _, row in df.iterrows():
        assert math.isfinite(row["z"]), row["estimator"]
        assert abs(row["z"]) < 5, (row["estimator"], row["mean"], row["exact_mean"], row["se"])
        heavy = not _fourth_moment_finite(pair) and lookup(row["estimator"]).poly is not None \
            and any(s >= 1 for s, _ in lookup(row["estimator"]).poly)
        if not heavy:
            assert abs(row["z_var"]) < 5, (row["estimator"], row["std"], row["exact_std"])
        if lookup(row["estimator"]).nonnegative:
            assert row["frac_negative"] == 0


@pytest.mark.parametrize("pair_name", PAIRS)
def test_kl_of_q_against_itself_is_exactly_zero(pair_name):
    pair = PAIRS[pair_name]()
    if isinstance(pair, GaussianPair):
        g = pair.params
        same = GaussianPair("same", g.mq, g.sq, g.mq, g.sq)
    else:
        same = CategoricalPair("same", pair.model.log_q, pair.model.log_q)
    assert same.kl() == 0 and same.kl_forward() == 0
    df = mc_frame(same, ALL, draws=10_000, batches=10)
    assert (df["mean"] == 0).all() and (df["std"] == 0).all() and (df["exact_mean"] == 0).all()


@pytest.mark.parametrize("pair_name", ["gauss-unequal", "categorical-8ctx"])
def test_chunk_size_does_not_change_the_result(pair_name):
    pair = PAIRS[pair_name]()
    small = mc_frame(pair, ALL, draws=30_000, batches=30, chunk=1_000)
    large = mc_frame(pair, ALL, draws=30_000, batches=30, chunk=1 << 22)
    for col in ("mean", "std", "se", "frac_negative"):
        assert small[col].tolist() == pytest.approx(large[col].tolist(), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("pair_name", ["gauss-3d", "categorical"])
def test_same_seed_gives_identical_sums_and_other_seed_agrees(pair_name):
    pair = PAIRS[pair_name]()
    a = run_case(pair, ALL, draws=50_000, seed=3, batches=50, chunk=1 << 20, device=CPU)
    b = run_case(pair, ALL, draws=50_000, seed=3, batches=50, chunk=1 << 20, device=CPU)
    c = run_case(pair, ALL, draws=50_000, seed=4, batches=50, chunk=1 << 20, device=CPU)
    assert torch.equal(a.sums, b.sums)
    assert not torch.equal(a.sums, c.sums)


def test_k3_keeps_precision_for_tiny_log_ratios():
    # (r − 1) − log r ≈ ½(log r)² for |log r| ≪ 1; a naive exp(log r) − 1 loses every digit here.
    logr = torch.tensor([1e-6, -1e-6, 1e-4], dtype=torch.float64)
    expected = logr**2 / 2 + logr**3 / 6
    assert torch.allclose(lookup("k3").fn(logr), expected, rtol=1e-9)


def test_permuting_the_vocabulary_keeps_monte_carlo_in_agreement():
    pair = _categorical(vocab=3000)
    perm = torch.randperm(3000, generator=torch.Generator().manual_seed(9))
    permuted = CategoricalPair("perm", pair.model.log_q[:, perm], pair.model.log_p[:, perm])
    a, b = mc_frame(pair, ALL, draws=200_000), mc_frame(permuted, ALL, draws=200_000)
    for (_, x), (_, y) in zip(a.iterrows(), b.iterrows()):
        assert abs(x["mean"] - y["mean"]) <= 5 * math.hypot(x["se"], y["se"]) + 1e-12 * abs(x["mean"]), \
            x["estimator"]
        assert x["exact_mean"] == pytest.approx(y["exact_mean"], rel=1e-10)


def test_infinite_kl_is_reported_as_inf_not_nan():
    lq = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64))
    lp = torch.log(torch.tensor([[0.6, 0.4, 0.0]], dtype=torch.float64))
    df = mc_frame(CategoricalPair("c", lq, lp), ["k1", "k3", "fwd_k3"], draws=1000, batches=10)
    k1 = df[df.estimator == "k1"].iloc[0]
    assert k1["true_kl"] == math.inf and k1["mean"] == math.inf and k1["exact_mean"] == math.inf
    fwd = df[df.estimator == "fwd_k3"].iloc[0]
    assert math.isfinite(fwd["mean"]) and abs(fwd["z"]) < 5
