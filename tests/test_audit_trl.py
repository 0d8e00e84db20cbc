"""KLAudit on real TRL runs (GRPOTrainer, RLOOTrainer) with the tiny random GPT-2s built in the test: no
GPU, no hub. Each run takes 5–15 s on a 2-core CPU, hence slow; .ci/run installs the trl extra and runs
this file."""
import pytest
import torch

import kl_bench

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

trl = pytest.importorskip("trl")


def _run(models, tmp_path, *, steps=3, max_rows=8, dtype=torch.float32, **kw):
    from kl_bench.integrations.demo import build_trainer
    from kl_bench.integrations.trl import KLAudit
    tr = build_trainer(models, tmp_path / "run", steps=steps, **kw)
    lines = []
    cb = KLAudit(tr, every=1, max_rows=max_rows, print_fn=lines.append, out=tmp_path / "audit", dtype=dtype)
    tr.add_callback(cb)
    tr.train()
    return tr, cb, lines


def test_grpo_clean_run_logged_kl_exact_kl_and_z(tiny_models, tmp_path):
    # learning rate 0: the policy that sampled every step is the one on disk, so an independent float64
    # forward through both models gives the exact KL of the last step.
    tr, cb, lines = _run(tiny_models, tmp_path, learning_rate=0.0)
    logged = [h["kl"] for h in tr.state.log_history if "kl" in h]
    assert len(logged) == 3 == len(cb.log.rows)
    last = cb.last_inputs
    # TRL's logged kl is kl_bench.estimate on TRL's own log-probs, bit for bit (max_rows covers the batch).
    mine = kl_bench.estimate(policy=last["policy_logps"], reference=last["ref_logps"], estimator="trl.grpo",
                             mask=last["mask"], aggregation="token-mean")
    assert mine.item() == logged[-1]
    assert cb.log.rows[-1].logged == pytest.approx(logged[-1], rel=1e-6)
    # The audit's exact KL against a float64 forward of both models on the same rows.
    from transformers import GPT2LMHeadModel
    k = last["mask"].shape[1]
    ids = last["input_ids"]
    lps = []
    for folder in ("policy", "reference"):
        model = GPT2LMHeadModel.from_pretrained(tiny_models / folder).double().eval()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -k - 1:-1]
        lps.append(torch.log_softmax(logits, -1))
    kl = (lps[0].exp() * (lps[0] - lps[1])).sum(-1)[last["mask"]]
    assert cb.log.rows[-1].exact == pytest.approx(kl.mean().item(), rel=1e-5)    # float32 body vs float64 body
    assert torch.allclose(last["values"].kl, kl, rtol=1e-4, atol=1e-6)
    pooled = cb.log.pooled()["kl"]
    assert all(abs(r.z) < 5 for r in cb.log.rows) and abs(pooled["z"]) < 5 and abs(pooled["consistency_z"]) < 5
    assert all(abs(r.bias_precision) < 1e-5 and abs(r.bias_sampler) < 1e-12 for r in cb.log.rows)
    assert not cb.warnings and sum(line.startswith("kl_audit: step") for line in lines) == 3
    assert (tmp_path / "audit" / "audit.csv").exists() and (tmp_path / "audit" / "run.json").exists()
    assert any(k.startswith("kl_audit/z") for h in tr.state.log_history for k in h)


def test_grpo_top_k_warns_that_the_sampler_moves_the_mean(tiny_models, tmp_path):
    tr, cb, lines = _run(tiny_models, tmp_path, top_k=20, use_bias_correction_kl=False)
    assert any("the sampler (b: top_k=20) moves the estimator's mean" in w for w in cb.warnings)
    assert all(r.miss > 0 and r.bias_sampler != 0 for r in cb.log.rows)
    assert abs(cb.log.pooled()["kl"]["consistency_z"]) < 5      # the tokens do come from the audited b


def test_left_padding_is_measured_as_the_mismatch_and_position_ids_clear_it(tiny_models, tmp_path):
    # Left-padded prompts: generate() derives position ids from the mask, TRL's loss pass does not, so the
    # pass that drew the tokens is not the scored one. The captured generation makes the gap its own part of
    # the split (bias_mismatch, warned), and the tokens do fit the distribution that drew them.
    kw = dict(equal_length=False, max_rows=16, per_device_train_batch_size=16)
    _, cb, _ = _run(tiny_models, tmp_path / "pad", **kw)
    rows = cb.log.rows
    assert all(r.sampling_pass == r.tokens for r in rows) and abs(cb.log.pooled()["kl"]["consistency_z"]) < 5
    assert any(abs(r.bias_mismatch) > 0.05 * abs(r.expected_q) for r in rows)
    assert any("position ids" in w and "drew the tokens" in w for w in cb.warnings)
    _, cb, _ = _run(tiny_models, tmp_path / "pos", position_ids=True, **kw)
    assert abs(cb.log.pooled()["kl"]["consistency_z"]) < 5 and not any("position ids" in w for w in cb.warnings)
    assert all(abs(r.bias_mismatch) < 1e-4 * abs(r.expected_q) for r in cb.log.rows)


