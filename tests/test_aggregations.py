"""Trainers' aggregations and TRL's sequence-level importance weight on rollouts: the length-split
dynamic program against brute-force enumeration, Monte Carlo against exact, and token-mean's limit."""
import math

import numpy as np
import pytest
import torch

from kl_bench.core import rollout_dp
from kl_bench.core.draws import LENGTH, Row
from kl_bench.engine.monte_carlo import as_rows
from kl_bench.core.estimators import lookup
from kl_bench.sampling.logits import zipf_logits
from kl_bench.kinds import RolloutPair
from kl_bench.kinds.rollout import dp
from kl_bench.kinds.rollout import brute_force_sequences

from .conftest import CPU, mc_frame


def _tables(v=5, c=2, seed=1, noise=0.4):
    lq = torch.log_softmax(zipf_logits(v, 1.1, seed, c), -1)
    g = torch.Generator().manual_seed(seed + 10)
    lp = torch.log_softmax(lq + noise * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    lb = torch.log_softmax(lq + noise * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    return lq, lp, lb


def test_length_split_program_sums_to_the_plain_one():
    lq, lp, _ = _tables(v=30, c=3)
    pair = RolloutPair("r", lq, lp, torch.arange(30) % 3, 7, 29)
    a, e = rollout_dp.moment_matrices(lq.exp(), torch.ones_like(lq), lp - lq, pair.model.bucket, 3, 29, 2)
    by_len = rollout_dp.propagate_by_length([(a, e, 7)])
    assert by_len.shape == (7, 3)
    assert torch.allclose(by_len.sum(0), torch.tensor(rollout_dp.propagate(a, e, 7), dtype=torch.float64), rtol=1e-12)


@pytest.mark.parametrize("eos", [None, 4])
def test_per_sequence_mean_and_geometric_weight_against_enumeration(eos):
    """V = 5, C = 2, T = 4: every sequence enumerated under b (and under q), the rows computed by hand."""
    lq, lp, lb = _tables()
    bucket = torch.arange(5) % 2
    est = lookup("k3")
    on_q = RolloutPair("q", lq, lp, bucket, 4, eos, per_sequence_mean=True)
    mean = var = 0.0
    for prob, path in brute_force_sequences(on_q.model):
        v = sum(float(est.fn(lp[c, x] - lq[c, x])) for c, x in path) / len(path)
        mean, var = mean + prob * v, var + prob * v * v
    got = on_q.exact_moments(est, "tok_mean")
    assert got[0] == pytest.approx(mean, rel=1e-12) and got[1] == pytest.approx(var - mean**2, rel=1e-10)

    geo = RolloutPair("g", lq, lp, bucket, 4, eos, log_b=lb, weights="geometric", per_sequence_mean=True)
    as_b = RolloutPair("b", lb, lp, bucket, 4, eos)             # enumerates sequences with b's probabilities
    gm = gm2 = tm = 0.0
    for prob, path in brute_force_sequences(as_b.model):
        s = sum(float(est.fn(lp[c, x] - lq[c, x])) for c, x in path)
        log_w = sum(float(lq[c, x] - lb[c, x]) for c, x in path)
        gm += prob * s * math.exp(log_w / len(path))
        gm2 += prob * (s * math.exp(log_w / len(path))) ** 2
        tm += prob * s / len(path) * math.exp(log_w)
    got = geo.exact_moments(est, "tok_gm")
    assert got[0] == pytest.approx(gm, rel=1e-12) and got[1] == pytest.approx(gm2 - gm**2, rel=1e-10)
    assert geo.exact_moments(est, "tok_mean")[0] == pytest.approx(tm, rel=1e-12)


def _pair(**kw):
    lq, lp, lb = _tables(v=400, c=4, noise=0.3)
    lq[:, 399] += 2.5                                   # EOS likely: lengths vary
    lq = torch.log_softmax(lq, -1)
    return RolloutPair("r", lq, lp, torch.arange(400) % 4, 8, 399, **kw), lb


def test_aggregation_rows_monte_carlo_against_exact():
    pair, lb = _pair(per_sequence_mean=True)
    geo = RolloutPair("g", pair.model.log_q, pair.model.log_p, pair.model.bucket, 8, 399, log_b=lb, weights="geometric",
                      per_sequence_mean=True)
    for p, aggs in ((pair, {"seq", "tok", "tok_mean"}), (geo, {"seq", "tok", "tok_mean", "tok_gm"})):
        rows = as_rows([lookup(n) for n in ("k1", "k3", "full")], p)
        assert {r.aggregate for r in rows} == aggs
        df = mc_frame(p, rows, draws=30_000, seed=7, batches=30)
        assert df["exact_mean"].notna().all() and (df["z"].abs() < 5).all(), df[["estimator", "aggregate", "z"]]
    # the geometric mean of the token ratios is not an unbiased correction: its bias is measurable
    tok = geo.exact_moments(lookup("k3"), "tok")[0]
    gm = geo.exact_moments(lookup("k3"), "tok_gm")[0]
    assert tok == pytest.approx(pair.kl(), rel=1e-10) and abs(gm - tok) > 0.01 * tok


def _token_mean_limit(pair, est) -> float:
    """E[Σ_t f] / E[|y|]: what "token-mean" aggregation (Σ over a batch's tokens / their number) converges to
    as the batch grows (its finite-batch ratio bias is O(1/n)); draws from q or an unweighted sampler."""
    model = pair.model
    assert not model.weighting.weighted
    f = model.tok_values(est)
    ones = torch.ones_like(f)
    num = dp.b_moments(model, lambda lb: ones, lambda lb: f, 1)[1]
    den = dp.b_moments(model, lambda lb: ones, lambda lb: ones, 1)[1]
    return num / den


def test_token_mean_limit_against_the_batch_ratio():
    """Token-mean aggregation, Σ_i Σ_t f / Σ_i |y_i| over one large batch, against E[Σ_t f]/E[|y|]
    (delta-method standard error of a ratio of means)."""
    pair, _ = _pair(per_sequence_mean=True)
    est = lookup("k3")
    d = pair.sample_draws(40_000, torch.Generator().manual_seed(3), CPU, [Row(est, "tok"), Row(LENGTH, "tok")])
    s, n = d.tok[:, 0], d.tok[:, 1]
    ratio = float(s.sum() / n.sum())
    resid = s - ratio * n
    se = float(resid.std() / n.mean()) / math.sqrt(len(s))
    exact = _token_mean_limit(pair, est)
    assert abs(ratio - exact) < 5 * se
    # token-mean and sequence-mean weight long sequences differently: different numbers here
    assert abs(pair.exact_moments(est, "tok_mean")[0] - exact) > 10 * se


def test_geometric_weights_refuse_gradients_and_token_weights_refuse_per_sequence_means():
    from kl_bench.foundation.errors import SpecError
    pair, lb = _pair()
    geo = RolloutPair("g", pair.model.log_q, pair.model.log_p, pair.model.bucket, 8, 399, log_b=lb, weights="geometric")
    with pytest.raises(SpecError, match="geometric"):
        geo.require_gradients()
    with pytest.raises(SpecError, match="per_sequence_mean"):
        RolloutPair("t", pair.model.log_q, pair.model.log_p, pair.model.bucket, 8, 399, log_b=lb, weights="token", per_sequence_mean=True)


# ----------------------------------------------------------------------------- token-mean over B sequences
@pytest.mark.parametrize("eos,sampler", [(None, None), (4, None), (4, "temperature"), (4, "top_k+min_length")])
def test_token_mean_batch_against_enumeration_of_every_batch(eos, sampler):
    """tok_batch = Σ_i Σ_t f / Σ_i |y_i| over B sequences: every B-tuple of sequences (V = 5, T = 3)
    enumerated, with their probabilities under the sampler b (unweighted draws), against the
    generating-function convolution; B = 1 is the per-sequence mean. The variance is enumerated in the
    centred form Σ P (v − mean)², free of E[v²] − E[v]²'s cancellation."""
    lq, lp, _ = _tables()
    bucket = torch.arange(5) % 2
    log_b, min_length = None, 0
    if sampler == "temperature":
        log_b = torch.log_softmax(lq / 0.6, -1)
    elif sampler == "top_k+min_length":
        top = torch.topk(lq, 3, dim=-1).indices
        log_b = torch.log_softmax(torch.full_like(lq, -torch.inf).scatter(-1, top, lq.gather(-1, top)), -1)
        min_length = 1
    for est in (lookup("k3"), lookup("full")):
        for b in (1, 2, 3):
            pair = RolloutPair("q", lq, lp, bucket, 3, eos, per_sequence_mean=True, token_mean_batch=b, log_b=log_b,
                               min_length=min_length)
            # sequences with their probability under b (EOS suppressed at the first step with min_length)
            on_b = RolloutPair("b", pair.model.phases[-1][0], lp, bucket, 3, eos)
            seqs = []
            for prob, path in brute_force_sequences(on_b.model):
                if prob == 0 or (min_length and path[0][1] == eos):
                    continue
                if min_length:       # the first token comes from the renormalised early phase instead
                    c0, x0 = path[0]
                    prob = prob / float(on_b.model.log_q[c0, x0].exp()) * float(pair.model.phases[0][0][c0, x0].exp())
                value = sum(float(pair.model.kl_ctx[c]) if est.analytic else float(est.fn(lp[c, x] - lq[c, x]))
                            for c, x in path)
                seqs.append((prob, value, len(path)))
            # every B-tuple at once: outer products/sums over B copies of the sequence list (125^3 at most)
            prob, val, length = (np.array(col, dtype=np.float64) for col in zip(*seqs))
            p_t, v_t, n_t = np.ones(1), np.zeros(1), np.zeros(1)
            for _ in range(b):
                p_t = np.multiply.outer(p_t, prob).ravel()
                v_t = np.add.outer(v_t, val).ravel()
                n_t = np.add.outer(n_t, length).ravel()
            ratio = v_t / n_t
            mean = math.fsum(p_t * ratio)
            var = math.fsum(p_t * (ratio - mean) ** 2)
            got = pair.exact_moments(est, "tok_batch")
            assert got[0] == pytest.approx(mean, rel=1e-12) and got[1] == pytest.approx(var, rel=1e-12)
            if b == 1:
                assert got == pytest.approx(pair.exact_moments(est, "tok_mean"), rel=1e-12)


def test_token_mean_batch_without_eos_is_the_mean_of_sums_over_t():
    """Every sequence has T tokens: Σ_i S_i / (B·T) has mean E[S]/T and variance Var(S)/(B·T²), for any B."""
    lq, lp, _ = _tables(v=30, c=3)
    est = lookup("k2")
    for b in (1, 16, 1000):
        pair = RolloutPair("r", lq, lp, torch.arange(30) % 3, 9, None, token_mean_batch=b)
        m, v = pair.exact_moments(est, "tok")
        got = pair.exact_moments(est, "tok_batch")
        # P^{B−1}'s spectrum raises its own rounding (~1e-16) to the power B − 1: B·1e-16, margin 100
        assert got[0] == pytest.approx(m / 9, rel=b * 1e-14) and got[1] == pytest.approx(v / (b * 81), rel=b * 1e-14)


def test_token_mean_batch_tends_to_its_limit_with_a_ratio_bias_of_order_one_over_b():
    """E[v_B] − E[S]/E[|y|] = c/B + O(1/B²), with the delta method's c = (μ_S Var|y|/μ_L − Cov(S, |y|))/μ_L²
    (all exact from the length-split program): the remainder after c/B shrinks like 1/B²."""
    pair, _ = _pair()
    est = lookup("k3")
    by_len = dp.by_length(pair.model, lambda lb: torch.ones_like(lb), lambda lb: pair.model.tok_values(est), 2)
    ell = torch.arange(1, pair.model.length + 1, dtype=torch.float64)
    mu_l, e_l2 = float((by_len[:, 0] * ell).sum()), float((by_len[:, 0] * ell**2).sum())
    mu_s, e_sl = float(by_len[:, 1].sum()), float((by_len[:, 1] * ell).sum())
    c = (mu_s * (e_l2 - mu_l**2) / mu_l - (e_sl - mu_s * mu_l)) / mu_l**2
    limit = _token_mean_limit(pair, est)
    assert limit == pytest.approx(mu_s / mu_l, rel=1e-12)
    rest = {}
    for b in (64, 128):
        p = RolloutPair("r", pair.model.log_q, pair.model.log_p, pair.model.bucket, pair.model.length, pair.model.eos, token_mean_batch=b)
        rest[b] = p.exact_moments(est, "tok_batch")[0] - limit - c / b
        assert abs(rest[b]) < 0.1 * abs(c / b)
    assert 3 < rest[64] / rest[128] < 5          # O(1/B²): halving B quadruples it


def test_token_mean_batch_monte_carlo_against_exact():
    """Rows with one value per group of B = 10 draws: mean, variance and counts, through the engine
    (batches of 3,000 draws: 300 whole groups each, none left out)."""
    pair, _ = _pair(per_sequence_mean=True, token_mean_batch=10)
    rows = as_rows([lookup(n) for n in ("k1", "k2", "k3", "full")], pair)
    assert {r.aggregate: r.group for r in rows} == {"seq": 1, "tok": 1, "tok_mean": 1, "tok_batch": 10}
    df = mc_frame(pair, rows, draws=60_000, seed=11, batches=20)
    tb = df[df["aggregate"] == "tok_batch"]
    assert len(tb) == 4 and (tb["draws"] == 60_000).all()
    assert (df["z"].abs() < 5).all() and (df["z_var"].abs() < 5).all(), df[["estimator", "aggregate", "z", "z_var"]]
    # one value per 10 draws: its std is that of a batch of 10's token-mean, well below a sequence's
    k3 = df[df["estimator"] == "k3"].set_index("aggregate")
    assert k3.loc["tok_batch", "exact_std"] < k3.loc["tok_mean", "exact_std"]


def test_token_mean_batch_monte_carlo_under_a_sampler_with_groups_cut_by_batches():
    """Draws from b (temperature 0.7, top-k 50, EOS suppressed for 2 steps), B = 7 in batches of 2,000
    draws: 285 groups each, 5 draws left out per batch; mean and variance against exact."""
    pair, _ = _pair()
    top = torch.topk(pair.model.log_q / 0.7, 50, dim=-1).indices
    log_b = torch.log_softmax(torch.full_like(pair.model.log_q, -torch.inf).scatter(-1, top, (pair.model.log_q / 0.7).gather(-1, top)), -1)
    log_b[:, 399] = pair.model.log_q[:, 399]                      # keep EOS in b's support
    log_b = torch.log_softmax(log_b, -1)
    sampled = RolloutPair("s", pair.model.log_q, pair.model.log_p, pair.model.bucket, 8, 399, log_b=log_b, min_length=2,
                          token_mean_batch=7)
    rows = [r for r in as_rows([lookup(n) for n in ("k1", "k3", "full")], sampled) if r.aggregate == "tok_batch"]
    df = mc_frame(sampled, rows, draws=60_000, seed=5, batches=30)
    assert (df["draws"] == 30 * 285 * 7).all()
    assert (df["z"].abs() < 5).all() and (df["z_var"].abs() < 5).all(), df[["estimator", "z", "z_var"]]


def test_token_mean_groups_stay_within_pieces_and_leave_the_rest_out():
    """A batch of 25 draws in pieces [10, 10, 5] with B = 4: groups [0:4], [4:8], [10:14], [14:18], [20:24];
    each value is Σ tok / Σ |y| over its group by hand; draws 8, 9, 18, 19 and 24 are in none."""
    from kl_bench.core.draws import Draws
    from kl_bench.core.aggregates import groups_in, row_values
    g = torch.Generator().manual_seed(0)
    tok = torch.rand(25, generator=g, dtype=torch.float64)
    length = torch.randint(1, 9, (25,), generator=g).double()
    d = Draws(torch.zeros(25), torch.zeros(25), torch.stack([tok, length], 1), segments=[10, 10, 5])
    v = row_values(d, [Row(lookup("k3"), "tok_batch", 4)])[:, 0]
    for lo in (0, 4, 10, 14, 20):
        want = float(tok[lo:lo + 4].sum() / length[lo:lo + 4].sum())
        assert torch.equal(v[lo:lo + 4], torch.full((4,), want, dtype=torch.float64))
    assert torch.isnan(v[[8, 9, 18, 19, 24]]).all()
    assert groups_in(25, 4, 10) == 5 and groups_in(40, 4, 10) == 8 and groups_in(40, 1, 10) == 40


def test_token_mean_batch_refusals(tmp_path):
    """Weighted draws, B out of range, B × T beyond the FFT, and batches smaller than B: one line each."""
    from kl_bench.foundation.errors import SpecError
    pair, lb = _pair()
    with pytest.raises(SpecError, match="token_mean_batch needs unweighted draws"):
        RolloutPair("t", pair.model.log_q, pair.model.log_p, pair.model.bucket, 8, 399, log_b=lb, weights="sequence", token_mean_batch=4)
    from kl_bench.api import prepare
    base = {"kind": "rollout", "name": "r", "vocab": 50, "buckets": 2, "length": 8, "eos": 49,
            "q": {"logits": "zipf", "exponent": 1.1, "seed": 1}, "p": {"from": "q", "noise": 0.3, "seed": 2}}
    for keys, msg in (({"token_mean_batch": 0}, r"must lie in \[1, 4096\], got 0"),
                      ({"token_mean_batch": 4096, "length": 2048}, r"times length must be ≤ 2\^22"),
                      ({"token_mean_batch": 64}, r"one value per 64 draws \(token_mean_batch\), and 1,000 draws in "
                                                  r"100 batches give batches of 10: give the case at least 6,400 draws")):
        spec = {"spec_version": 1, "experiment": {"name": "t", "draws": 1000, "batches": 100, "estimators": ["k3"]},
                "case": [{**base, **keys}]}
        with pytest.raises(SpecError, match=msg) as e:
            prepare(spec)
        assert e.value.case == "r"


def test_rows_divided_by_lengths_compare_with_the_kl_per_token():
    """tok_mean and tok_batch rows estimate a rate per generated token: their true value is KL/E_q|y|
    (E_q|y| against enumeration), the limit of the token-mean of the analytic per-step KL."""
    from kl_bench.core.targets import FORWARD, REVERSE
    lq, lp, _ = _tables()
    pair = RolloutPair("q", lq, lp, torch.arange(5) % 2, 4, 4, per_sequence_mean=True, token_mean_batch=3)
    mean_length = sum(prob * len(path) for prob, path in brute_force_sequences(pair.model))
    assert pair.oracle.mean_length() == pytest.approx(mean_length, rel=1e-12)
    for target in (REVERSE, FORWARD):
        for agg in ("tok_mean", "tok_batch"):
            assert pair.true_value(target, agg) == pytest.approx(pair.true_value(target) / mean_length, rel=1e-12)
        assert pair.true_value(target, "tok") == pair.true_value(target, "seq") == pair.true_value(target)
    assert _token_mean_limit(pair, lookup("full")) == pytest.approx(pair.true_value(REVERSE, "tok_batch"), rel=1e-12)


def test_run_warns_when_token_mean_rows_leave_draws_out(tmp_path):
    """Batches of 1,000 draws with B = 64: 960 in whole groups, 4% left out: one warning line naming the
    case and the remedy; none when batches are multiples of B."""
    from typer.testing import CliRunner

    from kl_bench.cli import app
    case = ('[[case]]\nname = "r"\nkind = "rollout"\nvocab = 50\nbuckets = 2\nlength = 6\neos = 49\n'
            'token_mean_batch = 64\nq = {logits = "zipf", exponent = 1.1, seed = 1}\np = {from = "q", noise = 0.3, seed = 2}\n')
    for draws, warned in ((20_000, True), (20_480, False)):
        spec = tmp_path / f"w{draws}.toml"
        spec.write_text(f'spec_version = 1\n[experiment]\nname = "w"\ndraws = {draws}\nbatches = 20\n'
                        f'estimators = ["k3"]\n{case}')
        res = CliRunner().invoke(app, ["run", str(spec), "--out", str(tmp_path / f"o{draws}")])
        assert res.exit_code == 0, res.output
        if warned:
            assert "warning: case 'r': tok_batch rows use 19,200 of 20,000 draws" in res.output, res.output
        else:
            assert "tok_batch rows use" not in res.output, res.output
