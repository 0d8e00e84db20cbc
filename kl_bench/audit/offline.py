"""Offline audits: training steps saved as .safetensors files, audited later, on any machine.

A folder holds ``step-*.safetensors`` files (one scored batch each; several files of one step pool into
one step audit, as micro-batches do; the format is documented in docs/audit.md "Saved steps") and
optionally ``heads.safetensors`` with output layers shared by every step (a frozen reference's).
:func:`save_step` writes a step from tensors, :func:`save_record` one audited batch of the TRL callback
(``KLAudit(save_steps=True)``), both atomically; :func:`audit_folder` audits every step through the same
core as the callback (kl_bench.audit.session), so ``kl-bench audit DIR`` (:func:`audit_command`) prints
the same lines and warnings. DIR may also be the callback's results folder: its ``steps/`` are audited,
or, without them, its audit.csv is read back and its verdicts printed.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..foundation.errors import SpecError
from ..core.estimators import resolve_estimator
from ..foundation.formatting import plural
from ..foundation.registry import UnknownName
from ..foundation.safe_io import cap_for, open_regular, parse_json, read_capped
from ..foundation.storage import atomic_write_bytes, check_output_dir
from ..results.folders import check_replaceable
from .aggregate import LOSS_AGGREGATIONS
from .exact import PositionValues, position_values
from .generation import Sampler
from .session import AuditSession, Metric, Record, check_distinct_sources
from .step import AuditLog, StepAudit, read_audit_folder, step_line
from .stream import Head
from .rollout_engine import engine_line
from .verdict import engine_warnings, step_warnings

FORMAT = "kl_bench.audit.step/2"
FORMATS = ("kl_bench.audit.step/1", FORMAT)      # /2 adds metrics, sampling_hidden and logit_multiplier
HEADS_FILE = "heads.safetensors"
HEAD_KEYS = ("policy_weight", "reference_weight", "policy_bias", "reference_bias")
REQUIRED = ("completion_ids", "mask")
LOGITS = ("policy_logits", "reference_logits")
HIDDEN = ("policy_hidden", "reference_hidden")


def save_step(path, *, completion_ids, mask, trainer_kl, step: int, estimator: str, aggregation: str = "token-mean",
              source: str = "kl", generation: dict | None = None, logit_scale: float = 1.0,
              logit_softcap: float | None = None, logit_multiplier: float = 1.0, metrics=None, **tensors) -> Path:
    """Write one step to ``path`` (.safetensors), atomically. ``tensors``: ``policy_logits`` and
    ``reference_logits`` [B, T, V]; or ``policy_hidden`` and ``reference_hidden`` [B, T, d] (the hidden
    state that predicts completion token t at index t, after the final norm) with the output layers here
    or in the folder's heads.safetensors (``policy_weight`` [V, d], ``reference_weight``, optional
    biases); optional ``prompt_ids`` [B, P] (what the repetition penalty sees). ``logit_scale``: the
    factor the trainer applies to the logits before its log-softmax (1/T in TRL and verl).
    ``logit_softcap``: the model's final_logit_softcapping c (Gemma), applied to h @ Wᵀ (+ bias) as
    c·tanh(z/c) before ``logit_scale``; it only matters for hidden states (saved logits are already capped)."""
    from safetensors.torch import save

    meta = {"format": FORMAT, "step": str(int(step)), "estimator": estimator, "aggregation": aggregation,
            "source": source, "generation": json.dumps(generation or {}), "logit_scale": repr(float(logit_scale)),
            "logit_multiplier": repr(float(logit_multiplier))}
    if logit_softcap is not None:
        meta["logit_softcap"] = repr(float(logit_softcap))
    if metrics is not None:          # several metrics of one batch: trainer_<source> tensors, one per metric
        meta["metrics"] = json.dumps([[m.source, m.estimator, m.aggregation] for m in metrics])
    data = {"completion_ids": completion_ids, "mask": mask, "trainer_kl": trainer_kl, **tensors}
    # host: a file is written from host memory
    data = {k: torch.as_tensor(v).detach().cpu().contiguous() for k, v in data.items() if v is not None}
    path = Path(path)
    atomic_write_bytes(path, save(data, metadata=meta))
    return path


def save_record(folder, record: Record, heads: tuple[Head, Head], *, step: int, index: int, metrics,
                generation: Sampler) -> Path:
    """One audited batch of the TRL callback (``KLAudit(save_steps=True)``) as a saved step: hidden states
    (the drawing pass's too, when captured), ids, mask, the trainer's values per metric and the policy's
    output layer as it was at that step; the reference's (frozen) once, in the folder's heads.safetensors."""
    from dataclasses import asdict

    from safetensors.torch import save
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
                     aggregation=metrics[0].aggregation, source=metrics[0].source, generation=gen,
                     logit_scale=heads[0].scale, logit_softcap=heads[0].softcap, logit_multiplier=heads[0].multiplier,
                     metrics=metrics if len(metrics) > 1 else None, policy_hidden=record.policy_hidden,
                     reference_hidden=record.reference_hidden, sampling_hidden=record.sampling_hidden,
                     prompt_ids=record.prompt_ids, policy_weight=heads[0].weight, policy_bias=heads[0].bias, **values)


@dataclass(frozen=True)
class SavedStep:
    """One saved batch read back and checked: the tensors and the settings it was saved with.
    ``metrics``: the KL numbers it holds the trainer's values of (trainer_kl, or trainer_<source> each)."""
    path: Path
    step: int
    metrics: tuple[Metric, ...]
    sampler: Sampler
    logit_scale: float
    tensors: dict
    logit_softcap: float | None = None
    logit_multiplier: float = 1.0

    def value_keys(self) -> dict[str, str]:
        """source → the tensor that holds the trainer's per-token values of that metric: ``trainer_kl`` the
        first metric's (the only one in format /1), ``trainer_<source>`` the others'."""
        return {m.source: "trainer_kl" if i == 0 and "trainer_kl" in self.tensors else f"trainer_{m.source}"
                for i, m in enumerate(self.metrics)}

    def trainer_values(self) -> dict[str, torch.Tensor]:
        """The trainer's per-token values of each metric (:meth:`value_keys`)."""
        return {source: self.tensors[k] for source, k in self.value_keys().items()}


def _load(path: Path, what: str = "saved step") -> tuple[dict, dict]:
    """The tensors and the metadata of a saved step (or of heads.safetensors). Only a regular file is opened
    (kl_bench.foundation.safe_io: a FIFO, a device or a folder at the path is one line, never a blocked
    open). safetensors then maps that very file through /proc/self/fd (the file checked is the file read,
    and memory holds each tensor once); without /proc, its bytes are read (within half of the memory this
    process may take) and parsed."""
    try:
        from safetensors import safe_open
        from safetensors.torch import load
    except ImportError:
        raise SpecError("reading saved steps needs the safetensors package: pip install 'kl-bench[hf]'",
                        file=str(path)) from None
    with open_regular(path, "tensor", what) as fh:
        opened = Path(f"/proc/self/fd/{fh.fileno()}")
        data = None if opened.exists() else read_capped(fh, cap_for("tensor"), path, what)
        try:
            if data is None:
                with safe_open(str(opened), framework="pt") as st:
                    return {k: st.get_tensor(k) for k in st.keys()}, dict(st.metadata() or {})
            tensors = load(data)        # checks the header's byte ranges against the bytes
            # The header: 8 bytes of its length (little-endian), then JSON whose "__metadata__" holds the
            # settings the step was saved with.
            header = parse_json(data[8:8 + int.from_bytes(data[:8], "little")], path, "the safetensors header")
            meta = (header.get("__metadata__") if isinstance(header, dict) else None) or {}
            if not isinstance(meta, dict):
                raise ValueError("__metadata__ is not a table")
            return tensors, dict(meta)
        except SpecError:
            raise
        except Exception as e:          # truncated or foreign files: safetensors raises several types
            raise SpecError(f"cannot read: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                            file=str(path)) from None


def _meta(meta: dict, path: Path, key: str, default=None):
    if key not in meta:
        if default is None:
            raise SpecError("missing metadata entry", file=str(path), key=key)
        return default
    return meta[key]


def _json_meta(meta: dict, path: Path, key: str, default: str | None = None):
    """A metadata entry that holds JSON, parsed by the safe parser (kl_bench.foundation.safe_io.parse_json:
    nesting too deep for the interpreter, a 5000-digit number or bad syntax is one line naming the key)."""
    try:
        return parse_json(_meta(meta, path, key, default), path, "the metadata entry")
    except SpecError as e:
        raise e.located(file=str(path), key=key) from None


def _metric(where: str, source, estimator, aggregation) -> Metric:
    for name, value in (("source", source), ("estimator", estimator), ("aggregation", aggregation)):
        if not isinstance(value, str) or not value:
            raise SpecError(f"must be a non-empty string, got {type(value).__name__} {value!r}"[:200], file=where,
                            key=name)
    try:
        if resolve_estimator(estimator).analytic:
            raise SpecError("must be a function of log r (the trainer's per-token formula)", file=where, key="estimator")
    except UnknownName as e:
        raise SpecError(str(e).strip("'\""), file=where, key="estimator") from None
    except SpecError as e:
        raise e.located(file=where, key="estimator") from None
    if aggregation not in LOSS_AGGREGATIONS:
        raise SpecError(f"must be one of {', '.join(LOSS_AGGREGATIONS)}, got '{aggregation}'", file=where, key="aggregation")
    return Metric(source, estimator, aggregation)


def _metrics(meta: dict, path: Path) -> tuple[Metric, ...]:
    """The metrics a step holds the trainer's values of: the ``metrics`` entry (JSON [[source, estimator,
    aggregation], ...]), or the ``source``/``estimator``/``aggregation`` entries. Sources are distinct (one
    audit.csv row per source and step: a source listed twice had counted every token twice)."""
    where = str(path)
    if "metrics" not in meta:
        return (_metric(where, _meta(meta, path, "source", "kl"), _meta(meta, path, "estimator"),
                        _meta(meta, path, "aggregation")),)
    rows = _json_meta(meta, path, "metrics")
    if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == 3 for r in rows):
        raise SpecError("must be a JSON list of [source, estimator, aggregation]", file=where, key="metrics")
    metrics = tuple(_metric(where, *row) for row in rows)
    check_distinct_sources(metrics, file=where)
    return metrics


def _number(meta: dict, path: Path, key: str, kind, default: str | None = None):
    value = _meta(meta, path, key, default)
    try:
        if not value.isascii():           # int() and float() read other scripts' digits ("٣" is 3)
            raise ValueError(value)
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        shown = value if len(value) <= 40 else value[:40] + f"… ({len(value)} characters)"
        raise SpecError(f"must be {what}, got '{shown}'", file=str(path), key=key) from None


def read_step(path: Path, heads: dict | None = None) -> SavedStep:
    """A saved step, validated: one line naming the file and key for anything missing or inconsistent."""
    tensors, meta = _load(path)
    where = str(path)
    try:
        return _read_step(path, tensors, meta, heads)
    except SpecError as e:                  # every error of a step names its file
        raise e.located(file=where) from None


def _read_step(path: Path, tensors: dict, meta: dict, heads: dict | None) -> SavedStep:
    where = str(path)
    if meta.get("format") not in FORMATS:
        raise SpecError(f"not a saved step (format '{meta.get('format')}', expected '{FORMAT}')", file=where,
                        key="format")
    for k in REQUIRED:
        if k not in tensors:
            raise SpecError("missing tensor", file=where, key=k)
    for k in HEAD_KEYS:
        if k not in tensors and heads and k in heads:
            tensors[k] = heads[k]
    metrics = _metrics(meta, path)
    if not metrics:
        raise SpecError("names no metric", file=where, key="metrics")
    generation = _json_meta(meta, path, "generation", "{}")
    if not isinstance(generation, dict):
        raise SpecError("must be a JSON object", file=where, key="generation")
    saved = SavedStep(path, _number(meta, path, "step", int), metrics, Sampler.from_dict(generation, file=where),
                      _number(meta, path, "logit_scale", float, "1.0"), tensors, _softcap(meta, where),
                      _number(meta, path, "logit_multiplier", float, "1.0"))
    _check_shapes(saved)
    return saved


def _softcap(meta: dict, where: str) -> float | None:
    """The optional logit_softcap metadata entry: a finite number > 0, or absent."""
    if "logit_softcap" not in meta:
        return None
    try:
        cap = float(meta["logit_softcap"])
    except ValueError:
        cap = math.nan
    if not (math.isfinite(cap) and cap > 0):
        raise SpecError(f"must be a finite number > 0, got '{meta['logit_softcap']}'", file=where, key="logit_softcap")
    return cap


def _check_shapes(s: SavedStep) -> None:
    t, where = s.tensors, str(s.path)
    bt = tuple(t["completion_ids"].shape)
    if len(bt) != 2:
        raise SpecError(f"must be [B, T], got {list(bt)}", file=where, key="completion_ids")
    _check_per_token(s, bt)
    form = LOGITS if all(k in t for k in LOGITS) else HIDDEN if all(k in t for k in HIDDEN) else None
    if form is None:
        raise SpecError("needs policy_logits and reference_logits, or policy_hidden and reference_hidden",
                        file=where, key="policy_logits")
    for k in form:
        if tuple(t[k].shape[:2]) != bt or t[k].ndim != 3:
            raise SpecError(f"must be [B, T, ·] with [B, T] = {list(bt)}, got {list(t[k].shape)}", file=where, key=k)
    _check_vocabulary(s, form)
    _check_values(s, form)
    _check_prompt(s, bt)


def _check_prompt(s: SavedStep, bt: tuple) -> None:
    """prompt_ids (what a repetition penalty sees): present when one is set, integer ids [B, P]."""
    t, where = s.tensors, str(s.path)
    if s.sampler.repetition_penalty != 1.0 and "prompt_ids" not in t:
        raise SpecError("repetition_penalty needs prompt_ids (the ids before the completion)", file=where,
                        key="prompt_ids")
    prompt = t.get("prompt_ids")
    if prompt is not None and (prompt.ndim != 2 or prompt.shape[0] != bt[0] or not _integer(prompt.dtype)):
        raise SpecError(f"must be integer ids [B, P] with B = {bt[0]}, got {prompt.dtype} {list(prompt.shape)}",
                        file=where, key="prompt_ids")


def _check_per_token(s: SavedStep, bt: tuple) -> None:
    """The [B, T] tensors (mask, the trainer's values per metric, the engine's log-probs) and the
    sampling pass's hidden states [B, T, d], against completion_ids' [B, T]. Each metric reads its own
    tensor (a later metric named 'kl' had read the first's trainer_kl)."""
    t, where = s.tensors, str(s.path)
    keys = s.value_keys()
    for source, k in keys.items():
        other = next((o for o, ko in keys.items() if ko == k and o != source), None)
        if other is not None:
            raise SpecError(f"sources '{other}' and '{source}' would both read {k} (trainer_kl holds the first "
                            "metric's values, trainer_<source> each later one's)", file=where, key="metrics")
    for k in ["mask", *keys.values()] + (["engine_logprobs"] if "engine_logprobs" in t else []):
        if k not in t:
            raise SpecError("missing tensor", file=where, key=k)
        if tuple(t[k].shape) != bt:
            raise SpecError(f"must have completion_ids' shape {list(bt)}, got {list(t[k].shape)}", file=where, key=k)
    if "sampling_hidden" in t and (t["sampling_hidden"].ndim != 3 or tuple(t["sampling_hidden"].shape[:2]) != bt):
        raise SpecError(f"must be [B, T, d] with [B, T] = {list(bt)}", file=where, key="sampling_hidden")


def _check_vocabulary(s: SavedStep, form: tuple[str, str]) -> None:
    """Logits of one shape, or output layers [V, d] matching the hidden states' d (and biases [V])."""
    t, where = s.tensors, str(s.path)
    if form == LOGITS:
        if t["policy_logits"].shape != t["reference_logits"].shape:
            raise SpecError(f"must have policy_logits' shape {list(t['policy_logits'].shape)}", file=where,
                            key="reference_logits")
        return
    for side in ("policy", "reference"):
        w, d = t.get(f"{side}_weight"), t[f"{side}_hidden"].shape[-1]
        if w is None:
            raise SpecError(f"missing tensor (here or in {HEADS_FILE})", file=where, key=f"{side}_weight")
        if w.ndim != 2 or w.shape[1] != d:
            raise SpecError(f"must be [V, d] with d = {d}, got {list(w.shape)}", file=where, key=f"{side}_weight")
        bias = t.get(f"{side}_bias")
        if bias is not None and tuple(bias.shape) != (w.shape[0],):
            raise SpecError(f"must be [V] with V = {w.shape[0]}, got {list(bias.shape)}", file=where, key=f"{side}_bias")
    if t["policy_weight"].shape[0] != t["reference_weight"].shape[0]:
        raise SpecError(f"vocabulary {t['reference_weight'].shape[0]} differs from the policy's "
                        f"{t['policy_weight'].shape[0]}", file=where, key="reference_weight")


def _integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _check_values(s: SavedStep, form: tuple[str, str]) -> None:
    """What the audit computes from, checked: the ids at the masked-in positions are token ids of the
    vocabulary (an id ≥ V had stopped the audit with a traceback), integers (not floats cast), the mask 0/1,
    the EOS ids of the generation settings inside the vocabulary, and every real-valued tensor
    floating-point and finite (:func:`_check_floats`)."""
    t, where = s.tensors, str(s.path)
    vocab = t["policy_logits"].shape[-1] if form == LOGITS else t["policy_weight"].shape[0]
    ids, mask = t["completion_ids"], t["mask"]
    if not _integer(ids.dtype):
        raise SpecError(f"must hold integer token ids, got {ids.dtype}", file=where, key="completion_ids")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise SpecError("must hold 0 or 1 (which positions are the completion's tokens)", file=where, key="mask")
    used = ids[mask.bool()]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= vocab):
        raise SpecError(f"holds ids outside the vocabulary [0, {vocab}) at masked-in positions "
                        f"(min {int(used.min())}, max {int(used.max())})", file=where, key="completion_ids")
    if any(e >= vocab for e in s.sampler.eos_token_id):
        raise SpecError(f"holds ids outside the vocabulary [0, {vocab}): {list(s.sampler.eos_token_id)}", file=where,
                        key="generation.eos_token_id")
    _check_floats(s, form)
    for name, value in (("logit_scale", s.logit_scale), ("logit_multiplier", s.logit_multiplier)):
        if not (math.isfinite(value) and value > 0):
            raise SpecError(f"must be a finite number > 0, got {value}", file=where, key=name)
    bound = _score_bound(s, form)
    if not math.isfinite(2 * bound):
        key = "generation.temperature" if 1 / s.sampler.temperature > s.logit_scale else "logit_scale"
        raise SpecError(f"the sampler's scores (logits × logit_scale / temperature) pass float64's range (temperature "
                        f"{s.sampler.temperature:g}, logit_scale {s.logit_scale:g}): the audit would compute NaN",
                        file=where, key=key)


