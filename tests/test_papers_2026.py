"""The 2025–2026 claims about KL estimators as gates, on experiments/papers_2026.toml's cases and on one-bucket
rollouts (docs/papers.md, "Gates" rows): DPPO's binary KL/TV see a part of the divergence, ATR-GRPO's k3 bound
is a ratio band, the Rao–Blackwellised KL (Amini et al.) has a variance at most k1's, the i.i.d.-step identity
Var(W) = (1 + χ²)^T − 1 of a sequence weight, and E_q[log W] = −T·KL where verl's ±20 clamp starts to bind."""
import math

import numpy as np
import pytest
import torch

from kl_bench.core.estimators import ESTIMATORS, lookup
from kl_bench.core.gates import k3_band
from kl_bench.core.targets import TV
from kl_bench.experiment.spec import load_spec
from kl_bench.kinds import RolloutPair, build_pair
from kl_bench.kinds.rollout import brute_force_sequences

F64 = torch.float64


def _pairs() -> dict:
    spec = load_spec("experiments/papers_2026.toml")
    return {c.name: build_pair(c) for c in spec.cases}


def _share(pair, name: str, aggregate: str = "") -> float:
    est = ESTIMATORS[name]
    return pair.exact_moments(est, aggregate)[0] / pair.true_value(est.target)


def test_dppo_binary_proxies_see_a_part_of_the_divergence_and_less_on_flat_pairs():
    pairs = _pairs()
    flat, peaked, roll = pairs["flat"], pairs["peaked"], pairs["rollout"]
    shares = {n: (_share(flat, n), _share(peaked, n), _share(roll, n, "tok")) for n in ("bin_kl", "bin_tv")}
    for name, (f, p, r) in shares.items():
        assert 0 < f < p < 1 and 0 < r < 1, (name, f, p, r)     # bounded by data processing; flat sees least
    # On a flat pair the sampled token carries ~q(x) of its context's divergence: the binary KL is about
    # E_q[q(x)·(r − 1)²]/2 ≈ Σq²·KL, below 1% at V = 1000 (0.11% here: docs/papers.md).
    assert shares["bin_kl"][0] < 0.005 and shares["bin_kl"][1] > 0.3
    assert flat.true_value(TV) > 0 and roll.true_value(TV) > 0


def test_atr_grpo_delta_is_an_asymmetric_band():
    lo, hi = k3_band(0.02)
    assert (round(lo, 3), round(hi, 3)) == (0.813, 1.214) and 1 - lo > hi - 1 - 0.03   # wider below 1
    assert (1 - lo) != pytest.approx(hi - 1, abs=0.01)


def test_rao_blackwellised_kl_is_unbiased_with_a_variance_at_most_k1s():
    roll = _pairs()["rollout"]
    kl = roll.kl()
    m_full, v_full = roll.exact_moments(lookup("full"), "tok")
    m_k1, v_k1 = roll.exact_moments(lookup("k1"), "tok")
    assert m_full == pytest.approx(kl, rel=1e-10) and m_k1 == pytest.approx(kl, rel=1e-10)
    # Var(k1) = Var(full) + E[Σ_t Var(k1_t | c_t)] (the law of total variance, step by step along the path)
    assert v_full < v_k1 and v_full / v_k1 < 0.05, (v_full, v_k1)


def _one_bucket(length: int, noise: float = 0.2, v: int = 50) -> tuple[RolloutPair, float, float]:
    g = torch.Generator().manual_seed(11)
    lq = torch.log_softmax(torch.randn(1, v, generator=g, dtype=F64), -1)
    lp = torch.log_softmax(lq + noise * torch.randn(1, v, generator=g, dtype=F64), -1)
    chi2 = float((lp.exp() ** 2 / lq.exp()).sum()) - 1          # χ²(p‖q) = E_q[r²] − 1
    kl = float((lq.exp() * (lq - lp)).sum())
    return RolloutPair("iid", lq, lp, torch.zeros(v, dtype=torch.long), length, None), chi2, kl


