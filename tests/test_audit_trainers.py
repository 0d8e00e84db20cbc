"""Beyond TRL, through saved steps (issue 43 item 6): a certification folder per trainer (verl, OpenRLHF,
NeMo-RL), built from that trainer's batch, its tensor names and layout, as the hook of docs/audit.md section 6
builds it (kl_bench.audit.saving.save_model_step), and audited by ``kl-bench audit DIR``, the rollout engine's
check included: an engine in float32 equal to the trainer passes (exit 0, no engine warning); an engine in bf16
with the same weights (precision) or one sampling with other settings (another sampler) is named and exits 1.

The trainers themselves do not run here: each batch holds what the trainer holds at the hook (read in its
source, docs/audit.md), made from tiny random GPT-2s (tests/conftest.py), an engine that generates with
transformers' generate() and returns its processed log-probs, and the trainer's KL formula (its preset)."""
import pytest
import torch
from typer.testing import CliRunner

import kl_bench
from kl_bench.audit.saving import save_model_step
from kl_bench.cli import app

runner = CliRunner()
B, P, T = 24, 4, 10
DECLARED = {"temperature": 1.0, "top_k": 20, "min_new_tokens": T, "eos_token_id": 0}
# engine → (its dtype, its top_k): equal to the trainer, bf16 with the same weights, a wider sampler
ENGINES = {"fp32": (torch.float32, 20), "bf16": (torch.bfloat16, 20), "top_k=50": (torch.float32, 50)}