def _norm(x: torch.Tensor | None) -> float:
    """The largest Euclidean norm of x's last-axis rows (0 for none)."""
    return float(x.double().norm(dim=-1).max()) if x is not None and x.numel() else 0.0


def _score_bound(s: SavedStep, form: tuple[str, str]) -> float:
    """An upper bound of |s| over the vocabulary, s = (transformed logit) / T the sampler's score: from the
    saved logits, or |h·w + b| ≤ ‖h‖‖w‖ + |b| for hidden states (then the multiplier, the cap); times the
    repetition penalty's largest factor. Scores past float64's range had made the audit's numbers NaN."""
    t = s.tensors
    if form == LOGITS:
        z = max(float(t[k].double().abs().max()) if t[k].numel() else 0.0 for k in LOGITS)
    else:
        hidden = {"policy": max(_norm(t["policy_hidden"]), _norm(t.get("sampling_hidden"))),
                  "reference": _norm(t["reference_hidden"])}
        bias = {side: _norm(t[f"{side}_bias"][:, None]) if f"{side}_bias" in t else 0.0 for side in hidden}
        z = max((hidden[side] * _norm(t[f"{side}_weight"]) + bias[side]) * s.logit_multiplier for side in hidden)
        z = min(z, s.logit_softcap) if s.logit_softcap is not None else z
    penalty = s.sampler.repetition_penalty
    return z * s.logit_scale * max(penalty, 1 / penalty) / s.sampler.temperature