def test_rloo_k1_as_logged_and_in_the_reward(tiny_models, tmp_path):
    # RLOO logs `kl` as the token mean of k1 and puts the per-sequence sum in the reward: two metrics, each
    # on its own scale (source "kl" is TRL's logged metric itself).
    tr, cb, _ = _run(tiny_models, tmp_path, trainer="rloo", learning_rate=0.0)
    rows = cb.log.rows
    assert [(r.source, r.aggregation) for r in rows[:2]] == [("kl", "token-mean"), ("reward", "seq-mean-token-sum")]
    assert len(rows) == 6 and all(r.estimator == "k1" for r in rows)
    logged = [h["kl"] for h in tr.state.log_history if "kl" in h]
    assert [r.logged for r in rows if r.source == "kl"] == pytest.approx(logged, rel=1e-6)
    last = cb.last_inputs
    mine = kl_bench.estimate(policy=last["policy_logps"], reference=last["ref_logps"], estimator="k1",
                             mask=last["mask"], aggregation="token-mean")
    assert mine.item() == logged[-1]
    kl_rows = [r for r in rows if r.source == "reward"]
    assert all(r.logged > 3 * k.logged for r, k in zip(kl_rows, rows[0::2]))       # Σ over ~8 tokens, not a mean
    assert all(abs(r.z) < 5 and abs(r.bias_precision) < 1e-4 for r in rows)
    assert any(k.startswith("kl_audit/kl/") for h in tr.state.log_history for k in h)


def test_dropout_and_bf16_warn(tiny_models, tmp_path):
    _, cb, _ = _run(tiny_models, tmp_path, steps=1, disable_dropout=False, bf16=True)
    assert any("dropout is active" in w for w in cb.warnings) and any("bf16" in w for w in cb.warnings)


def test_calibration_the_z_test_rejects_at_its_nominal_rate(tiny_models, tmp_path):
    # Learning rate 0: every step samples from the same policy, so the steps are independent repetitions
    # and z ~ N(0, 1) at each; at α = 0.05 the number of rejections is Binomial(S, 0.05).
    steps, alpha = 60, 0.05
    _, cb, _ = _run(tiny_models, tmp_path, steps=steps, learning_rate=0.0, seed=1)
    z = torch.tensor([r.z for r in cb.log.rows])
    cz = torch.tensor([r.consistency_z for r in cb.log.rows])
    assert len(z) == steps
    for stat in (z, cz):
        rejected = int((stat.abs() > 1.959964).sum())
        assert abs(rejected - steps * alpha) < 5 * (steps * alpha * (1 - alpha)) ** 0.5
        assert abs(stat.square().mean().item() - 1) < 5 * (2 / steps) ** 0.5
        assert abs(stat.mean().item()) < 5 / steps ** 0.5


def test_two_cpu_processes_reduce_the_audit(tmp_path):
    """torchrun, 2 gloo processes: each rank audits its own rows, rank 0 logs the sums of both."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "mp"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "-m", "kl_bench.integrations.demo", "--steps", "2", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = (out / "audit.csv").read_text().splitlines()
    header = rows[0].split(",")
    table = [dict(zip(header, r.split(","))) for r in rows[1:]]
    assert len(table) == 2 and all(int(r["tokens"]) == 2 * 64 and int(r["sequences"]) == 16 for r in table)
    logged = [h["kl"] for h in json.loads((out / "trl_log_history.json").read_text()) if "kl" in h]
    # TRL's kl is its global masked mean over both ranks; the audit's `logged` is the same token mean,
    # reduced from the ranks' float64 sums (TRL sums in float32).
    for r, kl in zip(table, logged):
        assert float(r["logged"]) == pytest.approx(kl, rel=1e-5)
    assert sum(line.startswith("kl_audit: step") for line in res.stdout.splitlines()) == 2     # rank 0 only


def _dense_kl(part, heads, scale):
    """Independent float64 oracle: log-softmax of both models' full logits from the captured hidden states."""
    m = part["mask"]
    lq = torch.log_softmax(part["policy_hidden"][m].double() @ heads[0].double().T * scale, -1)
    lp = torch.log_softmax(part["ref_hidden"][m].double() @ heads[1].double().T * scale, -1)
    return (lq.exp() * (lq - lp)).sum(-1), max(lq.abs().max().item(), lp.abs().max().item())


