"""The sampled-token proxies bin_kl and bin_tv (issue 42 item 1) and the TV target: the formulas against
a direct evaluation where it is accurate and against their limits where it is not, the data-processing
bounds pointwise, the exact oracles against independent sums and enumeration, Monte Carlo against exact."""
import math

import pytest
import torch

from kl_bench.core.estimators import ESTIMATORS, lookup
from kl_bench.core.modes import modes_for
from kl_bench.core.targets import REVERSE, TV
from kl_bench.foundation.errors import SpecError
from kl_bench.kinds import CategoricalPair, RolloutPair
from kl_bench.kinds.rollout import brute_force_sequences
from kl_bench.sampling.logits import zipf_logits

from .conftest import mc_frame
from kl_bench.cli import app

from .helpers import CAT_SPEC, GAUSS_SPEC, one_line, runner

F64 = torch.float64
BIN_KL, BIN_TV = ESTIMATORS["bin_kl"], ESTIMATORS["bin_tv"]


def _pair_tables(v=40, c=3, seed=1, noise=0.5):
    lq = torch.log_softmax(zipf_logits(v, 1.1, seed, c), -1)
    g = torch.Generator().manual_seed(seed + 7)
    lp = torch.log_softmax(lq + noise * torch.randn(lq.shape, generator=g, dtype=F64), -1)
    return lq, lp


def _direct_bin_kl(q: float, p: float) -> float:
    """The textbook form, accurate where neither term is tiny nor q, p near 1."""
    return q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))


@pytest.mark.parametrize("q,p", [(0.3, 0.7), (0.01, 0.2), (0.6, 0.05), (0.5, 0.25)])
def test_bin_kl_and_bin_tv_equal_their_definitions(q, p):
    lq, lp = torch.tensor([math.log(q)], dtype=F64), torch.tensor([math.log(p)], dtype=F64)
    assert float(BIN_KL.on(lp - lq, lq)) == pytest.approx(_direct_bin_kl(q, p), rel=1e-13)
    assert float(BIN_TV.on(lp - lq, lq)) == pytest.approx(abs(q - p), rel=1e-13)


def test_bin_kl_keeps_its_digits_where_the_textbook_form_loses_them():
    # q, p = 1 − 1e-12, 1 − 2e-12: D = q log(q/p) + (1−q) log 2 ≈ 3.07e-13; in the textbook form 1 − q is
    # rounded to 1.000089e-12 (relative error 9e-5). From log q = log1p(−1e-12) the proxy keeps every digit.
    lq = torch.tensor([math.log1p(-1e-12)], dtype=F64)
    lp = torch.tensor([math.log1p(-2e-12)], dtype=F64)
    exact = (1 - 1e-12) * (math.log1p(-1e-12) - math.log1p(-2e-12)) + 1e-12 * math.log(0.5)
    assert float(BIN_KL.on(lp - lq, lq)) == pytest.approx(exact, rel=1e-9)
    # Limits: q = 1 gives −log p; p = 0 < q gives +inf; q = p gives 0; never NaN.
    vals = BIN_KL.on(torch.tensor([math.log(0.5), -math.inf, 0.0], dtype=F64), torch.tensor([0.0, -0.1, -0.3], dtype=F64))
    assert vals[0] == pytest.approx(math.log(2), rel=1e-15) and math.isinf(vals[1]) and vals[2] == 0
    # Huge ratios (p/q = e^700) are finite: no overflow of r.
    big = BIN_KL.on(torch.tensor([700.0], dtype=F64), torch.tensor([-700.5], dtype=F64))
    assert math.isfinite(float(big)) and float(big) > 0
    assert float(BIN_TV.on(torch.tensor([700.0], dtype=F64), torch.tensor([-700.5], dtype=F64))) == pytest.approx(
        math.exp(-0.5) - math.exp(-700.5), rel=1e-14)


def test_proxies_are_bounded_by_their_divergence_token_by_token():
    """Data processing: the binary KL of any token ≤ KL(q(·|c) ‖ p(·|c)); |q(x) − p(x)| ≤ TV(q, p)."""
    lq, lp = _pair_tables(v=200, c=5)
    kl = (lq.exp() * (lq - lp)).sum(-1, keepdim=True)
    tv = 0.5 * (lq.exp() - lp.exp()).abs().sum(-1, keepdim=True)
    bk, bt = BIN_KL.on(lp - lq, lq), BIN_TV.on(lp - lq, lq)
    assert bool((bk >= 0).all()) and bool((bk <= kl * (1 + 1e-12)).all())
    assert bool((bt >= 0).all()) and bool((bt <= tv * (1 + 1e-12)).all())


