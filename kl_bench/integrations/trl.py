"""KLAudit: a TRL callback that audits the trainer's KL against the exact KL of the policy it trains.

    trainer.add_callback(KLAudit(trainer, every=10, max_rows=8))

A thin adapter over the trainer-agnostic core (kl_bench.audit.session) that captures what TRL's own passes
compute through forward hooks it removes at the end of training (no extra forward through a model body, no
trainer method replaced). The TRL versions it supports, what its hooks capture, which rows each step audits,
and what it logs, prints and writes: docs/audit.md section 5. This module is the callback itself (its hooks,
the audit of captured rows, its lines and metrics); what it knows of TRL is in :mod:`.trl_contract` (the
names it relies on: :data:`kl_bench.integrations.trl_contract.CONTRACT`), what its hooks capture in
:mod:`.trl_capture`.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from ..audit.generation import Sampler
from ..audit.session import AuditSession, Record
from ..audit.verdict import Thresholds, Voice, pooled_line
from ..foundation.errors import SpecError
from .trl_capture import Capture, Generation
from .trl_contract import MODELLED, body_of, check_trl_version, head_of, trainer_facts

try:                                   # the callback base class, when TRL (transformers) is installed
    from transformers import TrainerCallback as _Base
except ImportError:                    # pragma: no cover - the trl extra installs it
    _Base = object


class KLAudit(_Base):
    """A TRL ``TrainerCallback``; see docs/audit.md section 5. ``thresholds``: when to warn
    (kl_bench.audit.verdict); ``out``: a folder for audit.csv and run.json at the end of training;
    ``save_steps``: also write each audited batch to ``out/steps/`` (hidden states and output layers:
    ``kl-bench audit out`` re-audits them); ``dtype``: the audit's tile matmuls (float32, TF32 off;
    float64: exact to rounding); ``negative``: P(f < 0) of a sign-changing estimator under a sampler that
    does not truncate (RLOO's k1 at top_k = 0) costs a second pass, three more head matmuls (both models
    and the drawing pass), which would take RLOO's audited step from ~3.8 to ~6.9 head forwards: opt-in
    (True), and ``kl_audit/p_negative`` is then reported; by default it is left out (NaN, not logged). GRPO's
    k3 never changes sign (P = 0), and a truncating sampler gives it in one pass whatever this says.
    ``fused``: the audit's elementwise tile work compiled by torch.compile (kl_bench.audit.fused): a compile
    of ~30 s at the first audited step, then GRPO's audited step costs ~3.1 head forwards instead of ~3.9."""

    def __init__(self, trainer, every: int = 10, max_rows: int = 8, *, thresholds: Thresholds | None = None,
                 threshold: float | None = None, out=None, save_steps: bool = False, tile: int | None = None,
                 chunk: int | None = None, dtype: torch.dtype = torch.float32, negative: bool = False, fused: bool = False,
                 print_fn=print):
        self.print = print_fn
        self.version = check_trl_version(warn=self._say)
        if every < 1 or max_rows < 1:
            raise SpecError(f"every and max_rows must be ≥ 1, got {every} and {max_rows}")
        if save_steps and out is None:
            raise SpecError("save_steps needs out (the folder the steps go to)", key="save_steps")
        self.trainer, self.facts = trainer, trainer_facts(trainer)
        self.every, self.max_rows, self.out, self.save_steps = every, max_rows, out, save_steps
        t = thresholds or Thresholds()
        self.thresholds = t if threshold is None else Thresholds(z=threshold, pooled=t.pooled, sampler=t.sampler)
        self.warnings: list[str] = []
        self._warned: set[str] = set()
        self.voice = Voice()                                # the step lines and their warnings, each once
        self.notes: list[tuple[str, str]] = []              # settings warned about: saved for kl-bench audit
        self.disabled = self._check_setup()
        self.sampler = self._sampler()
        self.temperature = float(getattr(trainer, "temperature", 1.0) or 1.0)
        self.session = AuditSession((None, None), self.facts.metrics, self.sampler, dtype=dtype, chunk=chunk,
                                    tile=tile, negative=negative, fused=fused,
                                    thresholds=self.thresholds)
        self.log = self.session.log
        self.last_inputs: dict | None = None                # the last audited batch (inspection, tests)
        self.step_inputs: list[dict] = []                   # every audited batch of the last audited step
        self._handles: list = []
        self._active = self._active_step = False
        self._step = 0
        self._audited_steps: set[int] = set()
        self._metrics: dict[str, float] = {}                # kl_audit/* waiting for the next log entry
        self.seconds = 0.0                                  # wall time spent auditing (benchmarks/bench_audit.py)
        self._reset()

    # ------------------------------------------------------------------ setup
    def _say(self, line: str) -> None:
        if getattr(getattr(getattr(self, "trainer", None), "accelerator", None), "is_main_process", True):
            self.print(line)

    def _warn(self, key: str, message: str, once: bool = True) -> None:
        if once and key in self._warned:
            return
        self._warned.add(key)
        line = f"kl_audit: warning: {message}"
        self.warnings.append(line)
        self._say(line)

    def _note(self, key: str, message: str) -> None:
        """A setting the tensors do not show (dropout, autocast, generation options, num_iterations): warned
        once, and kept in the saved steps and run.json so that ``kl-bench audit`` says it again."""
        if key not in self._warned:
            self.notes.append((key, message))
        self._warn(key, message)

    def _check_setup(self) -> bool:
        """One warning line for each setting the audit does not model; True when nothing can be audited."""
        tr = self.trainer
        if getattr(tr, "beta", 0.0) == 0.0:
            self._warn("beta", "beta = 0: the trainer computes no KL, nothing to audit")
            return True
        if getattr(tr, "ref_model", None) is None:
            # TRL then scores the reference with the policy's own model under use_adapter(...): the base
            # weights with the adapter disabled (or a "ref" adapter), a pass the hooks cannot tell apart.
            self._warn("peft", "PEFT: the reference is the policy with its adapter disabled, which the audit does "
                               "not model; nothing will be audited (give the trainer a separate ref_model to audit)")
            return True
        mu = int(getattr(tr, "num_iterations", 1) or 1)
        if mu > 1:
            # Iteration 1 scores the policy that sampled; iterations 2..μ reuse the batch after the policy
            # has moved (and weight the KL by coef_1 ≠ 1): not modelled, not audited.
            self._note("iterations", f"num_iterations = {mu}: only the first pass over each generation batch is "
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
            other.append("use_vllm (the engine's tokens: see the rollout-engine audit in docs/audit.md)")
        temperature = float(getattr(tr, "temperature", 1.0) or 1.0)
        if kw.get("temperature") is not None and float(kw["temperature"]) != temperature:
            other.append(f"temperature {kw['temperature']} in generation_kwargs but {temperature} in the loss")
        if other:
            self._note("unmodelled", f"generation options the audit does not model: {', '.join(other)}; the "
                                     "sampler bias and the consistency check ignore them")

        def setting(name):
            return kw[name] if kw.get(name) is not None else getattr(tr, name, None)
        eos = kw.get("eos_token_id", getattr(tr, "eos_token_ids", None))
        return Sampler(top_k=setting("top_k"), top_p=setting("top_p"), min_p=setting("min_p"),
                       repetition_penalty=setting("repetition_penalty") or 1.0,
                       min_new_tokens=int(kw.get("min_new_tokens") or 0),
                       eos_token_id=() if eos is None else tuple(eos if isinstance(eos, (list, tuple)) else [eos]))

    def _reset(self) -> None:
        self._records: dict[str, list[dict]] = {"policy": [], "ref": []}
        self._passes = self._rows_used = 0
        self._generation = Generation()
        self._calls: dict[int, Capture] = {}

    # ------------------------------------------------------------------ hooks (installed at train begin)
    def _install(self) -> None:
        if self._handles or self.disabled:
            return                                         # attached twice: one set of hooks
        tr = self.trainer
        self._models = {"policy": tr.accelerator.unwrap_model(tr.model), "ref": tr.ref_model}
        for role, model in self._models.items():
            self._handles += [model.register_forward_pre_hook(self._pre(role), with_kwargs=True),
                              model.register_forward_hook(self._post(role), with_kwargs=True),
                              body_of(model).register_forward_hook(self._body_hook(role))]
        callbacks = getattr(getattr(tr, "callback_handler", None), "callbacks", None)
        if isinstance(callbacks, list) and self in callbacks:
            # first in line, so that the reporters after it see the kl_audit/* it adds in on_log
            callbacks.remove(self)
            callbacks.insert(0, self)

    def remove_hooks(self) -> None:
        """Remove every hook this callback installed (done at the end of training)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, role: str):
        def hook(module, args, kwargs):
            if self._active:
                self._calls[id(module)] = Capture(role, kwargs)
        return hook

    def _body_hook(self, role: str):
        def hook(module, args, output):
            call = self._calls.get(id(self._models[role])) if self._active else None
            if call is not None:
                call.hidden = output[0] if isinstance(output, (tuple, list)) else output.last_hidden_state
        return hook

    def _post(self, role: str):
        def hook(module, args, kwargs, output):
            call = self._calls.pop(id(module), None)
            if call is None:
                return
            if not call.scoring:
                if role == "policy":
                    self._generation.step(call.kwargs, call.hidden, limit=1 << 30)
                return
            self._scored(call, output)
        return hook

    # ------------------------------------------------------------------ what a scoring pass gives
    def _trainer_logps(self, call: Capture, output) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """TRL's per-token log-probs [B, k] of the completion, its mask [B, k] and k, from a scoring call."""
        kw = call.kwargs
        ids = kw.get("input_ids")
        if ids is None:
            return None
        if getattr(output, "log_probs", None) is not None and kw.get("labels") is not None:       # TRL 1.15+
            scored = kw["labels"] != -100
            first = scored.any(0).nonzero()
            if first.numel() == 0:
                return None
            k = ids.shape[1] - int(first[0])
            return output.log_probs[:, -k:].detach(), scored[:, -k:], k
        if getattr(output, "logits", None) is not None and kw.get("logits_to_keep"):              # TRL 1.14
            from trl.trainer.utils import selective_log_softmax
            k = int(kw["logits_to_keep"]) - 1
            mask = kw["attention_mask"][:, -k:]
            logits = output.logits[:, :-1][:, -k:].detach()
            return selective_log_softmax(logits, ids[:, -k:], temperature=self.temperature, row_mask=mask), mask.bool(), k
        return None

    def _scored(self, call: Capture, output) -> None:
        role = call.role
        phase = "loss" if torch.is_grad_enabled() else "generation"
        if role == "policy" and (phase != self.facts.phase or self._rows_left() <= 0 or not self._active_step):
            return
        got = self._trainer_logps(call, output)
        if got is None or call.hidden is None:
            self._warn("hook", "a scoring pass gave no log-probs or hidden states of the expected form (TRL changed "
                               "its call convention?); not audited")
            return
        logps, mask, k = got
        ids, length = call.kwargs["input_ids"], call.kwargs["input_ids"].shape[1]
        rows = ids.shape[0] if role == "ref" else min(self._rows_left(), ids.shape[0])
        if role == "policy":
            self._passes, self._rows_used = self._passes + 1, self._rows_used + rows
        attention = call.kwargs.get("attention_mask")
        attention = torch.ones_like(ids) if attention is None else attention
        # The hidden state at position t predicts token t + 1: completion tokens [L − k, L) come from [L − k − 1, L − 1).
        record = {"input_ids": ids[:rows].detach(), "attention": attention[:rows].detach(), "mask": mask[:rows],
                  "hidden": call.hidden[:rows, length - k - 1:length - 1].detach(), "logps": logps[:rows],
                  "k": k, "audited": False}
        if role == "policy":
            record["sampling_hidden"] = self._generation.match(record["input_ids"], record["attention"], k)
            self._check_dropout()
        self._records[role].append(record)
        self._audit_pending()

    def _rows_left(self) -> int:
        """This pass's share of the step's ``max_rows``: what is left spread evenly over the passes left
        (ceil), so that every micro-batch is audited and a small micro-batch leaves its share to later ones."""
        left = self.max_rows - self._rows_used
        passes = max(int(getattr(self.trainer.args, "gradient_accumulation_steps", 1) or 1), 1) \
            if self.facts.phase == "loss" else 1
        return -(-left // max(passes - self._passes, 1)) if left > 0 else 0

    def _matched(self, pol):
        """The reference rows (hidden states, log-probs) matching the policy record's rows, or None."""
        refs = [r for r in self._records["ref"] if r["input_ids"].shape[1] == pol["input_ids"].shape[1]
                and r["k"] == pol["k"]]
        if not refs:
            return None
        pool = torch.cat([r["input_ids"] for r in refs])
        same = (pol["input_ids"].unsqueeze(1) == pool.unsqueeze(0)).all(-1)       # [R, pool]
        if not bool(same.any(-1).all()):
            return None
        idx = same.float().argmax(-1)
        return {key: torch.cat([r[key] for r in refs])[idx] for key in ("hidden", "logps")}

    def _audit_pending(self) -> None:
        """Audit each policy record not yet audited that the reference rows cover, now: before the
        optimizer step changes the output layer its hidden states went through."""
        for pol in self._records["policy"]:
            if pol["audited"]:
                continue
            ref = self._matched(pol)
            if ref is None:
                continue
            pol["audited"] = True
            self._audit(pol, ref)

    def _audit(self, pol: dict, ref: dict) -> None:
        heads = [head_of(self._models[r], self.temperature) for r in ("policy", "ref")]
        reason = next((h for h in heads if isinstance(h, str)), None)
        if reason is not None:
            self._warn("head", f"step not audited: {reason}", once=False)
            return
        from ..core.estimators import ESTIMATORS
        values = {m.source: ESTIMATORS[m.estimator].fn(ref["logps"] - pol["logps"]) for m in self.facts.metrics}
        comp = pol["input_ids"][:, -pol["k"]:]
        record = Record(pol["hidden"], ref["hidden"], comp, pol["mask"], values, sampling_hidden=pol["sampling_hidden"],
                        prompt_ids=pol["input_ids"][:, :-pol["k"]].masked_fill(~pol["attention"][:, :-pol["k"]].bool(), -1),
                        policy_logprobs=pol["logps"], reference_logprobs=ref["logps"])
        device = pol["hidden"].device
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            pv = self.session.add(record, heads=tuple(h for h in heads))
        self.seconds += time.perf_counter() - start
        self.last_inputs = {"policy_logps": pol["logps"], "ref_logps": ref["logps"], "mask": pol["mask"],
                            "input_ids": pol["input_ids"], "completion_ids": comp, "policy_hidden": pol["hidden"],
                            "ref_hidden": ref["hidden"], "sampling_hidden": pol["sampling_hidden"], "values": pv,
                            "heads": heads, "record": record}
        self.step_inputs.append(self.last_inputs)
        if self.save_steps:
            from ..audit.saving import save_record
            # numbered as the step audit is: the global step once this optimizer step is done
            save_record(Path(self.out) / "steps", record, heads, step=self._step + 1, index=len(self.step_inputs) - 1,
                        metrics=self.facts.metrics, generation=self.sampler, notes=self.notes)

    def _check_dropout(self):
        """Called at the audited policy pass, when the model's train/eval mode is that pass's."""
        policy = self._models["policy"]
        if policy.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in policy.modules()):
            self._note("dropout", "dropout is active in the policy's passes: the loss scores a noisy policy (the audit's "
                                  "exact KL is of that noisy policy; with generation captured, its gap to the pass "
                                  "that sampled is bias_mismatch); set disable_dropout=True")

    # ------------------------------------------------------------------ callback events
    def on_train_begin(self, args, state, control, **kwargs):
        self._install()

    def on_step_begin(self, args, state, control, **kwargs):
        self._step = state.global_step
        self._active_step = not self.disabled and state.global_step % self.every == 0 \
            and state.global_step not in self._audited_steps
        spg = int(getattr(args, "steps_per_generation", 0) or 0)
        # A generation batch can serve several optimizer steps: then its passes are captured at every step
        # (the last batch kept), so that an audited step finds the reference rows and the drawing pass.
        self._active = self._active_step or spg > int(getattr(args, "gradient_accumulation_steps", 1) or 1)
        if self._active_step or not self._active:
            self._reset()
        self._passes = self._rows_used = 0
        if self._active_step:
            self.step_inputs = []
            self._check_run_settings()

    def _check_run_settings(self):
        args = self.trainer.args
        if getattr(args, "bf16", False) or getattr(args, "fp16", False):
            self._note("precision", f"log-probs are computed under {'bf16' if args.bf16 else 'fp16'} autocast: "
                                    "the logged KL carries their rounding (bias_precision); set bf16=False to remove it")

    def on_step_end(self, args, state, control, **kwargs):
        if not self._active_step:
            return
        self._active_step = False
        self._audited_steps.add(self._step)
        start = time.perf_counter()
        audits = self.session.finish(state.global_step, reduce=self._reduce)        # the step's one host sync
        self.seconds += time.perf_counter() - start
        if not audits:
            if int(getattr(self.trainer, "num_iterations", 1) or 1) == 1:
                self._warn("match", f"step {state.global_step}: no policy rows matched with reference rows; not "
                                    "audited", once=False)
            return
        unmatched = sum(not r["audited"] for r in self._records["policy"])
        if unmatched:
            self._warn("partial", f"step {state.global_step}: {unmatched} of {len(self._records['policy'])} audited "
                                  "micro-batches had no matching reference rows; the step audit covers the others",
                       once=False)
        for a in audits:
            self._report(a)

    def _reduce(self, sums: torch.Tensor | None) -> torch.Tensor | None:
        """Sum the ranks' additive sums (each rank audited its own rows; None: none on this rank). Every
        rank calls it for every metric at every audited step: first the largest length (0 where no rank
        has rows: None for all), then the sums, zeros standing in for a rank without rows."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return sums
        device = self.trainer.accelerator.device
        n = torch.tensor([0 if sums is None else sums.numel()], dtype=torch.int64, device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        if int(n.item()) == 0:
            return None
        t = torch.zeros(int(n.item()), dtype=torch.float64, device=device)
        if sums is not None:                 # a rank with fewer audited micro-batches pads with zero rows
            t[:sums.numel()] = sums.to(device)
        dist.all_reduce(t)
        return t

    def _report(self, a) -> None:
        for key in ("logged", "exact", "bias", "se", "z", "bias_sampler", "bias_mismatch", "bias_precision",
                    "consistency_z", "miss", "p_negative"):
            v = float(getattr(a, key))
            if math.isfinite(v):
                self._metrics[f"kl_audit/{a.source}/{key}" if len(self.facts.metrics) > 1 else f"kl_audit/{key}"] = v
        for line in self.voice.step(a, self.session.warnings(a)):
            if line.startswith("warning: "):
                self.warnings.append(f"kl_audit: {line}")
            self._say(f"kl_audit: {line}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        """The audited step's metrics join this log entry: reporters after this callback see them, and
        the trainer's log history keeps them."""
        if not self._metrics or logs is None:
            return
        logs.update(self._metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._metrics)
        self._metrics = {}

    def on_train_end(self, args, state, control, **kwargs):
        self.remove_hooks()
        for source, p in (self.log.pooled().items() if self.log.rows else ()):
            self._say(f"kl_audit: {pooled_line(source, p)}")
        if self.out is not None and self.log.rows and getattr(self.trainer.accelerator, "is_main_process", True):
            self.log.write(Path(self.out), trainer=type(self.trainer).__name__, trl=self.version,
                           sampler=self.sampler.describe(), every=self.every, max_rows=self.max_rows,
                           steps_saved=bool(self.save_steps), notes=[list(n) for n in self.notes])
