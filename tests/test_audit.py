"""kl_bench.audit: exact per-position values against enumeration, the sampler against transformers' own
logits processors, streaming against dense, and the step audit's z calibrated by Monte Carlo."""
import json
import math

import pytest
import torch

import kl_bench
from kl_bench.audit import (AUDIT_COLUMNS, AuditLog, Head, Sampler, StepAudit, aggregate, aggregation_weights,
                            audit_step, position_values, sampler_logprobs, stream_values)
from kl_bench.audit.step import SUMS, step_sums
from kl_bench.foundation.errors import SpecError

EST = ("k1", "k2", "k3", "trl.grpo", "openrlhf.k3", "fwd_k3")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- an independent sampler, by enumeration
def _b_enumerated(z, sp: Sampler, banned: bool, context: list[int]) -> list[float]:
    """b over one row of logits, written from transformers' rules with Python lists and sorting."""
    z = [float(v) for v in z]
    V = len(z)
    for i in set(context):
        if i >= 0 and sp.repetition_penalty != 1.0:
            z[i] = z[i] * sp.repetition_penalty if z[i] < 0 else z[i] / sp.repetition_penalty
    if banned:
        for e in sp.eos_token_id:
            z[e] = -math.inf
    s = [v / sp.temperature for v in z]
    keep = [v > -math.inf for v in s]
    if sp.top_k:
        kth = sorted(s, reverse=True)[sp.top_k - 1]
        keep = [k and v >= kth for k, v in zip(keep, s)]

    def probs():
        m = max(v for v, k in zip(s, keep) if k)
        w = [math.exp(v - m) if k else 0.0 for v, k in zip(s, keep)]
        t = sum(w)
        return [x / t for x in w]
    if sp.top_p is not None and sp.top_p < 1:
        p = probs()
        order = sorted(range(V), key=lambda i: -p[i])
        mass, new = 0.0, [False] * V
        for i in order:
            if keep[i] and mass < sp.top_p:
                new[i] = True
            mass += p[i]
        keep = new
    if sp.min_p:
        p = probs()
        top = max(p)
        keep = [k and q >= sp.min_p * top for k, q in zip(keep, p)]
    return probs()


SAMPLERS = [Sampler(), Sampler(temperature=0.7), Sampler(top_k=5), Sampler(top_p=0.8), Sampler(min_p=0.1),
            Sampler(temperature=1.3, top_k=9, top_p=0.7, min_p=0.05),
            Sampler(repetition_penalty=1.4, min_new_tokens=2, eos_token_id=(3,), top_p=0.9)]


@pytest.mark.parametrize("sp", SAMPLERS, ids=lambda s: s.describe())
def test_exact_values_against_enumeration(sp):
    g = _gen(1)
    N, V = 4, 13
    zp = 2.0 * torch.randn(N, V, generator=g)             # float32 in, float64 out
    zr = zp + torch.randn(N, V, generator=g)
    ids = torch.randint(V, (N,), generator=g)
    banned = torch.tensor([True, False, True, False])
    ctx = torch.tensor([[1, 2, -1], [0, 0, 5], [7, -1, -1], [12, 3, 4]])
    pv = position_values(zp, zr, EST, sp, ids=ids, eos_banned=banned, context_ids=ctx)
    for i in range(N):
        lp = torch.log_softmax(zp[i].double(), -1).tolist()
        lr = torch.log_softmax(zr[i].double(), -1).tolist()
        pi = [math.exp(v) for v in lp]
        b = _b_enumerated(zp[i], sp, bool(banned[i]), ctx[i].tolist())
        kl = sum(p * (a - c) for p, a, c in zip(pi, lp, lr))
        assert pv.kl[i].item() == pytest.approx(kl, rel=1e-12, abs=1e-13)
        assert pv.miss[i].item() == pytest.approx(sum(p for p, q in zip(pi, b) if q == 0), abs=1e-13)
        for j, name in enumerate(EST):
            f = kl_bench.ESTIMATORS[name].fn(torch.tensor([c - a for a, c in zip(lp, lr)], dtype=torch.float64)).tolist()
            for w, mean, var in ((pi, pv.mean_q, pv.var_q), (b, pv.mean_b, pv.var_b)):
                m = sum(x * y for x, y in zip(w, f))
                assert mean[i, j].item() == pytest.approx(m, rel=1e-11, abs=1e-13)
                assert var[i, j].item() == pytest.approx(sum(x * (y - m) ** 2 for x, y in zip(w, f)), rel=1e-10, abs=1e-13)
            assert pv.neg_b[i, j].item() == pytest.approx(sum(x for x, y in zip(b, f) if y < 0), abs=1e-13)
        logb = [math.log(q) if q > 0 else -math.inf for q in b]
        assert pv.tok_logb[i].item() == pytest.approx(logb[ids[i]], abs=1e-12)
        assert pv.tok_logq[i].item() == pytest.approx(lp[ids[i]], abs=1e-13)
        e = sum(q * lq for q, lq in zip(b, logb) if q > 0)
        assert pv.logb_mean[i].item() == pytest.approx(e, abs=1e-12)
        assert pv.logb_var[i].item() == pytest.approx(sum(q * (lq - e) ** 2 for q, lq in zip(b, logb) if q > 0), abs=1e-11)


