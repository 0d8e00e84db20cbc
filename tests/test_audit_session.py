"""The trainer-agnostic audit core (kl_bench.audit.session) on plain tensors: records in, step audits out,
equal to the dense audit of the same rows; micro-batches and ranks pool exactly; the sampling pass is its
own bias source; warnings name the part that explains a gap."""
import math

import pytest
import torch

import kl_bench
from kl_bench.audit import Head, Sampler, audit_step, position_values, sampler_logprobs
from kl_bench.audit.session import AuditSession, Metric, Record
from kl_bench.audit.step import StepAudit
from kl_bench.audit.verdict import Thresholds, step_warnings
from kl_bench.foundation.errors import SpecError


def _batch(seed, sp=Sampler(), B=4, T=5, V=60, d=8, draw_shift=0.0, drop=False):
    """A batch as a trainer holds it: hidden states [B, T, d] of a policy and a reference, output layers,
    tokens drawn from the sampler on the drawing pass's logits (the policy's hidden states moved by
    ``draw_shift``), a mask with ragged lengths, and the trainer's float32 per-token k3 (trl.grpo)."""
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(V, d, generator=g)
    wr = wq + 0.15 * torch.randn(V, d, generator=g)
    hq = torch.randn(B, T, d, generator=g)
    hr = hq + 0.15 * torch.randn(B, T, d, generator=g)
    hs = hq + draw_shift * torch.randn(B, T, d, generator=g)
    drawn = sampler_logprobs((hs.double() @ wq.double().T).reshape(B * T, V), sp)
    ids = torch.multinomial(torch.exp(drawn), 1, generator=g).view(B, T)
    mask = torch.arange(T) < torch.randint(1, T + 1, (B, 1), generator=g)
    lq = torch.log_softmax(hq @ wq.T, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    lr = torch.log_softmax(hr @ wr.T, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    values = kl_bench.ESTIMATORS["trl.grpo"].fn(lr - lq)
    rec = Record(hq, hr, ids, mask, values, sampling_hidden=None if drop else hs)
    return rec, (Head(wq), Head(wr))


METRICS = [Metric("kl", "trl.grpo", "token-mean"), Metric("reward", "trl.grpo", "seq-mean-token-sum")]


def _dense_audit(rec: Record, heads, sp, metric):
    m = rec.mask
    zq, zr = rec.policy_hidden[m].double() @ heads[0].weight.double().T, rec.reference_hidden[m].double() @ heads[1].weight.double().T
    zs = None if rec.sampling_hidden is None else rec.sampling_hidden[m].double() @ heads[0].weight.double().T
    pv = position_values(zq, zr, (metric.estimator,), sp, ids=rec.completion_ids[m], sampling=zs)
    return audit_step(pv, rec.values_for(metric.source), m, estimator=metric.estimator, aggregation=metric.aggregation)


@pytest.mark.parametrize("sp", [Sampler(), Sampler(top_k=7), Sampler(temperature=0.8, top_p=0.9)],
                         ids=lambda s: s.describe())
def test_a_session_equals_the_dense_audit_of_its_rows(sp):
    rec, heads = _batch(1, sp, draw_shift=0.2)
    session = AuditSession(heads, METRICS, sp, dtype=torch.float64)
    session.add(rec)
    audits = session.finish(step=3)
    assert [a.source for a in audits] == ["kl", "reward"] and all(a.step == 3 for a in audits)
    for a, metric in zip(audits, METRICS):
        ref = _dense_audit(rec, heads, sp, metric)
        for name in ("logged", "exact", "expected_q", "expected_b", "expected_g", "se", "bias_mismatch",
                     "consistency_sum", "consistency_var", "p_negative", "miss"):
            assert getattr(a, name) == pytest.approx(getattr(ref, name), rel=1e-10, abs=1e-12), name
        assert a.sampling_pass == a.tokens == int(rec.mask.sum())
    assert not session.pending and len(session.log.rows) == 2


def test_micro_batches_and_ranks_pool_as_one_batch():
    (a, heads), (b, _) = _batch(2), _batch(2)
    b = Record(*(getattr(_batch(3)[0], f) for f in ("policy_hidden", "reference_hidden", "completion_ids", "mask",
                                                      "trainer_values")))
    rows = Record(torch.cat([a.policy_hidden, b.policy_hidden]), torch.cat([a.reference_hidden, b.reference_hidden]),
                  torch.cat([a.completion_ids, b.completion_ids]), torch.cat([a.mask, b.mask]),
                  torch.cat([a.trainer_values, b.trainer_values]))
    a = Record(a.policy_hidden, a.reference_hidden, a.completion_ids, a.mask, a.trainer_values)
    micro = AuditSession(heads, METRICS, dtype=torch.float64)
    micro.add(a)
    micro.add(b)
    one = AuditSession(heads, METRICS, dtype=torch.float64)
    one.add(rows)
    # two "ranks": each audits its own rows; the reduce hook sums their vectors (an all-reduce)
    ranks = [AuditSession(heads, METRICS, dtype=torch.float64) for _ in range(2)]
    ranks[0].add(a)
    ranks[1].add(b)
    # what rank 1 hands its all-reduce, added to rank 0's (the hook is the only way in)
    handed = []
    ranks[1].finish(0, reduce=lambda x: handed.append(x) or x)
    for x, y, z in zip(micro.finish(0), one.finish(0), ranks[0].finish(0, reduce=lambda x: x + handed.pop(0))):
        for name in ("logged", "exact", "se", "consistency_z", "expected_b"):
            assert getattr(x, name) == pytest.approx(getattr(y, name), rel=1e-12, abs=1e-14), name
            assert getattr(z, name) == pytest.approx(getattr(y, name), rel=1e-12, abs=1e-14), name
    assert not handed


def _cat(x: Record, y: Record) -> Record:
    """Two records' rows as one record (the union a process group's all-reduce stands for)."""
    return Record(*(torch.cat([getattr(x, f), getattr(y, f)]) for f in ("policy_hidden", "reference_hidden",
                                                                         "completion_ids", "mask", "trainer_values")))


def test_a_mean_over_micro_batches_is_the_mean_of_their_audits_and_ranks_reduce_each_micro_batch():
    # TRL logs GRPO's kl as the mean of its micro-batches' token means: micro_batches = "mean" makes every
    # weighted column the mean of the micro-batches' own audits and se² the sum of their se² over J².
    whole, heads = _batch(2, B=13)
    rows = torch.arange(13).split([3, 4, 2, 4])
    parts = [Record(*(getattr(whole, f)[r] for f in ("policy_hidden", "reference_hidden", "completion_ids", "mask",
                                                      "trainer_values"))) for r in rows]
    metrics = [Metric("kl", "trl.grpo", "token-mean", "mean"), Metric("loss", "trl.grpo", "seq-mean-token-mean", "mean")]
    mean = AuditSession(heads, metrics, dtype=torch.float64)
    for p in parts[:2]:
        mean.add(p)
    alone = []
    for p in parts[:2]:
        s = AuditSession(heads, metrics, dtype=torch.float64)
        s.add(p)
        alone.append(s.finish(0))
    tokens = [int(p.mask.sum()) for p in parts[:2]]
    assert tokens[0] != tokens[1]                       # unequal lengths: the mean is not the pooled mean
    for i, got in enumerate(mean.finish(0)):
        a, b = alone[0][i], alone[1][i]
        for name in ("logged", "recomputed", "exact", "expected_q", "expected_b", "expected_g", "bias",
                     "bias_sampler", "bias_precision", "noise"):
            assert getattr(got, name) == pytest.approx((getattr(a, name) + getattr(b, name)) / 2, rel=1e-12,
                                                       abs=1e-15), name
        assert got.se == pytest.approx(math.hypot(a.se, b.se) / 2, rel=1e-12)
        assert (got.tokens, got.sequences) == (a.tokens + b.tokens, a.sequences + b.sequences)
        assert got.consistency_sum == pytest.approx(a.consistency_sum + b.consistency_sum, rel=1e-12)
    pooled = AuditSession(heads, [Metric("kl", "trl.grpo", "token-mean")], dtype=torch.float64)
    for p in parts[:2]:
        pooled.add(p)
    (p,) = pooled.finish(0)
    # the two differ by far more than float64 rounding: the test tells them apart
    assert abs(p.logged - (alone[0][0].logged + alone[1][0].logged) / 2) > 1e-6 * abs(p.logged)
    # Two ranks, two micro-batches each, rank 1 handing its rows to the all-reduce: micro-batch j is the
    # union of both ranks' j-th records (TRL reduces each micro-batch across processes), then the mean.
    ranks = [AuditSession(heads, metrics, dtype=torch.float64) for _ in range(2)]
    for j in range(2):
        ranks[0].add(parts[j])
        ranks[1].add(parts[2 + j])
    handed = []
    ranks[1].finish(0, reduce=lambda x: handed.append(x) or x)
    got = ranks[0].finish(0, reduce=lambda x: x + handed.pop(0))
    union = AuditSession(heads, metrics, dtype=torch.float64)
    union.add(_cat(parts[0], parts[2]))
    union.add(_cat(parts[1], parts[3]))
    for x, y in zip(got, union.finish(0)):
        for name in ("logged", "exact", "se", "consistency_z", "expected_b"):
            assert getattr(x, name) == pytest.approx(getattr(y, name), rel=1e-12, abs=1e-14), name


def test_a_rank_with_fewer_micro_batches_pads_with_rows_that_are_not_micro_batches():
    from kl_bench.audit.step import SUMS, combine_micro_batches
    heads = _batch(2)[1]
    rec = _batch(2)[0]
    s = AuditSession(heads, [Metric("kl", "trl.grpo", "token-mean", "mean")], dtype=torch.float64)
    s.add(rec)
    one = s.finish(0, reduce=lambda x: torch.cat([x, torch.zeros(len(SUMS), dtype=x.dtype)]))[0]
    s.add(rec)
    assert one == s.finish(0)[0]
    assert combine_micro_batches(torch.zeros(2, len(SUMS), dtype=torch.float64)).abs().sum() == 0


def test_bad_records_are_one_line():
    rec, heads = _batch(4)
    with pytest.raises(SpecError, match="key 'mask'"):
        Record(rec.policy_hidden, rec.reference_hidden, rec.completion_ids, rec.mask[:, :2], rec.trainer_values)
    with pytest.raises(SpecError, match="key 'policy_hidden'"):
        Record(rec.policy_hidden[:, :2], rec.reference_hidden, rec.completion_ids, rec.mask, rec.trainer_values)
    with pytest.raises(SpecError, match="aggregation"):
        Metric("kl", "k3", "token_mean")
    with pytest.raises(SpecError, match="at least one metric"):
        AuditSession(heads, [])


def _row(z, cz=0.0, step=0, **kw):
    base = dict(step=step, source="kl", estimator="k3", aggregation="token-mean", sequences=4, tokens=20, logged=0.1 + z * 0.01,
                recomputed=0.1, exact=0.1, expected_q=0.1, expected_b=0.1, se=0.01, bias=z * 0.01, z=z,
                bias_estimator=0.0, bias_sampler=0.0, bias_precision=0.0, noise=z * 0.01, frac_negative=0.0,
                p_negative=0.0, miss=0.0, consistency_z=cz, impossible=0, consistency_sum=cz, consistency_var=1.0,
                expected_g=0.1, bias_mismatch=0.0, sampling_pass=0)
    base.update(kw)
    return StepAudit(**base)


def test_warnings_flag_a_pooled_z_over_4_and_a_persistent_consistency_failure():
    t = Thresholds()
    # every step |z| < 5, pooled z = 3.4·√3 ≈ 5.9 > 4
    rows = [_row(3.4, step=s) for s in range(3)]
    keys = {w.key for w in step_warnings(rows[-1], rows, "b = q", t)}
    assert "z_pooled" in keys and "z" not in keys
    # consistency 2.3–4.0 at every step (left padding in a live run): silent per step, flagged as persistent
    rows = [_row(0.0, cz=c, step=s) for s, c in enumerate((-2.3, -4.0, -2.6))]
    keys = {w.key for w in step_warnings(rows[-1], rows, "b = q", t)}
    assert "consistency" not in keys and {"consistency_persistent", "consistency_pooled"} <= keys
    # one step over 2 is chance: nothing
    rows = [_row(0.0, cz=c, step=s) for s, c in enumerate((0.3, -2.5, 0.9))]
    assert not step_warnings(rows[-1], rows, "b = q", t)


def test_a_large_z_warning_names_the_part_that_explains_it():
    a = _row(9.0, bias_mismatch=0.08, noise=0.01, sampling_pass=20)
    (w,) = [w for w in step_warnings(a, [a], "b = q") if w.key == "z"]
    assert "bias_mismatch" in w.message and "pass that drew the tokens" in w.message
    a = _row(9.0, bias_precision=0.085)
    (w,) = [w for w in step_warnings(a, [a], "b = q") if w.key == "z"]
    assert "bias_precision" in w.message and "not captured" in w.message


def test_the_session_calibrates_with_a_captured_sampling_pass():
    # 80 steps, tokens drawn by a pass unlike the scored one: with it captured, z of the noise is N(0, 1)
    S, zs = 80, []
    for s in range(S):
        rec, heads = _batch(100 + s, draw_shift=0.5, B=8, T=8)
        session = AuditSession(heads, METRICS[:1], dtype=torch.float64)
        session.add(rec)
        (a,) = session.finish(s)
        zs.append(a.noise / a.se)
        assert a.bias == pytest.approx(a.bias_estimator + a.bias_sampler + a.bias_mismatch + a.noise + a.bias_precision,
                                       abs=1e-12)
    z = torch.tensor(zs)
    assert abs(z.mean().item()) * math.sqrt(S) < 5 and abs(z.square().mean().item() - 1) < 5 * math.sqrt(2 / S)


def test_an_id_outside_the_vocabulary_or_a_hidden_size_off_the_head_is_one_line():
    """What `kl-bench audit DIR` refuses in a saved step, the API refuses too (it made NaN values, then a bare
    StopIteration at finish); positions outside the mask may hold anything (padding such as −100)."""
    rec, heads = _batch(4)[:2]
    V = heads[0].vocab
    metrics = [Metric("kl", "k3", "token-mean")]
    ids = rec.completion_ids.clone()
    ids[~rec.mask.bool()] = -100
    ok = Record(rec.policy_hidden, rec.reference_hidden, ids, rec.mask, rec.trainer_values)
    AuditSession(heads, metrics).add(ok)
    bad = ids.clone()
    bad[rec.mask.bool().nonzero()[0].tolist()] = V + 7
    with pytest.raises(SpecError, match=rf"completion_ids.*outside the vocabulary \[0, {V}\).*max {V + 7}"):
        AuditSession(heads, metrics).add(Record(rec.policy_hidden, rec.reference_hidden, bad, rec.mask,
                                                rec.trainer_values))
    short = rec.policy_hidden[..., :-1]
    with pytest.raises(SpecError, match=r"policy_hidden.*do not fit the output layer"):
        AuditSession(heads, metrics).add(Record(short, rec.reference_hidden, ids, rec.mask, rec.trainer_values))
