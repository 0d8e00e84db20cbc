"""Offline audits: training steps saved as .safetensors files, audited later, on any machine.

A folder holds ``step-*.safetensors`` files (one scored batch each; several files of one step pool into
one step audit, as micro-batches do; the format is documented in docs/audit.md "Saved steps") and
optionally ``heads.safetensors`` with output layers shared by every step (a frozen reference's).
:func:`kl_bench.audit.saving.save_step` writes a step from tensors, :func:`kl_bench.audit.saving.save_record`
one audited batch of the TRL callback (``KLAudit(save_steps=True)``), both atomically;
:mod:`kl_bench.audit.saved` reads and checks them. This module's one job is auditing such a folder:
:func:`audit_folder` audits every step through the same core as the callback (kl_bench.audit.session),
so ``kl-bench audit DIR`` (:func:`kl_bench.audit.offline_command.audit_command`) prints the same lines
and warnings.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..core.estimators import resolve_estimator
from .exact import PositionValues, position_values
from .saved import SavedStep, read_folder
from .session import AuditSession, Record
from .step import AuditLog
from .tiling import Head


def _record(s: SavedStep) -> Record:
    t = s.tensors
    return Record(t["policy_hidden"], t["reference_hidden"], t["completion_ids"].to(torch.long), t["mask"].bool(),
                  s.trainer_values(), sampling_hidden=t.get("sampling_hidden"), prompt_ids=t.get("prompt_ids"),
                  engine_logprobs=t.get("engine_logprobs"), engine_dtype=s.engine_dtype, policy_logprobs=t.get("policy_logprobs"),
                  reference_logprobs=t.get("reference_logprobs"))


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


def audit_folder(directory, *, on_step=None, on_notes=None, tile: int | None = None, chunk: int | None = None,
                 dtype: torch.dtype = torch.float64) -> AuditLog:
    """Audit every saved step of ``directory`` through the audit core, the files of one step combined
    (their metrics' micro_batches); every file is read and checked before any is audited.
    ``on_notes(notes)`` before each step with the (key, message) notes its files carry (the settings the
    live audit warned about), ``on_step(audit, warnings)`` after each step audit. Hidden states: tile
    matmuls in ``dtype`` (float64 by default: exact to rounding)."""
    by_step = read_folder(Path(directory))
    log, sessions = AuditLog(), {}
    kw = dict(dtype=dtype, chunk=chunk, tile=tile)
    for number, group in sorted(by_step.items()):
        if on_notes is not None:
            on_notes(dict.fromkeys(n for s in group for n in s.notes))
        for s in group:
            key = (s.metrics, s.sampler)
            session = sessions.setdefault(key, _session(s, log, kw))
            if "policy_logits" in s.tensors:
                t = s.tensors
                own = t["reference_logprobs"] - t["policy_logprobs"] if "policy_logprobs" in t else None
                coarse = max((t[k].dtype for k in ("policy_logits", "reference_logits")),
                             key=lambda d: torch.finfo(d).eps)
                values = _logit_values(s)
                session.add_values(values, s.trainer_values(), t["mask"].bool(), own_logr=own, precision=coarse)
                session.add_engine(values, t.get("engine_logprobs"), t["mask"].bool(), s.engine_dtype)
            else:
                session.add(_record(s), heads=_heads(s))
        for session in sessions.values():
            for a in (session.finish(number) if session.pending else []):
                if on_step is not None:
                    on_step(a, session.warnings(a))
    return log

