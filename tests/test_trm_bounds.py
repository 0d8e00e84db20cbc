"""Trust Region Masking's bounds (Li et al., arXiv 2512.23075) against the exact surrogate error on rollouts
(kl_bench.kinds.rollout.surrogate; docs/gates.md#the-surrogate-error-and-trms-bounds): the two dynamic programs
against every sequence enumerated by prefix, every bound above the exact error at every length, and the error
zero on-policy."""
import math

import pytest
import torch

from kl_bench.experiment.spec import spec_from_dict
from kl_bench.kinds import build_pair
from kl_bench.kinds.rollout import brute_force_sequences
from kl_bench.kinds.rollout.surrogate import surrogate_error, trm_bounds


def _model(vocab=5, buckets=2, length=4, eos=4, noise=0.3):
    case = {"name": "r", "kind": "rollout", "vocab": vocab, "buckets": buckets, "length": length,
            "q": {"logits": "zipf", "exponent": 1.1, "seed": 1}, "p": {"from": "q", "noise": noise, "seed": 2}}
    if eos is not None:
        case["eos"] = eos
    spec = spec_from_dict({"spec_version": 1, "experiment": {"name": "t", "draws": 1000, "seed": 0, "device": "cpu"},
                           "case": [case]})
    return build_pair(spec.cases[0]).model


