"""The control-variate sweep: exact λ*, empirical λ* within its CI, the curve against direct
evaluation on the same draws, cv_opt from an independent pilot, planning columns, heavy tails."""
import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import integrate, stats
from typer.testing import CliRunner

from kl_bench.cli import app
from kl_bench.core.estimators import make_cv
from kl_bench.experiment.case import pilot_draws, run_experiment_case, small_batches
from kl_bench.kinds import GaussianPair
from kl_bench.core.planning import n_for_rel_error, prob_within
from kl_bench.experiment.spec_experiment import Experiment

from .conftest import CPU
from .test_monte_carlo import _categorical

LAMBDAS = (0.0, 0.25, 0.5, 1.0, 1.5)


def _exp(draws=400_000, optimal=True, estimators=("k1", "k3")):
    return Experiment(name="t", draws=draws, seed=5, batches=200, lambdas=LAMBDAS, optimal=optimal,
                      estimators=estimators)


def _quad_lambda_star(mq, sq, mp, sp):
    """Cov(log r, r)/Var(r) by quadrature over x: independent of the closed forms."""
    def logr(x):
        return stats.norm.logpdf(x, mp, sp) - stats.norm.logpdf(x, mq, sq)

    def e(f):
        return integrate.quad(lambda x: f(x) * stats.norm.pdf(x, mq, sq), mq - 30 * sq, mq + 30 * sq,
                              limit=400, epsabs=1e-14)[0]
    el, er = e(logr), e(lambda x: math.exp(logr(x)))
    cov = e(lambda x: logr(x) * math.exp(logr(x))) - el * er
    var = e(lambda x: math.exp(2 * logr(x))) - er * er
    return cov / var


@pytest.mark.parametrize("mu", [0.1, 0.5, 1.0])
def test_exact_lambda_star_equal_variances(mu):
    assert GaussianPair("g", [0.0], [1.0], [mu], [1.0]).exact_joint().lambda_star == \
        pytest.approx(mu**2 / math.expm1(mu**2), rel=1e-12)


@pytest.mark.parametrize("params", [(0.0, 1.0, 0.0, 0.8), (0.3, 1.0, -0.2, 1.3), (0.0, 1.0, 0.5, 1.35),
                                    (0.2, 1.1, 0.0, 0.9)])
def test_exact_lambda_star_against_quadrature(params):
    star = GaussianPair("g", *([v] for v in params)).exact_joint().lambda_star
    assert star == pytest.approx(_quad_lambda_star(*params), rel=1e-7)


def test_infinite_var_r_gives_lambda_star_zero_and_infinite_variance_elsewhere():
    j = GaussianPair("g", [0.0], [1.0], [0.0], [1.5]).exact_joint()
    assert j.lambda_star == 0 and math.isinf(j.var_b)
    assert j.var(0.0) == pytest.approx(GaussianPair("g", [0.0], [1.0], [0.0], [1.5]).exact_moments(
        make_cv(0.0))[1])
    assert math.isinf(j.var(0.5))


def test_multivariate_and_categorical_lambda_star_against_brute_force():
    g = GaussianPair("g", [0.0, 0.2], [1.0, 0.9], [0.3, 0.0], [1.1, 1.0])
    j = g.exact_joint()
    # λ* = [KL(p‖q) + KL(q‖p)]/χ², χ² from the product over dimensions of E_q[r²].
    assert j.lambda_star == pytest.approx((g.kl() + g.kl_forward()) / j.var_b, rel=1e-12)
    pair = _categorical(vocab=500, contexts=3)
    w = (pair.model.log_q.exp() / 3).reshape(-1).numpy()
    logr = (pair.model.log_p - pair.model.log_q).reshape(-1).numpy()
    r = np.exp(logr)
    cov = np.sum(w * logr * r) - np.sum(w * logr) * np.sum(w * r)
    assert pair.exact_joint().lambda_star == pytest.approx(cov / (np.sum(w * r * r) - np.sum(w * r) ** 2),
                                                           rel=1e-10)


