"""The trainer-agnostic audit core: records of a trainer's step in, step audits out (docs/audit.md).

An adapter (kl_bench.integrations.trl for TRL, or your own loop) hands an :class:`AuditSession` one
:class:`Record` per scored batch of rows, right after the trainer scored it (before an optimizer step
moves the output layer), then calls :meth:`AuditSession.finish` once per optimizer step. Each record is
audited at once (exact values streamed from its hidden states, kl_bench.audit.stream) and reduced to
additive sums per :class:`Metric` (kl_bench.audit.step), so micro-batches, and ranks through the
``reduce`` hook, pool into one step audit exactly as one batch of their rows would.

Devices: a record's tensors stay where the trainer has them; the audit runs there, and only the sums
(a vector of ~20 numbers per metric) cross to the host, once per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..foundation.errors import SpecError
from ..core.estimators import resolve_estimator
from .aggregate import LOSS_AGGREGATIONS, MICRO_BATCHES
from .rollout_engine import COARSE, EngineAudit, engine_sums, merge_engine_sums
from .exact import PositionValues
from .generation import Sampler
from .step import SUMS, AuditLog, StepAudit, combine_micro_batches, step_sums
from .stream import stream_values
from .stream_plan import Outputs
from .tiling import Head
from .verdict import Thresholds, Warning, engine_warnings, step_warnings


@dataclass(frozen=True)
class Metric:
    """One KL number a trainer forms: ``source`` names it (audit.csv's column), ``estimator`` is its
    per-token formula (a registry name or library preset), ``aggregation`` how its per-token values
    are combined into the number (kl_bench.audit.aggregate), ``micro_batches`` how the step's records
    (its micro-batches) combine: "pooled", one aggregate of all their rows, or "mean", the mean of each
    record's aggregate (TRL logs GRPO's ``kl`` so: each micro-batch's token mean, then their mean)."""
    source: str
    estimator: str
    aggregation: str
    micro_batches: str = "pooled"

    def __post_init__(self):
        resolve_estimator(self.estimator)
        if self.aggregation not in LOSS_AGGREGATIONS:
            raise SpecError(f"must be one of {', '.join(LOSS_AGGREGATIONS)}, got '{self.aggregation}'", key="aggregation")
        if self.micro_batches not in MICRO_BATCHES:
            raise SpecError(f"must be one of {', '.join(MICRO_BATCHES)}, got '{self.micro_batches}'",
                            key="micro_batches")


def check_distinct_sources(metrics, file: str | None = None) -> None:
    """Refuse a source listed twice in ``metrics`` (one SpecError, key ``metrics``): a step has one number per
    source, and one row per source and step (its sums had taken every token twice)."""
    sources = [m.source for m in metrics]
    twice = next((x for i, x in enumerate(sources) if x in sources[:i]), None)
    if twice is not None:
        raise SpecError(f"source '{twice}' listed twice (each source is one number of the step)", file=file,
                        key="metrics")


@dataclass(frozen=True)
class Record:
    """One batch of B rows as a trainer scored it (tensors on one device).

    ``policy_hidden``/``reference_hidden`` [B, T, d]: each model's last hidden state (after the final norm)
    at the positions that predict completion tokens 0..T−1; ``completion_ids`` [B, T]; ``mask`` [B, T]
    (1: a token the trainer counts); ``trainer_values`` [B, T]: the trainer's own per-token KL values
    (any dtype) of the metrics' estimator(s) — a dict source → [B, T] when metrics differ in formula;
    ``sampling_hidden`` [B, T, d]: the policy's hidden states in the pass that drew the tokens, when the
    adapter captured it (the mismatch part of the split); ``prompt_ids`` [B, P] (−1 or pads as the
    trainer had them): what a repetition penalty sees; ``engine_logprobs`` [B, T]: a rollout engine's
    log-probs of the sampled tokens, when another engine drew them (kl_bench.audit.rollout_engine), and
    ``engine_dtype`` the dtype it computes them in ("bfloat16", "float16", "float32", "float64"; None: not
    declared), which tells precision from another model version;
    ``policy_logprobs``/``reference_logprobs`` [B, T]: the trainer's own log-probs of the sampled tokens, in
    its dtype, when it has them: its values are then tested against its formula of its own log r (the
    formula part of the split; without them, log r is emulated at the dtype of its values)."""
    policy_hidden: torch.Tensor
    reference_hidden: torch.Tensor
    completion_ids: torch.Tensor
    mask: torch.Tensor
    trainer_values: torch.Tensor | dict
    sampling_hidden: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None
    engine_logprobs: torch.Tensor | None = None
    engine_dtype: str | None = None
    policy_logprobs: torch.Tensor | None = None
    reference_logprobs: torch.Tensor | None = None

    def __post_init__(self):
        bt = tuple(self.completion_ids.shape)
        if len(bt) != 2 or tuple(self.mask.shape) != bt:
            raise SpecError(f"completion_ids and mask must be one [B, T] shape, got {list(bt)} and "
                            f"{list(self.mask.shape)}", key="mask")
        for name in ("policy_hidden", "reference_hidden", "sampling_hidden"):
            h = getattr(self, name)
            if h is not None and (h.ndim != 3 or tuple(h.shape[:2]) != bt):
                raise SpecError(f"must be [B, T, d] with [B, T] = {list(bt)}, got {list(h.shape)}", key=name)
        values = self.trainer_values.values() if isinstance(self.trainer_values, dict) else [self.trainer_values]
        if any(tuple(v.shape) != bt for v in values):
            raise SpecError(f"the trainer's per-token values must be [B, T] = {list(bt)}", key="trainer_values")
        self._check_optional(bt)

    def _check_optional(self, bt: tuple) -> None:
        """The trainer's own log-probs (both or neither, [B, T]) and the engine's declared dtype."""
        for name in ("policy_logprobs", "reference_logprobs"):
            v = getattr(self, name)
            if v is not None and tuple(v.shape) != bt:
                raise SpecError(f"must be [B, T] = {list(bt)}, got {list(v.shape)}", key=name)
        if (self.policy_logprobs is None) != (self.reference_logprobs is None):
            raise SpecError("give both models' log-probs or neither", key="reference_logprobs")
        if self.engine_dtype is not None and self.engine_dtype not in COARSE:
            raise SpecError(f"must be one of {', '.join(COARSE)}, got {self.engine_dtype!r}"[:200], key="engine_dtype")

    def own_logr(self) -> torch.Tensor | None:
        """log p − log q from the trainer's own log-probs, in its dtype (None where not given)."""
        if self.policy_logprobs is None:
            return None
        return self.reference_logprobs - self.policy_logprobs

    def values_for(self, source: str) -> torch.Tensor:
        if isinstance(self.trainer_values, dict):
            return self.trainer_values[source]
        return self.trainer_values


def _sampler_inputs(record: Record, sampler: Sampler, mask: torch.Tensor, where: torch.Tensor):
    """Per masked position (``where``: their flat indices in [B, T], row-major): the EOS ban (fewer than
    min_new_tokens completion tokens before it) and the ids a repetition penalty sees (prompt and earlier
    completion tokens; −1 pads)."""
    k = mask.shape[1]
    rows, cols = where // k, where % k
    banned = None
    if sampler.min_new_tokens:
        banned = cols < sampler.min_new_tokens
    ctx = None
    if sampler.repetition_penalty != 1.0:
        if record.prompt_ids is None:
            raise SpecError("a repetition penalty needs the prompt ids", key="prompt_ids")
        full = torch.cat([record.prompt_ids.to(record.completion_ids), record.completion_ids], dim=1)
        prefix = record.prompt_ids.shape[1]
        pos = torch.arange(full.shape[1], device=full.device)
        ctx = torch.where(pos < prefix + cols.unsqueeze(-1), full[rows], torch.full_like(full[rows], -1))
    return banned, ctx


def _counted_positions(record: Record, mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The masked positions [n] (flat indices), after checking that each holds an id of the vocabulary (an id
    outside [0, V) would make its values NaN): both from one nonzero, then one scalar read, whatever the rows."""
    ids = record.completion_ids
    bad = mask & ((ids < 0) | (ids >= vocab))
    found = torch.cat([mask.reshape(-1), bad.reshape(-1)]).nonzero().squeeze(-1)      # ascending
    n = mask.numel()
    if found.numel() and int(found[-1]) >= n:                 # the last index found is past the mask: a bad id
        used = ids[bad]
        raise SpecError(f"holds ids outside the vocabulary [0, {vocab}) at masked-in positions "
                        f"(min {int(used.min())}, max {int(used.max())})", key="completion_ids")
    return found


def _masked(x: torch.Tensor | None, where: torch.Tensor) -> torch.Tensor | None:
    """x [B, T, ...] at the masked positions (flat indices ``where``), in row-major order: an index, not a
    boolean mask (each of which would read the mask back to the host)."""
    return None if x is None else x.reshape(-1, *x.shape[2:]).index_select(0, where.to(x.device))


def _read(record: Record) -> Outputs:
    """The values a step audit of ``record`` reads (kl_bench.audit.step.step_sums, rollout_engine.engine_sums)
    beyond the means: the variances and log-probability statistics of the family that drew the tokens (g
    where the drawing pass is known, else b), and each family's distance to q where an engine drew them.
    The rest is not computed (PositionValues then holds NaN there)."""
    drew = "b" if record.sampling_hidden is None else "g"
    return Outputs(spread=frozenset({drew}), var_q=False, against_q=record.engine_logprobs is not None)


@dataclass
class AuditSession:
    """Audits records into step audits. ``heads``: the policy's and the reference's output layers as the
    trainer applies them (temperature, soft-cap, logit scale: :class:`~.stream.Head`); ``metrics``: the
    KL numbers to audit; ``sampler``: the generation settings (b). ``dtype``, ``chunk``, ``tile``,
    ``negative``, ``fused``: as :func:`~.stream.stream_values`."""
    heads: tuple
    metrics: Sequence[Metric]
    sampler: Sampler = field(default_factory=Sampler)
    dtype: torch.dtype = torch.float32
    chunk: int | None = None          # None: stream.PIECES of the hidden states' device
    tile: int | None = None
    negative: bool = True
    thresholds: Thresholds = field(default_factory=Thresholds)
    log: AuditLog = field(default_factory=AuditLog)
    fused: bool = False

    def __post_init__(self):
        if not self.metrics:
            raise SpecError("an audit needs at least one metric", key="metrics")
        if not isinstance(self.fused, bool):            # checked here, not at the first audited step
            raise SpecError(f"fused must be True or False, got {self.fused!r}", key="fused")
        check_distinct_sources(self.metrics)
        self._pending: dict[str, list[torch.Tensor]] = {}      # source → each record's sums
        self._engine: torch.Tensor | None = None
        self._engine_dtype = ""
        self.estimators = tuple(dict.fromkeys(resolve_estimator(m.estimator).name for m in self.metrics))

    def add(self, record: Record, heads: tuple[Head, Head] | None = None) -> PositionValues:
        """Audit one scored batch now (``heads``: this batch's, when they changed since the session began).
        Returns the exact values at the masked positions: those a step audit reads (the spread of the family
        that drew the tokens; the rollout engine's distances where an engine drew them), the others NaN."""
        mask = record.mask.bool()
        heads = heads or self.heads
        where = _counted_positions(record, mask, heads[0].vocab)
        banned, ctx = _sampler_inputs(record, self.sampler, mask, where)
        values = stream_values(_masked(record.policy_hidden, where), _masked(record.reference_hidden, where),
                               heads[0], heads[1], self.estimators, self.sampler,
                               ids=_masked(record.completion_ids, where), eos_banned=banned, context_ids=ctx,
                               sampling_hidden=_masked(record.sampling_hidden, where), chunk=self.chunk,
                               tile=self.tile, dtype=self.dtype, negative=self.negative, outputs=_read(record),
                               fused=self.fused)
        coarse = max((record.policy_hidden.dtype, heads[0].weight.dtype), key=lambda t: torch.finfo(t).eps)
        self.add_values(values, {m.source: record.values_for(m.source) for m in self.metrics}, mask,
                        own_logr=record.own_logr(), precision=coarse)
        self.add_engine(values, record.engine_logprobs, mask, record.engine_dtype)
        return values

    def add_engine(self, values: PositionValues, engine_logprobs: torch.Tensor | None, mask: torch.Tensor,
                   engine_dtype: str | None = None) -> None:
        """Add a batch's rollout-engine log-probs [B, T] (None: nothing to add) against its exact values."""
        if engine_logprobs is None:
            return
        sums = engine_sums(values, engine_logprobs, mask)
        self._engine = sums if self._engine is None else merge_engine_sums(self._engine, sums)
        self._engine_dtype = engine_dtype or self._engine_dtype

    def add_values(self, values: PositionValues, trainer_values: torch.Tensor | dict, mask: torch.Tensor,
                   own_logr: torch.Tensor | None = None, precision: torch.dtype | None = None) -> None:
        """Add a batch whose exact values are already computed (e.g. from full logits by
        :func:`~.exact.position_values`): ``trainer_values`` [B, T] (or source → [B, T]), ``mask`` [B, T],
        ``own_logr`` [B, T]: log p − log q from the trainer's own log-probs, where known; ``precision``: the
        dtype of the logits or hidden states given (kl_bench.audit.step.step_sums)."""
        for m in self.metrics:
            v = trainer_values[m.source] if isinstance(trainer_values, dict) else trainer_values
            sums = step_sums(values, v, mask, estimator=m.estimator, aggregation=m.aggregation, own_logr=own_logr,
                             precision=precision)
            kept = self._pending.setdefault(m.source, [])
            if m.micro_batches == "mean" or not kept:
                kept.append(sums)                   # one row per record: each is a micro-batch of its own
            else:
                kept[0] = kept[0] + sums            # pooled: the records are one batch

    @property
    def pending(self) -> bool:
        """Records have been added since the last :meth:`finish`."""
        return bool(self._pending)

    def finish(self, step: int, reduce: Callable[[torch.Tensor | None], torch.Tensor | None] | None = None
               ) -> list[StepAudit]:
        """The step audits of the records added since the last call (one per metric), added to
        :attr:`log`. ``reduce``: sums across processes (an all-reduce of a flat vector, zero-padded by the
        caller to the longest of the processes; every process must call it, with None where it audited
        nothing); returns [] when no process audited anything. A "mean" metric hands ``reduce`` its
        records' sums one after another: record j of every process is micro-batch j, and TRL too reduces
        each micro-batch across processes before the mean over micro-batches."""
        out = []
        for m in self.metrics:
            rows = self._pending.get(m.source)
            sums = None if rows is None else torch.cat(rows)
            if reduce is not None:
                sums = reduce(sums)
            if sums is None:
                continue
            sums = combine_micro_batches(sums.reshape(-1, len(SUMS)))
            out.append(self.log.add(StepAudit.from_sums(sums, step=step, source=m.source, estimator=m.estimator,
                                                        aggregation=m.aggregation)))
        if self._engine is not None:
            sums = self._engine if reduce is None else reduce(self._engine)
            if sums is not None:
                self.log.engine.append(EngineAudit.from_sums(sums, step=step, engine_dtype=self._engine_dtype,
                                                             z=self.thresholds.z))
        self._pending, self._engine = {}, None
        return out

    def engine_warnings(self, a: EngineAudit) -> list[Warning]:
        """What a step's engine audit says (kl_bench.audit.verdict)."""
        return engine_warnings(a, self.thresholds)

    def warnings(self, audit: StepAudit) -> list[Warning]:
        """The warnings of a step audit this session made, with its source's history."""
        history = [r for r in self.log.rows if r.source == audit.source]
        return step_warnings(audit, history, self.sampler.describe(), self.thresholds)