def _check_floats(s: SavedStep, form: tuple[str, str]) -> None:
    """Real-valued tensors hold floating-point values (an integer trainer_kl had been read truncated) and
    are finite: the logits or hidden states and the output layers everywhere (NaN in, 'exact nan' out, in
    silence); the trainer's values, the engine's log-probs and the drawing pass's hidden states at the
    masked-in positions, the ones the audit reads (a NaN there had printed 'bias +nan' and exit 0)."""
    t, where = s.tensors, str(s.path)
    mask = t["mask"].bool()
    heads = tuple(k for k in HEAD_KEYS if k in t) if form == HIDDEN else ()
    masked = (*s.value_keys().values(), *(k for k in ("engine_logprobs", "sampling_hidden") if k in t))
    for k in form + heads + masked:
        if not t[k].dtype.is_floating_point:
            raise SpecError(f"must hold floating-point values, got {t[k].dtype}", file=where, key=k)
    for k in form + heads:
        if not bool(torch.isfinite(t[k]).all()):
            raise SpecError("holds NaN or infinite values", file=where, key=k)
    for k in masked:
        finite = torch.isfinite(t[k]) if t[k].ndim == 2 else torch.isfinite(t[k]).all(dim=-1)
        bad = (~finite & mask).nonzero()
        if bad.numel():
            b, pos = bad[0].tolist()
            x = t[k][b, pos] if t[k].ndim == 2 else t[k][b, pos][~torch.isfinite(t[k][b, pos])][0]
            v = float(x)
            raise SpecError(f"holds {'NaN' if math.isnan(v) else f'{v:+}'} at masked-in position [b, t] = "
                            f"[{b}, {pos}] (the audit reads every masked-in position)", file=where, key=k)


