"""Group baselines in reward mode (kl_bench.experiment.group_baselines): exact moments against enumeration of every group of
G tokens with autograd, GRPO's 1 − 1/G shrink, Monte Carlo rows |z| < 5, bad options refused."""
import itertools

import numpy as np
import pandas as pd
import pytest
import torch

from kl_bench.experiment import group_baselines as BL
from kl_bench.foundation.errors import SpecError
from kl_bench.core.estimators import ESTIMATORS
from kl_bench.core.modes import GradItem
from kl_bench.kinds import CategoricalPair
from kl_bench.kinds.rollout import RolloutPair
from kl_bench.sampling.mismatch import SamplerSpec
from kl_bench.core.targets import REVERSE
from kl_bench.core.weights import WeightCorrection


def _pair(v=4, seed=0, b=1, scale=0.7):
    g = torch.Generator().manual_seed(seed)
    zq = torch.randn(b, v, generator=g, dtype=torch.float64)
    zp = zq + scale * torch.randn(b, v, generator=g, dtype=torch.float64)
    return CategoricalPair("c", torch.log_softmax(zq, -1), torch.log_softmax(zp, -1)), zq


def _exact(pair, est, baseline, group, aggregate=""):
    """Exact E[g] [P] (flattened θ) and E|g|² (NaN where not exact) of the reward-mode per-draw gradient with
    a group baseline (None: none), from the pair's exact pieces (kl_bench.experiment.group_baselines)."""
    ex = pair.baseline_exact(est, aggregate)
    assert ex is not None, (est.name, aggregate)
    return {"mean": BL.exact_mean(ex, baseline, group), "second": BL.exact_second(ex, baseline, group)}


def _enumerate(pair, zq, est, baseline, g):
    """E[g_0] and E|g_0|² of draw 0's gradient ∇ sg(f_0 − b_0)·log q_θ(x_0), summed over all V^G groups
    (one context), each gradient by autograd."""
    lq0 = torch.log_softmax(zq[0], -1)
    lp = pair.model.log_p[0]
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
    ex = _exact(pair, ESTIMATORS[est], baseline, g)
    assert np.abs(ex["mean"] - mean).max() < 1e-13
    assert ex["second"] == pytest.approx(second, rel=1e-12)


@pytest.mark.parametrize("g", [2, 4, 16])
def test_group_mean_shrinks_the_kl_gradient_by_one_minus_one_over_g(g):
    """GRPO: with k1 in the reward E[g] = (1 − 1/G)∇KL(q‖p); RLOO keeps ∇KL(q‖p) exactly."""
    pair, _ = _pair(v=9, b=2)
    rev = pair.gradient_references()[REVERSE]
    plain = pair.gradient_exact(GradItem.of(ESTIMATORS["k1"], "reward"), {}).mean
    assert np.abs(plain - rev).max() < 1e-14
    gm = _exact(pair, ESTIMATORS["k1"], "group_mean", g)["mean"]
    loo = _exact(pair, ESTIMATORS["k1"], "leave_one_out", g)["mean"]
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


def test_bad_group_and_clipped_sampler_are_refused():
    pair, _ = _pair()
    with pytest.raises(SpecError, match="2 ≤ G ≤ 65536"):
        BL.baseline_rows(pair, [ESTIMATORS["k1"]], ["group_mean"], [1], draws=100, seed=0)
    lq = pair.model.log_q
    clipped = CategoricalPair("s", lq, pair.model.log_p, log_b=torch.log_softmax(lq / 0.8, -1), weights="token",
                              correction=WeightCorrection(clip=(0.2, 0.2)))
    with pytest.raises(SpecError, match="PPO clip"):
        BL.baseline_rows(clipped, [ESTIMATORS["k1"]], ["group_mean"], [2], draws=100, seed=0)


def _sampled(kind: str, v=5, seed=2):
    """A one-context pair drawn by b: top-3 of q with token weights (truncating: E_b[ρ s] ≠ 0), a
    tempered q with capped token weights, or a tempered q without weights."""
    pair, zq = _pair(v=v, seed=seed)
    lq = pair.model.log_q
    if kind == "top-k":
        sp = SamplerSpec(top_k=3, weights="token")
        return CategoricalPair("s", lq, pair.model.log_p, log_b=sp.logprobs(lq, pair.model.log_p), weights="token"), zq
    lb = torch.log_softmax(lq / 1.6, -1)
    if kind == "tempered-capped":
        return CategoricalPair("s", lq, pair.model.log_p, log_b=lb, weights="token", weight_cap=1.3), zq
    return CategoricalPair("s", lq, pair.model.log_p, log_b=lb), zq


