"""Offline audits: one training step saved as a .safetensors file, audited later, on any machine.

A folder holds ``step-*.safetensors`` files (one step each; the format is documented in docs/audit.md
"Saved steps") and optionally ``heads.safetensors`` with the output layers shared by every step.
:func:`save_step` writes a step (atomically); :func:`audit_folder` audits every step into an
:class:`~kl_bench.audit.step.AuditLog`; ``kl-bench audit DIR`` is :func:`audit_command`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpecError
from ..estimators import resolve_estimator
from ..formatting import plural
from ..registry import UnknownName
from ..storage import atomic_write_bytes, check_output_dir
from .aggregate import AGGREGATIONS
from .exact import PositionValues, position_values
from .sampler import Sampler
from .step import AuditLog, StepAudit, step_line, step_sums
from .stream import Head, stream_values

FORMAT = "kl_bench.audit.step/1"
HEADS_FILE = "heads.safetensors"
HEAD_KEYS = ("policy_weight", "reference_weight", "policy_bias", "reference_bias")
REQUIRED = ("completion_ids", "mask", "trainer_kl")
LOGITS = ("policy_logits", "reference_logits")
HIDDEN = ("policy_hidden", "reference_hidden")


def save_step(path, *, completion_ids, mask, trainer_kl, step: int, estimator: str, aggregation: str = "token-mean",
              source: str = "kl", generation: dict | None = None, logit_scale: float = 1.0,
              logit_softcap: float | None = None, **tensors) -> Path:
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
            "source": source, "generation": json.dumps(generation or {}), "logit_scale": repr(float(logit_scale))}
    if logit_softcap is not None:
        meta["logit_softcap"] = repr(float(logit_softcap))
    data = {"completion_ids": completion_ids, "mask": mask, "trainer_kl": trainer_kl, **tensors}
    data = {k: torch.as_tensor(v).detach().cpu().contiguous() for k, v in data.items() if v is not None}
    path = Path(path)
    atomic_write_bytes(path, save(data, metadata=meta))
    return path


@dataclass(frozen=True)
class SavedStep:
    """One step read back and checked: the tensors and the settings it was saved with."""
    path: Path
    step: int
    estimator: str
    aggregation: str
    source: str
    sampler: Sampler
    logit_scale: float
    tensors: dict
    logit_softcap: float | None = None


def _load(path: Path) -> tuple[dict, dict]:
    try:
        from safetensors import safe_open
    except ImportError:
        raise SpecError("reading saved steps needs the safetensors package: pip install 'kl-bench[hf]'",
                        file=str(path)) from None
    try:
        with safe_open(str(path), framework="pt") as fh:
            return {k: fh.get_tensor(k) for k in fh.keys()}, dict(fh.metadata() or {})
    except Exception as e:          # truncated or foreign files: safetensors raises several types
        raise SpecError(f"cannot read: {e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                        file=str(path)) from None


def _meta(meta: dict, path: Path, key: str, default=None):
    if key not in meta:
        if default is None:
            raise SpecError("missing metadata entry", file=str(path), key=key)
        return default
    return meta[key]


def read_step(path: Path, heads: dict | None = None) -> SavedStep:
    """A saved step, validated: one line naming the file and key for anything missing or inconsistent."""
    tensors, meta = _load(path)
    where = str(path)
    if meta.get("format") != FORMAT:
        raise SpecError(f"not a saved step (format '{meta.get('format')}', expected '{FORMAT}')", file=where,
                        key="format")
    for k in REQUIRED:
        if k not in tensors:
            raise SpecError("missing tensor", file=where, key=k)
    for k in HEAD_KEYS:
        if k not in tensors and heads and k in heads:
            tensors[k] = heads[k]
    estimator = _meta(meta, path, "estimator")
    try:
        if resolve_estimator(estimator).analytic:
            raise SpecError("must be a function of log r (the trainer's per-token formula)", file=where, key="estimator")
    except UnknownName as e:
        raise SpecError(str(e).strip("'\""), file=where, key="estimator") from None
    aggregation = _meta(meta, path, "aggregation")
    if aggregation not in AGGREGATIONS:
        raise SpecError(f"must be one of {', '.join(AGGREGATIONS)}, got '{aggregation}'", file=where, key="aggregation")
    try:
        generation = json.loads(_meta(meta, path, "generation", "{}"))
        step, scale = int(_meta(meta, path, "step")), float(_meta(meta, path, "logit_scale", "1.0"))
    except ValueError as e:
        raise SpecError(f"unreadable metadata: {e}", file=where) from None
    if not isinstance(generation, dict):
        raise SpecError("must be a JSON object", file=where, key="generation")
    saved = SavedStep(path, step, estimator, aggregation, _meta(meta, path, "source", "kl"),
                      Sampler.from_dict(generation, file=where), scale, tensors, _softcap(meta, where))
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
    for k in ("mask", "trainer_kl"):
        if tuple(t[k].shape) != bt:
            raise SpecError(f"must have completion_ids' shape {list(bt)}, got {list(t[k].shape)}", file=where, key=k)
    form = LOGITS if all(k in t for k in LOGITS) else HIDDEN if all(k in t for k in HIDDEN) else None
    if form is None:
        raise SpecError("needs policy_logits and reference_logits, or policy_hidden and reference_hidden",
                        file=where, key="policy_logits")
    for k in form:
        if tuple(t[k].shape[:2]) != bt or t[k].ndim != 3:
            raise SpecError(f"must be [B, T, ·] with [B, T] = {list(bt)}, got {list(t[k].shape)}", file=where, key=k)
    _check_vocabulary(s, form)
    if s.sampler.repetition_penalty != 1.0 and "prompt_ids" not in t:
        raise SpecError("repetition_penalty needs prompt_ids (the ids before the completion)", file=where,
                        key="prompt_ids")


def _check_vocabulary(s: SavedStep, form: tuple[str, str]) -> None:
    """Logits of one shape, or output layers [V, d] matching the hidden states' d."""
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
    if t["policy_weight"].shape[0] != t["reference_weight"].shape[0]:
        raise SpecError(f"vocabulary {t['reference_weight'].shape[0]} differs from the policy's "
                        f"{t['policy_weight'].shape[0]}", file=where, key="reference_weight")