def test_grpo_gradient_accumulation_audits_every_micro_batch(tiny_models, tmp_path):
    # Two micro-batches of 8 rows a step; max_rows = 16 covers both. Learning rate 0, one step.
    tr, cb, _ = _run(tiny_models, tmp_path / "all", steps=1, max_rows=16, learning_rate=0.0,
                     gradient_accumulation_steps=2, dtype=torch.float64)
    # loss_type dapo (TRL's default): the loss's KL term pools the window's tokens (source loss); the
    # logged kl (source kl) is the mean of the micro-batches' means (tested below).
    row, parts = next(r for r in cb.log.rows if r.source == "loss"), cb.step_inputs
    assert len(parts) == 2 and [p["input_ids"].shape[0] for p in parts] == [8, 8] and row.sequences == 16
    # Every row TRL generated for the step (the reference pass saw them all) is audited exactly once.
    generated = torch.cat([r["input_ids"] for r in cb._records["ref"]])
    audited = torch.cat([p["input_ids"] for p in parts])
    assert sorted(map(tuple, audited.tolist())) == sorted(map(tuple, generated.tolist()))
    mask = torch.cat([p["mask"] for p in parts])
    assert row.tokens == int(mask.sum())
    heads = [m.get_output_embeddings().weight.detach() for m in (tr.model, tr.ref_model)]
    kl, big = zip(*(_dense_kl(p, heads, 1.0 / tr.temperature) for p in parts))
    kl = torch.cat(kl)
    # Both sides are float64 sums of V terms of size ≤ max |log-prob|: rounding ≤ V·2⁻⁵³·max (γ_V bound).
    assert abs(row.exact - kl.mean().item()) <= heads[0].shape[0] * 2.0 ** -53 * max(big)
    # logged: the token mean of TRL's per-token k3 from its own float32 log-probs, pooled over both.
    logged = kl_bench.estimate(policy=torch.cat([p["policy_logps"] for p in parts]),
                               reference=torch.cat([p["ref_logps"] for p in parts]), estimator="trl.grpo",
                               mask=mask, aggregation="token-mean").item()
    assert abs(row.logged - logged) <= int(mask.sum()) * 2.0 ** -24 * abs(logged)     # float32 sum rounding
    assert not cb.warnings


def _trl_minor() -> tuple[int, int]:
    from importlib.metadata import version
    return tuple(int(x) for x in version("trl").split(".")[:2])