def _enumerate_sampled(pair, zq, est, baseline, g):
    """E[g_0], E|g_0|² of ρ(x_0)·(f_0 − b_0)·∇log q_θ(x_0) over every group of G draws from b (one
    context): ρ = min(q/b, cap) with token weights, 1 without; b_0 the plain mean of f (as trainers)."""
    lq0, lb0 = torch.log_softmax(zq[0], -1), pair.model.log_b[0]
    cap = pair.model.correction.cap
    support = [x for x in range(zq.shape[1]) if lb0[x] > -torch.inf]
    mean, second = torch.zeros(zq.shape[1], dtype=torch.float64), 0.0
    for xs in itertools.product(support, repeat=g):
        prob = float(torch.exp(lb0[list(xs)].sum()))
        f = ESTIMATORS[est].fn(pair.model.log_p[0, list(xs)] - lq0[list(xs)])
        base = f.mean() if baseline == "group_mean" else (f.sum() - f[0]) / (g - 1)
        rho = 1.0
        if pair.weights == "token":
            rho = float(torch.exp(lq0[xs[0]] - lb0[xs[0]]))
            rho = min(rho, cap) if cap is not None else rho
        theta = zq[0].clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(rho * (f[0] - base).detach() * torch.log_softmax(theta, -1)[xs[0]], theta)
        mean += prob * grad
        second += prob * float(grad @ grad)
    return mean.numpy(), second


@pytest.mark.parametrize("kind", ["top-k", "tempered-capped", "tempered"])
@pytest.mark.parametrize("baseline", ["group_mean", "leave_one_out"])
def test_baselines_under_a_sampler_against_enumeration(kind, baseline):
    pair, zq = _sampled(kind)
    for est in ("k1", "k3"):
        mean, second = _enumerate_sampled(pair, zq, est, baseline, 3)
        ex = _exact(pair, ESTIMATORS[est], baseline, 3)
        assert np.abs(ex["mean"] - mean).max() < 1e-13 * max(1.0, np.abs(mean).max()), (est, kind)
        assert ex["second"] == pytest.approx(second, rel=1e-12)


def test_under_truncation_leave_one_out_moves_the_gradient_and_monte_carlo_agrees():
    """Top-k with token weights: E_b[ρ s] = Σ_S q s ≠ 0, so even leave-one-out changes the expected
    gradient (by −μ·E_b[ρ s]); the Monte Carlo rows agree with the exact moments."""
    pair, _ = _sampled("top-k", v=20, seed=1)
    rows = BL.baseline_rows(pair, [ESTIMATORS["k1"], ESTIMATORS["k3"]], ["group_mean", "leave_one_out"], [4],
                            draws=30_000, seed=3, batches=40)
    for r in rows:
        assert abs(r["z_reverse"]) < 5 and abs(r["z_second"]) < 5, r
        assert r["sampler"] == pair.sampler_label
    loo = [r for r in rows if r["baseline"] == "leave_one_out"]
    assert all(abs(r["exact_shrink"] - 1) > 1e-3 for r in loo), [r["exact_shrink"] for r in loo]


def test_group_baselines_from_a_spec(write_spec, tmp_path):
    """`[experiment] baseline_groups` writes group_baselines.csv: one row per estimator × baseline × G,
    the exact 1 − 1/G shrink of the group mean, Monte Carlo within 5 SE; bad input is one line, exit 2."""
    from typer.testing import CliRunner
    from kl_bench.cli import app
    from kl_bench.results.verify import read_results_folder
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
    read_results_folder(tmp_path / "o")
    # Under a top-k sampler with token weights: the rows say so, and agree with their exact values.
    topk = text.replace('noise = 0.3, seed = 2 }', 'noise = 0.3, seed = 2 }\nsampler = { top_k = 20, weights = "token" }')
    res = CliRunner().invoke(app, ["run", str(write_spec(topk, "topk.toml")), "--out", str(tmp_path / "t")])
    assert res.exit_code == 0, res.output
    rows = pd.read_csv(tmp_path / "t" / "group_baselines.csv")
    assert rows["sampler"].str.contains("top-k=20").all() and (rows[["z_reverse", "z_second"]].abs() < 5).all().all()
    for bad, words in ((text.replace("[2, 8]", "[1, 8]"), "2 ≤ G"),
                       (text.replace("[2, 8]", "[2, 2]"), "twice"),
                       (text.replace("draws = 40000", "draws = 100"), "whole groups"),
                       (text.replace('kind = "categorical"\nvocab = 60\nq = { logits = "zipf", exponent = 1.1, seed = 1 }\n'
                                     'p = { from = "q", noise = 0.3, seed = 2 }',
                                     'kind = "gaussian"\nq = {mean = 0.0, std = 1.0}\np = {mean = 0.2, std = 1.0}'),
                        "not available on gaussian cases"),
                       (text.replace('noise = 0.3, seed = 2 }', 'noise = 0.3, seed = 2 }\nsampler = { top_k = 20, weights = '
                                     '"token", clip_low = 0.2 }'), "PPO clip")):
        res = CliRunner().invoke(app, ["run", str(write_spec(bad, "bad.toml")), "--out", str(tmp_path / "b")])
        assert res.exit_code == 2 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


