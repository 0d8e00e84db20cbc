"""The rollout engine's mismatch (kl_bench.audit.rollout_engine): the engine's log-prob convention, the exact
sampler gap, and the metrics trainers log (verl rollout_corr/*, TRL sampling_logp_difference) against
their exact values. Synthetic engines on plain tensors here; a tiny GPT-2 generating in bf16 as the engine
(transformers) in the last test."""
import dataclasses
import math

import pytest
import torch

import kl_bench
from kl_bench.audit import Head, Sampler, sampler_logprobs
from kl_bench.audit.rollout_engine import ENGINE_COLUMNS, EngineAudit
from kl_bench.audit.session import AuditSession, Metric, Record
from kl_bench.audit.verdict import Voice, engine_warnings

METRIC = [Metric("loss", "trl.grpo", "token-mean")]


def _engine_batch(seed, sp: Sampler, *, processed: bool, noise: float = 0.0, B=16, T=6, V=50, d=8):
    """A trainer's batch whose tokens an engine drew: the engine's logits are the trainer's plus ``noise``
    (its own precision), its sampler ``sp``; it returns processed (after truncation) or raw log-probs."""
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(V, d, generator=g)
    wr = wq + 0.2 * torch.randn(V, d, generator=g)
    hq = torch.randn(B, T, d, generator=g)
    hr = hq + 0.2 * torch.randn(B, T, d, generator=g)
    z_engine = (hq.double() @ wq.double().T) + noise * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    lb = sampler_logprobs(z_engine.reshape(-1, V), sp)
    ids = torch.multinomial(torch.exp(lb), 1, generator=g).view(B, T)
    full = torch.log_softmax(z_engine, -1).reshape(-1, V)
    e = (lb if processed else full).gather(-1, ids.view(-1, 1)).view(B, T)
    mask = torch.arange(T) < torch.randint(2, T + 1, (B, 1), generator=g)
    lq = torch.log_softmax(hq @ wq.T, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    lr = torch.log_softmax(hr @ wr.T, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    values = kl_bench.ESTIMATORS["trl.grpo"].fn(lr - lq)
    return Record(hq, hr, ids, mask, values, engine_logprobs=e), (Head(wq), Head(wr))


def _audit(seed, sp, **kw) -> EngineAudit:
    rec, heads = _engine_batch(seed, sp, **kw)
    s = AuditSession(heads, METRIC, sp, dtype=torch.float64)
    s.add(rec)
    s.finish(0)
    return s.log.engine[0], rec, heads


@pytest.mark.parametrize("sp, processed, want", [(Sampler(top_k=5), True, "processed"), (Sampler(top_k=5), False, "raw"),
                                                 (Sampler(top_p=0.8), True, "processed"), (Sampler(), True, "either")],
                         ids=["top-k processed", "top-k raw", "top-p processed", "no truncation"])
def test_the_convention_and_the_exact_sampler_gap(sp, processed, want):
    a, rec, heads = _audit(1, sp, processed=processed)
    assert a.convention == want
    # the sampler gap, written out: log b(x) − log q(x) per masked token from the trainer's own logits
    m = rec.mask
    z = (rec.policy_hidden.double() @ heads[0].weight.double().T)[m]
    lq = torch.log_softmax(z, -1)
    lb = sampler_logprobs(z, sp)
    ids = rec.completion_ids[m].unsqueeze(-1)
    gap = (lb.gather(-1, ids) - lq.gather(-1, ids)).mean().item()
    assert a.sampler_gap == pytest.approx(gap, rel=1e-12, abs=1e-15)
    if sp.k and sp.p is None:                               # top-k at T = 1: −log of the kept mass, exactly
        kept = torch.topk(lq.exp(), sp.k, -1).values.sum(-1)
        assert a.sampler_gap == pytest.approx(-torch.log(kept).mean().item(), rel=1e-12)


@pytest.mark.parametrize("sp", [Sampler(top_k=8), Sampler(top_p=0.7)], ids=lambda s: s.describe())
def test_an_engine_that_is_the_trainers_sampler_meets_the_exact_values(sp):
    # 60 batches: each metric's z against its exact value is N(0, 1) (clustered SE by sequence)
    zs = {"kl": [], "k3_kl": [], "chi2": [], "logp_diff": []}
    for seed in range(60):
        a, _, _ = _audit(100 + seed, sp, processed=True)
        for name in zs:
            zs[name].append(a.z(name))
    for name, z in zs.items():
        z = torch.tensor(z)
        assert abs(z.mean().item()) * math.sqrt(len(z)) < 5, name
        assert z.square().mean().item() < 1 + 5 * math.sqrt(2 / len(z)), name
    a, _, _ = _audit(7, sp, processed=True)
    assert not [w for w in engine_warnings(a) if w.key == "engine"]


def test_an_engine_without_truncation_that_is_the_trainer_measures_nothing():
    # b = q and the engine's log-probs are the trainer's (to float32 rounding): every metric ≈ 0
    a, _, _ = _audit(5, Sampler(), processed=False)
    assert a.convention == "either" and a.sampler_gap == 0.0 and a.kl_exact == 0.0 and a.chi2_exact == 0.0
    for name in ("kl", "k3_kl", "chi2", "logp_diff"):
        assert abs(getattr(a, name)) < 1e-5, name                 # float32 log-softmax against float64


def test_an_engine_with_its_own_numerics_is_told_apart():
    a, _, _ = _audit(3, Sampler(top_k=8), processed=True, noise=0.7, B=128)
    assert abs(a.z("kl")) > 5
    keys = {w.key for w in engine_warnings(a)}
    assert keys == {"engine", "engine_processed"}


def test_engine_sums_pool_across_batches_and_the_csv_is_written(tmp_path):
    sp = Sampler(top_k=6)
    s = AuditSession(_engine_batch(1, sp, processed=True)[1], METRIC, sp, dtype=torch.float64)
    for seed in (1, 2):
        rec, heads = _engine_batch(seed, sp, processed=True)
        s.add(rec, heads=heads)
    s.finish(4)
    (a,) = s.log.engine
    assert a.step == 4 and a.tokens == sum(int(_engine_batch(x, sp, processed=True)[0].mask.sum()) for x in (1, 2))
    s.log.write(tmp_path / "out")
    lines = (tmp_path / "out" / "engine.csv").read_text().splitlines()
    assert lines[0].split(",") == list(ENGINE_COLUMNS) == [f.name for f in dataclasses.fields(EngineAudit)]
    assert len(lines) == 2


def test_a_tiny_model_generating_in_bf16_as_the_engine(tiny_models):
    """The same tiny GPT-2 as engine (bf16, CPU, processed scores of generate()) and as trainer (float32):
    the audit names the convention, the exact sampler gap, and each metric is within its SE of the exact
    mismatch recomputed here from the engine's own bf16 distribution."""
    from transformers import GPT2LMHeadModel
    torch.manual_seed(0)
    policy = GPT2LMHeadModel.from_pretrained(tiny_models / "policy").eval()
    ref = GPT2LMHeadModel.from_pretrained(tiny_models / "reference").eval()
    engine = GPT2LMHeadModel.from_pretrained(tiny_models / "policy").to(torch.bfloat16).eval()
    sp = Sampler(top_k=20)
    prompt = torch.randint(0, policy.config.vocab_size, (32, 4), generator=torch.Generator().manual_seed(1))
    T = 8
    with torch.no_grad():
        out = engine.generate(prompt, do_sample=True, top_k=20, max_new_tokens=T, min_new_tokens=T,
                              output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        seq = out.sequences
        comp = seq[:, -T:]
        scores = torch.stack(out.scores, 1).float()                          # processed logits [B, T, V]
        e = torch.log_softmax(scores, -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
        hq = policy.transformer(seq).last_hidden_state[:, -T - 1:-1]
        hr = ref.transformer(seq).last_hidden_state[:, -T - 1:-1]
        lq = torch.log_softmax(policy(seq).logits[:, -T - 1:-1], -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
        lr = torch.log_softmax(ref(seq).logits[:, -T - 1:-1], -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
        z_engine = engine(seq).logits[:, -T - 1:-1].double()                 # the engine's own distribution
    mask = torch.ones_like(comp, dtype=torch.bool)
    rec = Record(hq, hr, comp, mask, kl_bench.ESTIMATORS["trl.grpo"].fn(lr - lq), engine_logprobs=e)
    heads = Head(policy.lm_head.weight.detach()), Head(ref.lm_head.weight.detach())
    s = AuditSession(heads, METRIC, sp, dtype=torch.float64)
    s.add(rec)
    s.finish(0)
    (a,) = s.log.engine
    assert a.convention == "processed" and a.sampler_gap > 0 and a.outside < a.tokens // 10
    # exact KL(engine‖trainer) per position from the engine's bf16 logits, its sampler, the trainer's q
    lb_e = sampler_logprobs(z_engine.reshape(-1, z_engine.shape[-1]), sp)
    lq_full = torch.log_softmax((hq.double() @ heads[0].weight.double().T).reshape(lb_e.shape), -1)
    b = lb_e.exp()
    exact = torch.where(b > 0, b * (lb_e - lq_full), torch.zeros_like(b)).sum(-1).mean().item()
    assert abs(a.kl - exact) < 5 * a.kl_se
    assert abs(a.kl_exact - exact) > 0                         # the bf16 engine is not the trainer's own sampler


# ----------------------------------------------------------------------------- engines that draw their own tokens
# Issue 43 item 1: an engine with the trainer's weights that computes its logits in bf16 (or in float32, equal to
# the trainer), or samples with other settings, draws its own tokens; the audit's measured KL(engine‖trainer)
# and metrics are checked against dense float64 values of the engine's own sampling distribution computed here.
def _drawing_engine(seed, sp: Sampler, *, dtype=torch.float32, engine_sp: Sampler | None = None, moved: float = 0.0,
                    processed: bool = True, B=96, T=8, V=1000, d=32):
    """The trainer's batch (float32 hidden states and heads) and an engine that computes the policy's logits in
    ``dtype`` (weights moved by ``moved``: another model version), samples with ``engine_sp`` (default the
    trainer's settings ``sp``) and returns its processed (or raw) log-probs of its draws. Also returns the dense
    float64 per-position expectations under the engine's own distribution b_e: KL(b_e‖q), E[k3(log q − log e)],
    E[(q/e)²] − 1, E|log q − log e|, E[k3(log b − log e); b > 0] (token means at the masked positions) and the
    sampler-only KL(b‖q)."""
    g = torch.Generator().manual_seed(seed)
    wq = 2 * torch.randn(V, d, generator=g) / d ** 0.5
    wr = wq + 0.1 * torch.randn(V, d, generator=g) / d ** 0.5
    hq = torch.randn(B, T, d, generator=g)
    hr = hq + 0.1 * torch.randn(B, T, d, generator=g)
    we = wq + moved * torch.randn(V, d, generator=g) / d ** 0.5
    z_e = (hq.to(dtype) @ we.to(dtype).T).double().reshape(-1, V)     # the engine's logits, in its own dtype
    lb_e = sampler_logprobs(z_e, engine_sp or sp)
    ids = torch.multinomial(lb_e.exp(), 1, generator=g).view(B, T)
    e = (lb_e if processed else torch.log_softmax(z_e, -1)).gather(-1, ids.view(-1, 1)).view(B, T).float()
    mask = torch.arange(T) < torch.randint(2, T + 1, (B, 1), generator=g)
    z = hq.double() @ wq.double().T
    lq = torch.log_softmax(z, -1)
    lr = torch.log_softmax(hr.double() @ wr.double().T, -1)
    values = kl_bench.ESTIMATORS["k3"].fn((lr - lq).gather(-1, ids.unsqueeze(-1)).squeeze(-1)).float()
    rec = Record(hq, hr, ids, mask, values, engine_logprobs=e,
                 engine_dtype=str(dtype).removeprefix("torch."))
    lq_m, lbe_m = lq.reshape(-1, V)[mask.flatten()], lb_e[mask.flatten()]
    be = lbe_m.exp()
    y = torch.where(be > 0, lq_m - lbe_m, torch.zeros_like(lq_m))

    def under_engine(x):
        return torch.where(be > 0, be * x, torch.zeros_like(x)).sum(-1).mean().item()
    dense = {"kl_engine": under_engine(-y), "k3_kl": under_engine(torch.expm1(y) - y), "chi2": under_engine(y.exp() ** 2) - 1,
             "logp_diff": under_engine(y.abs()), "kl_sampler": None}
    lb = sampler_logprobs(z.reshape(-1, V)[mask.flatten()], sp)
    dense["kl_sampler"] = torch.where(lb.isfinite(), lb.exp() * (lb - lq_m), torch.zeros_like(lb)).sum(-1).mean().item()
    yb = torch.where(lb.isfinite() & (be > 0), lb - lbe_m, torch.zeros_like(lb))
    dense["excess_k3"] = under_engine(torch.expm1(yb) - yb)
    return rec, (Head(wq), Head(wr)), dense


def _engine_audit(rec, heads, sp) -> EngineAudit:
    s = AuditSession(heads, [Metric("kl", "k3", "token-mean")], sp, dtype=torch.float64)
    s.add(rec)
    s.finish(1)
    return s.log.engine[0]


SAMPLERS = [Sampler(), Sampler(top_k=20), Sampler(top_p=0.9)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("sp", SAMPLERS, ids=lambda s: s.describe())
def test_an_engine_drawing_its_own_tokens_is_measured_against_its_own_distribution(sp, dtype):
    """KL(engine‖trainer) measured from the engine's log-probs of its own draws, and k3_kl, χ², the log-prob
    difference, each within 5 SE of its dense float64 value under the engine's own distribution; the
    sampler-only value is KL(b‖q) to rounding, never NaN (top-p's nuclei past the tile's candidates too). A
    bf16 engine departs from it and is named precision, once; an fp32 engine equal to the trainer is silent."""
    rec, heads, dense = _drawing_engine(11, sp, dtype=dtype)
    a = _engine_audit(rec, heads, sp)
    assert a.kl_sampler == pytest.approx(dense["kl_sampler"], rel=1e-9, abs=1e-15)
    for name in ("k3_kl", "chi2", "logp_diff", "kl_sampler", "logp_diff_exact", "chi2_exact", "k3_kl_exact"):
        assert math.isfinite(getattr(a, name)), name
    assert abs(a.kl_engine - dense["kl_engine"]) < 5 * a.kl_engine_se
    assert a.kl_excess == pytest.approx(a.kl_engine - a.kl_sampler)
    for name in ("k3_kl", "chi2", "logp_diff"):         # processed: the engine's distribution is its sampler's
        se = getattr(a, f"{name}_se")
        assert abs(getattr(a, name) - dense[name]) < 5 * se + a.envelope(name), name
    assert abs(a.excess_k3 - dense["excess_k3"]) < 5 * a.excess_k3_se + a.envelope("excess_k3")
    said = Voice().warnings(engine_warnings(a) + engine_warnings(a))
    engine_lines = [w for w in said if "rollout engine differs" in w]
    if dtype == torch.bfloat16:
        assert a.cause == "precision" and a.departs(5.0) and len(engine_lines) == 1
        assert "Cause that fits: precision" in engine_lines[0] and "bfloat16" in engine_lines[0]
        # the bf16 engine's own distribution is many SEs from the trainer-side sampler (≈ KL(b_e‖b), dense)
        assert dense["excess_k3"] > 5 * a.excess_k3_se
    else:
        assert a.cause == "" and not engine_lines and a.outside_beyond == 0
        assert max(abs(a.departure(m)) for m in ("kl", "k3_kl", "chi2", "logp_diff")) < 5


@pytest.mark.parametrize("declared, engine, processed", [
    (Sampler(top_k=20), Sampler(top_k=60), True), (Sampler(top_p=0.8), Sampler(top_p=0.97), True),
    (Sampler(top_k=20), Sampler(), False)], ids=["top_k 20 vs 60", "top_p 0.8 vs 0.97", "top_k 20 vs none, raw"])
def test_an_engine_with_another_sampler_is_named(declared, engine, processed):
    """A float32 engine equal to the trainer that samples with wider settings than the audit was given draws
    tokens outside the trainer-side support far below its threshold: named "another sampler"."""
    rec, heads, _ = _drawing_engine(12, declared, engine_sp=engine, processed=processed)
    a = _engine_audit(rec, heads, declared)
    assert a.cause == "sampler" and a.outside_beyond > 0 and a.deep(5.0)
    (line,) = [w.message for w in engine_warnings(a) if w.key == "engine"]
    assert "Cause that fits: another sampler" in line and "outside the support" in line


def test_an_engine_with_other_weights_is_named_another_model_version():
    """A float32 engine whose weights moved (not synced after a step): beyond float32's rounding, so not
    precision; undeclared, both are named."""
    rec, heads, dense = _drawing_engine(13, Sampler(), moved=0.05)
    a = _engine_audit(rec, heads, Sampler())
    assert a.cause == "version" and abs(a.kl_engine - dense["kl_engine"]) < 5 * a.kl_engine_se
    assert "another model version" in engine_warnings(a)[0].message
    a = _engine_audit(dataclasses.replace(rec, engine_dtype=None), heads, Sampler())
    assert a.cause == "precision or version"


def test_kl_of_the_drawing_pass_is_reported_exactly():
    """With the drawing pass's hidden states given, KL(g‖q) exactly beside the measured KL(engine‖trainer)."""
    rec, heads, dense = _drawing_engine(14, Sampler(top_k=20))
    hs = rec.policy_hidden + 0.05 * torch.randn(rec.policy_hidden.shape, generator=torch.Generator().manual_seed(1))
    a = _engine_audit(dataclasses.replace(rec, sampling_hidden=hs), heads, Sampler(top_k=20))
    z = hs.double() @ heads[0].weight.double().T
    m = rec.mask
    lq = torch.log_softmax((rec.policy_hidden.double() @ heads[0].weight.double().T)[m], -1)
    lg = sampler_logprobs(z[m], Sampler(top_k=20))
    want = torch.where(lg.isfinite(), lg.exp() * (lg - lq), torch.zeros_like(lg)).sum(-1).mean().item()
    assert a.kl_drawn == pytest.approx(want, rel=1e-9)
    assert math.isnan(_engine_audit(rec, heads, Sampler(top_k=20)).kl_drawn)