def _record(s: SavedStep) -> Record:
    t = s.tensors
    return Record(t["policy_hidden"], t["reference_hidden"], t["completion_ids"].to(torch.long), t["mask"].bool(),
                  s.trainer_values(), sampling_hidden=t.get("sampling_hidden"), prompt_ids=t.get("prompt_ids"),
                  engine_logprobs=t.get("engine_logprobs"))


def _heads(s: SavedStep) -> tuple[Head, Head]:
    t = s.tensors
    return tuple(Head(t[f"{side}_weight"], t.get(f"{side}_bias"), s.logit_scale, s.logit_softcap, s.logit_multiplier)
                 for side in ("policy", "reference"))


def _logit_values(s: SavedStep) -> PositionValues:
    """Exact values from saved full logits (the dense path, float64)."""
    t = s.tensors
    mask = t["mask"].bool()
    ids = t["completion_ids"].to(torch.long)
    ctx = None
    if s.sampler.repetition_penalty != 1.0:
        full = torch.cat([t["prompt_ids"].to(torch.long), ids], dim=1)
        prefix = t["prompt_ids"].shape[1]
        pos = torch.arange(full.shape[1], device=full.device)
        ctx = torch.stack([torch.where(pos < prefix + j, full[b], -1) for b, j in mask.nonzero().tolist()])
    banned = (torch.arange(mask.shape[1], device=mask.device).expand_as(mask) < s.sampler.min_new_tokens)[mask]
    names = tuple(dict.fromkeys(resolve_estimator(m.estimator).name for m in s.metrics))
    return position_values(t["policy_logits"][mask].double() * s.logit_scale,
                           t["reference_logits"][mask].double() * s.logit_scale, names, s.sampler,
                           ids=ids[mask], eos_banned=banned, context_ids=ctx)