def test_kl_of_a_model_with_itself_is_zero_and_permutation_changes_nothing():
    g = _gen(2)
    z = torch.randn(5, 40, generator=g, dtype=torch.float64)
    assert position_values(z, z, ("k3",)).kl.abs().max().item() < 1e-15
    zr = z + torch.randn(5, 40, generator=g, dtype=torch.float64)
    perm = torch.randperm(40, generator=g)
    a = position_values(z, zr, EST, Sampler(top_p=0.8))
    b = position_values(z[:, perm], zr[:, perm], EST, Sampler(top_p=0.8))
    assert torch.allclose(a.mean_b, b.mean_b, rtol=1e-12, atol=1e-14) and torch.allclose(a.kl, b.kl, rtol=1e-12)


# ----------------------------------------------------------------------------- transformers' processors
def _transformers_chain(sp: Sampler, input_ids, scores, min_length):
    from transformers import (MinLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
    chain = []
    if sp.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(sp.repetition_penalty))
    if min_length:
        chain.append(MinLengthLogitsProcessor(min_length, list(sp.eos_token_id)))
    if sp.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(sp.temperature))
    if sp.top_k:
        chain.append(TopKLogitsWarper(sp.top_k))
    if sp.top_p is not None and sp.top_p < 1:
        chain.append(TopPLogitsWarper(sp.top_p))
    if sp.min_p:
        chain.append(MinPLogitsWarper(sp.min_p))
    for proc in chain:
        scores = proc(input_ids, scores)
    return torch.log_softmax(scores.double(), -1)


@pytest.mark.parametrize("sp", SAMPLERS + [Sampler(temperature=0.6, top_k=50, top_p=0.95, min_p=0.02,
                                                   repetition_penalty=1.2)], ids=lambda s: s.describe())
def test_sampler_equals_transformers_logits_processors(sp):
    pytest.importorskip("transformers")
    g = _gen(3)
    B, V, L = 16, 300, 6
    logits = 3.0 * torch.randn(B, V, generator=g)
    input_ids = torch.randint(V, (B, L), generator=g)
    # min_length counts the whole sequence in transformers: with L ids present and min_length L + 1 the EOS
    # ban is on for every row, which is our eos_banned = True.
    ban = sp.min_new_tokens > 0
    ref = _transformers_chain(sp, input_ids, logits.clone(), L + 1 if ban else 0)
    ours = sampler_logprobs(logits, sp, eos_banned=torch.full((B,), ban), context_ids=input_ids)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref)), "the support differs"
    fin = torch.isfinite(ref)
    # transformers works in float32: its log-probs carry float32 rounding (~1e-7 relative)
    assert (ours[fin] - ref[fin]).abs().max().item() < 1e-5