@pytest.fixture(scope="module")
def rollouts(tiny_models):
    """Per engine: the sequences it generated [B, P + T], its processed log-probs of its tokens [B, T], and the
    trainer's float32 log-probs of them under the policy and the reference [B, T]."""
    from transformers import GPT2LMHeadModel
    policy = GPT2LMHeadModel.from_pretrained(tiny_models / "policy").eval()
    reference = GPT2LMHeadModel.from_pretrained(tiny_models / "reference").eval()
    prompts = torch.randint(1, policy.config.vocab_size, (B, P), generator=torch.Generator().manual_seed(3))
    out = {}
    for name, (dtype, top_k) in ENGINES.items():
        engine = GPT2LMHeadModel.from_pretrained(tiny_models / "policy").to(dtype).eval()
        torch.manual_seed(7)                                    # generate() draws from the global generator
        with torch.no_grad():
            gen = engine.generate(prompts, do_sample=True, top_k=top_k, max_new_tokens=T, min_new_tokens=T,
                                  output_scores=True, return_dict_in_generate=True, pad_token_id=0)
            seq, comp = gen.sequences, gen.sequences[:, P:]
            e = torch.log_softmax(torch.stack(gen.scores, 1).float(), -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
            lq, lr = (torch.log_softmax(m(seq).logits[:, P - 1:-1].float(), -1).gather(-1, comp.unsqueeze(-1))
                      .squeeze(-1) for m in (policy, reference))
        out[name] = (seq, e, lq, lr)
    return policy, reference, out


# ----------------------------------------------------------------------------- each trainer's batch and hook
def verl_hook(path, policy, reference, batch, step):
    """verl (RayPPOTrainer.fit, after apply_kl_penalty): the driver's batch.batch; the KL of
    core_algos.kl_penalty(old_log_probs, ref_log_prob, "kl"), logged as seq-mean-token-mean."""
    kld = kl_bench.ESTIMATORS["verl.kl"].fn(batch["ref_log_prob"] - batch["old_log_probs"])   # = old − ref
    return save_model_step(path, policy, reference, sequences=batch["input_ids"], attention_mask=batch["attention_mask"],
                           mask=batch["response_mask"], trainer_kl=kld, step=step, estimator="verl.kl",
                           aggregation="seq-mean-token-mean", generation=DECLARED, logit_scale=1.0,
                           engine_logprobs=batch["rollout_log_probs"], engine_dtype=batch["engine_dtype"],
                           policy_logprobs=batch["old_log_probs"], reference_logprobs=batch["ref_log_prob"])


def openrlhf_hook(path, policy, reference, s, step):
    """OpenRLHF (RemoteExperienceMaker.make_experience, after the KL loop): one Experience's fields; the KL of
    compute_approx_kl(action_log_probs, base_action_log_probs, "k1")."""
    return save_model_step(path, policy, reference, sequences=s["sequences"], attention_mask=s["attention_mask"],
                           mask=s["action_mask"], trainer_kl=s["kl"], step=step, estimator="openrlhf.k1",
                           aggregation="seq-mean-token-mean", generation=DECLARED, logit_scale=1.0,
                           engine_logprobs=s["rollout_log_probs"], engine_dtype=s["engine_dtype"],
                           policy_logprobs=s["action_log_probs"], reference_logprobs=s["base_action_log_probs"])


def nemo_rl_hook(path, policy, reference, d, step):
    """NeMo-RL (grpo_train, after reference_policy_logprobs): train_data, whole sequences, the value at index t
    for token t; the KL of calculate_kl(prev_logprobs, reference_policy_logprobs, "k3", 20) on-policy."""
    kl = kl_bench.ESTIMATORS["nemo.k3"].fn(d["reference_policy_logprobs"] - d["prev_logprobs"]) * d["token_mask"]
    return save_model_step(path, policy, reference, sequences=d["input_ids"], mask=d["token_mask"], trainer_kl=kl,
                           step=step, estimator="nemo.k3", aggregation="token-mean", generation=DECLARED,
                           logit_scale=1.0, engine_logprobs=d["generation_logprobs"], engine_dtype=d["engine_dtype"],
                           policy_logprobs=d["prev_logprobs"], reference_logprobs=d["reference_policy_logprobs"])


def _whole(x):
    """[B, T] completion values as [B, P + T] (NeMo-RL's layout: 0 at the prompt's positions)."""
    return torch.cat([x.new_zeros(x.shape[0], P), x], 1)


def batches(seq, e, lq, lr, dtype):
    """What each trainer holds at its hook, under its own names."""
    ones = torch.ones(B, T)
    dtype = str(dtype).removeprefix("torch.")
    verl = {"input_ids": seq, "attention_mask": torch.ones_like(seq), "responses": seq[:, P:], "response_mask": ones,
            "old_log_probs": lq, "ref_log_prob": lr, "rollout_log_probs": e, "engine_dtype": dtype}
    openrlhf = {"sequences": seq, "attention_mask": torch.ones_like(seq), "action_mask": ones.bool(),
                "action_log_probs": lq, "base_action_log_probs": lr, "rollout_log_probs": e, "engine_dtype": dtype,
                "kl": kl_bench.ESTIMATORS["openrlhf.k1"].fn(lr - lq)}
    nemo = {"input_ids": seq, "token_mask": _whole(ones), "generation_logprobs": _whole(e), "prev_logprobs": _whole(lq),
            "reference_policy_logprobs": _whole(lr), "engine_dtype": dtype}
    return {"verl": (verl_hook, verl), "openrlhf": (openrlhf_hook, openrlhf), "nemo_rl": (nemo_rl_hook, nemo)}


@pytest.mark.parametrize("trainer", ["verl", "openrlhf", "nemo_rl"])
def test_a_certification_folder_per_trainer(trainer, rollouts, tmp_path):
    policy, reference, out = rollouts
    results = {}
    for engine, (seq, e, lq, lr) in out.items():
        hook, batch = batches(seq, e, lq, lr, ENGINES[engine][0])[trainer]
        folder = tmp_path / trainer / engine
        hook(folder / "step-000001.safetensors", policy, reference, batch, 1)
        res = runner.invoke(app, ["audit", str(folder)])
        results[engine] = res
        assert res.exit_code in (0, 1), res.output
        # the trainer's KL is audited as its own formula of its own log-probs: no formula part
        assert "formula" not in res.output, res.output
    fp32, bf16, sampler = results["fp32"], results["bf16"], results["top_k=50"]
    assert fp32.exit_code == 0 and "rollout engine differs" not in fp32.output, fp32.output
    assert "step 1 engine (processed log-probs, float32" in fp32.output
    assert bf16.exit_code == 1 and bf16.output.count("rollout engine differs") == 1, bf16.output
    assert "Cause that fits: precision: the engine computes in bfloat16" in bf16.output
    assert sampler.exit_code == 1 and "Cause that fits: another sampler" in sampler.output, sampler.output
    assert "outside the support" in sampler.output
