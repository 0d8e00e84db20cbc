"""Experiment specs: TOML (or a dict with the TOML's structure) → frozen, validated dataclasses.

This module holds what every spec has (``spec_version``, ``[experiment]``, the common case keys
``name``, ``kind``, ``draws`` and ``sampler``); each case kind parses its own keys
(:meth:`kl_bench.pairs.base.Pair.parse`). Every error is a :class:`SpecError` naming the file, the case
and the key. Unknown keys are rejected with a "did you mean" suggestion. See README.md ("Spec format").
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import (MAX_BATCHES, MAX_DRAWS, Table, at_most, check_case_name, check_device, convert,
                     fmt_count, nonnegative, positive, typename)
from .errors import SpecError
from .estimators import DEFAULT_ESTIMATORS, EstimatorOption, lookup
from .logits import is_array, unsupported_array
from .pairs import CASE_KINDS, CaseConfig
from .registry import did_you_mean
from .samplers import parse_sampler

SPEC_VERSION = 1
# |λ| of cv(λ) = −log r + λ(r − 1): beyond it λ²·Var(r) and the squared per-draw values of the λ curve
# leave float64's range for ordinary pairs, and the row is λ(r − 1) to every printed digit anyway.
MAX_LAMBDA = 1e3
_DRAWS_WHY = "2^53: draws are counted in float64"
_check_draws = at_most(MAX_DRAWS, _DRAWS_WHY)


def _check_batches(v: int) -> str | None:
    return f"must be ≥ 2, got {fmt_count(v)}" if v < 2 else at_most(MAX_BATCHES, "2^20: batch means are kept in memory")(v)


@dataclass(frozen=True)
class Experiment:
    name: str
    draws: int
    seed: int = 0
    device: str = "auto"
    estimators: tuple[str | EstimatorOption, ...] = DEFAULT_ESTIMATORS
    batches: int = 200      # batch means for standard errors
    chunk: int = 1 << 22    # draws handed to the sampler at once (progress/checkpoints); memory is one piece
    lambdas: tuple[float, ...] = ()   # λ values of cv(λ) = −log r + λ(r − 1)
    optimal: bool = False             # "optimal" in lambdas: add cv_opt with λ from a pilot pass
    gradients: bool = False           # also write gradients.csv (kl_bench.gradients)


@dataclass(frozen=True)
class Spec:
    experiment: Experiment
    cases: tuple[CaseConfig, ...]
    path: Path                 # the spec file, or Path("<dict>") for a spec given as a dict
    text: str = field(repr=False)   # the TOML text (a dict spec: its JSON, tensors by shape and sha256)
    spec_version: int = SPEC_VERSION

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def case_draws(self) -> list[int]:
        """Draws of each case: its own ``draws``, else the experiment's."""
        return [c.draws or self.experiment.draws for c in self.cases]


# ----------------------------------------------------------------------------- [experiment]
def _check_experiment_name(v: str) -> str | None:
    # The name is the default results folder: a plain file name.
    if not re.fullmatch(r"[\w.\-]+", v) or v in (".", ".."):
        return "must be a plain file name: letters, digits, '_', '-', '.' (not '.' or '..')"
    return None


def _parse_experiment(t: Table, stem: str) -> Experiment:
    names = _parse_estimators(t)
    lambdas, optimal = _parse_lambdas(t)
    exp = Experiment(
        name=t.get("name", "str", stem, _check_experiment_name),
        draws=t.get("draws", "int", check=_check_draws),
        seed=t.get("seed", "int", 0, nonnegative),
        device=t.get("device", "str", "auto", check_device),
        estimators=names,
        batches=t.get("batches", "int", 200, _check_batches),
        chunk=t.get("chunk", "int", 1 << 22, positive),
        lambdas=lambdas,
        optimal=optimal,
        gradients=t.bool("gradients", False),
    )
    t.finish()
    return exp


