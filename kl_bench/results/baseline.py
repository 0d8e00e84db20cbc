"""Baselines (``kl-bench baseline``, ``check --baseline``): the stored file's format, its writer and its
reader. A baseline holds, per row of a reference run, what the regression gate compares a new run with
(:mod:`kl_bench.analysis.gate`); reading one validates every row, so that a damaged or hand-edited file is one line.
"""
from __future__ import annotations

import copy
import datetime as _dt
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..foundation.errors import SpecError
from ..foundation.formatting import CV_OPT
from ..foundation.safe_io import parse_json, read_regular
from ..core.stats import HeavyTail

if TYPE_CHECKING:
    import pandas as pd

BASELINE_VERSION = 1
BASELINE_FIELDS = ["case", "estimator", "lambda", "aggregate", "target", "draws", "mean", "std", "se", "std_se",
                   "exact_mean", "exact_std", "heavy_tail", "batches"]
# Fields a baseline may lack (written by later versions; older baselines still load): treated as unknown.
_LATER_FIELDS = ("batches",)



def baseline_key(r) -> tuple:
    """Rows match across runs by case, estimator, aggregate and λ; cv_opt's λ is fitted, so not by λ."""
    lam = r["lambda"]
    if r["estimator"] == CV_OPT or lam is None or (isinstance(lam, float) and math.isnan(lam)):
        lam = ""
    else:
        lam = round(float(lam), 12)
    return (r["case"], r["estimator"], r["aggregate"] or "", lam)


def make_baseline(df: pd.DataFrame, spec, *, run: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The baseline of the summary ``df`` of ``spec``'s experiment. ``run``: the run.json (envelope) of the
    results folder ``df`` was read from; the baseline then records that run's seed and spec sha256 (the
    numbers were drawn by it, whatever the spec says now), else ``spec``'s (``df`` is a run of ``spec``)."""
    seed, sha = spec.experiment.seed, spec.sha256
    if run is not None:
        seed, sha = run.get("seed", seed), run.get("spec_sha256", sha)
    rows = []
    for _, r in df.iterrows():
        row = {}
        for k in BASELINE_FIELDS:
            v = r.get(k)
            if isinstance(v, float) and math.isnan(v):
                v = None
            row[k] = v.item() if hasattr(v, "item") else v
        rows.append(row)
    out = {"kl_bench_baseline": BASELINE_VERSION, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(
           timespec="seconds"), "spec_name": spec.experiment.name, "spec_sha256": sha, "seed": seed, "rows": rows}
    # What load_baseline would refuse is never stored (a NaN mean, a negative se, a repeated row).
    normalize_baseline(copy.deepcopy(out), f"the baseline of {spec.path}")
    return out


def baseline_bytes(baseline: dict[str, Any]) -> bytes:
    # inf is not JSON: write it as a string and read it back (see load_baseline).
    def fix(v):
        return str(v) if isinstance(v, float) and math.isinf(v) else v
    safe = dict(baseline, rows=[{k: fix(v) for k, v in r.items()} for r in baseline["rows"]])
    return (json.dumps(safe, indent=1) + "\n").encode()