def _early_eos(models, tmp_path):
    """The tiny models with 60 of their 1000 ids declared EOS in the policy's generation config (TRL stops
    and masks at every id of model.generation_config.eos_token_id): completions of unequal lengths."""
    import json
    import shutil
    out = tmp_path / "eos-models"
    shutil.copytree(models, out)
    cfg = out / "policy" / "generation_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "eos_token_id": list(range(60))}))
    return out


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "sapo", "cispo", "vespo", "luspo"])
def test_logged_is_trls_kl_for_every_loss_type_under_gradient_accumulation(tiny_models, tmp_path, loss_type):
    # TRL appends each micro-batch's token mean of per_token_kl and logs their mean (logging_steps = 1):
    # with two micro-batches of unequal token counts that is not the pooled token mean, and the audit's
    # `logged` (source kl) must be TRL's number itself, whatever the loss_type.
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    if _trl_minor() < (1, 15):
        # TRL 1.14 stops and masks at the tokenizer's EOS only (not the generation config's ids): the 60 ids go to
        # generate() through generation_kwargs, which pads after them with that EOS, so completions end unequally
        extra["generation_kwargs"] = {"eos_token_id": list(range(60))}
    tr, cb, _ = _run(_early_eos(tiny_models, tmp_path), tmp_path, steps=2, max_rows=16, learning_rate=0.0,
                     gradient_accumulation_steps=2, loss_type=loss_type, **extra)
    trl_kl = [h["kl"] for h in tr.state.log_history if "kl" in h]
    rows = [r for r in cb.log.rows if r.source == "kl"]
    assert len(rows) == 2 == len(trl_kl) and all(r.sequences == 16 for r in rows)
    parts = cb.step_inputs                              # the last step's two micro-batches
    counts = [int(p["mask"].sum()) for p in parts]
    assert len(parts) == 2 and counts[0] != counts[1]   # unequal lengths (EOS at 6% of the ids)
    # TRL sums each micro-batch's float32 values in float32, the audit in float64: their difference is at
    # most the float32 sum's rounding, n·2⁻²⁴ of the mean of the non-negative k3 per micro-batch.
    bound = max(counts) * 2.0 ** -24 * max(trl_kl)
    for r, k in zip(rows, trl_kl):
        assert abs(r.logged - k) <= bound, (r.logged, k)
    values = [p["record"].values_for("kl").double() for p in parts]
    means = [(v * p["mask"]).sum() / p["mask"].sum() for v, p in zip(values, parts)]
    pooled = sum((v * p["mask"]).sum() for v, p in zip(values, parts)) / sum(counts)
    assert abs(pooled.item() - trl_kl[-1]) > 10 * bound            # the pooled mean is not what TRL logs
    assert rows[-1].logged == pytest.approx((means[0] + means[1]).item() / 2, rel=1e-12)
    # The loss's KL term, as the loss_type aggregates it (trl_contract.LOSS_TYPES), where it differs.
    from kl_bench.audit.aggregate import aggregate
    from kl_bench.integrations.trl_contract import LOSS_TYPES
    aggregation, micro_batches = LOSS_TYPES[loss_type]
    loss = [r for r in cb.log.rows if r.source == "loss"]
    assert len(loss) == (0 if aggregation == "token-mean" and micro_batches == "mean" else 2)
    if loss and micro_batches == "mean":
        want = sum(aggregate(v, p["mask"], aggregation) for v, p in zip(values, parts)) / 2
    elif loss:
        want = aggregate(torch.cat(values), torch.cat([p["mask"] for p in parts]), aggregation)
    if loss:
        assert (loss[-1].aggregation, loss[-1].logged) == (aggregation, pytest.approx(want.item(), rel=1e-12))
        assert all(abs(r.z) < 5 for r in loss)


def test_max_rows_is_spread_over_the_micro_batches(tiny_models, tmp_path):
    _, cb, _ = _run(tiny_models, tmp_path, steps=1, max_rows=5, learning_rate=0.0, gradient_accumulation_steps=2)
    assert [p["input_ids"].shape[0] for p in cb.step_inputs] == [3, 2] and cb.log.rows[-1].sequences == 5


def test_num_iterations_warns_once_and_audits_first_passes_only(tiny_models, tmp_path):
    # μ = 2: the first step generates (and is audited), the second reuses its batch after an optimizer
    # step (audit rows are numbered by the global step at the step's end: 1, 2).
    _, cb, lines = _run(tiny_models, tmp_path, steps=2, learning_rate=0.0, num_iterations=2)
    assert [r.step for r in cb.log.rows] == [1]
    assert len(cb.warnings) == 1 and "num_iterations = 2" in cb.warnings[0]
    assert sum("num_iterations" in line for line in lines) == 1


def test_peft_style_reference_and_beta_zero_each_warn_one_line(tiny_models, tmp_path):
    from kl_bench.integrations.demo import build_trainer
    from kl_bench.integrations.trl import KLAudit
    tr = build_trainer(tiny_models, tmp_path / "run", steps=1)
    tr.ref_model = None                 # what TRL 1.16 holds under PEFT: the reference is the adapter-less policy
    cb = KLAudit(tr, print_fn=lambda s: None)
    assert cb.disabled and len(cb.warnings) == 1 and "PEFT" in cb.warnings[0]
    tr = build_trainer(tiny_models, tmp_path / "run0", steps=1, beta=0.0)
    cb = KLAudit(tr, print_fn=lambda s: None)
    assert cb.disabled and len(cb.warnings) == 1 and "beta = 0" in cb.warnings[0]