# ----------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("sp", SAMPLERS, ids=lambda s: s.describe())
@pytest.mark.parametrize("candidates", [1024, 8])
def test_streaming_equals_dense(sp, candidates):
    g = _gen(4)
    N, V, d = 23, 1001, 12                 # V = 7·128 + 105: not a multiple of the tile
    hp, hr = 0.4 * torch.randn(N, d, generator=g), 0.4 * torch.randn(N, d, generator=g)
    wp, wr = torch.randn(V, d, generator=g), torch.randn(V, d, generator=g)
    bias = torch.randn(V, generator=g)
    ids = torch.randint(V, (N,), generator=g)
    ban = torch.rand(N, generator=g) < 0.5
    ctx = torch.randint(-1, V, (N, 5), generator=g)
    zp = hp.double() @ wp.double().T + bias.double()
    zr = hr.double() @ wr.double().T
    dense = position_values(zp, zr, EST, sp, ids=ids, eos_banned=ban, context_ids=ctx)
    st = stream_values(hp, hr, Head(wp, bias), Head(wr), EST, sp, ids=ids, eos_banned=ban, context_ids=ctx,
                       chunk=7, tile=128, candidates=candidates, dtype=torch.float64)
    for name in ("kl", "mean_q", "var_q", "mean_b", "var_b", "neg_b", "miss", "logb_mean", "logb_var",
                 "tok_logq", "tok_logp", "tok_logb"):
        a, b = getattr(dense, name), getattr(st, name)
        assert torch.equal(torch.isinf(a), torch.isinf(b)), name
        fin = torch.isfinite(a)
        assert ((a[fin] - b[fin]).abs() / (1 + a[fin].abs())).max().item() < 1e-12, name


@pytest.mark.parametrize("sp", [Sampler(), Sampler(top_k=20, temperature=0.7)], ids=lambda s: s.describe())
def test_soft_capped_heads_stream_equal_dense(sp):
    # Gemma's final_logit_softcapping: z ← c·tanh(z/c) on h Wᵀ + bias, then the trainer's 1/T scale.
    g = _gen(13)
    N, V, d, cap, scale = 11, 517, 10, 3.0, 1 / 0.7
    hp, hr = torch.randn(N, d, generator=g), torch.randn(N, d, generator=g)
    wp, wr = torch.randn(V, d, generator=g), torch.randn(V, d, generator=g)      # |z| ~ 3: the cap bends them
    bias = torch.randn(V, generator=g)
    ids = torch.randint(V, (N,), generator=g)
    zp = cap * torch.tanh((hp.double() @ wp.double().T + bias.double()) / cap) * scale
    zr = cap * torch.tanh((hr.double() @ wr.double().T) / cap) * scale
    dense = position_values(zp, zr, EST, sp, ids=ids)
    heads = Head(wp, bias, scale, softcap=cap), Head(wr, None, scale, softcap=cap)
    st = stream_values(hp, hr, *heads, EST, sp, ids=ids, chunk=4, tile=100, dtype=torch.float64)
    kl = kl_bench.audit.stream_kl(hp, hr, *heads, chunk=4, tile=100, dtype=torch.float64)
    for name in ("kl", "mean_q", "var_q", "mean_b", "var_b", "tok_logq", "tok_logp"):
        a, b = getattr(dense, name), getattr(st, name)
        fin = torch.isfinite(a)
        assert ((a[fin] - b[fin]).abs() / (1 + a[fin].abs())).max().item() < 1e-12, name
    assert ((kl - dense.kl).abs() / (1 + dense.kl.abs())).max().item() < 1e-12
    uncapped = kl_bench.audit.stream_kl(hp, hr, Head(wp, bias, scale), Head(wr, None, scale), dtype=torch.float64)
    assert (uncapped - dense.kl).abs().max().item() > 0.01           # the cap matters at these logits
    with pytest.raises(SpecError, match="soft-cap must be a finite number > 0"):
        Head(wp, softcap=0.0)


def test_streaming_refuses_mismatched_heads():
    with pytest.raises(SpecError, match="vocabularies differ"):
        stream_values(torch.zeros(2, 3), torch.zeros(2, 3), Head(torch.zeros(5, 3)), Head(torch.zeros(6, 3)))


