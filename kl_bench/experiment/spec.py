"""Experiment specs: TOML (or a dict with the TOML's structure) → frozen, validated dataclasses.

This module's job is the spec as a whole: the :class:`Spec` dataclass, its top-level tables, the dispatch
of each ``[[case]]`` to its kind (the common case keys ``name``, ``kind``, ``draws`` and ``sampler`` here;
each case kind parses its own keys, :meth:`kl_bench.kinds.protocols.CaseParser.parse`), dict specs and
command-line overrides. ``[experiment]`` is parsed in :mod:`kl_bench.experiment.spec_experiment` and
``[[sweep]]`` tables are expanded in :mod:`kl_bench.experiment.sweeps`. Every error is a :class:`SpecError` naming the file, the case
and the key. Unknown keys are rejected with a "did you mean" suggestion. See docs/spec.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..foundation.typed_toml import Table, check_case_name, check_device, check_seed
from ..foundation.errors import SpecError, argument
from ..sampling.logits_files import is_array, unsupported_array
from ..kinds import CASE_KINDS, CaseConfig
from ..foundation.registry import did_you_mean
from ..foundation.safe_io import decode_text, parse_toml, read_regular
from ..sampling.mismatch import parse_sampler
from ..results.verify import ORDERLESS, RUN_SETTINGS
from .spec_experiment import Experiment, check_draws, parse_experiment
from .sweeps import expand_sweeps

SPEC_VERSION = 1


@dataclass(frozen=True)
class Spec:
    experiment: Experiment
    cases: tuple[CaseConfig, ...]
    path: Path                 # the spec file, or Path("<dict>") for a spec given as a dict
    text: str = field(repr=False)   # the TOML text (a dict spec: its JSON, tensors by shape and sha256)
    spec_version: int = SPEC_VERSION
    # Cases expanded from [[sweep]] tables: case name → {swept key: value} (summary.csv's sweep.* columns).
    sweep_values: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False, compare=False)
    # The raw [train] table, parsed by kl_bench.training (optimisation trajectories), or None.
    train: Any = field(default=None, repr=False, compare=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def case_draws(self) -> list[int]:
        """Draws of each case: its own ``draws``, else the experiment's."""
        return [c.draws or self.experiment.draws for c in self.cases]

    def referenced_files(self) -> list[Path]:
        """The existing regular files the spec's text names (logits, masks, tables: any string value that is
        a path from the spec's folder), which a command's outputs must not replace."""
        try:
            table = json.loads(self.text) if self.path == Path("<dict>") else parse_toml(self.text, self.path)
        except (SpecError, ValueError):
            return []
        base = Path.cwd() if self.path == Path("<dict>") else self.path.parent
        found: list[Path] = []

        def walk(v: Any) -> None:
            if isinstance(v, dict):
                for x in v.values():
                    walk(x)
            elif isinstance(v, list):
                for x in v:
                    walk(x)
            elif isinstance(v, str) and 0 < len(v) < 4096 and "\x00" not in v:
                with contextlib.suppress(OSError, ValueError):
                    if (base / v).is_file():
                        found.append(base / v)
        walk(table)
        return found


    def measured_differences(self, recorded: str) -> list[str] | None:
        """What differs in what a run measures between the spec whose text ``recorded`` is (run.json's
        spec_text) and this one, both parsed with this spec's path (relative files from its folder): the
        [experiment] keys that are not run settings (kl_bench.results.verify.RUN_SETTINGS; estimators and
        λ as sets), a case on one side only, and a case's parsed fields other than ``draws``, by case name.
        Equivalent spellings are no difference (``./q.npy`` and ``q.npy``, a default written out, a sweep's
        values in another order). None where ``recorded`` is not a spec that parses here (a dict spec's
        JSON records its arrays by hash only; a file it names is gone): nothing is shown to be the same."""
        if self.path == Path("<dict>"):
            return None
        try:
            old = parse_spec(recorded, self.path)
        except (SpecError, OSError, ValueError, RecursionError):
            return None
        return _experiment_differences(old.experiment, self.experiment) + _case_differences(old, self)