# ----------------------------------------------------------------------------- rollouts
def _rollout(kind: str):
    """A small rollout (C = 2, V = 4, T = 2, EOS): x ~ q, a tempered q with sequence weights, or top-3 of
    q with sequence weights (truncating: E_b[W S] ≠ 0)."""
    g = torch.Generator().manual_seed(7)
    zq = torch.randn(2, 4, generator=g, dtype=torch.float64)
    lq = torch.log_softmax(zq, -1)
    lp = torch.log_softmax(zq + 0.8 * torch.randn(2, 4, generator=g, dtype=torch.float64), -1)
    kw = {}
    if kind == "tempered":
        kw = dict(log_b=torch.log_softmax(lq / 1.5, -1), weights="sequence")
    elif kind == "top-k":
        kw = dict(log_b=SamplerSpec(top_k=3).logprobs(lq, lp), weights="sequence")
    return RolloutPair("r", lq, lp, torch.arange(4) % 2, 2, 3, **kw), zq


def _enumerate_rollout_groups(pair, zq, est, agg, baseline, g):
    """E[g_0] of W_0·(F_0 − b_0)·∇θ log q_θ(y_0) over every group of G sequences from b, by autograd."""
    from .test_rollout_gradients import _enumerate
    seqs = _enumerate(pair)                     # (b-probability, [(bucket, token)], per-token q/b)
    fn = ESTIMATORS[est].fn
    vals = []
    for _, path, wts in seqs:
        logr = torch.stack([pair.model.log_p[c, x] - pair.model.log_q[c, x] for c, x in path])
        vals.append(float(fn(logr.sum())) if agg == "seq" else float(fn(logr).sum()))
    mean = torch.zeros(zq.numel(), dtype=torch.float64)
    for group in itertools.product(range(len(seqs)), repeat=g):
        prob = float(np.prod([seqs[i][0] for i in group]))
        f = torch.tensor([vals[i] for i in group], dtype=torch.float64)
        base = f.mean() if baseline == "group_mean" else (f.sum() - f[0]) / (g - 1)
        _, path, wts = seqs[group[0]]
        w = float(np.prod(wts)) if pair.weights == "sequence" else 1.0
        theta = zq.clone().requires_grad_(True)
        lq = torch.log_softmax(theta, -1)
        (grad,) = torch.autograd.grad(w * float(f[0] - base) * sum(lq[c, x] for c, x in path), theta)
        mean += prob * grad.reshape(-1)
    return mean.numpy()


@pytest.mark.parametrize("kind", ["on-policy", "tempered", "top-k"])
def test_rollout_baselines_against_enumeration_of_every_group(kind):
    pair, zq = _rollout(kind)
    for est, agg in (("k1", "seq"), ("k3", "seq"), ("k1", "tok"), ("k3", "tok")):
        for baseline in ("group_mean", "leave_one_out"):
            want = _enumerate_rollout_groups(pair, zq, est, agg, baseline, 2)
            got = _exact(pair, ESTIMATORS[est], baseline, 2, agg)["mean"]
            assert np.abs(got - want).max() < 1e-12 * max(1.0, np.abs(want).max()), (kind, est, agg, baseline)
    if kind == "top-k":        # truncation: leave-one-out moves the gradient (−μ·E_b[W S])
        loo = _exact(pair, ESTIMATORS["k1"], "leave_one_out", 2, "seq")["mean"]
        plain = _exact(pair, ESTIMATORS["k1"], None, 2, "seq")["mean"]
        assert np.linalg.norm(loo - plain) > 1e-3 * np.linalg.norm(plain)