@pytest.mark.parametrize("length", [1, 4, 16, 64])
def test_sequence_weight_variance_is_one_plus_chi2_to_the_T_minus_one(length):
    pair, chi2, kl = _one_bucket(length)
    # W = R = Π_t r_t: E_q[W] = 1 and E_q[W²] = (1 + χ²)^T for T i.i.d. steps.
    e_r = pair.oracle.seq_moments(1)[0]
    e_r2 = pair.oracle.seq_moments(2)[0]
    assert e_r == pytest.approx(1.0, rel=1e-12)
    assert e_r2 - 1 == pytest.approx((1 + chi2) ** length - 1, rel=1e-10)
    # E_q[log W] = −T·KL(q‖p): verl's ±20 clamp on the sequence log-weight binds at its centre once T·KL ≈ 20.
    assert pair.oracle.seq_moments(0)[1] == pytest.approx(-length * kl, rel=1e-10)
    assert pair.kl() == pytest.approx(length * kl, rel=1e-10)


def _weighted(weights: str, length: int = 8, eos=None):
    from kl_bench.sampling.logits import zipf_logits
    lq = torch.log_softmax(zipf_logits(5, 1.1, 1, 2), -1)
    g = torch.Generator().manual_seed(8)
    lp = torch.log_softmax(lq + 0.5 * torch.randn(lq.shape, generator=g, dtype=F64), -1)
    lb = torch.log_softmax(lq + 0.5 * torch.randn(lq.shape, generator=g, dtype=F64), -1)
    bucket = torch.arange(5) % 2
    return (RolloutPair(weights, lq, lp, bucket, length, eos, log_b=lb, weights=weights),
            RolloutPair("b", lb, lp, bucket, length, eos), lq, lp, lb)


@pytest.mark.parametrize("eos", [None, 4])
def test_cumulative_prefix_weights_against_enumeration(eos):
    """CTPO (arXiv 2605.07331): Σ_t ρ_{1:t} f_t, ρ_{1:t} = Π_{s≤t} q/b: the exact program against every sequence."""
    pair, as_b, lq, lp, lb = _weighted("cumulative", 4, eos)
    est = lookup("k3")
    mean = second = 0.0
    for prob, path in brute_force_sequences(as_b.model):
        rho, s = 1.0, 0.0
        for c, x in path:
            rho *= math.exp(float(lq[c, x] - lb[c, x]))
            s += rho * float(est.fn(lp[c, x] - lq[c, x]))
        mean, second = mean + prob * s, second + prob * s * s
    m, v = pair.exact_moments(est, "tok")
    assert m == pytest.approx(mean, rel=1e-12) and v == pytest.approx(second - mean**2, rel=1e-10)
    assert m == pytest.approx(pair.kl(), rel=1e-12)          # unbiased per token


def test_cumulative_weights_are_unbiased_with_less_variance_than_the_sequence_weight():
    """CTPO's ordering at T = 8: token weights alone are biased (the prefix came from b); the whole-sequence
    weight and the prefix weights are unbiased, the prefix weights with the smaller variance."""
    est = lookup("k3")
    got = {w: _weighted(w)[0].exact_moments(est, "tok") for w in ("token", "sequence", "cumulative")}
    kl = _weighted("cumulative")[0].kl()
    assert got["cumulative"][0] == pytest.approx(kl, rel=1e-12) and got["sequence"][0] == pytest.approx(kl, rel=1e-12)
    assert abs(got["token"][0] / kl - 1) > 0.01
    assert got["cumulative"][1] < got["sequence"][1]


def test_cumulative_monte_carlo_agrees_with_exact():
    from .conftest import mc_frame
    pair = _weighted("cumulative", 6, 4)[0]
    df = mc_frame(pair, ["k1", "k3", "bin_kl"], draws=60_000, seed=3)
    assert (df.z.abs() < 5).all(), df[["estimator", "aggregate", "mean", "exact_mean", "z"]]