def _session(s: SavedStep, log: AuditLog, kw: dict) -> AuditSession:
    return AuditSession((None, None), s.metrics, s.sampler, log=log, **kw)


def step_files(directory: Path) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        raise SpecError("not a folder of saved steps", file=str(directory))
    files = sorted(directory.glob("step-*.safetensors"))
    if not files:
        raise SpecError("no step-*.safetensors files (docs/audit.md, \"Saved steps\")", file=str(directory))
    return files


def _check_group(group: list[SavedStep]) -> None:
    """The files of one step, together: each source with one set of settings (estimator, aggregation,
    generation), since they pool into one audit.csv row per source (files that differed had made two rows of
    one step, pooled as two steps), and at least one masked-in token (a step without any had printed a
    vacuous '0 tokens ... z = +0.00'; nothing can be audited: one line, exit code 2)."""
    first = group[0]
    settings: dict[str, tuple[Metric, SavedStep]] = {}
    for s in group:
        for m in s.metrics:
            metric, other = settings.setdefault(m.source, (m, s))
            if metric != m:
                raise SpecError(f"step {s.step}, source '{m.source}': estimator '{m.estimator}', aggregation "
                                f"'{m.aggregation}' here but '{metric.estimator}', '{metric.aggregation}' in "
                                f"{other.path.name} (the files of one step pool into one row)", file=str(s.path),
                                key="metrics")
            differ = [f.name for f in fields(Sampler) if getattr(s.sampler, f.name) != getattr(other.sampler, f.name)]
            if differ:
                name = differ[0]
                raise SpecError(f"step {s.step}, source '{m.source}': {getattr(s.sampler, name)!r} here but "
                                f"{getattr(other.sampler, name)!r} in {other.path.name} (the files of one step pool "
                                "into one row)", file=str(s.path), key=f"generation.{name}")
    if not any(bool(s.tensors["mask"].bool().any()) for s in group):
        files = f" in all its {len(group)} files" if len(group) > 1 else ""
        raise SpecError(f"step {first.step} has no masked-in token (the mask is 0 everywhere{files}): nothing to "
                        "audit; drop the file or save the completion's tokens with mask 1", file=str(first.path),
                        key="mask")