def test_the_head_reads_gemma_final_logit_softcapping():
    from types import SimpleNamespace

    from kl_bench.integrations.trl_contract import head_of
    lm = torch.nn.Linear(4, 9, bias=False)
    model = SimpleNamespace(get_output_embeddings=lambda: lm, config=SimpleNamespace(final_logit_softcapping=30.0))
    assert head_of(model, 0.5).softcap == 30.0 and head_of(model, 0.5).scale == 2.0
    model.config.final_logit_softcapping = None                        # Gemma configs may hold None: no cap
    model.config.logit_scale = 0.25                                    # a model's own scale, applied before the cap
    assert head_of(model, 1.0).softcap is None and head_of(model, 1.0).multiplier == 0.25
    # a sharded or offloaded head: one line, the step not audited
    model = SimpleNamespace(get_output_embeddings=lambda: torch.nn.Linear(4, 9, bias=False, device="meta"),
                            config=SimpleNamespace())
    assert "not materialised here" in head_of(model, 1.0)
    zero3 = torch.nn.Linear(4, 9, bias=False)
    zero3.weight = torch.nn.Parameter(torch.empty(0))                  # DeepSpeed ZeRO-3 outside a gather
    model = SimpleNamespace(get_output_embeddings=lambda: zero3, config=SimpleNamespace())
    assert "ZeRO-3" in head_of(model, 1.0)


def _reduce_worker(rank: int, init: str, out: str) -> None:
    """One of two gloo processes: rank 1 has no rows at this step; both call the reduction."""
    import types
    import torch.distributed as dist
    from kl_bench.integrations.trl import KLAudit
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    fake = types.SimpleNamespace(trainer=types.SimpleNamespace(accelerator=types.SimpleNamespace(device="cpu")))
    mine = torch.arange(1.0, 5.0, dtype=torch.float64) if rank == 0 else None
    both = KLAudit._reduce(fake, mine)
    none = KLAudit._reduce(fake, None)                    # a step where no rank has rows
    torch.save({"both": both, "none": none}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_a_rank_without_rows_still_takes_part_in_the_reduction(tmp_path):
    """Two gloo processes, one with no audited rows at a step: neither waits forever, both get the
    other's sums (zeros stand in for the empty rank), and a step with no rows anywhere gives None."""
    import torch.multiprocessing as mp
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(_reduce_worker, args=(init, str(tmp_path / "r")), nprocs=2, join=True, start_method="spawn")
    for rank in (0, 1):
        got = torch.load(tmp_path / f"r.{rank}")
        assert torch.equal(got["both"], torch.arange(1.0, 5.0, dtype=torch.float64)) and got["none"] is None


def _hook_counts(tr):
    models = [tr.model, tr.ref_model, tr.model.base_model, tr.ref_model.base_model]
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in models]


def test_the_adapter_replaces_no_trainer_method_and_removes_its_hooks(tiny_models, tmp_path):
    from kl_bench.integrations.demo import build_trainer
    from kl_bench.integrations.trl import KLAudit
    tr = build_trainer(tiny_models, tmp_path / "run", steps=2, learning_rate=0.0)
    before = _hook_counts(tr)
    cb = KLAudit(tr, every=1, print_fn=lambda s: None)
    tr.add_callback(cb)
    tr.add_callback(cb)                       # attached twice: one set of hooks, one audit a step
    tr.train()
    assert not {"compute_loss", "_get_per_token_logps_and_entropies", "log"} & set(vars(tr))
    assert _hook_counts(tr) == before
    assert [r.step for r in cb.log.rows] == [1, 2]
    assert sum("kl_audit/z" in h for h in tr.state.log_history) == 2
    # a second, independent audit on the same trainer agrees with the first
    tr = build_trainer(tiny_models, tmp_path / "run2", steps=1, learning_rate=0.0)
    a, b = (KLAudit(tr, every=1, print_fn=lambda s: None, dtype=torch.float64) for _ in range(2))
    tr.add_callback(a)
    tr.add_callback(b)
    tr.train()
    assert a.log.rows[0].exact == pytest.approx(b.log.rows[0].exact, rel=1e-12) and _hook_counts(tr) == before


def _both_ways(models, tmp_path, **kw):
    """One run audited live (the callback, saving its steps) and again by `kl-bench audit` from its saved
    steps and from its audit.csv alone: the lines each printed (the callback's prefix removed)."""
    import shutil

    from typer.testing import CliRunner

    from kl_bench.cli import app
    from kl_bench.integrations.demo import build_trainer
    from kl_bench.integrations.trl import KLAudit
    out = tmp_path / "audit"
    tr = build_trainer(models, tmp_path / "run", **kw)
    lines = []
    cb = KLAudit(tr, every=1, out=out, save_steps=True, dtype=torch.float64, print_fn=lines.append)
    tr.add_callback(cb)
    tr.train()
    live = [x.removeprefix("kl_audit: ") for x in lines if x.startswith("kl_audit: ")]
    saved = CliRunner().invoke(app, ["audit", str(out)])
    shutil.rmtree(out / "steps")
    replay = CliRunner().invoke(app, ["audit", str(out)])
    cli = [[x for x in r.output.splitlines() if x.strip() and not x.startswith("→")] for r in (saved, replay)]
    return cb, live, (saved, replay), cli


