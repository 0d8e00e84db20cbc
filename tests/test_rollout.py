"""Rollouts: the dynamic program against brute-force enumeration of every sequence, Monte Carlo
against the dynamic program, and bad input."""
import math

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kl_bench.cli import app
from kl_bench.engine.monte_carlo import run_case
from kl_bench.core.estimators import ESTIMATORS, make_cv, lookup
from kl_bench.experiment.case import run_experiment_case
from kl_bench.sampling.logits import zipf_logits
from kl_bench.kinds import RolloutPair
from kl_bench.kinds.rollout import brute_force_sequences
from kl_bench.results import to_frame
from kl_bench.experiment.rows import summarize
from kl_bench.experiment.spec_experiment import Experiment

from .conftest import CPU

# library presets: tests/test_presets.py; functions of log q(x) too: tests/test_proxies.py
BUILTIN = [n for n in ESTIMATORS.names() if not ESTIMATORS[n].source and not ESTIMATORS[n].needs_logq]
LOGR = [n for n in BUILTIN if n not in ("full", "abs")]


def _tiny(eos, seed=0, v=4, c=2, t=3, bucket=None):
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(c, v, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(torch.randn(c, v, generator=g, dtype=torch.float64), -1)
    return RolloutPair("r", lq, lp, torch.arange(v) % c if bucket is None else bucket, t, eos)


def _brute(pair):
    """Sequence probability, L, per-step log r and per-step context KL for every sequence."""
    g, kl = pair.model.logr_table.numpy(), pair.model.kl_ctx.numpy()
    seqs = brute_force_sequences(pair.model)
    prob = np.array([p for p, _ in seqs])
    steps = [[g[c, x] for c, x in path] for _, path in seqs]
    full = np.array([sum(kl[c] for c, _ in path) for _, path in seqs])
    return prob, steps, full


def _moments(prob, values):
    m = float((prob * values).sum())
    return m, float((prob * (values - m) ** 2).sum())


CASES = [dict(eos=None), dict(eos=3), dict(eos=0, seed=1, v=5, c=3, t=4),
         dict(eos=2, seed=2, bucket=torch.tensor([1, 1, 0, 1]))]


@pytest.mark.parametrize("kw", CASES, ids=["no-eos", "eos", "eos0-3buckets", "bucket-map"])
def test_dp_matches_brute_force_enumeration(kw):
    pair = _tiny(**kw)
    prob, steps, full = _brute(pair)
    assert prob.sum() == pytest.approx(1.0, rel=1e-13)
    seq_l = np.array([sum(s) for s in steps])
    assert pair.kl() == pytest.approx(-(prob * seq_l).sum(), rel=1e-12)
    assert pair.kl_forward() == pytest.approx((prob * np.exp(seq_l) * seq_l).sum(), rel=1e-12)
    for name in LOGR:
        est = lookup(name)
        seq = est.fn(torch.tensor(seq_l)).numpy()
        tok = np.array([float(est.fn(torch.tensor(s, dtype=torch.float64)).sum()) for s in steps])
        for agg, values in (("seq", seq), ("tok", tok)):
            m, v = _moments(prob, values)
            em, ev = pair.exact_moments(est, agg)
            assert em == pytest.approx(m, rel=1e-10, abs=1e-13), (name, agg)
            assert ev == pytest.approx(v, rel=1e-9, abs=1e-13), (name, agg)
    m, v = _moments(prob, full)
    assert pair.exact_moments(lookup("full"), "tok") == (pytest.approx(m, rel=1e-12),
                                                                 pytest.approx(v, rel=1e-9, abs=1e-15))
    # λ* for both aggregations: Cov(a, b)/Var(b) by enumeration.
    a = -seq_l
    for agg, b in (("seq", np.expm1(seq_l)), ("tok", np.array([np.expm1(s).sum() for s in steps]))):
        cov = (prob * a * b).sum() - (prob * a).sum() * (prob * b).sum()
        var = (prob * b * b).sum() - (prob * b).sum() ** 2
        assert pair.exact_joint(agg).lambda_star == pytest.approx(-cov / var, rel=1e-9)


def _small(eos=499, t=8, noise=0.4):
    lq = torch.log_softmax(zipf_logits(500, 1.1, 1, 4), -1)
    g = torch.Generator().manual_seed(2)
    lp = torch.log_softmax(lq + noise * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    lq[:, 499] = lq[:, 499] + 3          # a likely EOS, so that sequences do end early
    return RolloutPair("r", torch.log_softmax(lq, -1), lp, torch.arange(500) % 4, t, eos)


@pytest.mark.parametrize("eos", [None, 499])
def test_monte_carlo_matches_the_dynamic_program(eos):
    pair = _small(eos=eos)
    exp = Experiment(name="t", draws=50_000, seed=3, batches=50, lambdas=(0.0, 0.5, 1.0), optimal=True,
                     estimators=tuple(BUILTIN))
    df = pd.DataFrame(run_experiment_case(pair, exp, CPU).rows)
    checked = df[df["exact_mean"].notna()]
    assert len(checked) >= 2 * len(LOGR) + 1 + 6
    assert (checked["z"].abs() < 5).all(), checked[["estimator", "aggregate", "z"]]
    light = checked[checked["heavy_tail"] == ""]
    assert (light["z_var"].abs() < 5).all(), light[["estimator", "aggregate", "z_var"]]
    # λ* measured within its confidence interval, per aggregation
    for agg in ("seq", "tok"):
        r = df[(df["estimator"] == "cv") & (df["aggregate"] == agg)].iloc[0]
        assert abs(r["lambda_star_mc"] - r["lambda_star"]) < 5 * r["lambda_star_mc_se"]
    # seq and tok k1 are the same number: Σ_t (−log r_t) = −L.
    k1 = df[df["estimator"] == "k1"]
    assert k1["mean"].iloc[0] == pytest.approx(k1["mean"].iloc[1], rel=1e-12)


def test_eos_stops_contributions_and_length_matches_the_dp():
    """Count generated tokens with a token-level row whose per-step value is 1: its mean must be the
    exact expected length from the dynamic program (h = 1), which is < T when EOS is likely."""
    from kl_bench.core.draws import Row
    from kl_bench.core.estimators import REVERSE, Estimator
    ones = Estimator("ones", torch.ones_like, REVERSE, False, True, "1", None)
    pair = _small(eos=499, t=64)
    exact = pair.oracle.tok_moments(torch.ones_like(pair.model.logr_table))
    assert exact[1] < 0.9 * 64          # EOS ends most sequences early (exactly 45.6 tokens on average)
    draws = pair.sample_draws(50_000, torch.Generator().manual_seed(0), CPU, [Row(ones, "tok")])
    steps = draws.tok[:, 0]
    se = math.sqrt((exact[2] - exact[1] ** 2) / 50_000)
    assert abs(float(steps.mean()) - exact[1]) < 5 * se
    assert float(steps.max()) <= 64 and float(steps.min()) >= 1
    no_eos = _small(eos=None, t=64).sample_draws(2000, torch.Generator().manual_seed(0), CPU, [Row(ones, "tok")])
    assert (no_eos.tok[:, 0] == 64).all()


def test_chunking_does_not_change_rollout_results():
    pair = _small()
    a = to_frame(summarize(run_case(pair, ["k1", "k3", "full"], draws=6000, seed=1, batches=30,
                                    chunk=500, device=CPU)))
    b = to_frame(summarize(run_case(pair, ["k1", "k3", "full"], draws=6000, seed=1, batches=30,
                                    chunk=1 << 22, device=CPU)))
    assert a["mean"].tolist() == pytest.approx(b["mean"].tolist(), rel=1e-12)
    assert a["se"].tolist() == pytest.approx(b["se"].tolist(), rel=1e-10)


GOOD = """
spec_version = 1
[experiment]
draws = 4000
device = "cpu"
batches = 20
estimators = ["k1", "k3", "full"]
[[case]]
name = "r"
kind = "rollout"
vocab = 50
buckets = 4
length = 5
eos = 49
q = {logits = "zipf", exponent = 1.1, seed = 1}
p = {from = "q", noise = 0.3, seed = 2}
"""


def test_rollout_through_the_cli(write_spec, tmp_path):
    res = CliRunner().invoke(app, ["run", str(write_spec(GOOD)), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "o" / "summary.csv", keep_default_na=False)
    assert set(df["aggregate"]) == {"seq", "tok"} and "seq k3" in res.output and "tok k3" in res.output


@pytest.mark.parametrize("old, new, needles", [
    ("eos = 49", "eos = 50", ["key 'eos'", "[0, 50)"]),
    ("length = 5", "length = 0", ["key 'length'", "≥ 1"]),
    ("buckets = 4", "buckets = 60", ["key 'buckets'", "≤ vocab"]),
    ('q = {logits = "zipf", exponent = 1.1, seed = 1}', 'q = {file = "wrong.npy"}', ["shape [C, V]", "[4, 50]"]),
    ("eos = 49", 'eos = 49\nbucket_of = {file = "short.npy"}', ["bucket_of.file", "shape [50]"]),
    ("eos = 49", 'eos = 49\nbucket_of = {file = "range.npy"}', ["bucket_of.file", "[0, 4)"]),
    ("eos = 49", 'eos = 49\nbucket_of = "div"', ["bucket_of", "mod"]),
    # a bucket map is no logits file ("logits file not found: nope.npy" had said so)
    ("eos = 49", 'eos = 49\nbucket_of = {file = "nope.npy"}', ["bucket_of.file", "bucket map file not found"]),
    ("eos = 49", 'eos = 49\nbucket_of = {file = "text.npy"}', ["bucket_of.file", "bucket map must be numeric"]),
    ("eos = 49", 'eos = 49\nbucket_of = {file = "pickle.pt"}', ["bucket_of.file", "cannot read bucket map file"]),
])
def test_rollout_bad_input(old, new, needles, write_spec, tmp_path):
    np.save(tmp_path / "wrong.npy", np.zeros((3, 50)))
    np.save(tmp_path / "short.npy", np.zeros(49, dtype=np.int64))
    np.save(tmp_path / "range.npy", np.arange(50) % 5)
    np.save(tmp_path / "text.npy", np.array(["a"] * 50))
    (tmp_path / "pickle.pt").write_bytes(b"not a tensor file")
    assert old in GOOD
    res = CliRunner().invoke(app, ["run", str(write_spec(GOOD.replace(old, new))), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    msg = res.stderr.strip()
    assert len(msg.splitlines()) == 1 and "case 'r'" in msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert not (tmp_path / "o").exists()


def test_seq_k3_variance_explodes_with_length_while_tok_k3_does_not():
    """The headline: rel_std of seq-k3 grows with T; that of tok-k3 and full shrinks."""
    rel = {}
    for t in (16, 64, 256):
        pair = _small(eos=None, t=t, noise=0.3)
        true = pair.kl()
        rel[t] = {agg: math.sqrt(pair.exact_moments(lookup("k3"), agg)[1]) / true for agg in ("seq", "tok")}
        rel[t]["full"] = math.sqrt(pair.exact_moments(lookup("full"), "tok")[1]) / true
    assert rel[16]["seq"] < rel[64]["seq"] < rel[256]["seq"] and rel[256]["seq"] > 100 * rel[64]["seq"]
    assert rel[16]["tok"] > rel[64]["tok"] > rel[256]["tok"]
    assert rel[16]["full"] > rel[64]["full"] > rel[256]["full"]
    assert all(rel[t]["full"] < rel[t]["tok"] for t in rel)
    assert make_cv(1.0).poly == lookup("k3").poly


def test_exact_kurtosis_flags_seq_rows_whose_measured_std_cannot_be_trusted():
    pair = _small(eos=None, t=64, noise=0.6)
    kurt = pair.kurtosis_proxy(lookup("k3"), "seq")
    assert kurt > 10_000
    assert math.isnan(pair.kurtosis_proxy(lookup("k3"), "tok"))
    assert math.isnan(pair.kurtosis_proxy(lookup("k1"), "seq"))
    df = to_frame(summarize(run_case(pair, ["k1", "k3"], draws=10_000, seed=0, batches=20,
                                     chunk=1 << 22, device=CPU)))
    flags = dict(zip(df["aggregate"] + " " + df["estimator"], df["heavy_tail"]))
    assert flags["seq k3"] == "kurtosis > draws" and flags["tok k3"] == "" and flags["seq k1"] == ""


def test_a_constant_rows_exact_std_is_zero_not_the_cancellations_rounding():
    """On a one-step rollout the token row of the analytic KL is one constant, KL(q(·|c₀) ‖ p(·|c₀)): its
    exact variance E[X²] − E[X]² cancels to a few ulps of E[X²] (it was 6.5e-19: an exact std of 8.1e-10 that
    the gate compared with the measured 0 at z = −20,365), and is now 0; a spread above that floor is kept
    (k3's, and a variance of 10 ulps of E[X²])."""
    from kl_bench.kinds.rollout.oracle import CANCELLATION_ULPS, mean_var
    pair = _tiny(None, seed=8, v=20, c=4, t=1)       # seed 8: the cancellation leaves +8.3e-17
    full, k3 = lookup("full"), ESTIMATORS["k3"]
    mean, var = pair.oracle.tok(full)
    assert var == 0.0 and mean > 0
    assert pair.oracle.tok(k3)[1] > 0
    second = 0.04 ** 2
    assert mean_var(0.04, second)[1] == 0.0
    above = second * (1 + 2 * CANCELLATION_ULPS * 2.0**-52)
    assert mean_var(0.04, above)[1] == above - second > 0
    assert mean_var(0.04, math.inf) == (0.04, math.inf)


def test_an_unknown_moment_gives_an_unknown_variance():
    """mean_var keeps NaN as NaN: a NaN mean had given a variance of 0 (the gate then compared the std with
    0), a NaN second moment an infinite variance (the gate then skipped the row's mean)."""
    from kl_bench.kinds.rollout.oracle import mean_var
    for mean, second in ((math.nan, 1.0), (1.0, math.nan), (math.nan, math.nan)):
        assert math.isnan(mean_var(mean, second)[1])
    assert mean_var(1.0, math.inf) == (1.0, math.inf)