def audit_folder(directory, *, on_step=None, tile: int | None = None, chunk: int | None = None,
                 dtype: torch.dtype = torch.float64) -> AuditLog:
    """Audit every saved step of ``directory`` through the audit core, the files of one step pooled;
    every file is read and checked before any is audited. ``on_step(audit, warnings)`` after each step
    audit. Hidden states: tile matmuls in ``dtype`` (float64 by default: exact to rounding)."""
    directory = Path(directory)
    files = step_files(directory)
    heads_file = directory / HEADS_FILE           # a dangling link there is an error, not "no heads"
    heads = _load(heads_file, "heads")[0] if heads_file.exists() or heads_file.is_symlink() else None
    by_step: dict[int, list[SavedStep]] = {}
    for f in files:
        s = read_step(f, heads)
        by_step.setdefault(s.step, []).append(s)
    for group in by_step.values():
        _check_group(group)
    log, sessions = AuditLog(), {}
    kw = dict(dtype=dtype, chunk=chunk, tile=tile)
    for number, group in sorted(by_step.items()):
        for s in group:
            key = (s.metrics, s.sampler)
            session = sessions.setdefault(key, _session(s, log, kw))
            if "policy_logits" in s.tensors:
                session.add_values(_logit_values(s), s.trainer_values(), s.tensors["mask"].bool())
            else:
                session.add(_record(s), heads=_heads(s))
        for session in sessions.values():
            for a in (session.finish(number) if session.pending else []):
                if on_step is not None:
                    on_step(a, session.warnings(a))
    return log