def _reward(model, seed=0):
    """A random per-token reward in [0, 1/T]: every sequence's reward lies in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(model.log_q.shape, generator=g, dtype=torch.float64) / model.length


def _by_prefix(model, reward):
    """J(q), J(p) and E_q[Σ_t ρ_t A_t] from every sequence, with V(prefix) = E_q[reward still to come | prefix]
    summed over the sequences that extend the prefix (no bucket state: an oracle independent of the programs)."""
    q, p, r = model.log_q.exp().numpy(), model.log_p.exp().numpy(), reward.numpy()
    seqs = brute_force_sequences(model)
    mass, to_come = {}, {}
    for prob, path in seqs:
        rewards = [r[c, x] for c, x in path]
        for t in range(len(path) + 1):
            key = tuple(x for _, x in path[:t])
            mass[key] = mass.get(key, 0.0) + prob
            to_come[key] = to_come.get(key, 0.0) + prob * sum(rewards[t:])
    value = {k: to_come[k] / mass[k] for k in mass}
    j_q = j_p = surrogate = 0.0
    for prob, path in seqs:
        total = sum(r[c, x] for c, x in path)
        j_q += prob * total
        j_p += math.prod(p[c, x] for c, x in path) * total
        tokens = [x for _, x in path]
        for t, (c, x) in enumerate(path):
            advantage = r[c, x] + value[tuple(tokens[:t + 1])] - value[tuple(tokens[:t])]
            surrogate += prob * p[c, x] / q[c, x] * advantage
    return j_q, j_p, surrogate


@pytest.mark.parametrize("eos", [4, None], ids=["eos", "no-eos"])
def test_the_programs_against_every_sequence(eos):
    model = _model(eos=eos)
    reward = _reward(model)
    got = surrogate_error(model, reward)
    j_q, j_p, surrogate = _by_prefix(model, reward)
    assert got.j_roll == pytest.approx(j_q, rel=1e-12)
    assert got.j_theta == pytest.approx(j_p, rel=1e-12)
    assert got.surrogate == pytest.approx(surrogate, rel=1e-10, abs=1e-15)
    assert got.error == pytest.approx(j_p - j_q - surrogate, rel=1e-9, abs=1e-15)
    # D_seq against its definition, KL of the two sequence laws
    p = model.log_p.exp().numpy()
    kl_seq = sum(prob * math.log(prob / math.prod(p[c, x] for c, x in path)) for prob, path in brute_force_sequences(model))
    assert got.kl_seq == pytest.approx(kl_seq, rel=1e-10)


def test_on_policy_the_surrogate_is_exact():
    model = _model(noise=0.0)
    got = surrogate_error(model, _reward(model))
    assert got.kl_max == 0 and abs(got.error) < 1e-15 and abs(got.surrogate) < 1e-15
    assert all(b == 0 for b in got.bounds.values())


@pytest.mark.parametrize("noise", [0.05, 0.3, 1.0])
def test_every_bound_holds_at_every_length(noise):
    """The paper's claim: each bound is above |Error| (rewards in [0, 1]); here at T = 2 … 64 on a V = 50,
    8-bucket rollout with EOS, from a small mismatch to a large one."""
    for length in (2, 4, 8, 16, 32, 64):
        model = _model(vocab=50, buckets=8, length=length, eos=49, noise=noise)
        # a random reward, and one on the tokens p favours (the surrogate then predicts a real gain)
        for reward in (_reward(model, seed=length), (model.log_p > model.log_q).double() / length):
            got = surrogate_error(model, reward)
            for name, bound in got.bounds.items():
                assert abs(got.error) <= bound, (noise, length, name, got.error, bound)
        assert got.surrogate > 0
        assert got.bounds["classical_tv"] <= got.bounds["classical_kl"] * (1 + 1e-12)       # Pinsker: ε² ≤ δ/2


def test_the_bounds_scale_as_the_paper_says():
    """Classical O(T²), Pinsker-Marginal O(T^{3/2}), Mixed O(T) at a fixed sequence-level KL D_seq (the paper's
    reading: D_seq is its own budget; where it grows as T·δ, Mixed grows as T^{3/2} too)."""
    b = [trm_bounds(t, 1e-4, 7e-3, 0.01) for t in (1024, 4096)]
    ratio = {k: b[1][k] / b[0][k] for k in b[0]}
    assert ratio["classical_kl"] == pytest.approx((4096 * 4095) / (1024 * 1023), rel=1e-12)
    assert ratio["pinsker_marginal"] == pytest.approx(8, rel=1e-12)
    assert ratio["mixed"] == pytest.approx(4, rel=1e-12)
    wide = [trm_bounds(t, 0.5, 0.5, 0.01)["coupling"] for t in (1024, 4096)]   # (t−1)ε ≥ 1 from t = 3: linear
    assert wide[1] / wide[0] == pytest.approx(4, rel=1e-2)
    assert trm_bounds(4096, 1e-4, 0.0, 0.0)["classical_kl"] == pytest.approx(1677.3, abs=0.1)   # the paper's "≈ 1677"


def test_a_reward_outside_zero_one_is_refused():
    model = _model()
    with pytest.raises(ValueError, match=r"bounds need \[0, 1\]"):
        surrogate_error(model, _reward(model) * model.length)
    with pytest.raises(ValueError, match="shape"):
        surrogate_error(model, torch.zeros(3, 3, dtype=torch.float64))


# docs/gates.md's table: (noise, T) → (predicted gain, exact error, tightest bound's name and value), as printed
DOCUMENTED = {(0.05, 4): (0.0174, 3.7e-6, "classical_tv", 0.011), (0.05, 16): (0.0173, 8.7e-6, "pinsker_marginal", 0.116),
              (0.05, 64): (0.0154, 1.7e-5, "pinsker_marginal", 0.93), (0.3, 4): (0.105, 9.7e-5, "coupling", 0.41),
              (0.3, 16): (0.104, 2.2e-4, "pinsker_marginal", 4.1), (0.3, 64): (0.094, 7.6e-4, "coupling", 31)}


@pytest.mark.parametrize("noise, length", list(DOCUMENTED))
def test_the_documented_table(noise, length):
    """The papers_2026 rollout's tables (V = 200, 8 buckets, EOS) with the reward 1/T on the tokens p favours."""
    model = _model(vocab=200, buckets=8, length=length, eos=199, noise=noise)
    got = surrogate_error(model, (model.log_p > model.log_q).double() / length)
    gain, error, name, bound = DOCUMENTED[noise, length]
    # within half a unit of the last digit printed (3 significant digits for the gain, 2 for the rest)
    assert got.surrogate == pytest.approx(gain, rel=0.5 / 100) and got.error == pytest.approx(error, rel=0.5 / 10)
    assert got.tightest[0] == name and got.tightest[1] == pytest.approx(bound, rel=0.5 / 10)
