"""A spec's ``[experiment]`` table: the :class:`Experiment` dataclass and its parser (name, draws, seed,
device, batches, chunk; the estimators, clamped variants and their labels; the λ values of cv(λ); the
group sizes of the baseline rows; the gates' thresholds), every error naming the file and key."""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..foundation.typed_toml import (MAX_BATCHES, MAX_DRAWS, Table, at_most, check_device, check_seed, convert,
                                  positive, shown, typename)
from ..foundation.formatting import fmt_count
from .group_baselines import MAX_GROUP
from ..foundation.errors import SpecError
from ..core.gates import gate, gate_names
from ..core.estimators import DEFAULT_ESTIMATORS, ESTIMATORS, PAIR_ROWS, EstimatorOption, lookup, resolve_estimator
from ..foundation.registry import UnknownName, did_you_mean, plugin_path

# |λ| of cv(λ) = −log r + λ(r − 1): beyond it λ²·Var(r) and the squared per-draw values of the λ curve
# leave float64's range for ordinary pairs, and the row is λ(r − 1) to every printed digit anyway.
MAX_LAMBDA = 1e3
_DRAWS_WHY = "2^53: draws are counted in float64"
_at_most_draws = at_most(MAX_DRAWS, _DRAWS_WHY)


def check_draws(v: int) -> str | None:
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
    gates: tuple[tuple[str, tuple[float, ...]], ...] = ()   # (gate, δ values): also write gates.csv (kl_bench.core.gates)

    @functools.cached_property
    def sources(self) -> tuple:
        """The estimators as objects (:func:`kl_bench.core.estimators.resolve_estimator`: registered ones,
        plug-ins, clamped variants), resolved once per spec: every pass of the run uses these objects."""
        return tuple(resolve_estimator(n) for n in self.estimators)

    def __getstate__(self) -> dict:
        # A pickled spec (torchrun's handshake, a deep copy) leaves the resolved estimators behind: a plug-in
        # or clamped variant may be a closure, and the receiver resolves its own.
        return {k: v for k, v in self.__dict__.items() if k != "sources"}



def _check_experiment_name(v: str) -> str | None:
    # The name is the default results folder: a plain file name.
    if not re.fullmatch(r"[\w.\-]+", v) or v in (".", ".."):
        return "must be a plain file name: letters, digits, '_', '-', '.' (not '.' or '..')"
    return None


def parse_experiment(t: Table, stem: str) -> Experiment:
    names = _parse_estimators(t)
    lambdas, optimal = _parse_lambdas(t)
    exp = Experiment(
        name=t.get("name", "str", stem, _check_experiment_name),
        draws=t.get("draws", "int", check=check_draws),
        seed=t.get("seed", "int", 0, check_seed),
        device=t.get("device", "str", "auto", check_device),
        estimators=names,
        batches=t.get("batches", "int", 200, _check_batches),
        chunk=t.get("chunk", "int", 1 << 22, positive),
        lambdas=lambdas,
        optimal=optimal,
        gradients=t.bool("gradients", False),
        baseline_groups=_parse_groups(t),
        gates=_parse_gates(t),
    )
    t.finish()
    return exp


def _parse_gates(t: Table) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """`gates = { bin_kl = [0.001, 0.01], k3 = [0.02] }`: per registered gate (kl_bench.core.gates), the
    thresholds δ > 0 swept in one pass."""
    raw = t.raw("gates")
    if raw is None:
        return ()
    key = t.key("gates")
    if not isinstance(raw, dict) or not raw:
        raise t.error(f"must be a table of gate = [thresholds], e.g. {{ bin_kl = [0.01] }}, got {typename(raw)}", key=key)
    out = []
    for name, deltas in raw.items():
        try:
            gate(name)
        except UnknownName:
            raise t.error(f"unknown gate '{name}'{did_you_mean(name, gate_names())}; known: {', '.join(gate_names())}",
                          key=key) from None
        values = deltas if isinstance(deltas, list) else [deltas]
        if not values:
            raise t.error(f"'{name}' needs at least one threshold", key=key)
        got = []
        for v in values:
            x = convert(v, "float", lambda m: t.error(f"'{name}': {m}", key=key))
            if not (math.isfinite(x) and x > 0):
                raise t.error(f"'{name}': a threshold must be a finite number > 0, got {v!r}", key=key)
            got.append(x)
        if len(set(got)) < len(got):
            raise t.error(f"'{name}' lists a threshold twice", key=key)
        out.append((name, tuple(sorted(got))))
    return tuple(out)


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
    out = [_estimator_item(t, item, i, key) for i, item in enumerate(raw)]
    labels = [o.label if isinstance(o, EstimatorOption) else o for o in out]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup is not None:
        raise t.error(f"lists '{dup}' twice (give clamped variants distinct labels)", key=key)
    return tuple(out)


def _estimator_item(t: Table, item: Any, i: int, key: str) -> str | EstimatorOption:
    """Item i (from 0) of the estimators list: a name, or a clamped variant's table; its estimator looked up."""
    if isinstance(item, dict):
        name, out = _estimator_option(Table(item, t.file, t.case, f"{key}[{i + 1}]."), f"{key}[{i + 1}]")
    else:
        name = out = convert(item, "str", lambda m: t.error(m, key=key))
    source = _lookup_estimator(name, t.file, key)
    if isinstance(out, EstimatorOption) and source.analytic:
        raise t.error(f"'{name}' does not depend on log r: clamps do not apply", key=key)
    return out


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
