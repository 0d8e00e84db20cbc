"""kl_bench.estimate's keyword form (policy first, as trainers write it), logits with ids, `full`, and the
trainers' masked aggregations."""
import pytest
import torch

import kl_bench
from kl_bench.audit import aggregate


def _tensors(seed=0, B=3, T=5, V=17):
    g = torch.Generator().manual_seed(seed)
    zq = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    zp = zq + 0.7 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    ids = torch.randint(V, (B, T), generator=g)
    mask = torch.arange(T) < torch.tensor([[5], [2], [4]])
    return zq, zp, ids, mask


def test_keywords_name_the_sides_and_a_swap_flips_k1():
    zq, zp, ids, mask = _tensors()
    logq = torch.log_softmax(zq, -1).gather(-1, ids[..., None]).squeeze(-1)
    logp = torch.log_softmax(zp, -1).gather(-1, ids[..., None]).squeeze(-1)
    kw = kl_bench.estimate(policy=logq, reference=logp, estimator="k1")
    assert torch.equal(kw, logq - logp)                                   # k1 = −log r = log q − log p
    assert torch.equal(kl_bench.estimate(policy=logp, reference=logq, estimator="k1"), -kw)
    via_logits = kl_bench.estimate(policy_logits=zq, reference_logits=zp, ids=ids, estimator="k3")
    assert torch.equal(via_logits, kl_bench.estimate(policy=logq, reference=logp, estimator="k3"))


@pytest.mark.parametrize("args", [(1,), (2, 3), (4, 5, "k1")])
def test_a_positional_call_is_refused_never_read_in_one_order(args):
    """Issue 31: estimate(policy_logprobs, reference_logprobs) used to mean (reference, policy) and flip the
    KL silently; positional tensors are now refused, naming the keywords, whatever their number."""
    zq, zp, ids, mask = _tensors()
    tensors = {1: zq[..., 0], 2: zq[..., 0], 3: zp[..., 0], 4: zq[..., 0], 5: zp[..., 0]}
    with pytest.raises(TypeError, match=r"keyword arguments only.*policy=\.\.\., reference=") as e:
        kl_bench.estimate(*[tensors.get(a, a) for a in args])
    assert "\n" not in str(e.value)


def test_full_from_logits_is_the_exact_kl():
    zq, zp, ids, mask = _tensors(1)
    full = kl_bench.estimate(policy_logits=zq.float(), reference_logits=zp.float(), estimator="full")
    lq, lp = torch.log_softmax(zq.float().double(), -1), torch.log_softmax(zp.float().double(), -1)
    want = (lq.exp() * (lq - lp)).sum(-1)
    assert full.dtype == torch.float64 and torch.allclose(full, want, rtol=1e-12, atol=1e-15)
    tm = kl_bench.estimate(policy_logits=zq, reference_logits=zp, estimator="full", mask=mask, aggregation="token-mean")
    full64 = kl_bench.estimate(policy_logits=zq, reference_logits=zp, estimator="full")
    assert tm.item() == pytest.approx(float(full64[mask].mean()), rel=1e-12)


@pytest.mark.parametrize("bad, match", [
    (dict(policy=torch.zeros(2)), "one pair, both sides"),
    (dict(policy=torch.zeros(2), reference=torch.zeros(2), policy_logits=torch.zeros(2, 3)), "one pair"),
    (dict(policy=torch.zeros(2), reference=torch.zeros(2), estimator="full"), "full next-token"),
    (dict(policy_logits=torch.zeros(2, 3), reference_logits=torch.zeros(2, 3)), "need ids"),
    (dict(policy_logits=torch.zeros(2, 3), reference_logits=torch.zeros(2, 3), ids=torch.zeros(3)), "ids must"),
    (dict(policy=torch.zeros(2, 2), reference=torch.zeros(2, 2), aggregation="token-mean"), "needs the mask"),
    (dict(policy=torch.zeros(2, 2), reference=torch.zeros(2, 2), mask=torch.ones(2, 2), aggregation="mean"),
     "unknown aggregation"),
])
def test_estimate_refuses_ambiguous_input_in_one_line(bad, match):
    with pytest.raises(kl_bench.SpecError, match=match):
        kl_bench.estimate(**bad)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregations_through_estimate(agg):
    zq, zp, ids, mask = _tensors(2)
    v = kl_bench.estimate(policy_logits=zq.float(), reference_logits=zp.float(), ids=ids, estimator="trl.grpo",
                          mask=mask)
    got = kl_bench.estimate(policy_logits=zq.float(), reference_logits=zp.float(), ids=ids, estimator="trl.grpo",
                            mask=mask, aggregation=agg)
    assert got.dtype == torch.float32 and torch.equal(got, aggregate(v, mask, agg))
    per_seq = [v[b, mask[b]] for b in range(3)]
    want = {"token-mean": torch.cat(per_seq).sum() / mask.sum(),
            "seq-mean-token-mean": sum(s.mean() for s in per_seq) / 3,
            "seq-mean-token-sum": sum(s.sum() for s in per_seq) / 3}[agg]
    assert got.item() == pytest.approx(want.item(), rel=1e-6)


@pytest.mark.parametrize("version", ["1.13.2", "2.0.0"])
def test_a_trl_outside_the_tested_range_is_one_warning_line(version):
    from kl_bench.integrations.trl_contract import check_trl_version
    said = []
    assert check_trl_version(version, warn=said.append) == version
    assert len(said) == 1 and "outside the tested range (trl >= 1.14, < 1.17" in said[0] and "\n" not in said[0]
    said.clear()
    assert check_trl_version("1.15.2", warn=said.append) == "1.15.2" and not said


def test_an_unreadable_trl_version_is_one_line():
    from kl_bench.integrations.trl_contract import check_trl_version
    with pytest.raises(kl_bench.SpecError, match="cannot read the TRL version 'x'") as e:
        check_trl_version("x")
    assert "\n" not in str(e.value)