def _experiment_differences(a: Experiment, b: Experiment) -> list[str]:
    out = []
    for f in dataclasses.fields(Experiment):
        key, x, y = f"experiment.{f.name}", getattr(a, f.name), getattr(b, f.name)
        if key not in RUN_SETTINGS and ((set(x) != set(y)) if key in ORDERLESS else not _same(x, y)):
            out.append(key)
    return out


def _case_differences(old: Spec, new: Spec) -> list[str]:
    before, now = {c.name: c for c in old.cases}, {c.name: c for c in new.cases}
    out = []
    for name in sorted(before.keys() | now.keys()):
        if name not in before or name not in now:
            out.append(f"case '{name}'")
            continue
        a, b = before[name], now[name]
        out += [f"case '{name}'.{f.name}" for f in dataclasses.fields(b) if f.name != "draws"
                and (type(a) is not type(b) or not _same(getattr(a, f.name), getattr(b, f.name)))]
        if not _same(old.sweep_values.get(name), new.sweep_values.get(name)):
            out.append(f"case '{name}'.sweep")
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal as parsed values; a value that holds tensors (no plain ``==``) is never shown to be the same."""
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False


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
    common = {"name": name, "draws": t.get("draws", "int", None, check_draws), "sampler": None}
    if t.has("sampler"):
        def others() -> dict[str, tuple[str, ...]]:
            kinds = [CASE_KINDS.get(n) for n in CASE_KINDS.names()]     # None: a kind that cannot be loaded
            return {k.name: k.sampler_keys for k in kinds if k is not None}
        common["sampler"] = parse_sampler(t.sub("sampler"), kind.name, kind.sampler_keys, kind.weight_kinds,
                                          others, spec_dir)
    config = kind.pair.parse(t, common, spec_dir)
    t.finish()          # a safety net: a kind's parser that forgets to finish still rejects unknown keys
    return dataclasses.replace(config, kind=kind.name)


# The tables and keys a spec holds at its top level (a typo among them is refused before anything is read).
TOP_KEYS = ["spec_version", "experiment", "case", "sweep", "train"]


def _check_top_keys(top: Table) -> None:
    """An unknown top-level key (``[experiments]``, ``[[cases]]``) is one line with "did you mean", before
    the table it was meant to be is reported missing."""
    for k in top.data:
        if k not in TOP_KEYS:
            raise top.error(f"unknown top-level key{did_you_mean(k, TOP_KEYS)}; allowed: {', '.join(TOP_KEYS)}",
                            key=k)


def _parse_data(data: Any, file: str, spec_dir: Path, stem: str, text: str, path: Path) -> Spec:
    top = Table(data, file, None, "")
    _check_top_keys(top)
    version = top.get("spec_version", "int")
    if version != SPEC_VERSION:
        raise top.error(f"unsupported spec_version {version}; this kl-bench reads {SPEC_VERSION}",
                        key="spec_version")
    exp = parse_experiment(top.sub("experiment"), stem)
    raw_cases = top.raw("case")
    if not isinstance(raw_cases, list) or not raw_cases:
        raise top.error("needs at least one [[case]] table", key="case")
    raw_sweeps = top.raw("sweep")
    raw_train = top.raw("train")
    top.finish(TOP_KEYS)
    expanded, swept = expand_sweeps(raw_cases, raw_sweeps, file)
    cases: list[CaseConfig] = []
    for i, (raw, origin) in enumerate(expanded):
        try:
            cases.append(_parse_case(raw, i, file, spec_dir, cases))
        except SpecError as e:      # a swept value the case refuses: name the sweep and its key
            key = next((k for k in (origin[1] if origin else {}) if e.key and (e.key == k or e.key.startswith(k + "."))),
                       None)
            if key is None:
                raise
            raise SpecError(f"value {origin[1][key]!r} for case '{raw['name']}': {e.message}", file=file,
                            case=None, key=f"sweep[{origin[0] + 1}].{key}") from None
    spec = Spec(exp, tuple(cases), path, text, sweep_values=swept, train=raw_train)
    return spec


def parse_spec(text: str, path: Path) -> Spec:
    """Parse and validate spec ``text`` read from ``path`` (used for messages and relative files)."""
    path = Path(path)
    data = parse_toml(text, path)
    return _parse_data(data, str(path), path.parent, path.stem, text, path)


def _canonical(value: Any, where: str = "") -> Any:
    """A dict spec as JSON-able data: tensors and arrays by shape, dtype and sha256 of their bytes.
    ``where``: the key path of ``value`` (``case[0].q``), for the one error found here: a key that is not
    a string, which TOML cannot spell and the parser's key matching cannot read."""
    if isinstance(value, dict):
        return _canonical_dict(value, where)
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if is_array(value):
        return _canonical_array(value)
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return value.item()           # numpy / torch scalars (e.g. draws = np.int64(10**6))
    return value


