"""Sequence-level rejection masks on rollouts (kl_bench.core.rejection, docs/weights.md): the mask against verl's
expression written out here, exact values and gradients of the factorising criteria (seq_max_k2/k3) against
enumeration of every sequence, Monte Carlo rows against them (and against enumeration where no exact value
is given: seq_sum, seq_mean), and bad input refused with one line, exit 2."""
import math

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kl_bench.experiment import gradient_rows as G
from kl_bench.core import modes as M
from kl_bench.cli import app
from kl_bench.core.estimators import lookup
from kl_bench.experiment.case import run_experiment_case
from kl_bench.core.modes import GradItem
from kl_bench.kinds.rollout import RolloutPair
from kl_bench.core.rejection import CRITERIA, Criterion, Rejection, RunningStats
from kl_bench.experiment.spec_experiment import Experiment

from .conftest import CPU
from .test_rollout_gradients import _token_gradient


# ----------------------------------------------------------------------------- verl's mask, written out
def _verl_keep(log_ratio, response_mask, options):
    """compute_rollout_rejection_mask (volcengine/verl b178a3c, verl/trainer/ppo/rollout_corr_helper.py) for
    sequence options [(name, lower, upper)], as verl writes it: clamp to ±20, token_k1 = −lr, token_k2 =
    ½lr², token_k3 = exp(lr) − 1 − lr; masked_sum, masked_mean (÷ (count + 1e-8)), max over valid tokens;
    k1 keeps log(lower) ≤ stat ≤ log(upper), k2/k3 stat ≤ upper; options ANDed. [B] bool."""
    lr = torch.clamp(log_ratio, min=-20.0, max=20.0)
    tok = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1.0 - lr}
    mask = response_mask

    def masked_sum(v):
        return (torch.where(mask.bool(), v, 0.0) * mask).sum(-1)

    def seq_max(v):
        m = v.masked_fill(~mask.bool(), float("-inf")).max(-1).values
        return torch.where(m == float("-inf"), torch.zeros_like(m), m)
    combined = torch.ones_like(mask)
    for name, lower, upper in options:
        red, k = name.split("_")[1], name[-2:]
        v = tok[k]
        stat = {"sum": masked_sum(v), "mean": masked_sum(v) / (mask.sum(-1) + 1e-8), "max": seq_max(v)}[red]
        keep = (stat >= math.log(lower)) & (stat <= math.log(upper)) if k == "k1" else stat <= upper
        combined = combined * keep.unsqueeze(-1).expand_as(mask).to(mask.dtype)
    return ((combined > 0.5) | ~mask.bool()).all(-1)


def _ours(rejection, log_ratio, response_mask):
    run = RunningStats(log_ratio.shape[0], CPU)
    for t in range(log_ratio.shape[1]):
        run.add(log_ratio[:, t], response_mask[:, t])
    return rejection.keep(run) > 0


THRESHOLDS = {"seq_sum_k1": (0.4, 2.0), "seq_sum_k2": 1.5, "seq_sum_k3": 1.5, "seq_mean_k1": (0.7, 1.2),
              "seq_mean_k2": 0.15, "seq_mean_k3": 0.15, "seq_max_k2": 0.5, "seq_max_k3": 0.5}


def _criterion(name):
    th = THRESHOLDS[name]
    return Criterion(name, th[1], th[0]) if isinstance(th, tuple) else Criterion(name, th)


def _options(rejection):
    return [(c.name, c.lower, c.upper) for c in rejection.criteria]


def test_mask_equals_verls_expression_on_random_tensors():
    g = torch.Generator().manual_seed(0)
    n, t = 4000, 12
    lr = 0.6 * torch.randn(n, t, generator=g, dtype=torch.float64)
    wild = torch.rand(n, t, generator=g, dtype=torch.float64) < 0.01        # beyond verl's ±20 clamp
    lr = torch.where(wild, 30.0 * torch.sign(lr), lr)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)
    assert set(THRESHOLDS) == set(CRITERIA)
    combos = [[name] for name in CRITERIA] + [["seq_max_k3", "seq_mean_k1"], ["seq_sum_k2", "seq_max_k2", "seq_mean_k3"]]
    for combo in combos:
        rej = Rejection(tuple(_criterion(name) for name in combo))
        want = _verl_keep(lr, mask, _options(rej))
        assert 0.05 < float(want.double().mean()) < 0.95, combo      # the threshold binds
        assert torch.equal(_ours(rej, lr, mask), want), combo