def _parse_estimators(t: Table) -> tuple[str | EstimatorOption, ...]:
    """Registry names, plug-in references ('package.module:function'), or tables {name, logr_clamp,
    clamp, label} for clamped variants."""
    raw = t.raw("estimators")
    key = t.key("estimators")
    raw = list(DEFAULT_ESTIMATORS) if raw is None else raw
    if not isinstance(raw, list):
        raise t.error(f"must be a list of estimator names or tables, got {typename(raw)}", key=key)
    if not raw:
        raise t.error("must name at least one estimator", key=key)
    out: list[str | EstimatorOption] = []
    for i, item in enumerate(raw):
        if isinstance(item, dict):
            sub = Table(item, t.file, t.case, f"{key}[{i + 1}].")
            name = sub.get("name", "str")
            opt = EstimatorOption(name=name, label="",
                                  logr_clamp=sub.get("logr_clamp", "float", None, positive),
                                  clamp=sub.get("clamp", "float", None, positive))
            label = sub.get("label", "str", None)
            sub.finish()
            if opt.logr_clamp is None and opt.clamp is None:
                raise sub.error("needs logr_clamp or clamp (or use the plain name)", key=f"{key}[{i + 1}]")
            if label is None:
                label = name + (f"|logr|≤{opt.logr_clamp:g}" if opt.logr_clamp else "") + \
                    (f"|est|≤{opt.clamp:g}" if opt.clamp else "")
            item_name, out_item = name, dataclasses.replace(opt, label=label)
        else:
            item_name = out_item = convert(item, "str", lambda m: t.error(m, key=key))
        try:
            source = lookup(item_name)          # imports a plug-in now, so that a broken one fails here
        except SpecError as e:
            raise e.located(file=t.file, key=key) from None
        if isinstance(out_item, EstimatorOption) and source.analytic:
            raise t.error(f"'{item_name}' does not depend on log r: clamps do not apply", key=key)
        out.append(out_item)
    labels = [o.label if isinstance(o, EstimatorOption) else o for o in out]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup is not None:
        raise t.error(f"lists '{dup}' twice (give clamped variants distinct labels)", key=key)
    return tuple(out)


def _parse_lambdas(t: Table) -> tuple[tuple[float, ...], bool]:
    """`lambdas = [0.0, 0.5, 1.0, "optimal"]`: numbers, and the word "optimal" at most once."""
    raw = t.raw("lambdas")
    raw = [] if raw is None else raw
    key = t.key("lambdas")
    if not isinstance(raw, list):
        raise t.error(f"must be a list of numbers and \"optimal\", got {typename(raw)}", key=key)
    values, optimal = [], False
    for v in raw:
        if isinstance(v, str):
            if v != "optimal":
                raise t.error(f"unknown entry '{v}'{did_you_mean(v, ['optimal'])}: "
                              f"use numbers or \"optimal\"", key=key)
            if optimal:
                raise t.error("lists \"optimal\" twice", key=key)
            optimal = True
        else:
            lam = convert(v, "float", lambda m: t.error(m, key=key))
            if abs(lam) > MAX_LAMBDA:
                raise t.error(f"|λ| must be ≤ {MAX_LAMBDA:g} (beyond it cv(λ)'s variance leaves float64's range), "
                              f"got {lam:g}", key=key)
            values.append(lam)
    if len(set(values)) != len(values):
        raise t.error("lists a λ twice", key=key)
    return tuple(values), optimal


# ----------------------------------------------------------------------------- cases
def _parse_case(raw: Any, i: int, file: str, spec_dir: Path, seen: list[CaseConfig]) -> CaseConfig:
    label = raw.get("name") if isinstance(raw, dict) and isinstance(raw.get("name"), str) else f"#{i + 1}"
    t = Table(raw, file, label, "")
    name = t.get("name", "str", check=check_case_name)
    if any(c.name == name for c in seen):
        raise t.error("duplicate case name", key="name")
    kind_name = t.get("kind", "str")
    try:
        kind = CASE_KINDS[kind_name]
    except SpecError as e:
        raise e.located(file=file, case=label, key="kind") from None
    common = {"name": name, "draws": t.get("draws", "int", None, _check_draws), "sampler": None}
    if t.has("sampler"):
        others = {k.name: k.sampler_keys for k in CASE_KINDS.values()}
        common["sampler"] = parse_sampler(t.sub("sampler"), kind.name, kind.sampler_keys, kind.weight_kinds,
                                          others, spec_dir)
    config = kind.pair.parse(t, common, spec_dir)
    t.finish()          # a safety net: a kind's parser that forgets to finish still rejects unknown keys
    return dataclasses.replace(config, kind=kind.name)


