"""Group baselines in reward mode (kl_bench.baselines): exact moments against enumeration of every group of
G tokens with autograd, GRPO's 1 − 1/G shrink, Monte Carlo rows |z| < 5, bad options refused."""
import itertools

import numpy as np
import pandas as pd
import pytest
import torch

from kl_bench import baselines as BL
from kl_bench.errors import SpecError
from kl_bench.estimators import ESTIMATORS
from kl_bench.modes import GradItem
from kl_bench.pairs import CategoricalPair
from kl_bench.targets import REVERSE


def _pair(v=4, seed=0, b=1, scale=0.7):
    g = torch.Generator().manual_seed(seed)
    zq = torch.randn(b, v, generator=g, dtype=torch.float64)
    zp = zq + scale * torch.randn(b, v, generator=g, dtype=torch.float64)
    return CategoricalPair("c", torch.log_softmax(zq, -1), torch.log_softmax(zp, -1)), zq


def _enumerate(pair, zq, est, baseline, g):
    """E[g_0] and E|g_0|² of draw 0's gradient ∇ sg(f_0 − b_0)·log q_θ(x_0), summed over all V^G groups
    (one context), each gradient by autograd."""
    lq0 = torch.log_softmax(zq[0], -1)
    lp = pair.log_p[0]
    mean, second = torch.zeros(zq.shape[1], dtype=torch.float64), 0.0
    for xs in itertools.product(range(zq.shape[1]), repeat=g):
        prob = float(torch.exp(lq0[list(xs)].sum()))
        f = ESTIMATORS[est].fn(lp[list(xs)] - lq0[list(xs)])
        base = f.mean() if baseline == "group_mean" else (f.sum() - f[0]) / (g - 1)
        theta = zq[0].clone().requires_grad_(True)
        (grad,) = torch.autograd.grad((f[0] - base).detach() * torch.log_softmax(theta, -1)[xs[0]], theta)
        mean += prob * grad
        second += prob * float(grad @ grad)
    return mean.numpy(), second


@pytest.mark.parametrize("baseline", ["group_mean", "leave_one_out"])
@pytest.mark.parametrize("g", [2, 3])
@pytest.mark.parametrize("est", ["k1", "k3"])
def test_exact_moments_equal_enumeration_with_autograd(baseline, g, est):
    pair, zq = _pair()
    mean, second = _enumerate(pair, zq, est, baseline, g)
    ex = BL.exact_baseline_gradient(pair, ESTIMATORS[est], baseline, g)
    assert np.abs(ex["mean"] - mean).max() < 1e-13
    assert ex["second"] == pytest.approx(second, rel=1e-12)


@pytest.mark.parametrize("g", [2, 4, 16])
def test_group_mean_shrinks_the_kl_gradient_by_one_minus_one_over_g(g):
    """GRPO: with k1 in the reward E[g] = (1 − 1/G)∇KL(q‖p); RLOO keeps ∇KL(q‖p) exactly."""
    pair, _ = _pair(v=9, b=2)
    rev = pair.gradient_references()[REVERSE]
    plain = pair.gradient_exact(GradItem.of(ESTIMATORS["k1"], "reward"), {}).mean
    assert np.abs(plain - rev).max() < 1e-14
    gm = BL.exact_baseline_gradient(pair, ESTIMATORS["k1"], "group_mean", g)["mean"]
    loo = BL.exact_baseline_gradient(pair, ESTIMATORS["k1"], "leave_one_out", g)["mean"]
    assert np.abs(gm - (1 - 1 / g) * rev).max() < 1e-14 and np.abs(loo - rev).max() < 1e-14