def test_seq_max_factorises_into_per_token_indicators():
    """seq_max keeps a sequence iff every token's statistic passes: the product of token_keep."""
    g = torch.Generator().manual_seed(1)
    lr = 0.8 * torch.randn(500, 6, generator=g, dtype=torch.float64)
    mask = torch.ones_like(lr)
    rej = Rejection((_criterion("seq_max_k2"), _criterion("seq_max_k3")))
    assert rej.factorises and not Rejection((_criterion("seq_mean_k3"),)).factorises
    assert torch.equal(rej.token_keep(lr).prod(-1) > 0, _verl_keep(lr, mask, _options(rej)))


# ----------------------------------------------------------------------------- enumeration
# ρ = q/b spans [0.55, 2.2] on this pair: these thresholds reject some sequences and keep others
PAIR_THRESHOLDS = {"seq_max_k3": (0.1,), "seq_max_k2": (0.08,), "seq_mean_k1": (1.15, 1 / 1.15)}


def _pair(weights="token", criteria=("seq_max_k3",), min_length=0, eos=4, v=5, t=3, seed=3):
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(2, v, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(lq + 0.7 * torch.randn(2, v, generator=g, dtype=torch.float64), -1)
    lb = torch.log_softmax(lq + 0.6 * torch.randn(2, v, generator=g, dtype=torch.float64), -1)
    rej = Rejection(tuple(Criterion(c, *PAIR_THRESHOLDS[c]) for c in criteria))
    return RolloutPair("r", lq, lp, torch.arange(v) % 2, t, eos, log_b=lb, min_length=min_length, weights=weights,
                       rejection=rej, sampler_label="rejection")


def _enumerate(pair):
    """Every sequence b draws: (b-probability, [(bucket, token)], per-token q/b, kept by verl's mask)."""
    step_lb = [lb for lb, steps in pair.model.phases for _ in range(steps)]
    out = []

    def rec(c, prob, path, lrs):
        t = len(path)
        if t == pair.model.length or (path and path[-1][1] == pair.model.eos):
            lr = torch.tensor([lrs], dtype=torch.float64)
            keep = bool(_verl_keep(lr, torch.ones_like(lr), _options(pair.model.rejection))[0])
            out.append((prob, path, [math.exp(x) for x in lrs], keep))
            return
        for x in range(pair.model.vocab):
            pb = float(step_lb[t][c, x].exp())
            if pb > 0:
                rec(int(pair.model.bucket[x]), prob * pb, path + [(c, x)], lrs + [float(pair.model.log_q[c, x] - step_lb[t][c, x])])
    rec(0, 1.0, [], [])
    return out


def _values(pair, seqs, est):
    """Per sequence the seq and tok row values (the mask times the weighted value), [n] each."""
    g = pair.model.logr_table
    seq, tok = [], []
    for _, path, wts, keep in seqs:
        big_w = math.prod(wts) if pair.weights != "none" else 1.0
        f_seq = float(est.fn(torch.tensor(sum(float(g[c, x]) for c, x in path), dtype=torch.float64)))
        toks = [float(est.fn(g[c, x])) for c, x in path]
        tok_w = wts if pair.weights == "token" else [1.0] * len(wts)
        outer = big_w if pair.weights == "sequence" else 1.0
        seq.append(keep * big_w * f_seq)
        tok.append(keep * outer * sum(w * f for w, f in zip(tok_w, toks)))
    return {"seq": np.array(seq), "tok": np.array(tok)}


def _grad(pair, seqs, est, mode, agg):
    """E_b[mask · per-draw gradient] by enumeration, with explicit score vectors."""
    c = M.coefficient(est, mode)
    q, gt = pair.model.log_q.exp().numpy(), pair.model.logr_table
    f_tab, c_tab = est.fn(gt).numpy(), c(gt).numpy()
    mean = np.zeros(q.size)
    for prob, path, wts, keep in seqs:
        if not keep:
            continue
        big_w = math.prod(wts) if pair.weights != "none" else 1.0
        steps = []
        for cb, x in path:
            s = np.zeros(q.shape)
            s[cb] -= q[cb]
            s[cb, x] += 1
            steps.append((s.reshape(-1), f_tab[cb, x], c_tab[cb, x]))
        if agg == "seq":
            big_l = torch.tensor([sum(float(gt[cb, x]) for cb, x in path)], dtype=torch.float64)
            g = big_w * float(c(big_l)[0]) * sum(s for s, _, _ in steps)
        else:
            tok_w = wts if pair.weights == "token" else [1.0] * len(wts)
            g = (big_w if pair.weights == "sequence" else 1.0) * _token_gradient(M.MODES[mode].token, steps, tok_w)
        mean += prob * g
    return mean


CASES = [dict(weights="none"), dict(weights="token"), dict(weights="sequence"),
         dict(weights="token", criteria=("seq_max_k2", "seq_max_k3"), min_length=1)]
IDS = ["none", "token", "sequence", "token-k2k3-minlen"]


@pytest.mark.parametrize("kw", CASES, ids=IDS)
def test_exact_values_against_enumeration_of_every_sequence(kw):
    pair = _pair(**kw)
    seqs = _enumerate(pair)
    prob = np.array([p for p, *_ in seqs])
    kept = np.array([k for *_, k in seqs])
    assert prob.sum() == pytest.approx(1.0, rel=1e-12)
    assert 0.05 < float(prob[~kept].sum()) < 0.95           # the mask binds
    for name in ("k1", "k2", "k3", "fwd_k3"):
        est = lookup(name)
        for agg, vals in _values(pair, seqs, est).items():
            m = float((prob * vals).sum())
            v = float((prob * (vals - m) ** 2).sum())
            em, ev = pair.exact_moments(est, agg)
            assert em == pytest.approx(m, rel=1e-10, abs=1e-14) and ev == pytest.approx(v, rel=1e-10, abs=1e-14), \
                (name, agg, em - m, ev - v)


@pytest.mark.parametrize("kw", CASES, ids=IDS)
def test_exact_gradients_against_enumeration_of_every_sequence(kw):
    pair = _pair(**kw)
    seqs = _enumerate(pair)
    for name in ("k1", "k3"):
        est = lookup(name)
        for agg in ("seq", "tok"):
            for mode in M.modes_for(est, token=agg != "seq"):
                want = _grad(pair, seqs, est, mode, agg)
                got = pair.gradient_exact(GradItem.of(est, mode, agg), {}).mean
                assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max(), (name, mode, agg)


def test_monte_carlo_rows_agree_with_the_exact_values_and_gradients():
    pair = _pair(weights="token", criteria=("seq_max_k2", "seq_max_k3"), min_length=1)
    exp = Experiment(name="m", draws=40_000, seed=2, batches=40, estimators=("k1", "k3"))
    df = pd.DataFrame(run_experiment_case(pair, exp, CPU).rows)
    assert df["exact_mean"].notna().all() and (df["z"].abs() < 5).all(), df[["estimator", "aggregate", "z"]]
    rows = pd.DataFrame(G.gradient_rows(pair, [lookup("k1"), lookup("k3")], draws=20_000, seed=2, batches=20,
                                        device=CPU))
    assert rows["exact_norm"].notna().all()
    assert (rows["z_reverse"].abs() < 5).all() and (rows["z_forward"].abs() < 5).all(), \
        rows[["estimator", "mode", "aggregate", "z_reverse", "z_forward"]]


def test_geometric_weights_and_the_ppo_clip_take_the_mask():
    """tok_gm rows (TRL's W^(1/|y|)) against enumeration; the PPO clip's local rows (loss_is) under the mask
    against Monte Carlo."""
    from kl_bench.core.weights import WeightCorrection
    pair = _pair(weights="geometric")
    seqs = _enumerate(pair)
    prob = np.array([p for p, *_ in seqs])
    est = lookup("k3")
    vals = np.array([keep * math.prod(wts) ** (1 / len(path)) * sum(float(est.fn(pair.model.logr_table[c, x])) for c, x in path)
                     for _, path, wts, keep in seqs])
    m = float((prob * vals).sum())
    em, ev = pair.exact_moments(est, "tok_gm")
    assert em == pytest.approx(m, rel=1e-10) and ev == pytest.approx(float((prob * (vals - m) ** 2).sum()), rel=1e-10)
    base = _pair(weights="token")
    clipped = RolloutPair("r", base.model.log_q, base.model.log_p, base.model.bucket, 3, 4, log_b=base.model.phases[0][0], weights="token",
                          correction=WeightCorrection(clip=(0.2, 0.2)), rejection=base.model.rejection)
    rows = pd.DataFrame(G.gradient_rows(clipped, [lookup("k1"), lookup("k3")], draws=20_000, seed=4, batches=20,
                                        device=CPU))
    assert ("loss_is" in set(rows["mode"])) and rows["exact_norm"].notna().all()
    assert (rows["z_reverse"].abs() < 5).all() and (rows["z_forward"].abs() < 5).all(), \
        rows[["estimator", "mode", "aggregate", "z_reverse", "z_forward"]]


def test_sum_and_mean_criteria_are_monte_carlo_only_and_agree_with_enumeration():
    """seq_mean/seq_sum: no exact value (NaN, the sampler's words say so, gradient rows equal nothing); the
    Monte Carlo means still agree with the enumerated expectation."""
    pair = _pair(weights="token", criteria=("seq_max_k3", "seq_mean_k1"))
    assert math.isnan(pair.exact_moments(lookup("k3"), "seq")[0])
    seqs = _enumerate(pair)
    prob = np.array([p for p, *_ in seqs])
    exp = Experiment(name="m", draws=40_000, seed=3, batches=40, estimators=("k1", "k3"))
    df = pd.DataFrame(run_experiment_case(pair, exp, CPU).rows)
    assert df["exact_mean"].isna().all() and df["z"].isna().all()
    assert "Monte Carlo only" in pair.model.rejection.words()
    for r in df.itertuples():
        truth = float((prob * _values(pair, seqs, lookup(r.estimator))[r.aggregate]).sum())
        assert abs(r.mean - truth) < 5 * r.se, (r.estimator, r.aggregate, r.mean, truth, r.se)
    rows = pd.DataFrame(G.gradient_rows(pair, [lookup("k3")], draws=2_000, seed=2, batches=10, device=CPU))
    assert rows["exact_norm"].isna().all() and (rows["equals"] == "").all()


# ----------------------------------------------------------------------------- the spec
ROLLOUT = """
spec_version = 1
[experiment]
draws = 4000
batches = 10
device = "cpu"
estimators = ["k3"]
gradients = true
[[case]]
name = "x"
kind = "KIND"
BODY
"""
BODIES = {"categorical": 'vocab = 20\nq = {logits = "zipf", seed = 1}\np = {from = "q", noise = 0.2}',
          "rollout": 'vocab = 20\nbuckets = 2\nlength = 4\neos = 19\nq = {logits = "zipf", seed = 1}\n'
                     'p = {from = "q", noise = 0.2}'}


def _run(write_spec, tmp_path, kind, extra):
    text = ROLLOUT.replace("KIND", kind).replace("BODY", BODIES[kind] + "\n" + extra)
    return CliRunner().invoke(app, ["run", str(write_spec(text)), "--out", str(tmp_path / "o")])


@pytest.mark.parametrize("kind, extra, needles", [
    ("rollout", "sampler = {temperature = 0.8, reject = {seq_max_k4 = 2.0}}",
     ["sampler.reject.seq_max_k4", "unknown rejection criterion", "did you mean 'seq_max_k"]),
    ("rollout", "sampler = {temperature = 0.8, reject = {token_k3 = 2.0}}", ["sampler.reject.token_k3", "mask_low"]),
    ("rollout", "sampler = {temperature = 0.8, reject = {seq_max_k3 = [1.0, 2.0]}}",
     ["sampler.reject.seq_max_k3", "one upper bound"]),
    ("rollout", "sampler = {temperature = 0.8, reject = {seq_mean_k3 = -1.0}}", ["sampler.reject.seq_mean_k3", "> 0"]),
    ("rollout", "sampler = {temperature = 0.8, reject = {seq_sum_k1 = [2.0, 0.5]}}",
     ["sampler.reject.seq_sum_k1", "≤ upper"]),
    ("rollout", "sampler = {temperature = 0.8, reject = {seq_mean_k1 = [0.5, 1.0, 2.0]}}",
     ["sampler.reject.seq_mean_k1", "[lower, upper]"]),
    ("rollout", "sampler = {temperature = 0.8, reject = {seq_mean_k1 = 0.0}}", ["sampler.reject.seq_mean_k1", "> 0"]),
    ("rollout", "sampler = {temperature = 0.8, reject = {}}", ["sampler.reject", "at least one criterion"]),
    ("rollout", "sampler = {temperature = 0.8, reject = 2.0}", ["sampler.reject", "must be a table"]),
    ("rollout", 'sampler = {weights = "token", reject = {seq_max_k3 = 2.0}}', ["sampler.reject", "b ≠ q"]),
    ("rollout", "per_sequence_mean = true\nsampler = {temperature = 0.8, reject = {seq_max_k3 = 2.0}}",
     ["sampler.reject", "per_sequence_mean"]),
    ("rollout", "token_mean_batch = 4\nsampler = {temperature = 0.8, reject = {seq_max_k3 = 2.0}}",
     ["sampler.reject", "token_mean_batch"]),
    ("categorical", "sampler = {temperature = 0.8, reject = {seq_max_k3 = 2.0}}",
     ["sampler.reject", "only for rollout"]),
])
def test_bad_rejection_input_is_one_line_exit_2(kind, extra, needles, write_spec, tmp_path):
    res = _run(write_spec, tmp_path, kind, extra)
    assert res.exit_code == 2, res.output
    msg = res.stderr.strip()
    assert len(msg.splitlines()) == 1 and "case 'x'" in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert not (tmp_path / "o").exists()


def test_a_spec_with_a_rejection_writes_values_and_gradients(write_spec, tmp_path):
    res = _run(write_spec, tmp_path, "rollout", 'sampler = {temperature = 0.7, weights = "token", '
               'reject = {seq_max_k3 = 0.5, seq_mean_k1 = 1.5}}')
    assert res.exit_code == 0, res.output
    summary = pd.read_csv(tmp_path / "o" / "summary.csv")
    assert set(summary["aggregate"]) == {"seq", "tok"} and summary["exact_mean"].isna().all()
    assert summary["sampler"].str.contains("seq_max_k3 ≤ 0.5 and seq_mean_k1 in \\[log 0.666667, log 1.5\\]").all()
    assert summary["sampler"].str.contains("Monte Carlo only").all()
    grads = pd.read_csv(tmp_path / "o" / "gradients.csv")
    assert len(grads) and grads["exact_norm"].isna().all() and grads["cos_reverse"].notna().all()
    assert "rejection mask" in res.output                 # the advice does not promise that weights unbias it
    spec = tmp_path / "spec.toml"
    exact = CliRunner().invoke(app, ["exact", str(spec)])
    assert exact.exit_code == 0 and "no exact moments here (Monte Carlo only)" in exact.output, exact.output


def test_trl_sequence_mask_is_seq_sum_k1_with_the_inverted_band():
    """TRL 1.16.0's vllm_importance_sampling_mode = "sequence_mask" (grpo_trainer.py), written out: a
    sequence is masked when W = exp(Σ_t log ρ_t) < C_min or > C_max. docs/weights.md maps it to
    reject = { seq_sum_k1 = [1/C_max, 1/C_min] } (k1 = −log ρ)."""
    g = torch.Generator().manual_seed(1)
    n, t = 4000, 10
    lr = 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)
    for c_min, c_max in ((0.5, 3.0), (0.8, 1.25)):
        w = torch.exp((lr * mask).sum(-1))
        trl_keep = ~((w < c_min) | (w > c_max))
        rej = Rejection((Criterion("seq_sum_k1", 1 / c_min, 1 / c_max),))
        assert 0.05 < float(trl_keep.double().mean()) < 0.95
        assert torch.equal(_ours(rej, lr, mask), trl_keep)
