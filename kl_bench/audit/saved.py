"""Reading a folder of saved steps back and validating it: each ``step-*.safetensors`` file (and the
folder's ``heads.safetensors``) opened safely and checked, one line naming the file and key for anything
missing or inconsistent, and the files of one step checked together (:func:`read_folder`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ..foundation.errors import SpecError
from ..core.estimators import resolve_estimator
from ..foundation.registry import UnknownName
from ..foundation.safe_io import cap_for, open_regular, parse_json, read_capped
from .aggregate import LOSS_AGGREGATIONS, MICRO_BATCHES
from .generation import Sampler
from .rollout_engine import COARSE
from .saving import FORMAT, FORMATS, HEAD_KEYS, HEADS_FILE, HIDDEN, LOGITS, REQUIRED
from .session import Metric, check_distinct_sources


# Optional [B, T] tensors: a rollout engine's log-probs; the trainer's own log-probs of the sampled tokens.
OPTIONAL_PER_TOKEN = ("engine_logprobs", "policy_logprobs", "reference_logprobs")


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
    notes: tuple[tuple[str, str], ...] = ()       # settings the live audit warned about (saving.save_step)
    engine_dtype: str | None = None               # the dtype the rollout engine computes in, where declared

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
        raise SpecError("reading saved steps needs the safetensors package: pip install safetensors (or the hf "
                        "extra, 'kl-bench[hf]')",
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


def _metric(where: str, source, estimator, aggregation, micro_batches="pooled") -> Metric:
    for name, value in (("source", source), ("estimator", estimator), ("aggregation", aggregation),
                        ("micro_batches", micro_batches)):
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
    if micro_batches not in MICRO_BATCHES:
        raise SpecError(f"must be one of {', '.join(MICRO_BATCHES)}, got '{micro_batches}'"[:200], file=where,
                        key="micro_batches")
    return Metric(source, estimator, aggregation, micro_batches)


def _metrics(meta: dict, path: Path) -> tuple[Metric, ...]:
    """The metrics a step holds the trainer's values of: the ``metrics`` entry (JSON [[source, estimator,
    aggregation(, micro_batches)], ...]), or the ``source``/``estimator``/``aggregation``(/``micro_batches``)
    entries; micro_batches defaults to "pooled". Sources are distinct (one audit.csv row per source and
    step: a source listed twice had counted every token twice)."""
    where = str(path)
    if "metrics" not in meta:
        return (_metric(where, _meta(meta, path, "source", "kl"), _meta(meta, path, "estimator"),
                        _meta(meta, path, "aggregation"), _meta(meta, path, "micro_batches", "pooled")),)
    rows = _json_meta(meta, path, "metrics")
    if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) in (3, 4) for r in rows):
        raise SpecError("must be a JSON list of [source, estimator, aggregation] or [source, estimator, "
                        "aggregation, micro_batches]", file=where, key="metrics")
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
                      _number(meta, path, "logit_multiplier", float, "1.0"), _notes(meta, path),
                      _engine_dtype(meta, where))
    _check_shapes(saved)
    return saved


def _notes(meta: dict, path: Path) -> tuple[tuple[str, str], ...]:
    """The optional notes entry: JSON [[key, message], ...], strings each."""
    rows = _json_meta(meta, path, "notes", "[]")
    if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r)
                                             for r in rows):
        raise SpecError("must be a JSON list of [key, message] strings", file=str(path), key="notes")
    return tuple((k, m) for k, m in rows)


def _engine_dtype(meta: dict, where: str) -> str | None:
    """The optional engine_dtype metadata entry: one of rollout_engine.COARSE's names, or absent."""
    value = meta.get("engine_dtype")
    if value is not None and value not in COARSE:
        raise SpecError(f"must be one of {', '.join(COARSE)}, got '{value}'"[:200], file=where, key="engine_dtype")
    return value


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
    if ("policy_logprobs" in t) != ("reference_logprobs" in t):
        raise SpecError("give both models' log-probs or neither", file=where, key="reference_logprobs")
    for k in ["mask", *keys.values()] + [k for k in OPTIONAL_PER_TOKEN if k in t]:
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
    masked = (*s.value_keys().values(), *(k for k in (*OPTIONAL_PER_TOKEN, "sampling_hidden") if k in t))
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
                                f"'{m.aggregation}', micro_batches '{m.micro_batches}' here but "
                                f"'{metric.estimator}', '{metric.aggregation}', '{metric.micro_batches}' in "
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


def read_folder(directory: Path) -> dict[int, list[SavedStep]]:
    """Every saved step of ``directory`` read and checked (the files of one step together), by step number,
    before any is audited."""
    files = step_files(directory)
    heads_file = directory / HEADS_FILE           # a dangling link there is an error, not "no heads"
    heads = _load(heads_file, "heads")[0] if heads_file.exists() or heads_file.is_symlink() else None
    by_step: dict[int, list[SavedStep]] = {}
    for f in files:
        s = read_step(f, heads)
        by_step.setdefault(s.step, []).append(s)
    for group in by_step.values():
        _check_group(group)
    return by_step