# ----------------------------------------------------------------------------- aggregations
def test_aggregations_are_the_trainers_formulas_bit_for_bit():
    g = _gen(5)
    v = torch.randn(6, 9, generator=g)
    m = (torch.rand(6, 9, generator=g) < 0.7).float()
    m[2] = 0
    assert torch.equal(aggregate(v, m, "token-mean"), (v * m).sum() / m.sum().clamp(min=1.0))
    assert torch.equal(aggregate(v, m, "seq-mean-token-mean"), ((v * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean())
    assert torch.equal(aggregate(v, m, "seq-mean-token-sum"), (v * m).sum(-1).mean())
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        w = aggregation_weights(m, agg)
        assert (w * v.double()).sum().item() == pytest.approx(aggregate(v.double(), m, agg).item(), rel=1e-14)
    with pytest.raises(SpecError, match="did you mean 'token-mean'"):
        aggregate(v, m, "token_mean")


# ----------------------------------------------------------------------------- step audit by Monte Carlo
def _steps(g, sp: Sampler, steps: int, *, trainer="trl.grpo", draw_temperature=1.0, ref_noise=0.5, B=4, T=6, V=30,
           draw_noise=0.0, captured=False):
    """Synthetic steps: per-position logits, tokens drawn from b (of logits / draw_temperature, moved by
    ``draw_noise`` as a dropout mask would), a trainer's float32 per-token values. ``captured``: the
    audit is given the drawing pass's logits. Every step's positions are audited in one call, then split."""
    n = steps * B * T
    zp = 1.5 * torch.randn(n, V, generator=g, dtype=torch.float64)
    zr = zp + ref_noise * torch.randn(n, V, generator=g, dtype=torch.float64)
    draw = zp / draw_temperature + draw_noise * torch.randn(n, V, generator=g, dtype=torch.float64)
    ids = torch.multinomial(torch.exp(sampler_logprobs(draw, sp)), 1, generator=g).squeeze(-1)
    lengths = torch.randint(1, T + 1, (steps, B), generator=g)
    mask = torch.arange(T) < lengths.unsqueeze(-1)                                  # [S, B, T]
    lp = torch.log_softmax(zp, -1).gather(-1, ids[:, None]).squeeze(-1).float()   # a trainer's float32 log-probs
    lr = torch.log_softmax(zr, -1).gather(-1, ids[:, None]).squeeze(-1).float()
    values = kl_bench.ESTIMATORS[trainer].fn(lr - lp).view(steps, B, T)
    flat = mask.flatten()
    pv = position_values(zp[flat], zr[flat], (trainer,), sp, ids=ids[flat], sampling=draw[flat] if captured else None)
    ends = torch.cumsum(mask.flatten(1).sum(-1), 0).tolist()
    starts = [0] + ends[:-1]
    return [(pv.select(slice(a, b)), values[s], mask[s]) for s, (a, b) in enumerate(zip(starts, ends))]


def _step(g, sp: Sampler, **kw):
    return _steps(g, sp, 1, **kw)[0]


def _audit(log, steps, estimator="trl.grpo", source="loss", aggregation="token-mean"):
    for s, (pv, values, mask) in enumerate(steps):
        log.add(audit_step(pv, values, mask, estimator=estimator, aggregation=aggregation, step=s, source=source))
    return log.pooled()[source]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_step_z_is_standard_normal_in_a_clean_run(agg):
    g, log, S = _gen(6), AuditLog(), 300
    pooled = _audit(log, _steps(g, Sampler(), S), aggregation=agg)
    z = torch.tensor([r.z for r in log.rows])
    cz = torch.tensor([r.consistency_z for r in log.rows])
    # mean z: SE 1/√S; mean z²: E = 1, SD √2/√S (normal z); pooled z ~ N(0,1).
    assert abs(z.mean().item()) * math.sqrt(S) < 5 and abs(cz.mean().item()) * math.sqrt(S) < 5
    assert abs(z.square().mean().item() - 1) < 5 * math.sqrt(2 / S)
    assert abs(cz.square().mean().item() - 1) < 5 * math.sqrt(2 / S)
    assert abs(pooled["z"]) < 5 and abs(pooled["consistency_z"]) < 5 and pooled["impossible"] == 0
    r = log.rows[0]
    assert r.bias == pytest.approx(r.bias_estimator + r.bias_sampler + r.noise + r.bias_precision, abs=1e-12)
    assert abs(r.bias_precision) < 1e-5 and r.bias_sampler == 0.0 and abs(r.bias_estimator) < 1e-12


def test_step_audit_finds_the_sampler_bias_and_splits_it():
    log = AuditLog()
    pooled = _audit(log, _steps(_gen(7), Sampler(top_k=3), 100))
    assert abs(pooled["z"]) > 5                                   # the estimate is not of the exact KL
    # ... and the bias is the sampler's: what is left is noise, within its SE.
    assert abs(pooled["mean_bias"] - pooled["mean_bias_sampler"]) < 5 * pooled["se"] + 1e-6
    assert abs(pooled["consistency_z"]) < 5 and log.rows[0].miss > 0


def test_step_audit_finds_k2s_bias_and_a_draw_mismatch():
    g, log = _gen(8), AuditLog()
    k2 = _audit(log, _steps(g, Sampler(), 100, trainer="k2", ref_noise=2.0), estimator="k2", source="k2")
    mism = _audit(log, _steps(g, Sampler(), 100, draw_temperature=1.3), source="mismatch")
    assert abs(k2["z"]) > 5 and abs(k2["consistency_z"]) < 5
    assert abs(k2["mean_bias"] - sum(r.bias_estimator for r in log.rows if r.source == "k2") / 100) < 5 * k2["se"]
    assert mism["consistency_z"] < -5       # tokens drawn at another temperature than the one audited


@pytest.mark.parametrize("sp", [Sampler(), Sampler(top_k=5)], ids=lambda s: s.describe())
def test_a_sampling_pass_unlike_the_scored_one_is_its_own_bias_source(sp):
    # Tokens drawn by a pass whose logits differ from the scored pass's (here a temperature of 2 in the
    # drawing pass; dropout or position ids do the same): without that pass the audit books the gap as
    # noise and the consistency check fails; with it, the gap is bias_mismatch (its exact value), the rest
    # is noise within its SE, and the check passes.
    S = 120
    blind = _audit(AuditLog(), _steps(_gen(17), sp, S, draw_temperature=2.0), source="blind")
    log = AuditLog()
    seen = _audit(log, _steps(_gen(17), sp, S, draw_temperature=2.0, captured=True), source="seen")
    assert blind["consistency_z"] < -5
    assert abs(seen["consistency_z"]) < 5 and all(r.sampling_pass == r.tokens for r in log.rows)
    mismatch = sum(r.bias_mismatch for r in log.rows) / S
    assert abs(mismatch) > 2 * seen["se"]                          # a real source, above the noise
    assert abs(seen["mean_bias"] - seen["mean_bias_sampler"] - mismatch) < 5 * seen["se"] + 1e-6
    z = torch.tensor([r.noise / r.se for r in log.rows])           # what is left is noise: ≈ N(0, 1)
    assert abs(z.mean().item()) * math.sqrt(S) < 5 and abs(z.square().mean().item() - 1) < 5 * math.sqrt(2 / S)
    r = log.rows[0]
    assert r.bias == pytest.approx(r.bias_estimator + r.bias_sampler + r.bias_mismatch + r.noise + r.bias_precision,
                                   abs=1e-12)


def test_impossible_token_fails_consistency():
    g = _gen(9)
    pv, values, mask = _step(g, Sampler())
    flat_ids = torch.zeros(int(mask.sum()), dtype=torch.long)
    zp = torch.randn(int(mask.sum()), 30, generator=g, dtype=torch.float64)
    zp[:, 0] = -50.0                               # id 0 is far outside the top-2
    pv = position_values(zp, zp, ("trl.grpo",), Sampler(top_k=2), ids=flat_ids)
    a = audit_step(pv, values, mask, estimator="trl.grpo")
    assert a.impossible == int(mask.sum()) and a.consistency_z == -math.inf


def test_sums_of_two_ranks_are_the_sums_of_their_union():
    g = _gen(10)
    pv1, v1, m1 = _step(g, Sampler(top_p=0.9))
    pv2, v2, m2 = _step(g, Sampler(top_p=0.9))
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        both = step_sums(kl_bench.audit.PositionValues.cat([pv1, pv2]), torch.cat([v1, v2]), torch.cat([m1, m2]),
                         estimator="trl.grpo", aggregation=agg)
        split = step_sums(pv1, v1, m1, estimator="trl.grpo", aggregation=agg) + \
            step_sums(pv2, v2, m2, estimator="trl.grpo", aggregation=agg)
        assert torch.allclose(both, split, rtol=1e-12, atol=1e-12), agg
    assert len(SUMS) == both.numel()


def test_audit_log_writes_a_results_folder(tmp_path):
    g, log = _gen(11), AuditLog()
    for s in range(3):
        pv, values, mask = _step(g, Sampler(top_k=5))
        log.add(audit_step(pv, values, mask, estimator="trl.grpo", step=s, source="loss"))
    out = log.write(tmp_path / "audit", trainer="test")
    lines = (out / "audit.csv").read_text().splitlines()
    assert lines[0].split(",") == list(AUDIT_COLUMNS) == list(StepAudit.__dataclass_fields__)
    assert len(lines) == 4
    env = json.loads((out / "run.json").read_text())
    assert env["kl_bench_audit"] == 1 and env["trainer"] == "test" and env["pooled"]["loss"]["steps"] == 3
    assert "audit.csv" in env["files"]


def test_sampler_settings_reject_unknown_keys():
    with pytest.raises(SpecError, match="key 'generation.top_kk'"):
        Sampler.from_dict({"top_kk": 3}, file="step.json")
    with pytest.raises(SpecError, match="needs eos_token_id"):
        Sampler(min_new_tokens=2)
    assert Sampler.from_dict({"top_k": 0, "top_p": 1.0, "eos_token_id": 5}).is_identity


def test_stream_kl_is_pass_one_of_stream_values():
    g = _gen(12)
    hp, hr = 0.4 * torch.randn(9, 6, generator=g), 0.4 * torch.randn(9, 6, generator=g)
    wp, wr = torch.randn(300, 6, generator=g), torch.randn(300, 6, generator=g)
    full = stream_values(hp, hr, Head(wp), Head(wr), (), chunk=4, tile=64, dtype=torch.float64)
    kl = kl_bench.audit.stream_kl(hp, hr, Head(wp), Head(wr), chunk=4, tile=64, dtype=torch.float64)
    assert torch.allclose(kl, full.kl, rtol=1e-13, atol=1e-15)
    dense = position_values(hp.double() @ wp.double().T, hr.double() @ wr.double().T, ())
    assert torch.allclose(kl, dense.kl, rtol=1e-12, atol=1e-14)


def test_stream_kl_float32_error_is_within_its_rounding_bound():
    # Dyadic inputs (multiples of 1/4, |entries| ≤ 2): every product and every partial sum of the d = 16
    # terms is exact in float32, so the float32 logits equal the float64 ones and only the tile work
    # rounds: each exp ≤ 1 ulp-ish, each tile sum of t terms in (0, 1] ≤ log2(t)·2⁻²⁴ relative, and
    # A/S = E_q[z_q − z_p] ≤ (log2 t + 2)·2⁻²⁴·max|z_q − z_p|; lse_q, lse_p each ≤ (log2 t + 2)·2⁻²⁴.
    g = _gen(14)
    N, V, d, tile = 16, 3000, 16, 512
    hp, hr = (torch.randint(-8, 9, (N, d), generator=g) / 4 for _ in range(2))
    wp, wr = (torch.randint(-4, 5, (V, d), generator=g) / 4 for _ in range(2))
    zq, zp = hp.double() @ wp.double().T, hr.double() @ wr.double().T
    dense = position_values(zq, zp, ()).kl
    kl = kl_bench.audit.stream_kl(hp, hr, Head(wp), Head(wr), tile=tile, dtype=torch.float32)
    bound = (math.log2(tile) + 2) * 2.0 ** -24 * (2 + (zq - zp).abs().max().item())
    err = (kl - dense).abs().max().item()
    assert err <= bound
    assert err > 0                     # float32 tile work did run (the float64 path is exact to ~1e-15)
    with pytest.raises(SpecError, match="float32 or float64, not torch.bfloat16"):
        kl_bench.audit.stream_kl(hp, hr, Head(wp), Head(wr), dtype=torch.bfloat16)


def test_the_audit_sampler_is_the_engines_model_where_they_overlap():
    """Temperature, top-k and top-p of generation's b are the engine's SamplerSpec (one model, issue 34): the
    audit's dense log b equals SamplerSpec.reshape wherever the penalty, the EOS ban and min-p are off."""
    from kl_bench.sampling.mismatch import SamplerSpec
    z = torch.randn(6, 40, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    for s in (Sampler(), Sampler(temperature=0.7), Sampler(top_k=5), Sampler(top_p=0.8, temperature=1.3),
              Sampler(top_k=0, top_p=1.0)):
        assert s.spec == SamplerSpec(temperature=s.temperature, top_k=s.k, top_p=s.p)
        assert torch.equal(sampler_logprobs(z, s), s.spec.reshape(z))