def _iid_pair(v=4, seed=3, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(v, generator=g, dtype=F64) * scale, -1).numpy()
    lb = torch.log_softmax(torch.randn(v, generator=g, dtype=F64) * scale, -1).numpy()
    return lq, lb


def test_clamped_sequence_weight_against_every_sequence():
    """The ±C clamp of verl's sequence log-weight, exact by compositions, against all V^T sequences."""
    import itertools

    from kl_bench.core.seq_clamp import clamped_weight
    lq, lb = _iid_pair()
    for steps, clamp in ((3, 1.5), (5, 2.0)):
        want = 0.0
        for seq in itertools.product(range(4), repeat=steps):
            big_l = sum(lq[x] - lb[x] for x in seq)
            want += math.exp(sum(lb[x] for x in seq)) * math.exp(min(max(big_l, -clamp), clamp))
        got = clamped_weight(lq, lb, steps, clamp)
        assert got.mean == pytest.approx(want, rel=1e-12) and got.bias == pytest.approx(want - 1, rel=1e-10)


def test_sequence_weights_collapse_once_t_kl_reaches_the_clamp():
    """E_b[e^{clamp(L, ±20)}] stays 1 while T·KL(q‖b) ≪ 20 and falls towards e^20·P_b(L > 20) once it passes
    it. A Monte Carlo check needs a clamp that bounds the weights: at T = 16 with C = 20 the mean 0.79 is carried by
    sequences of weight up to e^20 that 200,000 draws never meet (they measure 0.06: the collapse itself); with
    C = 3 every weight is ≤ e^3 and the exact value agrees with the draws."""
    from kl_bench.core.seq_clamp import clamped_weight
    lq, lb = _iid_pair()
    got = {t: clamped_weight(lq, lb, t, 20.0) for t in (4, 16, 32, 64)}
    assert abs(got[4].bias) < 1e-12 and got[4].t_kl < 20 / 4
    assert got[16].mean < 0.9 and got[32].mean < 0.05 and got[64].mean < 1e-4
    assert [round(got[t].above, 3) for t in (4, 16, 32)] == sorted(round(got[t].above, 3) for t in (4, 16, 32))
    gen = torch.Generator().manual_seed(0)
    x = torch.multinomial(torch.tensor(np.exp(lb)).expand(200_000, -1), 16, replacement=True, generator=gen)
    w = torch.exp(torch.tensor(lq - lb)[x].sum(1).clamp(-3, 3))
    small = clamped_weight(lq, lb, 16, 3.0)
    assert small.bias < -0.1                                  # the clamp binds
    assert abs((float(w.mean()) - small.mean) / (float(w.std()) / math.sqrt(len(w)))) < 5


def test_opsm_share_against_every_sequence_and_its_limit():
    """DeepSeek-V3.2's OPSM: the share of sequences whose mean log(π_old/π_new) exceeds δ, exact by compositions
    against all V^T sequences; as T grows it tends to 1 where KL(π_old‖π_new) > δ and to 0 where it is below."""
    import itertools

    from kl_bench.core.seq_clamp import opsm_share
    old, new = _iid_pair(scale=0.8)
    kl = float(np.sum(np.exp(old) * (old - new)))
    for steps in (3, 5):
        want = sum(math.exp(sum(old[x] for x in seq)) for seq in itertools.product(range(4), repeat=steps)
                   if sum(old[x] - new[x] for x in seq) / steps > kl / 2)
        assert opsm_share(old, new, steps, kl / 2) == pytest.approx(want, rel=1e-12)
    high = [opsm_share(old, new, t, kl / 2) for t in (4, 32, 128)]
    low = [opsm_share(old, new, t, 2 * kl) for t in (4, 32, 128)]
    assert high[0] < high[1] < high[2] and high[2] > 0.95
    assert low[0] > low[1] > low[2] and low[2] < 0.05
