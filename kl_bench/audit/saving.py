"""Writing saved steps: the format of a ``step-*.safetensors`` file (one scored batch; docs/audit.md
"Saved steps") and its writers, :func:`save_step` from tensors and :func:`save_record` for one audited
batch of the TRL callback (``KLAudit(save_steps=True)``), both atomic."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..foundation.atomic import atomic_write_bytes
from ..foundation.errors import SpecError
from .generation import Sampler
from .session import Record
from .tiling import Head

FORMAT = "kl_bench.audit.step/3"
# /2 adds metrics, sampling_hidden and logit_multiplier; /3 micro_batches (a reader of /2 would pool
# micro-batches that the trainer averaged, so it refuses /3 files instead)
FORMATS = ("kl_bench.audit.step/1", "kl_bench.audit.step/2", FORMAT)
HEADS_FILE = "heads.safetensors"
HEAD_KEYS = ("policy_weight", "reference_weight", "policy_bias", "reference_bias")
REQUIRED = ("completion_ids", "mask")
LOGITS = ("policy_logits", "reference_logits")
HIDDEN = ("policy_hidden", "reference_hidden")


def _safetensors_save():
    """safetensors' writer, or one line saying how to install it (not in kl-bench's base install)."""
    try:
        from safetensors.torch import save
    except ImportError:
        raise SpecError("saving steps needs the safetensors package: pip install safetensors (or the hf extra, "
                        "'kl-bench[hf]')", key="safetensors") from None
    return save


def save_step(path, *, completion_ids, mask, trainer_kl, step: int, estimator: str, aggregation: str = "token-mean",
              source: str = "kl", micro_batches: str = "pooled", generation: dict | None = None,
              logit_scale: float = 1.0, logit_softcap: float | None = None, logit_multiplier: float = 1.0,
              metrics=None, notes=(), engine_dtype: str | None = None, **tensors) -> Path:
    """Write one step to ``path`` (.safetensors), atomically. ``tensors``: ``policy_logits`` and
    ``reference_logits`` [B, T, V]; or ``policy_hidden`` and ``reference_hidden`` [B, T, d] (the hidden
    state that predicts completion token t at index t, after the final norm) with the output layers here
    or in the folder's heads.safetensors (``policy_weight`` [V, d], ``reference_weight``, optional
    biases); optional ``prompt_ids`` [B, P] (what the repetition penalty sees). ``logit_scale``: the
    factor the trainer applies to the logits before its log-softmax (1/T in TRL and verl).
    ``logit_softcap``: the model's final_logit_softcapping c (Gemma), applied to h @ Wᵀ (+ bias) as
    c·tanh(z/c) before ``logit_scale``; it only matters for hidden states (saved logits are already capped).
    ``micro_batches``: how the files of one step combine (kl_bench.audit.session.Metric): "pooled" (one
    aggregate of all their rows) or "mean" (the mean of each file's aggregate: TRL's logged GRPO kl).
    ``metrics``: several :class:`~.session.Metric` of one batch (each its own ``trainer_<source>``).
    ``notes``: (key, message) pairs, the trainer's settings a live audit warned about that the tensors do
    not show (dropout, autocast): ``kl-bench audit`` says them again, once each. ``engine_dtype``: the dtype
    the rollout engine that returned ``engine_logprobs`` computes in (kl_bench.audit.rollout_engine: it tells
    precision from another model version)."""
    save = _safetensors_save()

    meta = {"format": FORMAT, "step": str(int(step)), "estimator": estimator, "aggregation": aggregation,
            "source": source, "micro_batches": micro_batches, "generation": json.dumps(generation or {}),
            "logit_scale": repr(float(logit_scale)),
            "logit_multiplier": repr(float(logit_multiplier))}
    if notes:
        meta["notes"] = json.dumps([[str(k), str(m)] for k, m in notes])
    if engine_dtype is not None:
        meta["engine_dtype"] = str(engine_dtype)
    if logit_softcap is not None:
        meta["logit_softcap"] = repr(float(logit_softcap))
    if metrics is not None:          # several metrics of one batch: trainer_<source> tensors, one per metric
        meta["metrics"] = json.dumps([[m.source, m.estimator, m.aggregation, m.micro_batches] for m in metrics])
    data = {"completion_ids": completion_ids, "mask": mask, "trainer_kl": trainer_kl, **tensors}
    # host: a file is written from host memory
    data = {k: torch.as_tensor(v).detach().cpu().contiguous() for k, v in data.items() if v is not None}
    path = Path(path)
    atomic_write_bytes(path, save(data, metadata=meta))
    return path


def save_record(folder, record: Record, heads: tuple[Head, Head], *, step: int, index: int, metrics,
                generation: Sampler, notes=()) -> Path:
    """One audited batch of the TRL callback (``KLAudit(save_steps=True)``) as a saved step: hidden states
    (the drawing pass's too, when captured), ids, mask, the trainer's values per metric and the policy's
    output layer as it was at that step; the reference's (frozen) once, in the folder's heads.safetensors."""
    from dataclasses import asdict

    save = _safetensors_save()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / HEADS_FILE).exists():
        ref = {"reference_weight": heads[1].weight, "reference_bias": heads[1].bias}
        atomic_write_bytes(folder / HEADS_FILE, save({k: v.detach().cpu().contiguous() for k, v in ref.items()
                                                      if v is not None}))
    gen = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(generation).items()}
    values = {f"trainer_{m.source}": record.values_for(m.source) for m in metrics}
    first = values.pop(f"trainer_{metrics[0].source}")
    return save_step(folder / f"step-{step:06d}-{index:03d}.safetensors", completion_ids=record.completion_ids,
                     mask=record.mask.to(torch.uint8), trainer_kl=first, step=step, estimator=metrics[0].estimator,
                     aggregation=metrics[0].aggregation, source=metrics[0].source,
                     micro_batches=metrics[0].micro_batches, generation=gen,
                     logit_scale=heads[0].scale, logit_softcap=heads[0].softcap, logit_multiplier=heads[0].multiplier,
                     metrics=metrics if len(metrics) > 1 else None, notes=notes, policy_hidden=record.policy_hidden,
                     reference_hidden=record.reference_hidden, sampling_hidden=record.sampling_hidden,
                     prompt_ids=record.prompt_ids, policy_weight=heads[0].weight, policy_bias=heads[0].bias,
                     policy_logprobs=record.policy_logprobs, reference_logprobs=record.reference_logprobs, **values)




def _aligned(x, shape: tuple) -> torch.Tensor | None:
    """A per-token tensor [B, S] as given, or [B, T] (the last T tokens of the sequences) padded on the left."""
    if x is None:
        return None
    x = torch.as_tensor(x)      # host: or a tensor's own device (as_tensor keeps it); saved from the host
    if tuple(x.shape) == shape:
        return x
    if x.ndim != 2 or x.shape[0] != shape[0] or x.shape[1] > shape[1]:
        raise SpecError(f"must be [B, S] = {list(shape)} or [B, T ≤ S] (the last T tokens), got {list(x.shape)}",
                        key="per-token tensor")
    return torch.cat([x.new_zeros(shape[0], shape[1] - x.shape[1]), x], dim=1)


@torch.no_grad()
def save_model_step(path, policy, reference, *, sequences, mask, trainer_kl, step: int, estimator: str,
                    attention_mask=None, engine_logprobs=None, policy_logprobs=None, reference_logprobs=None,
                    **settings) -> Path:
    """A saved step from a trainer's batch as it holds it and its two models as Hugging Face causal LMs (the
    policy and the reference at this step, loaded in the dtype the audit should see: float32): each model's
    last hidden states (``hidden_states[-1]``, after the final norm) at the positions that predict the counted
    tokens, its output layer, and the batch's tensors, through :func:`save_step` (``settings``: its keywords,
    ``aggregation``, ``generation``, ``logit_scale``, ``engine_dtype``, ...).

    ``sequences`` [B, S]: the ids, prompt and completion; ``attention_mask`` [B, S] (default: all ones;
    positions are derived from it, as verl and OpenRLHF pass them); ``mask`` and the per-token tensors
    (``trainer_kl``, the engine's and the trainer's own log-probs) [B, S] with the value at index t for token t
    (NeMo-RL's layout), or [B, T] for the last T tokens (verl's ``responses``, OpenRLHF's actions). Token t is
    predicted at position t − 1; columns before the first counted token are dropped. The hidden states and
    the output layers are what the file holds (O(B·S·d + V·d)): a certification run's few steps, not every one."""
    ids = torch.as_tensor(sequences)      # host: or the trainer's device (as_tensor keeps a tensor's)
    shape = tuple(ids.shape)
    am = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask)  # host: as ids
    positions = (am.long().cumsum(-1) - 1).clamp(min=0)
    per_token = {k: _aligned(v, shape) for k, v in (("mask", mask), ("trainer_kl", trainer_kl),
                 ("engine_logprobs", engine_logprobs), ("policy_logprobs", policy_logprobs),
                 ("reference_logprobs", reference_logprobs))}
    counted = per_token["mask"][:, 1:].bool()
    start = int(counted.any(0).nonzero()[0]) if counted.any() else 0
    cols = slice(start + 1, None)                        # token t's column; its hidden state is at t − 1
    hidden, heads = {}, {}
    for side, model in (("policy", policy), ("reference", reference)):
        out = model(input_ids=ids, attention_mask=am, position_ids=positions, output_hidden_states=True)
        hidden[f"{side}_hidden"] = out.hidden_states[-1][:, start:-1]
        layer = model.get_output_embeddings()
        heads[f"{side}_weight"] = layer.weight
        if getattr(layer, "bias", None) is not None:
            heads[f"{side}_bias"] = layer.bias
    values = {k: None if v is None else v[:, cols] for k, v in per_token.items()}
    return save_step(path, completion_ids=ids[:, cols], mask=values.pop("mask").to(torch.uint8),
                     trainer_kl=values.pop("trainer_kl"), step=step, estimator=estimator, **settings, **hidden, **heads,
                     **values)
