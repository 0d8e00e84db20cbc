"""KLAudit: a TRL callback that audits the trainer's KL against the exact KL of the policy it trains.

    trainer.add_callback(KLAudit(trainer, every=10, max_rows=8))

Every ``every`` optimizer steps it takes, from TRL's own passes (no extra forward through a model body):
the last hidden states of the policy and the reference (a forward hook on each model's body), the
output layers, the sampled ids, the mask, TRL's per-token log-probs of both models (hence TRL's per-token
KL) and the generation settings; it computes the exact per-position values streamed over vocabulary tiles
(kl_bench.audit.stream) for up to ``max_rows`` rows a step, spread over the step's micro-batches (each
gradient-accumulation pass is audited as it happens, before the optimizer step; their additive sums pool
into one step audit), audits the step (kl_bench.audit.step), logs
``kl_audit/*`` metrics through TRL's reporters, prints one line, and warns (one line each) about what it
finds. Multi-process: each rank audits its own rows; the additive sums are all-reduced, rank 0 prints.

Supported: TRL 1.16 (GRPOTrainer, with and without ``use_bias_correction_kl``; RLOOTrainer). The facts it
relies on (where the KL is formed, which pass scores it) are listed in docs/audit.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from ..audit.sampler import Sampler
from ..audit.step import AuditLog, StepAudit, step_line, step_sums
from ..audit.stream import Head, stream_values
from ..errors import SpecError

SUPPORTED = ((1, 16), (1, 17))        # [lo, hi) on (major, minor)
SUPPORTED_TEXT = "trl >= 1.16, < 1.17 (tested: 1.16.0)"

try:                                   # the callback base class, when TRL (transformers) is installed
    from transformers import TrainerCallback as _Base
except ImportError:                    # pragma: no cover - the trl extra installs it
    _Base = object


def check_trl_version(version: str | None = None) -> str:
    """The installed TRL version, or a one-line SpecError naming the supported range."""
    try:
        version = version or metadata.version("trl")
    except metadata.PackageNotFoundError:
        raise SpecError(f"KLAudit needs TRL: pip install 'kl-bench[trl]' ({SUPPORTED_TEXT})") from None
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        raise SpecError(f"cannot read the TRL version '{version}'; supported: {SUPPORTED_TEXT}") from None
    if not SUPPORTED[0] <= (major, minor) < SUPPORTED[1]:
        raise SpecError(f"TRL {version} is not supported by KLAudit; supported: {SUPPORTED_TEXT}")
    return version


@dataclass(frozen=True)
class TrainerFacts:
    """Where a trainer forms its KL. ``estimator``: the kl_bench preset equal to its per-token formula;
    ``phase``: the pass whose policy log-probs enter it ("loss": the loss pass; "generation": the pass
    after sampling); ``aggregation``: how its per-token values are combined."""
    estimator: str
    source: str
    aggregation: str
    phase: str


# GRPO: per_token_kl = exp(ref − logp) − (ref − logp) − 1 = k3 (log r = ref − logp) in the loss (× coef_1 = 1 on-policy), logged as its
# masked token mean. RLOO: old − ref (k1) from the pass after generation, summed per sequence into the reward.
FACTS = {"GRPOTrainer": TrainerFacts("trl.grpo", "loss", "token-mean", "loss"),
         "RLOOTrainer": TrainerFacts("k1", "reward", "seq-mean-token-sum", "generation")}

MODELLED = {"max_new_tokens", "do_sample", "pad_token_id", "bos_token_id", "eos_token_id", "temperature", "top_p",
            "top_k", "min_p", "repetition_penalty", "cache_implementation", "min_new_tokens", "disable_compile"}


def trainer_facts(trainer) -> TrainerFacts:
    for cls in type(trainer).__mro__:
        if cls.__name__ in FACTS:
            return FACTS[cls.__name__]
    raise SpecError(f"KLAudit supports {', '.join(FACTS)} (and their subclasses), not {type(trainer).__name__}")


def _body(model):
    """The model body whose output is the last hidden state (after the final norm, for GPT-2, Llama, Qwen)."""
    body = getattr(model, "base_model", None)
    if body is None or body is model:
        raise SpecError(f"{type(model).__name__} has no separate body (base_model) to hook")
    return body


def _head(model, temperature: float) -> Head:
    out = model.get_output_embeddings()
    bias = getattr(out, "bias", None)
    # TRL divides the logits by the temperature before its log-softmax, in both models: so does the audit.
    # Gemma-style models cap their logits inside forward (c·tanh(z/c), config.final_logit_softcapping),
    # before TRL sees them: the head caps them too, before the 1/T scale.
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return Head(out.weight.detach(), None if bias is None else bias.detach(), scale=1.0 / temperature,
                softcap=float(cap) if cap else None)


class KLAudit(_Base):
    """A TRL ``TrainerCallback``; see the module docstring. ``threshold``: |z| that warns; ``out``: a
    folder for audit.csv and run.json at the end of training; ``dtype``: the audit's logit matmul
    (float64: exact to rounding)."""

    def __init__(self, trainer, every: int = 10, max_rows: int = 8, *, threshold: float = 5.0, out=None,
                 tile: int = 8192, chunk: int = 256, dtype: torch.dtype = torch.float64, print_fn=print):
        self.version = check_trl_version()
        if every < 1 or max_rows < 1:
            raise SpecError(f"every and max_rows must be ≥ 1, got {every} and {max_rows}")
        self.trainer, self.facts = trainer, trainer_facts(trainer)
        self.every, self.max_rows, self.threshold = every, max_rows, threshold
        self.out, self.tile, self.chunk, self.dtype, self.print = out, tile, chunk, dtype, print_fn
        self.log = AuditLog()
        self.warnings: list[str] = []
        self._warned: set[str] = set()
        self._active = self._in_loss = self._capturing = False
        self._pending: torch.Tensor | None = None          # this step's additive sums, once audited
        # The last audited step's inputs on this rank (for inspection and tests): TRL's per-token log-probs
        # of both models, the mask and ids, the hidden states, and the exact values (PositionValues).
        self.last_inputs: dict | None = None
        self.step_inputs: list[dict] = []                   # every audited micro-batch of the last audited step
        self._captured: list[torch.Tensor] = []
        self._records: dict[str, list[dict]] = {"policy": [], "ref": []}
        self._passes = self._rows_used = 0                  # policy passes and rows audited this step
        self.disabled = self._check_setup()
        self.sampler = self._sampler()
        self._install()

    # ------------------------------------------------------------------ setup
    def _check_setup(self) -> bool:
        """One warning line for each setting the audit does not model; True when nothing can be audited."""
        tr = self.trainer
        if getattr(tr, "beta", 0.0) == 0.0:
            self._warn("beta", "beta = 0: the trainer computes no KL, nothing to audit")
            return True
        if getattr(tr, "ref_model", None) is None:
            # TRL 1.16 then scores the reference with the policy's own model under use_adapter(...): the
            # base weights with the adapter disabled (or a "ref" adapter), a pass the hooks cannot tell apart.
            self._warn("peft", "PEFT: the reference is the policy with its adapter disabled, which the audit does "
                               "not model; nothing will be audited (give the trainer a separate ref_model to audit)")
            return True
        mu = int(getattr(tr, "num_iterations", 1) or 1)
        if mu > 1:
            # Iteration 1 scores the policy that sampled (no optimizer step since generation); iterations
            # 2..μ reuse the batch with no reference pass, after the policy has moved: q ≠ the sampler, and
            # the KL term is weighted by coef_1 ≠ 1 (use_bias_correction_kl). Not modelled, not audited.
            self._warn("iterations", f"num_iterations = {mu}: only the first pass over each generation batch is "
                                     f"audited; passes 2 to {mu} score a policy that has moved since it sampled "
                                     "(not modelled) and are skipped")
        return False

    def _sampler(self) -> Sampler:
        """b from the generation settings TRL passes to generate() (its merged generation_kwargs, which a
        user's args.generation_kwargs override), with the trainer's attributes as defaults."""
        tr = self.trainer
        kw = dict(getattr(tr, "generation_kwargs", None) or {})
        other = sorted(k for k, v in kw.items() if k not in MODELLED and v is not None)
        if getattr(tr.args, "use_vllm", False):
            other.append("use_vllm")
        temperature = float(getattr(tr, "temperature", 1.0) or 1.0)
        if kw.get("temperature") is not None and float(kw["temperature"]) != temperature:
            other.append(f"temperature {kw['temperature']} in generation_kwargs but {temperature} in the loss")
        if other:
            self._warn("unmodelled", f"generation options the audit does not model: {', '.join(other)}; the "
                                     "sampler bias and the consistency check ignore them")

        def setting(name):
            return kw[name] if kw.get(name) is not None else getattr(tr, name, None)
        eos = kw.get("eos_token_id", getattr(tr, "eos_token_ids", None))
        return Sampler(top_k=setting("top_k"), top_p=setting("top_p"), min_p=setting("min_p"),
                       repetition_penalty=setting("repetition_penalty") or 1.0,
                       min_new_tokens=int(kw.get("min_new_tokens") or 0),
                       eos_token_id=() if eos is None else tuple(eos if isinstance(eos, (list, tuple)) else [eos]))

    def _install(self):
        tr = self.trainer
        policy = tr.accelerator.unwrap_model(tr.model)
        self._models = {"policy": policy, "ref": tr.ref_model}
        for role, model in self._models.items():
            if model is not None:
                _body(model).register_forward_hook(self._hook)
        logps_fn = tr._get_per_token_logps_and_entropies
        loss_fn = tr.compute_loss

        def get_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            role = self._role(model)
            if role is None:
                return logps_fn(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            self._captured, self._capturing = [], True
            try:
                out = logps_fn(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            finally:
                self._capturing = False
            self._record(role, input_ids, attention_mask, logits_to_keep, out[0])
            if role == "policy":
                self._check_dropout()
            # Audit now, before the optimizer step changes the output layer the hidden states went through.
            self._audit_pending()
            return out

        def compute_loss(model, inputs, *args, **kwargs):
            self._in_loss = True
            try:
                return loss_fn(model, inputs, *args, **kwargs)
            finally:
                self._in_loss = False
        tr._get_per_token_logps_and_entropies = get_logps
        tr.compute_loss = compute_loss

    def _role(self, model) -> str | None:
        if not self._active:
            return None
        unwrapped = self.trainer.accelerator.unwrap_model(model)
        if unwrapped is self._models["ref"] or model is self._models["ref"]:
            return "ref"
        phase = "loss" if self._in_loss else "generation"
        if unwrapped is self._models["policy"] and phase == self.facts.phase and self._rows_left() > 0:
            return "policy"
        return None

    def _passes_per_step(self) -> int:
        """The policy passes a step makes in the audited phase: one per micro-batch (gradient
        accumulation) for the loss pass; one per generation for the pass after sampling."""
        if self.facts.phase == "loss":
            return max(int(getattr(self.trainer.args, "gradient_accumulation_steps", 1) or 1), 1)
        return 1

    def _rows_left(self) -> int:
        """This pass's share of the step's ``max_rows``: what is left spread evenly over the passes left
        (ceil), so that every micro-batch is audited and a small micro-batch leaves its share to later ones."""
        left = self.max_rows - self._rows_used
        passes_left = max(self._passes_per_step() - self._passes, 1)
        return -(-left // passes_left) if left > 0 else 0

    def _hook(self, module, args, output):
        if self._capturing:
            hidden = output[0] if isinstance(output, (tuple, list)) else output.last_hidden_state
            self._captured.append(hidden.detach())

    def _record(self, role, input_ids, attention_mask, k, logps):
        hidden = torch.cat(self._captured) if self._captured else None
        if hidden is None or hidden.shape[:2] != input_ids.shape:
            self._warn("hook", "the forward hook saw no hidden states of the expected shape; step not audited")
            return
        rows = input_ids.shape[0]
        if role == "policy":
            rows = min(self._rows_left(), rows)
            self._passes, self._rows_used = self._passes + 1, self._rows_used + rows
        length = input_ids.shape[1]
        # The hidden state at position t predicts token t + 1: completion tokens [L − k, L) come from [L − k − 1, L − 1).
        self._records[role].append({
            "input_ids": input_ids[:rows].detach().cpu(), "mask": attention_mask[:rows, -k:].detach().cpu(),
            "hidden": hidden[:rows, length - k - 1:length - 1].cpu(), "logps": logps[:rows].detach().cpu(),
            "audited": False})

    def _warn(self, key: str, message: str, once: bool = True) -> None:
        if once and key in self._warned:
            return
        self._warned.add(key)
        line = f"kl_audit: warning: {message}"
        self.warnings.append(line)
        if self._is_main():
            self.print(line)

    def _is_main(self) -> bool:
        return bool(getattr(self.trainer.accelerator, "is_main_process", True))

    # ------------------------------------------------------------------ callback events
    def on_step_begin(self, args, state, control, **kwargs):
        self._active = not self.disabled and state.global_step % self.every == 0
        self._records, self._pending = {"policy": [], "ref": []}, None
        self._passes = self._rows_used = 0
        if self._active:
            self.step_inputs = []
            self._check_run_settings()

    def on_step_end(self, args, state, control, **kwargs):
        if not self._active:
            return
        self._active = False
        # Every rank takes part in the reduction, rows of its own or not (one that returned early would
        # leave the others waiting in all_reduce).
        sums = self._reduce(self._pending)
        if sums is None:
            if int(getattr(self.trainer, "num_iterations", 1) or 1) == 1:     # else: said once, at the start
                self._warn("match", f"step {state.global_step}: no policy rows matched with reference rows; not "
                                    "audited", once=False)
            return
        unmatched = sum(not r["audited"] for r in self._records["policy"])
        if unmatched:
            self._warn("partial", f"step {state.global_step}: {unmatched} of {len(self._records['policy'])} audited "
                                  "micro-batches had no matching reference rows; the step audit covers the others",
                       once=False)
        self._report(self.log.add(StepAudit.from_sums(sums, step=state.global_step, source=self.facts.source,
                                                      estimator=self.facts.estimator,
                                                      aggregation=self.facts.aggregation)))

    def on_train_end(self, args, state, control, **kwargs):
        if self.out is not None and self.log.rows and self._is_main():
            self.log.write(Path(self.out), trainer=type(self.trainer).__name__, trl=self.version,
                           sampler=self.sampler.describe(), every=self.every, max_rows=self.max_rows)

    # ------------------------------------------------------------------ the audit
    def _check_dropout(self):
        """Called right after the audited policy pass, when the model's train/eval mode is that pass's."""
        policy = self._models["policy"]
        if policy.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in policy.modules()):
            self._warn("dropout", "dropout is active in the policy's passes: the loss scores a noisy policy, not "
                                  "the one that sampled (the audit's exact KL is of that noisy policy); set "
                                  "disable_dropout=True")

    def _check_run_settings(self):
        args = self.trainer.args
        if getattr(args, "bf16", False) or getattr(args, "fp16", False):
            self._warn("precision", f"log-probs are computed under {'bf16' if args.bf16 else 'fp16'} autocast: "
                                    "the logged KL carries their rounding (bias_precision); set bf16=False to remove it")

    def _audit_pending(self) -> None:
        """Audit each policy record not yet audited that the step's reference rows cover, and add its
        sums to the step's: the sums are additive over rows (kl_bench.audit.step), so the micro-batches
        pool into one step audit exactly as if they were one batch."""
        for pol in self._records["policy"]:
            if pol["audited"] or not self._records["ref"]:
                continue
            sums = self._audit(pol)
            if sums is None:
                continue                                   # no matching reference rows (yet)
            pol["audited"] = True
            self._pending = sums if self._pending is None else self._pending + sums

    def _matched(self, pol):
        """The reference rows (hidden states, log-probs) matching the policy record's rows, or None."""
        refs = self._records["ref"]
        pool_ids = torch.cat([r["input_ids"] for r in refs if r["input_ids"].shape[1] == pol["input_ids"].shape[1]] or
                             [pol["input_ids"][:0]])
        if pool_ids.shape[0] == 0:
            return None
        same = (pol["input_ids"].unsqueeze(1) == pool_ids.unsqueeze(0)).all(-1)       # [R, pool]
        if not bool(same.any(-1).all()):
            return None
        idx = same.float().argmax(-1)
        cat = {key: torch.cat([r[key] for r in refs if r["input_ids"].shape[1] == pol["input_ids"].shape[1]])
               for key in ("hidden", "logps")}
        return {key: v[idx] for key, v in cat.items()}

    @torch.no_grad()
    def _audit(self, pol) -> torch.Tensor | None:
        """This rank's additive sums for one policy record (kl_bench.audit.step.step_sums), or None
        (its rows have no matching reference rows)."""
        ref = self._matched(pol)
        if ref is None:
            return None
        mask = pol["mask"].bool()
        k = mask.shape[1]
        comp_ids = pol["input_ids"][:, -k:]
        temperature = float(getattr(self.trainer, "temperature", 1.0) or 1.0)
        heads = [_head(self._models[r], temperature) for r in ("policy", "ref")]
        ctx = None
        if self.sampler.repetition_penalty != 1.0:     # every id before the position, prompt padding included
            full = pol["input_ids"]
            prefix = full.shape[1] - k
            pos = torch.arange(full.shape[1])
            ctx = torch.stack([torch.where(pos < prefix + j, full[b], -1) for b, j in mask.nonzero().tolist()])
        banned = None
        if self.sampler.min_new_tokens:
            banned = (torch.arange(k).expand_as(mask) < self.sampler.min_new_tokens)[mask]
        values = stream_values(pol["hidden"][mask], ref["hidden"][mask], heads[0], heads[1], (self.facts.estimator,),
                               self.sampler, ids=comp_ids[mask], eos_banned=banned, context_ids=ctx,
                               chunk=self.chunk, tile=self.tile, dtype=self.dtype)
        self.last_inputs = {"policy_logps": pol["logps"], "ref_logps": ref["logps"], "mask": mask,
                            "input_ids": pol["input_ids"], "completion_ids": comp_ids, "policy_hidden": pol["hidden"],
                            "ref_hidden": ref["hidden"], "values": values}
        self.step_inputs.append(self.last_inputs)
        from ..estimators import ESTIMATORS
        # TRL's per-token KL from its own log-probs, in its dtype (the preset is its formula, bit for bit).
        trainer_values = ESTIMATORS[self.facts.estimator].fn(ref["logps"] - pol["logps"])
        return step_sums(values, trainer_values, mask, estimator=self.facts.estimator, aggregation=self.facts.aggregation)

    def _reduce(self, sums: torch.Tensor | None) -> torch.Tensor | None:
        """Sum the ranks' additive sums (each rank audited its own rows; None: none on this rank). Every
        rank calls it at every audited step: first the largest length (0 where no rank has rows: None for
        all), then the sums, zeros standing in for a rank without rows (zero rows add nothing)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return sums
        device = self.trainer.accelerator.device
        n = torch.tensor([0 if sums is None else sums.numel()], dtype=torch.int64, device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        if int(n.item()) == 0:
            return None
        t = (torch.zeros(int(n.item()), dtype=torch.float64) if sums is None else sums).to(device)
        dist.all_reduce(t)
        return t.cpu()

    def _report(self, a: StepAudit) -> None:
        metrics = {"logged": a.logged, "exact": a.exact, "bias": a.bias, "se": a.se, "z": a.z,
                   "bias_sampler": a.bias_sampler, "bias_precision": a.bias_precision,
                   "consistency_z": a.consistency_z, "miss": a.miss, "p_negative": a.p_negative}
        store = getattr(self.trainer, "_metrics", None)      # TRL averages these at its next logging step
        if isinstance(store, dict) and "train" in store:
            for key, v in metrics.items():
                store["train"][f"kl_audit/{key}"].append(float(v))
        if self._is_main():
            self.print(f"kl_audit: {step_line(a)}")
        self._warn_step(a)

    def _warn_step(self, a: StepAudit) -> None:
        if abs(a.z) > self.threshold:
            self._warn("z", f"step {a.step}: the logged KL {a.logged:.4g} is {a.bias:+.3g} from the exact {a.exact:.4g} "
                            f"(z = {a.z:+.1f}); see the bias split in kl_audit/bias_sampler and bias_precision",
                       once=False)
        if abs(a.expected_b - a.expected_q) > 0.05 * abs(a.expected_q):
            self._warn("sampler", f"step {a.step}: the sampler ({self.sampler.describe()}) moves the estimator's mean "
                                  f"by {(a.expected_b - a.expected_q) / abs(a.expected_q):+.0%}: the logged KL is of "
                                  "another distribution; sample with top_k=0, top_p=1, min_p=0 or weight by q/b",
                       once=False)
        if abs(a.consistency_z) > self.threshold:
            self._warn("consistency", f"step {a.step}: the sampled tokens do not fit the distribution the loss scores "
                                      f"(consistency z = {a.consistency_z:+.1f}, {a.impossible} impossible tokens); "
                                      "likely causes: position ids (left padding without position_ids), dropout in the "
                                      "loss pass, bf16/fp16 log-probs, an unmodelled generation option", once=False)
        pooled = self.log.pooled()[a.source]
        if pooled["steps"] > 1 and abs(pooled["consistency_z"]) > self.threshold:
            self._warn("consistency_pooled", f"over {pooled['steps']} audited steps the sampled tokens do not fit the "
                                             f"distribution the loss scores (pooled consistency z = "
                                             f"{pooled['consistency_z']:+.1f}); likely causes: position ids (left "
                                             "padding without position_ids), dropout, bf16/fp16 log-probs")
        if pooled["steps"] > 1 and abs(pooled["z"]) > self.threshold:
            self._warn("z_pooled", f"over {pooled['steps']} audited steps the logged KL is biased: mean bias "
                                   f"{pooled['mean_bias']:+.3g} ± {pooled['se']:.2g} (pooled z = {pooled['z']:+.1f})")