def _pooled_line(source: str, p: dict) -> str:
    return (f"pooled {source} over {plural(p['steps'], 'step')}: mean bias {p['mean_bias']:+.3g} ± {p['se']:.2g} "
            f"(z = {p['z']:+.2f}), sampler {p['mean_bias_sampler']:+.3g}, consistency z = {p['consistency_z']:+.2f}")


def _echo_step(echo):
    def show(a, warnings):
        echo(step_line(a))
        for w in warnings:
            echo(f"warning: {w.message}")
    return show


def steps_folder(directory: Path) -> Path | None:
    """Where the saved steps of ``directory`` are: itself, or the ``steps/`` of a callback's results
    folder; None when there are none."""
    directory = Path(directory)
    for d in (directory, directory / "steps"):
        if d.is_dir() and any(d.glob("step-*.safetensors")):
            return d
    return None


def audit_command(directory: Path, out: Path | None, *, tile: int | None, chunk: int | None,
                  echo=print) -> Path | None:
    """``kl-bench audit DIR``: audit every saved step (DIR's own or its ``steps/``), print a line each,
    its warnings and the pooled verdict, write ``--out`` (default DIR/audit) with audit.csv and run.json.
    A callback's results folder without saved steps is read back and its verdicts printed (nothing
    written; returns None)."""
    for key, value in (("--tile", tile), ("--chunk", chunk)):
        if value is not None and value < 1:
            raise SpecError(f"must be ≥ 1, got {value}", key=key)
    directory = Path(directory)
    found = steps_folder(directory)
    if found is None and any((directory / n).is_file() for n in ("audit.csv", "run.json")):
        for key, value in (("--out", out), ("--tile", tile), ("--chunk", chunk)):
            if value is not None:          # nothing is audited or written: the option would be ignored
                raise SpecError(f"has no effect here: {directory} holds no saved steps, only the verdicts its "
                                f"audit.csv records (read back, nothing written): drop {key}", key=key)
        return replay_folder(directory, echo)       # a folder the callback wrote (another kind: said so)
    out = check_output_dir(Path(out) if out is not None else directory / "audit")
    check_replaceable(out, "audit")
    log = audit_folder(found or directory, on_step=_echo_step(echo), tile=tile, chunk=chunk)
    for a in log.engine:                                  # saved steps with a rollout engine's log-probs
        echo(engine_line(a))
        for w in engine_warnings(a):
            echo(f"warning: {w.message}")
    for source, p in log.pooled().items():
        echo(_pooled_line(source, p))
    return log.write(out, source_folder=str(directory))


def replay_folder(directory: Path, echo=print) -> None:
    """A results folder written by the callback (audit.csv, run.json) read back: each step's line and the
    warnings the callback printed, from the stored rows."""
    envelope, rows = read_audit_folder(directory)
    sampler = str(envelope.get("sampler", "b"))
    history: dict[str, list[StepAudit]] = {}
    for a in rows:
        history.setdefault(a.source, []).append(a)
        _echo_step(echo)(a, step_warnings(a, history[a.source], sampler))
    log = AuditLog()
    for a in rows:
        log.add(a)
    for source, p in log.pooled().items():
        echo(_pooled_line(source, p))
    return None