@pytest.mark.parametrize("trainer, kw", [("grpo", dict(top_k=20, use_bias_correction_kl=False, disable_dropout=False)),
                                         ("rloo", dict(top_k=20))], ids=["grpo-dropout", "rloo"])
def test_the_callback_and_kl_bench_audit_print_the_same_lines_once_each(tiny_models, tmp_path, trainer, kw):
    # One voice (kl_bench.audit.verdict.Voice): the same run audited live and by `kl-bench audit`, from its
    # saved steps and from its audit.csv, prints the same lines in the same order, each once: the settings'
    # notes (dropout) included, the sampler's line once for every source of one estimator (RLOO's kl and
    # reward both carry k1), the pooled verdicts once per source; exit 1 where a check failed.
    cb, live, results, cli = _both_ways(tiny_models, tmp_path, trainer=trainer, steps=3, learning_rate=0.0, **kw)
    for res, lines in zip(results, cli):
        assert lines == live, (res.output, live)
        assert res.exit_code == (1 if cb.voice.failed else 0), res.output
    assert len(set(live)) == len(live)                                  # each line once
    # TRL's own log-probs are the callback's: its formula is tested on them and fits (no formula part)
    assert all(r.formula_fit == 0 and r.bias_formula == 0 and r.own_logprobs == r.tokens for r in cb.log.rows)
    sources = ["kl", "reward"] if trainer == "rloo" else ["kl"]
    assert [x.split()[1] for x in live if x.startswith("pooled ")] == sources
    assert sum("the sampler (b: top_k=20) moves" in x for x in live) == 1
    assert sum(x.startswith("step ") for x in live) == 3 * len(sources)
    if trainer == "grpo":
        assert sum("dropout is active" in x for x in live) == 1 and live[0].startswith("warning: dropout")


def test_a_trl_outside_the_tested_range_warns_once_and_runs(tiny_models, tmp_path, monkeypatch):
    from kl_bench.integrations import trl_contract as adapter
    monkeypatch.setattr(adapter.metadata, "version", lambda name: "1.99.0")
    _, cb, lines = _run(tiny_models, tmp_path, steps=1)
    assert sum("outside the tested range" in x for x in lines) == 1 and len(cb.log.rows) == 1
    with pytest.raises(kl_bench.foundation.errors.SpecError, match="cannot read the TRL version"):
        adapter.check_trl_version("one.two")


def test_the_names_the_adapter_relies_on_are_in_the_installed_trl():
    """KLAudit.CONTRACT against the installed TRL: a release that renames one fails here."""
    import inspect

    import trl as installed
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from kl_bench.integrations.trl_contract import CONTRACT, FACTS
    assert {c.split(".")[-1] for c in CONTRACT["trainer classes"]} == set(FACTS)
    for cfg in (GRPOConfig, RLOOConfig):
        fields = set(cfg.__dataclass_fields__)
        assert set(CONTRACT["args"]) <= fields, set(CONTRACT["args"]) - fields
    for cls in (GRPOTrainer, RLOOTrainer):
        src = inspect.getsource(cls)
        for attr in ("beta", "ref_model", "temperature", "num_iterations", "generation_kwargs", "top_k", "top_p",
                     "min_p", "repetition_penalty"):
            assert f"self.{attr}" in src, (cls.__name__, attr)
        assert '_metrics[mode]["kl"]' in src, cls.__name__
        version = tuple(int(x) for x in installed.__version__.split(".")[:2])
        if version >= (1, 15):
            assert "fused_lm_head=True" in src and "outputs.log_probs" in src, cls.__name__
        else:
            assert "logits_to_keep" in src
            from trl.trainer.utils import selective_log_softmax  # noqa: F401


def test_fused_is_passed_to_the_session_and_off_by_default(tiny_models, tmp_path):
    """KLAudit(fused=True) compiles the tile work (kl_bench.audit.fused, tests/test_audit_fused.py); off by
    default: the compile costs ~30 s at the first audited step."""
    from kl_bench.integrations.demo import build_trainer
    from kl_bench.integrations.trl import KLAudit
    tr = build_trainer(tiny_models, tmp_path / "run", steps=1)
    assert KLAudit(tr, fused=True, print_fn=lambda s: None).session.fused
    assert not KLAudit(tr, print_fn=lambda s: None).session.fused
