"""Top-k forward KL (kl_bench.core.topk): per-context values written out by hand, the clamp at 0 firing,
and the rollout path sum against brute-force enumeration of every sequence."""
import math

import pytest
import torch

from kl_bench.sampling.logits import zipf_logits
from kl_bench.kinds import RolloutPair
from kl_bench.kinds.rollout import brute_force_sequences
from kl_bench.core.topk import TRL_TAIL, VERL, categorical_topk, full_forward_kl, rollout_topk, topk_forward_kl


def _by_hand(lq, lp, k, by="p", renormalize=False):
    order = sorted(range(len(lq)), key=lambda i: -(lp if by == "p" else lq)[i])[:k]
    p, q = [math.exp(lp[i]) for i in order], [math.exp(lq[i]) for i in order]
    if renormalize:
        p, q = [v / sum(p) for v in p], [v / sum(q) for v in q]
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_topk_values_by_hand_and_the_clamp():
    lq = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, -1.0, -2.0]], dtype=torch.float64), -1)
    lp = torch.log_softmax(torch.tensor([[1.0, 2.2, 0.4, -0.5, -3.0]], dtype=torch.float64), -1)
    for k in range(1, 6):
        for by in ("p", "q"):
            for ren in (False, True):
                want = _by_hand(lq[0].tolist(), lp[0].tolist(), k, by, ren)
                got = float(topk_forward_kl(lq, lp, k, by=by, renormalize=ren, clamp_min=None)[0])
                assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert float(topk_forward_kl(lq, lp, 5, clamp_min=None)[0]) == pytest.approx(float(full_forward_kl(lq, lp)[0]), rel=1e-12)
    # on q's top token q > p, so the truncated sum p log(p/q) is negative there: the clamp at 0 fires
    raw = float(topk_forward_kl(lq, lp, 1, by="q", clamp_min=None)[0])
    assert raw < 0 and float(topk_forward_kl(lq, lp, 1, by="q")[0]) == 0.0
    out = categorical_topk(lq, lp, 2, clamp_min=None)
    assert out["bias"] == pytest.approx(out["topk"] - out["full"], rel=1e-12)


def test_rollout_topk_path_sum_against_enumeration():
    lq = torch.log_softmax(zipf_logits(6, 1.1, 1, 2), -1)
    g = torch.Generator().manual_seed(5)
    lp = torch.log_softmax(lq + 0.7 * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    bucket = torch.arange(6) % 2
    pair = RolloutPair("r", lq, lp, bucket, 3, 5)
    top = topk_forward_kl(lq, lp, 2, clamp_min=None)
    full = full_forward_kl(lq, lp)
    want_top = sum(prob * sum(float(top[c]) for c, _ in path) for prob, path in brute_force_sequences(pair.model))
    want_full = sum(prob * sum(float(full[c]) for c, _ in path) for prob, path in brute_force_sequences(pair.model))
    got = rollout_topk(lq, lp, bucket, 3, 5, 2, clamp_min=None)
    assert got["topk"] == pytest.approx(want_top, rel=1e-12) and got["full"] == pytest.approx(want_full, rel=1e-12)


def _verl_written_out(lq, lp, k):
    """verl 1dda039: fsdp/losses.py compute_forward_kl_topk + kl_divergence, losses.py clamp_min(0.0) and
    the loss clamp, with the defaults log_prob_min_clamp = −10, loss_max_clamp = 10."""
    teacher_topk_log_probs, teacher_topk_ids = torch.topk(lp, k, dim=-1)
    student_topk_log_probs = torch.gather(lq, dim=-1, index=teacher_topk_ids)
    student_topk_log_probs = student_topk_log_probs.clamp_min(-10.0)
    teacher_topk_log_probs = teacher_topk_log_probs.clamp_min(-10.0)
    log_p, log_q = teacher_topk_log_probs.float(), student_topk_log_probs.float()
    kld = (log_p.exp() * (log_p - log_q)).sum(dim=-1)
    return kld.clamp_min(0.0).clamp(min=-10.0, max=10.0)


def _trl_tail_written_out(lq, lp, k):
    """TRL 1.16.0 experimental/sdpo/loss_utils.py add_tail_bucket on both sides, then Σ p (log p − log q)."""
    def add_tail_bucket(log_probs):
        log_s = torch.logsumexp(log_probs, dim=-1, keepdim=True)
        log_s = torch.clamp(log_s, max=-1e-7)
        tail_log = torch.log(-torch.expm1(log_s))
        return torch.cat([log_probs, tail_log], dim=-1)
    ids = torch.topk(lp, k, dim=-1).indices
    t, s = add_tail_bucket(lp.gather(-1, ids)), add_tail_bucket(lq.gather(-1, ids))
    return (t.exp() * (t - s)).sum(-1)


def test_library_defaults_value_for_value():
    g = torch.Generator().manual_seed(1)
    lq = torch.log_softmax(3 * torch.randn(64, 200, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(lq + 1.5 * torch.randn(64, 200, generator=g, dtype=torch.float64), -1)
    assert float(lp.min()) < -10                          # the −10 floor fires
    for k in (1, 5, 50, 200):
        verl = topk_forward_kl(lq, lp, k, **VERL)
        assert torch.equal(verl, _verl_written_out(lq, lp, k).double())
        tail = topk_forward_kl(lq, lp, k, **TRL_TAIL)
        assert torch.allclose(tail, _trl_tail_written_out(lq, lp, k), rtol=1e-12, atol=1e-15)
        # coarsening to S ∪ {rest} never increases a divergence: 0 ≤ tail ≤ KL(p‖q)
        assert bool((tail >= -1e-15).all()) and bool((tail <= full_forward_kl(lq, lp) + 1e-12).all())


def test_verl_clamps_fire():
    lq = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, -1.0, -2.0]], dtype=torch.float64), -1)
    lp = torch.log_softmax(torch.tensor([[1.0, 2.2, 0.4, -0.5, -3.0]], dtype=torch.float64), -1)
    assert float(topk_forward_kl(lq, lp, 1, by="q", clamp_min=None)[0]) < 0     # negative truncated sum …
    assert float(topk_forward_kl(lq, lp, 1, **{**VERL, "by": "q"})[0]) == 0.0   # … clamped at 0 by verl
    big = torch.log_softmax(torch.tensor([[0.0, -40.0]], dtype=torch.float64), -1)
    top = torch.log_softmax(torch.tensor([[-40.0, 0.0]], dtype=torch.float64), -1)
    assert float(topk_forward_kl(big, top, 1, clamp_min=None)[0]) == pytest.approx(40.0, rel=1e-12)
    assert float(topk_forward_kl(big, top, 1, **VERL)[0]) == 10.0               # −10 floor: p̃ log(p̃/q̃) = 10