def _parse_data(data: Any, file: str, spec_dir: Path, stem: str, text: str, path: Path) -> Spec:
    top = Table(data, file, None, "")
    version = top.get("spec_version", "int")
    if version != SPEC_VERSION:
        raise top.error(f"unsupported spec_version {version}; this kl-bench reads {SPEC_VERSION}",
                        key="spec_version")
    exp = _parse_experiment(top.sub("experiment"), stem)
    raw_cases = top.raw("case")
    if not isinstance(raw_cases, list) or not raw_cases:
        raise top.error("needs at least one [[case]] table", key="case")
    top.finish(["spec_version", "experiment", "case"])
    cases: list[CaseConfig] = []
    for i, raw in enumerate(raw_cases):
        cases.append(_parse_case(raw, i, file, spec_dir, cases))
    spec = Spec(exp, tuple(cases), path, text)
    return spec


def parse_spec(text: str, path: Path) -> Spec:
    """Parse and validate spec ``text`` read from ``path`` (used for messages and relative files)."""
    path = Path(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"TOML syntax error: {e}", file=str(path)) from None
    return _parse_data(data, str(path), path.parent, path.stem, text, path)


def _canonical(value: Any) -> Any:
    """A dict spec as JSON-able data: tensors and arrays by shape, dtype and sha256 of their bytes."""
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if is_array(value):
        if unsupported_array(value):      # sparse or complex: refused by the case's parser, with its key
            return {"array": list(value.shape), "dtype": str(value.dtype), "unsupported": True}
        # The bytes TensorLogits hashes: float64 on the CPU (bf16 has no numpy dtype).
        import torch
        t = torch.as_tensor(value).detach().to("cpu", torch.float64).contiguous()
        return {"array": list(t.shape), "dtype": str(value.dtype),
                "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest()}
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return value.item()           # numpy / torch scalars (e.g. draws = np.int64(10**6))
    return value


def spec_from_dict(data: dict[str, Any], base_dir: str | Path | None = None, name: str = "experiment") -> Spec:
    """A spec given as a dict with the TOML's structure (``{"spec_version": 1, "experiment": {...},
    "case": [{...}]}``); a categorical or rollout side (``q``, ``p``, ``sampler.behavior``) may be a
    tensor or ndarray of logits. Relative file paths are read from ``base_dir`` (default: the current
    folder); ``name`` is the experiment's default name."""
    if not isinstance(data, dict):
        raise SpecError(f"a spec must be a path, a Spec or a dict, got {type(data).__name__}")
    try:
        text = json.dumps(_canonical(data), ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise SpecError(f"the spec holds a value that is neither TOML data nor an array: {e}", file="<dict>") from None
    return _parse_data(data, "<dict>", Path(base_dir) if base_dir is not None else Path.cwd(), name, text,
                       Path("<dict>"))


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError("spec file not found", file=str(path)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read spec file: {e.__class__.__name__}: {e}", file=str(path)) from None
    return parse_spec(text, path)


def with_overrides(spec: Spec, *, draws: int | None = None, seed: int | None = None,
                   device: str | None = None) -> Spec:
    """Apply command-line overrides (validated like the spec's own fields)."""
    exp = spec.experiment
    for key, value in (("--draws", draws), ("--seed", seed)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise SpecError(f"must be an integer, got {value!r}", file=str(spec.path), key=key)
    if device is not None and not isinstance(device, str):
        raise SpecError(f"must be a string, got {device!r}", file=str(spec.path), key="--device")
    if draws is not None:
        if isinstance(draws, bool) or not isinstance(draws, int):
            if isinstance(draws, float) and math.isfinite(draws) and draws.is_integer():
                draws = int(draws)
            else:
                raise SpecError(f"must be an integer, got {draws!r}", file=str(spec.path), key="--draws")
        msg = _check_draws(draws)
        if msg:
            raise SpecError(msg, file=str(spec.path), key="--draws")
        exp = dataclasses.replace(exp, draws=draws)
        # --draws sets every case, per-case overrides included.
        spec = dataclasses.replace(spec, cases=tuple(dataclasses.replace(c, draws=None) for c in spec.cases))
    if seed is not None:
        if seed < 0:
            raise SpecError(f"must be ≥ 0, got {seed}", file=str(spec.path), key="--seed")
        exp = dataclasses.replace(exp, seed=seed)
    if device is not None:
        msg = check_device(device)
        if msg:
            raise SpecError(msg, file=str(spec.path), key="--device")
        exp = dataclasses.replace(exp, device=device)
    return dataclasses.replace(spec, experiment=exp)