def step_values(s: SavedStep, *, tile: int = 8192, chunk: int = 256) -> PositionValues:
    """The exact per-position values at the step's masked positions."""
    t = s.tensors
    mask = t["mask"].bool()
    ids = t["completion_ids"].to(torch.long)
    ctx = None
    if s.sampler.repetition_penalty != 1.0:
        full = torch.cat([t["prompt_ids"].to(torch.long), ids], dim=1)
        prefix = t["prompt_ids"].shape[1]
        pos = torch.arange(full.shape[1])
        ctx = torch.stack([torch.where(pos < prefix + j, full[b], -1) for b, j in mask.nonzero().tolist()])
    banned = (torch.arange(mask.shape[1]).expand_as(mask) < s.sampler.min_new_tokens)[mask]
    common = dict(ids=ids[mask], eos_banned=banned, context_ids=ctx)
    if "policy_logits" in t:
        return position_values(t["policy_logits"][mask].double() * s.logit_scale,
                               t["reference_logits"][mask].double() * s.logit_scale, (s.estimator,), s.sampler, **common)
    heads = [Head(t[f"{side}_weight"], t.get(f"{side}_bias"), s.logit_scale, s.logit_softcap)
             for side in ("policy", "reference")]
    return stream_values(t["policy_hidden"][mask], t["reference_hidden"][mask], heads[0], heads[1], (s.estimator,),
                         s.sampler, tile=tile, chunk=chunk, **common)


def audit_saved(s: SavedStep, **kw) -> StepAudit:
    sums = step_sums(step_values(s, **kw), s.tensors["trainer_kl"], s.tensors["mask"], estimator=s.estimator,
                     aggregation=s.aggregation)
    return StepAudit.from_sums(sums, step=s.step, source=s.source, estimator=s.estimator, aggregation=s.aggregation)


def step_files(directory: Path) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        raise SpecError("not a folder of saved steps", file=str(directory))
    files = sorted(directory.glob("step-*.safetensors"))
    if not files:
        raise SpecError("no step-*.safetensors files (docs/audit.md, \"Saved steps\")", file=str(directory))
    return files


def audit_folder(directory, *, on_step=None, tile: int = 8192, chunk: int = 256) -> AuditLog:
    """Audit every saved step of ``directory``; every file is read and checked before any is audited."""
    directory = Path(directory)
    files = step_files(directory)
    heads = _load(directory / HEADS_FILE)[0] if (directory / HEADS_FILE).exists() else None
    steps = [read_step(f, heads) for f in files]
    log = AuditLog()
    for s in steps:
        a = log.add(audit_saved(s, tile=tile, chunk=chunk))
        if on_step is not None:
            on_step(a)
    return log


def audit_command(directory: Path, out: Path | None, *, tile: int, chunk: int, echo=print) -> Path:
    """``kl-bench audit DIR``: audit every saved step, print a line each and the pooled verdict, write
    ``--out`` (default DIR/audit) with audit.csv and run.json."""
    out = check_output_dir(Path(out) if out is not None else Path(directory) / "audit")
    if tile < 1 or chunk < 1:
        raise SpecError(f"must be ≥ 1, got {min(tile, chunk)}", key="--tile" if tile < 1 else "--chunk")
    log = audit_folder(directory, on_step=lambda a: echo(step_line(a)), tile=tile, chunk=chunk)
    for source, p in log.pooled().items():
        echo(f"pooled {source} over {plural(p['steps'], 'step')}: mean bias {p['mean_bias']:+.3g} ± {p['se']:.2g} "
             f"(z = {p['z']:+.2f}), sampler {p['mean_bias_sampler']:+.3g}, consistency z = {p['consistency_z']:+.2f}")
    return log.write(out, source_folder=str(directory))