@pytest.mark.parametrize("pair", [GaussianPair("g1", [0.0], [1.0], [1.0], [1.0]),
                                  GaussianPair("g08", [0.0], [1.0], [0.0], [0.8]),
                                  _categorical(vocab=3000, contexts=4)], ids=["gauss", "gauss-narrow-p", "cat"])
def test_cv_rows_agree_with_exact_and_lambda_star_within_ci(pair):
    out = run_experiment_case(pair, _exp(), CPU)
    df = pd.DataFrame(out.rows)
    cv = df[df["estimator"].isin(["cv", "cv_opt"])]
    assert len(cv) == len(LAMBDAS) + 1
    assert (cv["z"].abs() < 5).all() and (cv["z_var"].abs() < 5).all()
    assert (cv["heavy_tail"] == "").all()
    r = cv.iloc[0]
    assert abs(r["lambda_star_mc"] - r["lambda_star"]) < 5 * r["lambda_star_mc_se"]
    # cv_opt: λ from the pilot, whose SE is larger by √(draws / pilot draws).
    opt = cv[cv["estimator"] == "cv_opt"].iloc[0]
    pilot_se = r["lambda_star_mc_se"] * math.sqrt(400_000 / pilot_draws(400_000))
    assert abs(opt["lambda"] - r["lambda_star"]) < 5 * pilot_se
    assert opt["lambda"] != r["lambda_star_mc"]          # not fitted on the draws it is scored on
    # k3 is cv(1): identical draws, identical numbers.
    k3 = df[df["estimator"] == "k3"].iloc[0]
    cv1 = cv[cv["lambda"] == 1.0].iloc[0]
    assert cv1["mean"] == pytest.approx(k3["mean"], rel=1e-12) and cv1["std"] == pytest.approx(k3["std"], rel=1e-9)


