"""Experiment specs: TOML (or a dict with the TOML's structure) → frozen, validated dataclasses.

This module holds what every spec has (``spec_version``, ``[experiment]``, the common case keys
``name``, ``kind``, ``draws`` and ``sampler``); each case kind parses its own keys
(:meth:`kl_bench.kinds.protocols.CaseParser.parse`). Every error is a :class:`SpecError` naming the file, the case
and the key. Unknown keys are rejected with a "did you mean" suggestion. See README.md ("Spec format").
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..foundation.typed_toml import (MAX_BATCHES, MAX_DRAWS, Table, at_most, check_case_name, check_device, check_seed,
                                  convert, positive, shown, typename)
from ..foundation.formatting import fmt_count
from .group_baselines import MAX_GROUP
from ..foundation.errors import SpecError
from ..core.estimators import DEFAULT_ESTIMATORS, ESTIMATORS, PAIR_ROWS, EstimatorOption, lookup, resolve_estimator
from ..sampling.logits import is_array, unsupported_array
from ..kinds import CASE_KINDS, CaseConfig
from ..foundation.registry import did_you_mean, plugin_path
from ..foundation.safe_io import decode_text, parse_toml, read_regular
from ..sampling.mismatch import parse_sampler
from ..results.verify import ORDERLESS, RUN_SETTINGS

SPEC_VERSION = 1
# |λ| of cv(λ) = −log r + λ(r − 1): beyond it λ²·Var(r) and the squared per-draw values of the λ curve
# leave float64's range for ordinary pairs, and the row is λ(r − 1) to every printed digit anyway.
MAX_LAMBDA = 1e3
_DRAWS_WHY = "2^53: draws are counted in float64"
_at_most_draws = at_most(MAX_DRAWS, _DRAWS_WHY)


def _check_draws(v: int) -> str | None:
    """Draws of an experiment, a case or --draws: 2 ≤ draws ≤ 2^53 (a standard error needs two batches)."""
    if v == 1:
        return "must be ≥ 2 (a standard error needs at least two batches of draws), got 1"
    return _at_most_draws(v)
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
    gradients: bool = False           # also write gradients.csv (kl_bench.experiment.gradient_rows)
    baseline_groups: tuple[int, ...] = ()   # G values: also write group_baselines.csv (kl_bench.experiment.group_baselines)

    @functools.cached_property
    def sources(self) -> tuple:
        """The estimators as objects (:func:`kl_bench.core.estimators.resolve_estimator`: registered ones,
        plug-ins, clamped variants), resolved once per spec: every pass of the run uses these objects."""
        return tuple(resolve_estimator(n) for n in self.estimators)

    def __getstate__(self) -> dict:
        # A pickled spec (torchrun's handshake, a deep copy) leaves the resolved estimators behind: a plug-in
        # or clamped variant may be a closure, and the receiver resolves its own.
        return {k: v for k, v in self.__dict__.items() if k != "sources"}


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
        seed=t.get("seed", "int", 0, check_seed),
        device=t.get("device", "str", "auto", check_device),
        estimators=names,
        batches=t.get("batches", "int", 200, _check_batches),
        chunk=t.get("chunk", "int", 1 << 22, positive),
        lambdas=lambdas,
        optimal=optimal,
        gradients=t.bool("gradients", False),
        baseline_groups=_parse_groups(t),
    )
    t.finish()
    return exp


def _parse_groups(t: Table) -> tuple[int, ...]:
    """`baseline_groups = [2, 8]`: group sizes G of the group-mean and leave-one-out rows."""
    raw = t.raw("baseline_groups")
    if raw is None:
        return ()
    key = t.key("baseline_groups")
    if not isinstance(raw, list) or not raw:
        raise t.error(f"must be a non-empty list of group sizes, got {typename(raw)}", key=key)
    out = []
    for v in raw:
        g = convert(v, "int", lambda m: t.error(m, key=key))
        if not 2 <= g <= MAX_GROUP:
            raise t.error(f"group sizes must be 2 ≤ G ≤ {fmt_count(MAX_GROUP)} (whole groups fit a piece of "
                          f"draws), got {fmt_count(g)}", key=key)
        if g in out:
            raise t.error(f"lists G = {g} twice", key=key)
        out.append(g)
    return tuple(out)


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
            item_name, out_item = _estimator_option(Table(item, t.file, t.case, f"{key}[{i + 1}]."), f"{key}[{i + 1}]")
        else:
            item_name = out_item = convert(item, "str", lambda m: t.error(m, key=key))
        source = _lookup_estimator(item_name, t.file, key)
        if isinstance(out_item, EstimatorOption) and source.analytic:
            raise t.error(f"'{item_name}' does not depend on log r: clamps do not apply", key=key)
        out.append(out_item)
    labels = [o.label if isinstance(o, EstimatorOption) else o for o in out]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup is not None:
        raise t.error(f"lists '{dup}' twice (give clamped variants distinct labels)", key=key)
    return tuple(out)


def _lookup_estimator(name: str, file: str | None, key: str):
    """The registered (or plug-in) estimator ``name``; a plug-in is imported now, so that a broken one fails
    here (plug-in paths relative to the spec's folder)."""
    try:
        with plugin_path(Path(file).parent if file and Path(file).is_file() else None):
            return lookup(name)
    except SpecError as e:
        raise e.located(file=file, key=key) from None


def _estimator_option(sub: Table, where: str) -> tuple[str, EstimatorOption]:
    """(name, option) of a clamped variant's table {name, logr_clamp, clamp, label}."""
    name = sub.get("name", "str")
    opt = EstimatorOption(name=name, label="", logr_clamp=sub.get("logr_clamp", "float", None, positive),
                          clamp=sub.get("clamp", "float", None, positive))
    label = sub.get("label", "str", None)
    sub.finish()
    if opt.logr_clamp is None and opt.clamp is None:
        raise sub.error("needs logr_clamp or clamp (or use the plain name)", key=where)
    if label is None:
        label = name + (f"|logr|≤{opt.logr_clamp:g}" if opt.logr_clamp else "") + \
            (f"|est|≤{opt.clamp:g}" if opt.clamp else "")
    else:
        _check_label(sub, label, where)
    return name, dataclasses.replace(opt, label=label)


# Row names a label may not take: the λ rows' (cv(λ) and the pilot-fitted cv_opt, written "cv"/"cv_opt" in
# summary.csv's estimator column and "cv(0.5)"/"cv_opt(0.58)" in tables), and every registered estimator's
# and pair row's (a clamped k3 reported as "k1" would read as k1 itself, and meet its row if k1 is listed).
_LAMBDA_ROWS = ("cv", "cv_opt")


def _check_label(sub: Table, label: str, where: str) -> None:
    """Refuse a clamped variant's ``label`` that cannot name its row: empty, blank, unprintable, surrounded by
    spaces, not NFC (as a case name), or one of the names above (a row that a reader would take for another)."""
    if not label or not label.isprintable() or label != label.strip():
        raise sub.error(f"must be non-empty printable text without surrounding spaces, got {shown(label)}",
                        key=f"{where}.label")
    if unicodedata.normalize("NFC", label) != label:
        raise sub.error(f"must be written in Unicode's composed form (NFC), got {ascii(label)}: write "
                        f"{ascii(unicodedata.normalize('NFC', label))}", key=f"{where}.label")
    head = label.split("(", 1)[0]
    if head in _LAMBDA_ROWS:
        raise sub.error(f"'{label}' is the name of the λ rows (cv(λ), cv_opt): choose another label", key=f"{where}.label")
    if label in ESTIMATORS.names() or label in PAIR_ROWS:
        raise sub.error(f"'{label}' is the name of an estimator: a clamped variant needs a label of its own",
                        key=f"{where}.label")


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
        def others() -> dict[str, tuple[str, ...]]:
            return {k.name: k.sampler_keys for k in CASE_KINDS.values()}
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
    exp = _parse_experiment(top.sub("experiment"), stem)
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


# ----------------------------------------------------------------------------- [[sweep]]
# A sweep names a base case and maps case keys (dotted for nested tables: "p.noise",
# "sampler.temperature") to values: a list, {geomspace = [a, b], num = n} or {linspace = [a, b], num = n}.
# The base case is replaced by one case per combination of values (the cartesian product of the table's
# keys), named "<base>[key=value,...]"; several sweeps of one base add their cases together.
MAX_SWEEP_CASES = 1024      # cases a spec's sweeps may make: a grid beyond it is almost surely a typo
_GRID_DIGITS = 4            # geomspace/linspace inner values are rounded to this many significant digits,
                            # so case names stay short and every value is written exactly (the ends: as written)


def _grid_values(v: Any, where: str, file: str) -> list[Any]:
    def err(msg: str) -> SpecError:
        return SpecError(msg, file=file, key=where)
    if isinstance(v, list):
        return _listed_values(v, err)
    if not isinstance(v, dict):
        raise err(f"must be a list of values, or {{ geomspace = [a, b], num = n }} / {{ linspace = [a, b], num = n }}; "
                  f"got {typename(v)}")
    out = _grid_points(*_grid_spec(v, err))        # finite: finite ends (convert), inner values within them
    if len(set(out)) < len(out):            # [1, 1.0001] in 5 steps: all 1 once rounded (names say the value)
        raise err(f"its {len(out)} values are not all different once the inner ones are rounded to {_GRID_DIGITS} "
                  f"significant digits ({', '.join(dict.fromkeys(map(_fmt_value, out)))}): give ends further apart, "
                  "or fewer values")
    return out


def _grid_points(grid: str, a: float, b: float, num: int) -> list[float]:
    """``num`` values from ``a`` to ``b``, evenly spaced (linspace) or in ratio (geomspace). The ends are
    ``a`` and ``b`` exactly as written (``a + (b − a)`` had made [1.1, 1e-20]'s last value 0.0); the inner
    values are a + (b − a)·i/(num − 1) (of the logs for geomspace; (1 − i/(num − 1))·a + b·i/(num − 1) where
    b − a overflows, as for [−1e308, 1e308]), rounded to :data:`_GRID_DIGITS` significant digits and kept
    within [a, b]."""
    if num == 1:
        return [a]
    lo, hi = min(a, b), max(a, b)
    steps = range(1, num - 1)
    if grid == "geomspace":
        la, lb = math.log(a), math.log(b)
        inner = [math.exp(la + (lb - la) * i / (num - 1)) for i in steps]
    elif math.isfinite(b - a):
        inner = [a + (b - a) * i / (num - 1) for i in steps]
    else:
        inner = [(1 - i / (num - 1)) * a + b * i / (num - 1) for i in steps]
    return [a, *(min(max(float(f"{x:.{_GRID_DIGITS}g}"), lo), hi) for x in inner), b]


def _listed_values(v: list, err: Callable[[str], SpecError]) -> list[Any]:
    """A sweep's list of values, checked: plain values, none twice (as the case names write them)."""
    if not v:
        raise err("must list at least one value")
    if any(isinstance(x, (dict, list)) for x in v):
        raise err("must list plain values (numbers, strings, booleans)")
    twice = next((x for i, x in enumerate(v) if _fmt_value(x) in map(_fmt_value, v[:i])), None)
    if twice is not None:
        raise err(f"lists the value {_fmt_value(twice)} twice")
    return list(v)


def _grid_spec(v: dict, err: Callable[[str], SpecError]) -> tuple[str, float, float, int]:
    """(geomspace or linspace, first, last, num) of a grid table, checked."""
    kinds = [k for k in ("geomspace", "linspace") if k in v]
    unknown = [k for k in v if k not in ("geomspace", "linspace", "num")]
    if unknown:
        raise err(f"unknown key '{unknown[0]}'{did_you_mean(unknown[0], ['geomspace', 'linspace', 'num'])}")
    if len(kinds) != 1:
        raise err("needs exactly one of geomspace or linspace")
    ends = v[kinds[0]]
    if not isinstance(ends, list) or len(ends) != 2 or not all(_is_number(x) for x in ends):
        raise err(f"{kinds[0]} must be [first, last] numbers")
    num = _grid_num(v.get("num"), err)
    a, b = (convert(x, "float", lambda m: err(f"{kinds[0]}: {m}")) for x in ends)
    if kinds[0] == "geomspace" and not (a > 0 and b > 0):
        raise err("geomspace needs positive ends")
    return kinds[0], a, b, num


def _grid_num(num: Any, err: Callable[[str], SpecError]) -> int:
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        raise err(f"num must be an integer ≥ 1, got {num!r}")
    if num > MAX_SWEEP_CASES:        # refused before a single value is made: a grid this size is a typo
        raise err(f"num = {fmt_count(num)} makes more than {MAX_SWEEP_CASES:,} cases: sweep fewer values")
    return num


def _is_number(x: Any) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        short = f"{v:g}"
        return short if float(short) == v else repr(v)
    return str(v).lower() if isinstance(v, bool) else str(v)


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"p": {"noise": [..]}} → {"p.noise": [..]} (TOML's unquoted dotted keys), stopping at grid helpers."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and not ({"geomspace", "linspace", "num"} & set(v)):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def expand_sweeps(raw_cases: list, raw_sweeps: Any, file: str) -> tuple[list[tuple[Any, Any]], dict]:
    """The [[case]] list with every swept base case replaced by its cases: [(raw case, origin)], origin
    (sweep index, {key: value}) or None; and {case name: {key: value}} of the swept cases."""
    if raw_sweeps is None:
        return [(c, None) for c in raw_cases], {}
    if not isinstance(raw_sweeps, list):
        raise SpecError(f"must be an array of tables ([[sweep]]), got {typename(raw_sweeps)}", file=file, key="sweep")
    by_name = {c.get("name"): c for c in raw_cases if isinstance(c, dict)}
    made: dict[str, list[tuple[Any, Any]]] = {}
    total = 0
    for i, sw in enumerate(raw_sweeps):
        where = f"sweep[{i + 1}]"
        base_name, values = _sweep_values(sw, where, by_name, file)
        total += math.prod(len(v) for v in values.values())
        if total > MAX_SWEEP_CASES:
            raise SpecError(f"the sweeps make {total:,}+ cases, more than {MAX_SWEEP_CASES:,}: sweep fewer values",
                            file=file, key=where)
        for combo in itertools.product(*values.values()):
            assigned = dict(zip(values, combo))
            raw = _swept_case(by_name[base_name], base_name, assigned, where, file)
            made.setdefault(base_name, []).append((raw, (i, assigned)))
    return _in_case_order(raw_cases, made, file)


def _sweep_values(sw: Any, where: str, by_name: dict, file: str) -> tuple[str, dict[str, list[Any]]]:
    """(base case name, {dotted key: its values}) of one [[sweep]] table, checked."""
    if not isinstance(sw, dict):
        raise SpecError(f"must be a table, got {typename(sw)}", file=file, key=where)
    base_name = sw.get("case")
    if not isinstance(base_name, str):
        raise SpecError("needs case = \"<name of a [[case]]>\"", file=file, key=f"{where}.case")
    if base_name not in by_name:
        raise SpecError(f"no [[case]] named '{base_name}'{did_you_mean(base_name, [n for n in by_name if n])}",
                        file=file, key=f"{where}.case")
    grid = _flatten({k: v for k, v in sw.items() if k != "case"})
    if not grid:
        raise SpecError("sweeps no key: add e.g. noise = [0.1, 0.3]", file=file, key=where)
    for key in grid:
        if key in ("name", "kind"):
            raise SpecError("cannot be swept (it names the case and its kind)", file=file, key=f"{where}.{key}")
    return base_name, {k: _grid_values(v, f"{where}.{k}", file) for k, v in grid.items()}


def _swept_case(base: dict, base_name: str, assigned: dict[str, Any], where: str, file: str) -> dict:
    """A copy of the base case with the swept (dotted) keys set, named "<base>[key=value;...]"."""
    raw = copy.deepcopy(base)
    for key, v in assigned.items():
        node = raw
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SpecError(f"'{part}' of case '{base_name}' is not a table", file=file, key=f"{where}.{key}")
        node[leaf] = v
    raw["name"] = f"{base_name}[" + ";".join(f"{k}={_fmt_value(v)}" for k, v in assigned.items()) + "]"
    return raw


def _in_case_order(raw_cases: list, made: dict[str, list[tuple[Any, Any]]],
                   file: str) -> tuple[list[tuple[Any, Any]], dict]:
    """Every swept base case replaced, in place, by its cases; a case name made twice is refused."""
    out, swept, seen = [], {}, set()
    for c in raw_cases:
        name = c.get("name") if isinstance(c, dict) else None
        for raw, origin in made.get(name, [(c, None)]) if name in made else [(c, None)]:
            if origin is not None:
                if raw["name"] in seen:
                    raise SpecError(f"makes the case '{raw['name']}' twice (two sweeps over the same values?)",
                                    file=file, key=f"sweep[{origin[0] + 1}]")
                seen.add(raw["name"])
                swept[raw["name"]] = origin[1]
            out.append((raw, origin))
    return out, swept


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
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                at = f"in '{where}'" if where else "at the top level"
                raise SpecError(f"a spec's keys must be strings, as in TOML: got {k!r} ({type(k).__name__}) {at}",
                                file="<dict>", key=f"{where}.{k!r}" if where else repr(k))
            out[k] = _canonical(v, f"{where}.{k}" if where else k)
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if is_array(value):
        if unsupported_array(value):      # sparse or complex: refused by the case's parser, with its key
            return {"array": list(value.shape), "dtype": str(value.dtype), "unsupported": True}
        # The bytes TensorLogits hashes: float64 on the CPU (bf16 has no numpy dtype).
        import torch
        t = torch.as_tensor(value).detach().to("cpu", torch.float64).contiguous()  # host: a spec table, hashed from host bytes
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


def with_overrides(spec: Spec, *, draws: int | None = None, seed: int | None = None,
                   device: str | None = None) -> Spec:
    """Apply command-line overrides (validated like the spec's own fields)."""
    path = str(spec.path)
    for key, value in (("--draws", draws), ("--seed", seed)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise SpecError(f"must be an integer, got {value!r}", file=path, key=key)
    if device is not None and not isinstance(device, str):
        raise SpecError(f"must be a string, got {device!r}", file=path, key="--device")
    changes = {}
    for name, value, check in (("draws", draws, _check_draws), ("seed", seed, check_seed),
                               ("device", device, check_device)):
        msg = None if value is None else check(value)
        if msg:
            raise SpecError(msg, file=path, key=f"--{name}")
        if value is not None:
            changes[name] = value
    if draws is not None:       # --draws sets every case, per-case overrides included
        spec = dataclasses.replace(spec, cases=tuple(dataclasses.replace(c, draws=None) for c in spec.cases))
    return dataclasses.replace(spec, experiment=dataclasses.replace(spec.experiment, **changes))