def _canonical_dict(value: dict, where: str) -> dict:
    out = {}
    for k, v in value.items():
        if not isinstance(k, str):
            at = f"in '{where}'" if where else "at the top level"
            raise SpecError(f"a spec's keys must be strings, as in TOML: got {k!r} ({type(k).__name__}) {at}",
                            file="<dict>", key=f"{where}.{k!r}" if where else repr(k))
        out[k] = _canonical(v, f"{where}.{k}" if where else k)
    return out


def _canonical_array(value: Any) -> dict:
    """A tensor or array by shape, dtype and the sha256 of its bytes."""
    if unsupported_array(value):      # sparse or complex: refused by the case's parser, with its key
        return {"array": list(value.shape), "dtype": str(value.dtype), "unsupported": True}
    # The bytes TensorLogits hashes: float64 on the CPU (bf16 has no numpy dtype).
    import torch
    t = torch.as_tensor(value).detach().to("cpu", torch.float64).contiguous()  # host: a spec table, hashed from host bytes
    return {"array": list(t.shape), "dtype": str(value.dtype), "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest()}


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
    return _parse_data(_plain(data), "<dict>", Path(base_dir) if base_dir is not None else Path.cwd(), name, text,
                       Path("<dict>"))


def _plain(value: Any) -> Any:
    """A dict spec with Python's spellings of TOML data as TOML's: tuples as lists, paths as strings (what
    _canonical already records them as); arrays and everything else as they are."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file."""
    path = Path(path)
    # A regular file only (a FIFO or /dev/zero is one line, never a hang), at most 16 MiB, UTF-8 text.
    text = decode_text(read_regular(path, "spec"), path, "spec")
    return parse_spec(text, path)


def _check_override_types(path: str, draws, seed, device) -> None:
    """draws and seed are integers, device a string (a Python caller may pass anything); errors name the API's
    argument (the command line says its flag: SpecError.as_flags)."""
    for key, value in (("draws", draws), ("seed", seed)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise SpecError(f"must be an integer, got {value!r}", file=path, key=argument(key))
    if device is not None and not isinstance(device, str):
        raise SpecError(f"must be a string, got {device!r}", file=path, key=argument("device"))


def with_overrides(spec: Spec, *, draws: int | None = None, seed: int | None = None,
                   device: str | None = None) -> Spec:
    """Apply command-line overrides (validated like the spec's own fields)."""
    path = str(spec.path)
    _check_override_types(path, draws, seed, device)
    changes = {}
    for name, value, check in (("draws", draws, check_draws), ("seed", seed, check_seed),
                               ("device", device, check_device)):
        msg = None if value is None else check(value)
        if msg:
            raise SpecError(msg, file=path, key=argument(name))
        if value is not None:
            changes[name] = value
    if draws is not None:       # --draws sets every case, per-case overrides included
        spec = dataclasses.replace(spec, cases=tuple(dataclasses.replace(c, draws=None) for c in spec.cases))
    return dataclasses.replace(spec, experiment=dataclasses.replace(spec.experiment, **changes))