def test_rollout_baseline_rows_monte_carlo_and_spec(write_spec, tmp_path):
    """Rows on seq and tok with the exact mean and measured second moments; |z| < 5 along ∇KL(q‖p); the
    group mean shrinks by 1 − 1/G on-policy; from a spec, and token weights refused in one line."""
    from typer.testing import CliRunner
    from kl_bench.cli import app
    pair, _ = _rollout("tempered")
    rows = pd.DataFrame(BL.baseline_rows(pair, [ESTIMATORS["k1"], ESTIMATORS["k3"]], ["group_mean", "leave_one_out"],
                                         [4], draws=40_000, seed=1, batches=40))
    assert set(rows["aggregate"]) == {"seq", "tok"} and len(rows) == 8
    assert (rows["z_reverse"].abs() < 5).all(), rows[["estimator", "aggregate", "baseline", "z_reverse"]]
    assert rows["exact_second"].isna().all() and rows["variance_ratio"].gt(0).all()
    text = """
spec_version = 1
[experiment]
draws = 20000
device = "cpu"
batches = 10
estimators = ["k1", "k3"]
baseline_groups = [4]
[[case]]
name = "r"
kind = "rollout"
vocab = 6
buckets = 2
length = 3
eos = 5
q = { logits = "zipf", exponent = 1.0, seed = 1 }
p = { from = "q", noise = 0.5, seed = 2 }
"""
    res = CliRunner().invoke(app, ["run", str(write_spec(text)), "--out", str(tmp_path / "o"), "--wide"])
    assert res.exit_code == 0, res.output
    assert "group baselines" in res.output and "tok-k3" in res.output and "leave_one_out" in res.output
    from kl_bench.results.verify import read_results_folder
    read_results_folder(tmp_path / "o")             # one row per (case, estimator, aggregate, baseline, G)
    from kl_bench.present import report_data, report_html, report_md
    res = report_data.load_results(tmp_path / "o")
    md = report_md.report_md([res], "", [])
    assert "## Group baselines" in md and "| r | tok-k3 | leave_one_out | 4 |" in md
    assert "<h2>Group baselines</h2>" in report_html.report_html([res], res.summary, [], "", [], [])
    got = pd.read_csv(tmp_path / "o" / "group_baselines.csv")
    gm = got[got["baseline"] == "group_mean"]
    assert len(got) == 8 and np.allclose(gm["exact_shrink"], 0.75, rtol=1e-10)
    assert (got["z_reverse"].abs() < 5).all()
    bad = text.replace('seed = 2 }', 'seed = 2 }\nsampler = { temperature = 1.3, weights = "token" }')
    res = CliRunner().invoke(app, ["run", str(write_spec(bad, "bad.toml")), "--out", str(tmp_path / "b")])
    assert res.exit_code == 2 and 'weights = "none" or "sequence"' in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    bad = text.replace('seed = 2 }', 'seed = 2 }\nsampler = { temperature = 1.3, weights = "sequence", '
                       'reject = { seq_max_k3 = 1.0 } }')
    res = CliRunner().invoke(app, ["run", str(write_spec(bad, "bad2.toml")), "--out", str(tmp_path / "b")])
    assert res.exit_code == 2 and "rejection mask" in res.stderr and len(res.stderr.strip().splitlines()) == 1, \
        res.stderr


def test_a_group_baselines_file_of_the_first_format_still_verifies(write_spec, tmp_path):
    """group_baselines.csv written before baselines had samplers and rollouts (no sampler, aggregate,
    trace_cov, trace_cov_none columns) still loads: those columns are not required."""
    import hashlib
    import json
    from typer.testing import CliRunner
    import kl_bench
    from kl_bench.cli import app
    spec = write_spec("""
spec_version = 1
[experiment]
draws = 8000
device = "cpu"
batches = 8
estimators = ["k1"]
baseline_groups = [2]
[[case]]
name = "c"
kind = "categorical"
vocab = 20
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.3, seed = 2 }
""")
    out = tmp_path / "o"
    assert CliRunner().invoke(app, ["run", str(spec), "--out", str(out), "--quiet"]).exit_code == 0
    old = pd.read_csv(out / "group_baselines.csv").drop(columns=["sampler", "aggregate", "trace_cov", "trace_cov_none"])
    old.to_csv(out / "group_baselines.csv", index=False)
    env = json.loads((out / "run.json").read_text())
    env["files"]["group_baselines.csv"] = hashlib.sha256((out / "group_baselines.csv").read_bytes()).hexdigest()
    (out / "run.json").write_text(json.dumps(env))
    got = kl_bench.load_results(out).group_baselines
    assert len(got) == 2 and "aggregate" not in got.columns