def test_monte_carlo_rows_agree_with_the_exact_moments_and_are_reproducible():
    pair, _ = _pair(v=20, b=2, seed=1)
    args = dict(draws=30_000, seed=3, batches=40)
    rows = BL.baseline_rows(pair, [ESTIMATORS["k1"], ESTIMATORS["k3"]], ["group_mean", "leave_one_out"], [4], **args)
    assert len(rows) == 4
    for r in rows:
        assert abs(r["z_reverse"]) < 5 and abs(r["z_second"]) < 5, r
        assert r["baseline"] in ("group_mean", "leave_one_out") and r["group"] == 4
        assert r["exact_shrink"] == pytest.approx(0.75 if r["baseline"] == "group_mean" else 1.0, rel=1e-12)
    # The group mean's per-draw moments are the leave-one-out ones times (1 − 1/G)², draw by draw.
    by = {(r["estimator"], r["baseline"]): r for r in rows}
    for e in ("k1", "k3"):
        assert by[e, "group_mean"]["exact_second"] == pytest.approx(0.75**2 * by[e, "leave_one_out"]["exact_second"],
                                                                    rel=1e-12)
    again = BL.baseline_rows(pair, [ESTIMATORS["k1"], ESTIMATORS["k3"]], ["group_mean", "leave_one_out"], [4], **args)
    assert again == rows


def test_bad_group_and_sampler_are_refused():
    pair, _ = _pair()
    with pytest.raises(SpecError, match="2 ≤ G ≤ 65536"):
        BL.baseline_rows(pair, [ESTIMATORS["k1"]], ["group_mean"], [1], draws=100, seed=0)
    lq = pair.log_q
    sampled = CategoricalPair("s", lq, pair.log_p, log_b=torch.log_softmax(lq / 0.8, -1))
    with pytest.raises(SpecError, match="x ~ q"):
        BL.exact_baseline_gradient(sampled, ESTIMATORS["k1"], "group_mean", 2)


def test_group_baselines_from_a_spec(write_spec, tmp_path):
    """`[experiment] baseline_groups` writes group_baselines.csv: one row per estimator × baseline × G,
    the exact 1 − 1/G shrink of the group mean, Monte Carlo within 5 SE; bad input is one line, exit 2."""
    from typer.testing import CliRunner
    from kl_bench.cli import app
    from kl_bench.results.verify import verify_results_folder
    text = """
spec_version = 1
[experiment]
draws = 40000
device = "cpu"
batches = 20
estimators = ["k1", "k3", "full"]
baseline_groups = [2, 8]
[[case]]
name = "c"
kind = "categorical"
vocab = 60
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.3, seed = 2 }
"""
    res = CliRunner().invoke(app, ["run", str(write_spec(text)), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    rows = pd.read_csv(tmp_path / "o" / "group_baselines.csv")
    assert len(rows) == 2 * 2 * 2 and set(rows["estimator"]) == {"k1", "k3"}
    gm = rows[rows["baseline"] == "group_mean"]
    assert np.allclose(gm["exact_shrink"], 1 - 1 / gm["group"], rtol=1e-12)
    assert np.allclose(rows.loc[rows["baseline"] == "leave_one_out", "exact_shrink"], 1.0, rtol=1e-12)
    assert (rows[["z_reverse", "z_second"]].abs() < 5).all().all()
    verify_results_folder(tmp_path / "o")
    for bad, words in ((text.replace("[2, 8]", "[1, 8]"), "2 ≤ G"),
                       (text.replace("[2, 8]", "[2, 2]"), "twice"),
                       (text.replace("draws = 40000", "draws = 100"), "whole groups"),
                       (text.replace('kind = "categorical"\nvocab = 60\nq = { logits = "zipf", exponent = 1.1, seed = 1 }\n'
                                     'p = { from = "q", noise = 0.3, seed = 2 }',
                                     'kind = "gaussian"\nq = {mean = 0.0, std = 1.0}\np = {mean = 0.2, std = 1.0}'),
                        "categorical cases only")):
        res = CliRunner().invoke(app, ["run", str(write_spec(bad, "bad.toml")), "--out", str(tmp_path / "b")])
        assert res.exit_code == 2 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
