"""What the TRL adapter (kl_bench.integrations.trl) knows of TRL: the tested versions and the names it
relies on (:data:`CONTRACT`), each supported trainer's KL metrics (:data:`FACTS`), the generation settings
the audit models, and how a model's body and output layer are found."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from ..audit.session import Metric
from ..audit.tiling import Head
from ..foundation.errors import SpecError

TESTED = ((1, 14), (1, 17))           # [lo, hi) on (major, minor)
TESTED_TEXT = "trl >= 1.14, < 1.17 (run live: 1.14.0, 1.16.0)"

# What the adapter relies on in TRL (and transformers), by name: tests/test_audit_trl.py checks each
# against the installed version, so that a TRL release that renames one fails a test, not a training run.
CONTRACT = {
    "trainer classes": ("trl.GRPOTrainer", "trl.RLOOTrainer"),
    "trainer attributes": ("beta", "ref_model", "temperature", "num_iterations", "generation_kwargs", "top_k",
                           "top_p", "min_p", "repetition_penalty", "accelerator", "args", "model"),
    "args": ("use_vllm", "gradient_accumulation_steps", "bf16", "fp16"),
    "model calls": ("fused_lm_head=True with labels, output .log_probs (1.15+)",
                    "logits_to_keep, output .logits, trl.trainer.utils.selective_log_softmax (1.14)"),
    "model structure": ("model.base_model (its output .last_hidden_state)", "model.get_output_embeddings()",
                        "config final_logit_softcapping / logit_scale"),
    "logged metric": ("'kl' in the logs of GRPOTrainer and RLOOTrainer",),
}


def check_trl_version(version: str | None = None, warn=print) -> str:
    """The installed TRL version: a one-line SpecError without TRL or with an unreadable version; outside
    the tested range, one warning line (the contract decides at attach time whether it can run)."""
    try:
        version = version or metadata.version("trl")
    except metadata.PackageNotFoundError:
        raise SpecError(f"KLAudit needs TRL: pip install 'kl-bench[trl]' ({TESTED_TEXT})") from None
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        raise SpecError(f"cannot read the TRL version '{version}'; tested: {TESTED_TEXT}") from None
    if not TESTED[0] <= (major, minor) < TESTED[1]:
        warn(f"kl_audit: warning: TRL {version} is outside the tested range ({TESTED_TEXT}); the audit runs if "
             "every name it relies on is there (KLAudit.CONTRACT), and says so in one line if not")
    return version


@dataclass(frozen=True)
class TrainerFacts:
    """Where a trainer forms its KL: the ``metrics`` it logs (source, estimator, aggregation) and the
    ``phase`` of the policy pass whose log-probs enter them ("loss": the pass with gradients;
    "generation": the scoring pass right after sampling)."""
    metrics: tuple[Metric, ...]
    phase: str


# GRPO: per_token_kl = exp(ref − logp) − (ref − logp) − 1 = k3 (log r = ref − logp) in the loss (× coef_1 = 1
# on-policy). Its logged `kl`: each micro-batch appends its token mean (global_masked_mean: summed over
# processes, then divided), and `log` averages what was appended since the last log entry: with
# logging_steps = 1, the mean over the step's micro-batches of their token means, whatever the loss_type.
# RLOO: old − ref (k1) from the pass after generation, logged as `kl`: one token mean of the whole
# generation batch (kl_stats[0] / kl_stats[1]), however many scoring calls made it: pooled; and summed per
# sequence into the reward.
FACTS = {"GRPOTrainer": TrainerFacts((Metric("kl", "trl.grpo", "token-mean", "mean"),), "loss"),
         "RLOOTrainer": TrainerFacts((Metric("kl", "k1", "token-mean"), Metric("reward", "k1", "seq-mean-token-sum")),
                                     "generation")}

# GRPO's KL term in the loss: per_token_loss += beta · per_token_kl, then the loss_type's aggregation of
# each micro-batch (grpo_trainer.py, _compute_loss). Every type but the dapo family divides a micro-batch's
# loss by the accumulation steps, so the step's loss is the mean over micro-batches of their aggregates;
# dapo, cispo and vespo divide the token sum by the generation batch's token count (num_items_in_batch,
# all processes), so that the window's micro-batches pool into one token mean when steps_per_generation =
# gradient_accumulation_steps (TRL's default; otherwise not audited). dr_grpo divides the sequences' sums by
# B · max_completion_length: seq-mean-token-sum up to that constant, which no z depends on.
LOSS_TYPES = {"grpo": ("seq-mean-token-mean", "mean"), "sapo": ("seq-mean-token-mean", "mean"),
              "bnpo": ("token-mean", "mean"), "dr_grpo": ("seq-mean-token-sum", "mean"),
              "luspo": ("seq-mean-token-sum", "mean"), "dapo": ("token-mean", "pooled"),
              "cispo": ("token-mean", "pooled"), "vespo": ("token-mean", "pooled")}

MODELLED = {"max_new_tokens", "do_sample", "pad_token_id", "bos_token_id", "eos_token_id", "temperature", "top_p",
            "top_k", "min_p", "repetition_penalty", "cache_implementation", "min_new_tokens", "disable_compile"}


def trainer_facts(trainer) -> TrainerFacts:
    """The trainer's KL metrics: FACTS by class, and for GRPO its loss's KL term as its loss_type aggregates
    it (source ``loss``, :data:`LOSS_TYPES`) where that differs from the logged ``kl`` (source ``kl``)."""
    for cls in type(trainer).__mro__:
        if cls.__name__ in FACTS:
            facts = FACTS[cls.__name__]
            return _with_loss(facts, trainer) if cls.__name__ == "GRPOTrainer" else facts
    raise SpecError(f"KLAudit supports {', '.join(FACTS)} (and their subclasses), not {type(trainer).__name__}")


def _with_loss(facts: TrainerFacts, trainer) -> TrainerFacts:
    args = getattr(trainer, "args", None)
    gas = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    spg = int(getattr(args, "steps_per_generation", None) or gas)
    form = LOSS_TYPES.get(str(getattr(trainer, "loss_type", getattr(args, "loss_type", ""))))
    if form is None or (form[1] == "pooled" and spg != gas):
        return facts                                   # not modelled: the logged kl alone
    aggregation, micro_batches = form
    if aggregation == "token-mean" and (micro_batches == "mean" or gas == 1):
        return facts                                   # the same number as the logged kl
    return TrainerFacts(facts.metrics + (Metric("loss", facts.metrics[0].estimator, aggregation, micro_batches),),
                        facts.phase)


def body_of(model):
    """The model body whose output is the last hidden state (after the final norm, for GPT-2, Llama, Qwen)."""
    body = getattr(model, "base_model", None)
    if body is None or body is model:
        raise SpecError(f"{type(model).__name__} has no separate body (base_model) to hook")
    return body


def head_of(model, temperature: float) -> Head | str:
    """The output layer as TRL applies it (logit scale, soft-cap, then 1/T), or a one-line reason it
    cannot be read here (sharded or offloaded: a meta placeholder or an empty ZeRO-3 partition)."""
    out = model.get_output_embeddings()
    weight, bias = out.weight.detach(), None if getattr(out, "bias", None) is None else out.bias.detach()
    if hasattr(weight, "full_tensor"):                  # FSDP2 DTensor: gather it, as TRL's own kernel does
        weight = weight.full_tensor()
        bias = None if bias is None else bias.full_tensor()
    if weight.device.type == "meta" or weight.numel() == 0 or weight.ndim != 2:
        return (f"the output layer is not materialised here ({'meta' if weight.device.type == 'meta' else 'an empty'} "
                "placeholder: offloaded or sharded, e.g. DeepSpeed ZeRO-3 outside a gather)")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(cfg, "final_logit_softcapping", None)
    scale = getattr(cfg, "logit_scale", None)
    return Head(weight, bias, scale=1.0 / temperature, softcap=float(cap) if cap else None,
                multiplier=1.0 if scale is None else float(scale))