def test_categorical_exact_values_are_the_vocabulary_sums():
    lq, lp = _pair_tables()
    pair = CategoricalPair("c", lq, lp)
    q = lq.exp()
    mean_kl = float((q * BIN_KL.on(lp - lq, lq)).sum(-1).mean())
    second = float((q * BIN_KL.on(lp - lq, lq) ** 2).sum(-1).mean())
    m, v = pair.exact_moments(BIN_KL)
    assert m == pytest.approx(mean_kl, rel=1e-13) and v == pytest.approx(second - mean_kl**2, rel=1e-10)
    tv = float((0.5 * (q - lp.exp()).abs().sum(-1)).mean())
    assert pair.true_value(TV) == pytest.approx(tv, rel=1e-13)
    assert pair.true_value(REVERSE) > m            # the proxy sees part of the KL


def test_categorical_monte_carlo_agrees_with_exact():
    lq, lp = _pair_tables()
    df = mc_frame(CategoricalPair("c", lq, lp), ["bin_kl", "bin_tv"], draws=100_000, seed=4)
    assert set(df.estimator) == {"bin_kl", "bin_tv"}
    assert (df.z.abs() < 5).all(), df[["estimator", "mean", "exact_mean", "se", "z"]]
    assert (df.z_var.abs() < 5).all()
    assert set(df.target) == {REVERSE, TV}


@pytest.mark.parametrize("eos", [None, 4])
def test_rollout_token_rows_against_enumeration(eos):
    lq, lp = _pair_tables(v=5, c=2)
    pair = RolloutPair("r", lq, lp, torch.arange(5) % 2, 4, eos)
    tv_c = 0.5 * (lq.exp() - lp.exp()).abs().sum(-1)
    mean = second = tv = 0.0
    for prob, path in brute_force_sequences(pair.model):
        s = sum(float(BIN_KL.on(lp[c, x] - lq[c, x], lq[c, x])) for c, x in path)
        mean, second = mean + prob * s, second + prob * s * s
        tv += prob * sum(float(tv_c[c]) for c, _ in path)
    m, v = pair.exact_moments(BIN_KL, "tok")
    assert m == pytest.approx(mean, rel=1e-12) and v == pytest.approx(second - mean**2, rel=1e-10)
    assert pair.true_value(TV) == pytest.approx(tv, rel=1e-12)
    assert pair.aggregates_for(BIN_KL) == ("tok",)          # no function of L alone: token rows only


def test_rollout_monte_carlo_agrees_with_exact():
    lq, lp = _pair_tables(v=30, c=3)
    pair = RolloutPair("r", lq, lp, torch.arange(30) % 3, 6, 29)
    df = mc_frame(pair, ["bin_kl", "bin_tv", "k3"], draws=40_000, seed=2)
    assert (df.z.abs() < 5).all(), df[["estimator", "aggregate", "mean", "exact_mean", "z"]]


def test_no_gradient_modes_and_kinds_without_probabilities_refuse(tmp_path):
    assert modes_for(BIN_KL, token=True) == [] and modes_for(BIN_TV) == []
    assert lookup("bin_kl").needs_logq and not lookup("k3").needs_logq
    with pytest.raises(SpecError, match="needs log q"):
        BIN_KL.on(torch.zeros(2, dtype=F64))
    spec = tmp_path / "g.toml"
    spec.write_text(GAUSS_SPEC.format(name="g", seed=0, more=', "bin_kl"', extra=""))
    one_line(runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "out")]), 2, "bin_kl", "gaussian")
    assert not (tmp_path / "out").exists()


def test_a_spec_runs_the_proxies_beside_the_penalty_estimators(tmp_path):
    spec = tmp_path / "c.toml"
    spec.write_text(CAT_SPEC.format(q='{ logits = "zipf", exponent = 1.1, seed = 1 }',
                                    p='{ from = "q", noise = 0.3, seed = 2 }', extra="")
                    .replace('estimators = ["k1", "k3"]', 'estimators = ["k3", "bin_kl", "bin_tv"]'))
    r = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert "bin_kl" in r.stdout and "TV(q,p)" in r.stdout