def load_baseline(path: Path) -> dict[str, Any]:
    """Read and validate a baseline; a truncated or corrupted file is a one-line SpecError."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        raise SpecError("baseline file not found (make one with `kl-bench baseline SPEC`)", file=str(path))
    data = parse_json(read_regular(path, "baseline"), path, "baseline")
    return normalize_baseline(data, str(path))


def check_baseline_matches(baseline: dict[str, Any], spec_name: str, path: Path) -> None:
    """Refuse a baseline made from another experiment (its ``spec_name``): its rows would all read as moved
    or missing, a verdict about the wrong file."""
    made = baseline.get("spec_name")
    if isinstance(made, str) and made != spec_name:
        raise SpecError(f"is the baseline of experiment '{made}', not of '{spec_name}': give the baseline of this "
                        f"experiment (make it with `kl-bench baseline`)", file=str(path), key="--baseline")


# Baseline fields by type: numbers that every row must have, numbers that may be null (NaN: make_baseline
# writes NaN as null, e.g. the se of a row whose estimates are infinite), text.
_REQUIRED_NUMBERS = ("draws", "mean")
_OPTIONAL_NUMBERS = ("std", "se", "lambda", "std_se", "exact_mean", "exact_std", "batches")
_REQUIRED_TEXT = ("case", "estimator", "target")
_OPTIONAL_TEXT = ("aggregate", "heavy_tail")
_INF_TEXT = {"inf": math.inf, "infinity": math.inf, "+inf": math.inf, "-inf": -math.inf, "-infinity": -math.inf}


def _baseline_number(v: Any, what: str, where: str, required: bool) -> float:
    """A baseline value as a float: a JSON number, "inf"/"-inf" (as baseline_bytes writes infinities), or
    null (NaN) where allowed; anything else is a one-line SpecError."""
    if v is None:
        if required:
            raise SpecError(f"{what} is null, a number is needed (corrupted baseline?)", file=where)
        return math.nan
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise SpecError(f"{what} is not a number: {json.dumps(v)[:40]}", file=where)
    if isinstance(v, str):
        if v.strip().lower() not in _INF_TEXT:
            raise SpecError(f"{what} is not a number: {v[:40]!r}", file=where)
        return _INF_TEXT[v.strip().lower()]
    x = float(v)
    if math.isnan(x) and required:
        raise SpecError(f"{what} is NaN, a number is needed (corrupted baseline?)", file=where)
    return x


def normalize_baseline(data: Any, where: str = "baseline") -> dict[str, Any]:
    """Validate a decoded baseline and convert its numbers (None → NaN, "inf" → inf). Every problem (a
    row that is null or not an object, a missing key, a value of the wrong type, a duplicated row) is a
    one-line SpecError naming ``where`` and the row."""
    seen: dict[tuple, int] = {}
    for i, r in enumerate(_baseline_rows(data, where)):
        name = _check_row_fields(i, r, where)
        _check_row_numbers(name, r, where)
        r["aggregate"] = r["aggregate"] or ""
        r["heavy_tail"] = r["heavy_tail"] or ""
        key = baseline_key(r)
        if key in seen:
            raise SpecError(f"{name} repeats row {seen[key]} (same case, estimator, aggregate and λ)", file=where)
        seen[key] = i + 1
    return data


def _baseline_rows(data: Any, where: str) -> list:
    """The rows of a baseline of this version (one line if it is not one, or has none)."""
    version = data.get("kl_bench_baseline") if isinstance(data, dict) else None
    if isinstance(version, bool) or version != BASELINE_VERSION:
        raise SpecError(f"not a kl-bench baseline of version {BASELINE_VERSION}", file=where)
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise SpecError("baseline has no rows" + ("" if rows is None or isinstance(rows, list)
                        else f" ('rows' is not a list but {type(rows).__name__})"), file=where)
    return rows


def _check_row_fields(i: int, r: Any, where: str) -> str:
    """Row ``i`` is an object with every key and its text fields are strings; returns its name for errors."""
    if not isinstance(r, dict):
        got = "null" if r is None else f"not an object ({json.dumps(r)[:40]})"
        raise SpecError(f"baseline row {i + 1} is {got} (corrupted baseline?)", file=where)
    missing = [k for k in BASELINE_FIELDS if k not in r and k not in _LATER_FIELDS]
    if missing:
        raise SpecError(f"baseline row {i + 1} lacks {', '.join(missing)}", file=where)
    return _check_text_fields(i, r, where)


def _check_text_fields(i: int, r: dict, where: str) -> str:
    """Row ``i``'s text fields: the required ones non-empty strings, the optional ones strings or null; its name."""
    for k in _REQUIRED_TEXT:
        if not isinstance(r[k], str) or not r[k]:
            raise SpecError(f"baseline row {i + 1}: {k} must be a non-empty string, got "
                            f"{json.dumps(r[k])[:40]}", file=where)
    name = f"baseline row {i + 1} ({r['case']}: {r['estimator']})"
    for k in _OPTIONAL_TEXT:
        if r[k] is not None and not isinstance(r[k], str):
            raise SpecError(f"{name}: {k} must be a string or null, got {json.dumps(r[k])[:40]}", file=where)
    return name


def _whole(x: float) -> bool:
    return math.isfinite(x) and x >= 1 and x == int(x)


def _check_row_numbers(name: str, r: dict, where: str) -> None:
    """The row's numbers converted (None → NaN) and in range: draws and batches whole, spreads ≥ 0."""
    for k in _REQUIRED_NUMBERS + _OPTIONAL_NUMBERS:
        r[k] = _baseline_number(r.get(k), f"{name}: {k}", where, k in _REQUIRED_NUMBERS)
    if not _whole(r["draws"]):
        raise SpecError(f"{name}: draws must be a whole number ≥ 1, got {r['draws']:g}", file=where)
    if r["se"] < 0 or r["std"] < 0 or r["std_se"] < 0:        # NaN compares False: allowed
        raise SpecError(f"{name}: std, se and std_se must be ≥ 0, got std {r['std']:g}, se {r['se']:g}, "
                        f"std_se {r['std_se']:g}", file=where)
    unknown = r.get("heavy_tail") == HeavyTail.DEGENERATE.value        # its SE is unknown: empty by design
    if math.isfinite(r["mean"]) and ((math.isnan(r["se"]) and not unknown) or math.isnan(r["std"])):
        raise SpecError(f"{name}: se and std must be numbers where the mean is finite (corrupted baseline?)",
                        file=where)
    if not (math.isnan(r["batches"]) or _whole(r["batches"])):
        raise SpecError(f"{name}: batches must be a whole number ≥ 1, got {r['batches']:g}", file=where)