def test_curve_matches_direct_evaluation_on_the_same_draws():
    pair = _categorical(vocab=2000)
    out = run_experiment_case(pair, _exp(), CPU)
    df = pd.DataFrame(out.rows)
    sweep = out.sweep
    assert len(sweep) >= 201
    assert sweep["lambda"].min() <= out.sweep["lambda_star"].iloc[0] <= sweep["lambda"].max()
    for lam in LAMBDAS:
        direct = df[(df["estimator"] == "cv") & (df["lambda"] == lam)].iloc[0]
        curve = sweep[sweep["lambda"] == lam].iloc[0]
        assert curve["mean"] == pytest.approx(direct["mean"], rel=1e-10)
        assert curve["std"] == pytest.approx(direct["std"], rel=1e-8)
        assert curve["se"] == pytest.approx(direct["se"], rel=1e-8)
        assert curve["frac_negative"] == direct["frac_negative"]
        assert curve["exact_std"] == pytest.approx(direct["exact_std"], rel=1e-9)
        # the exact negative probability against the measured fraction (binomial standard error)
        p, n = curve["p_negative_exact"], direct["draws"]
        assert abs(direct["frac_negative"] - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12
    assert (sweep.loc[sweep["lambda"] == 1.0, "p_negative_exact"] == 0).all()


def test_heavy_tails_are_flagged():
    for sp, k3_flag in [(1.5, "infinite variance"), (1.35, "infinite 4th moment")]:
        out = run_experiment_case(GaussianPair("h", [0.0], [1.0], [0.5], [sp]), _exp(draws=50_000), CPU)
        df = pd.DataFrame(out.rows)
        assert df.loc[df["estimator"] == "k3", "heavy_tail"].iloc[0] == k3_flag
        assert df.loc[df["estimator"] == "k1", "heavy_tail"].iloc[0] == ""
        if sp == 1.5:
            assert math.isinf(df.loc[df["estimator"] == "k3", "n_for_10pct"].iloc[0])


@pytest.mark.slow
def test_n_for_10pct_holds_up_in_simulation():
    pair = _categorical(vocab=2000, noise=0.3)
    out = run_experiment_case(pair, _exp(draws=100_000, optimal=False, estimators=("k1", "k2", "k3")), CPU)
    df = pd.DataFrame(out.rows)
    g = torch.Generator().manual_seed(123)
    trials = 4000
    for name in ("k1", "k3"):
        n = int(df.loc[df["estimator"] == name, "n_for_10pct"].iloc[0])
        true = pair.kl()
        fn = make_cv(0.0 if name == "k1" else 1.0).fn
        means = fn(pair.sample_draws(n * trials, g, CPU).logr.view(trials, n)).mean(dim=1)
        hit = float(((means - true).abs() <= 0.1 * true).double().mean())
        assert abs(hit - 0.95) < 5 * math.sqrt(0.95 * 0.05 / trials), (name, n, hit)
    # k2's bias (3% here) is within 10%: finite n; a bias beyond 10% makes it impossible.
    assert math.isfinite(df.loc[df["estimator"] == "k2", "n_for_10pct"].iloc[0])
    assert math.isinf(n_for_rel_error(bias=0.2, std=1.0, true=1.0))
    assert prob_within(0.0, 1.0, 1.0, n_for_rel_error(0.0, 1.0, 1.0)) >= 0.95


def test_rmse_and_small_batch_negatives():
    out = run_experiment_case(GaussianPair("g", [0.0], [1.0], [0.1], [1.0]), _exp(draws=50_000), CPU)
    df = pd.DataFrame(out.rows).set_index(["estimator", "lambda"], drop=False)
    k1 = df[df["estimator"] == "k1"].iloc[0]
    assert k1["rmse_b64"] == pytest.approx(k1["exact_std"] / 8, rel=1e-12)          # unbiased: σ/√n
    k3 = df[df["estimator"] == "k3"].iloc[0]
    assert k3["p_neg_b64"] == 0                                                          # k3 ≥ 0
    # k1 at KL = 0.005, σ = 0.1: a mean of 64 draws is ~N(0.005, 0.0125²): P(< 0) = Φ(−0.4) ≈ 0.34;
    # simulated on small_batches(draws) batches, so compare within 5 binomial standard errors.
    p = stats.norm.cdf(-0.005 / (0.1 / 8))
    assert abs(k1["p_neg_b64"] - p) < 5 * math.sqrt(p * (1 - p) / small_batches(50_000))


def test_cli_writes_lambda_sweep_and_rejects_bad_lambdas(write_spec, tmp_path):
    runner = CliRunner()
    base = """
        spec_version = 1
        [experiment]
        draws = 20000
        device = "cpu"
        batches = 20
        lambdas = {lam}
        [[case]]
        name = "g"
        kind = "gaussian"
        q = {{mean = 0.0, std = 1.0}}
        p = {{mean = 0.5, std = 1.0}}
    """
    res = runner.invoke(app, ["run", str(write_spec(base.format(lam='[0.0, 1.0, "optimal"]'))),
                              "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    sweep = pd.read_csv(tmp_path / "o" / "lambda_sweep.csv")
    assert len(sweep) >= 201 and "control variate" in res.output
    for bad, needle in [('["optimum"]', "did you mean 'optimal'"), ("[0.5, 0.5]", "twice"),
                        ("0.5", "must be a list"), ("[true]", "number")]:
        res = runner.invoke(app, ["run", str(write_spec(base.format(lam=bad))), "--out", str(tmp_path / "b")])
        assert res.exit_code == 2 and needle in res.stderr and "experiment.lambdas" in res.stderr, res.stderr


def test_n_for_rel_error_terminates_past_float64_integers():
    """A relative std of 1e9 needs ~4e20 draws: beyond 2^53 the bisection midpoint stops moving."""
    import math as _m

    from kl_bench.core.planning import n_for_rel_error
    n = n_for_rel_error(0.0, 1e9, 1.0)
    assert _m.isfinite(n) and n == pytest.approx((1.959964 * 1e9 / 0.1) ** 2, rel=1e-3)
