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


def _run(models, tmp_path, *, steps=3, max_rows=8, **kw):
    from kl_bench.integrations.demo import build_trainer
    from kl_bench.integrations.trl import KLAudit
    tr = build_trainer(models, tmp_path / "run", steps=steps, **kw)
    lines = []
    cb = KLAudit(tr, every=1, max_rows=max_rows, print_fn=lines.append, out=tmp_path / "audit")
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
    pooled = cb.log.pooled()["loss"]
    assert all(abs(r.z) < 5 for r in cb.log.rows) and abs(pooled["z"]) < 5 and abs(pooled["consistency_z"]) < 5
    assert all(abs(r.bias_precision) < 1e-5 and abs(r.bias_sampler) < 1e-12 for r in cb.log.rows)
    assert not cb.warnings and sum(line.startswith("kl_audit: step") for line in lines) == 3
    assert (tmp_path / "audit" / "audit.csv").exists() and (tmp_path / "audit" / "run.json").exists()
    assert any(k.startswith("kl_audit/z") for h in tr.state.log_history for k in h)


def test_grpo_top_k_warns_that_the_sampler_moves_the_mean(tiny_models, tmp_path):
    tr, cb, lines = _run(tiny_models, tmp_path, top_k=20, use_bias_correction_kl=False)
    assert any("the sampler (b: top_k=20) moves the estimator's mean" in w for w in cb.warnings)
    assert all(r.miss > 0 and r.bias_sampler != 0 for r in cb.log.rows)
    assert abs(cb.log.pooled()["loss"]["consistency_z"]) < 5      # the tokens do come from the audited b


def test_left_padding_trips_the_consistency_check_and_position_ids_clear_it(tiny_models, tmp_path):
    kw = dict(equal_length=False, max_rows=16, per_device_train_batch_size=16)
    _, cb, _ = _run(tiny_models, tmp_path / "pad", **kw)
    assert cb.log.pooled()["loss"]["consistency_z"] < -5
    assert any("position ids" in w for w in cb.warnings)
    _, cb, _ = _run(tiny_models, tmp_path / "pos", position_ids=True, **kw)
    assert abs(cb.log.pooled()["loss"]["consistency_z"]) < 5 and not any("position ids" in w for w in cb.warnings)


def test_rloo_k1_in_the_reward(tiny_models, tmp_path):
    tr, cb, _ = _run(tiny_models, tmp_path, trainer="rloo", learning_rate=0.0)
    rows = cb.log.rows
    assert len(rows) == 3 and all(r.estimator == "k1" and r.source == "reward" for r in rows)
    last = cb.last_inputs
    logged = [h["kl"] for h in tr.state.log_history if "kl" in h]
    mine = kl_bench.estimate(policy=last["policy_logps"], reference=last["ref_logps"], estimator="k1",
                             mask=last["mask"], aggregation="token-mean")
    assert mine.item() == logged[-1]
    assert all(abs(r.z) < 5 and abs(r.bias_precision) < 1e-4 for r in rows)


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
                     gradient_accumulation_steps=2)
    row, parts = cb.log.rows[-1], cb.step_inputs
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

    from kl_bench.integrations.trl import _head
    lm = torch.nn.Linear(4, 9, bias=False)
    model = SimpleNamespace(get_output_embeddings=lambda: lm, config=SimpleNamespace(final_logit_softcapping=30.0))
    assert _head(model, 0.5).softcap == 30.0 and _head(model, 0.5).scale == 2.0
    model.config.final_logit_softcapping = None                        # Gemma configs may hold None: no cap
    assert _head(model, 1.0).softcap is None


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
