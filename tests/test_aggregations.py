"""Trainers' aggregations and TRL's sequence-level importance weight on rollouts: the length-split
dynamic program against brute-force enumeration, Monte Carlo against exact, and token-mean's limit."""
import math

import pytest
import torch

from kl_bench import rollout_dp
from kl_bench.draws import LENGTH, Row
from kl_bench.engine import as_rows
from kl_bench.estimators import lookup
from kl_bench.logits import zipf_logits
from kl_bench.pairs import RolloutPair
from kl_bench.pairs.rollout import brute_force_sequences

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
    a, e = rollout_dp.moment_matrices(lq.exp(), torch.ones_like(lq), lp - lq, pair.bucket, 3, 29, 2)
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
    for prob, path in brute_force_sequences(on_q):
        v = sum(float(est.fn(lp[c, x] - lq[c, x])) for c, x in path) / len(path)
        mean, var = mean + prob * v, var + prob * v * v
    got = on_q.exact_moments(est, "tok_mean")
    assert got[0] == pytest.approx(mean, rel=1e-12) and got[1] == pytest.approx(var - mean**2, rel=1e-10)

    geo = RolloutPair("g", lq, lp, bucket, 4, eos, log_b=lb, weights="geometric", per_sequence_mean=True)
    as_b = RolloutPair("b", lb, lp, bucket, 4, eos)             # enumerates sequences with b's probabilities
    gm = gm2 = tm = 0.0
    for prob, path in brute_force_sequences(as_b):
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
    geo = RolloutPair("g", pair.log_q, pair.log_p, pair.bucket, 8, 399, log_b=lb, weights="geometric",
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
    exact = pair.token_mean_limit(est)
    assert abs(ratio - exact) < 5 * se
    # token-mean and sequence-mean weight long sequences differently: different numbers here
    assert abs(pair.exact_moments(est, "tok_mean")[0] - exact) > 10 * se


def test_geometric_weights_refuse_gradients_and_token_weights_refuse_per_sequence_means():
    from kl_bench.errors import SpecError
    pair, lb = _pair()
    geo = RolloutPair("g", pair.log_q, pair.log_p, pair.bucket, 8, 399, log_b=lb, weights="geometric")
    with pytest.raises(SpecError, match="geometric"):
        geo.require_gradients()
    with pytest.raises(SpecError, match="per_sequence_mean"):
        RolloutPair("t", pair.log_q, pair.log_p, pair.bucket, 8, 399, log_b=lb, weights="token", per_sequence_mean=True)
