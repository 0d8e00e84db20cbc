"""Verification of a results folder before anything reads its numbers.

A results folder (``kl-bench run``) is checked as a whole, and every problem is one
:class:`~kl_bench.foundation.errors.SpecError` naming the folder or the file and saying what is wrong:

- ``run.json`` is a UTF-8 JSON object; its ``files`` dict (name → sha256, written by every run since
  the hashes were introduced) matches every data file byte for byte, names no missing file, and every
  known data file on disk is recorded in it. Folders written before ``files`` existed skip the hash
  check but get every other check.
- ``summary.csv`` and ``batches.csv`` (and ``lambda_sweep.csv``, ``gradients.csv`` when present) have
  their schema's columns, every row has as many fields as the header (a truncated file does not), the
  file ends with a newline, numeric columns parse as numbers, and the key text columns are not empty.
- Every number is plausible: counts are whole numbers ≥ 0, standard deviations and errors are ≥ 0 (or
  empty), a KL (true_kl) is ≥ 0 or empty, fractions lie in [0, 1], a statistic of a row that has draws is
  never NaN (an empty cell) where its mean is finite, and
  each table holds one row per key (case, estimator, aggregate, λ; batches.csv: and batch).
- ``reservoir.npz`` is a readable archive of numeric arrays (no pickles), each array's header checked
  against its size before it is allocated.
- Every file is opened as a regular file only (never a FIFO or a device) and read up to a size cap
  (kl_bench.foundation.safe_io).
- The cases agree: summary.csv's cases are exactly run.json's ``cases`` (when recorded), and
  batches.csv holds only those cases.

:func:`check_results_match_spec` checks a folder against a spec: same experiment name, the same cases.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..foundation.errors import SpecError
from .csv_checks import check_numeric_columns, check_whole, first_bad, parse_csv
from .folders import (FORMATS, check_hashes, check_recorded, format_of, read_bytes,
                      read_envelope, require_folder, require_kind, version_of)
from .migrate import migrate
from .schema import BATCH_SCHEMA, GATE_SCHEMA, GRAD_SCHEMA, GROUP_BASELINE_SCHEMA, SCHEMA, SWEEP_SCHEMA, TEXT_COLUMNS
from ..foundation.safe_io import cap_for, load_npz
from ..core.stats import HeavyTail

# The columns every results folder has had; later columns are optional so that older results still load.
SUMMARY_REQUIRED = ["case", "estimator", "lambda", "aggregate", "target", "true_kl", "draws", "mean", "std", "se",
                    "bias", "rel_bias", "rel_std", "exact_mean", "exact_std", "z", "frac_negative"]
# Data files a run writes (run.json records their sha256), and the tables among them (CSV files with a schema).
DATA_FILES = FORMATS["run"].data_files
TABLES = FORMATS["run"].tables


@dataclass
class FolderContents:
    """What a verified results folder holds: run.json decoded, each table parsed (None when absent)."""
    path: Path
    envelope: dict
    summary: Any
    batches: Any
    sweep: Any
    gradients: Any
    reservoir: dict[str, np.ndarray] | None
    group_baselines: Any = None
    gates: Any = None


def _schemas() -> dict[str, tuple[list[str], list[str]]]:
    """file name → (all columns of its schema, columns that every version has written)."""
    return {"summary.csv": (list(SCHEMA), SUMMARY_REQUIRED),
            "batches.csv": (list(BATCH_SCHEMA), list(BATCH_SCHEMA)),
            "lambda_sweep.csv": (list(SWEEP_SCHEMA), ["case", "lambda", "mean", "exact_mean"]),
            "gradients.csv": (list(GRAD_SCHEMA), ["case", "estimator", "mode"]),
            # sampler, aggregate, trace_cov and trace_cov_none came later (baselines under samplers, on rollouts)
            "group_baselines.csv": (list(GROUP_BASELINE_SCHEMA),
                                    [c for c in GROUP_BASELINE_SCHEMA
                                     if c not in ("sampler", "aggregate", "trace_cov", "trace_cov_none")]),
            "gates.csv": (list(GATE_SCHEMA), [c for c in GATE_SCHEMA if c not in ("sees", "seq_kl_unseen", "seq_weight_bias")])}


# Text columns that identify a row: an empty cell there is a damaged file.
_KEY_TEXT = ("case", "estimator", "target", "mode")
# Counts: a whole number ≥ 0 on every row.
_COUNTS = {"summary.csv": ("draws", "batches"), "batches.csv": ("batch", "draws"), "lambda_sweep.csv": ("draws",),
           "gradients.csv": ("draws", "params"), "group_baselines.csv": ("draws", "group")}
# One row per key: the columns that identify a row of each table.
_KEYS = {"summary.csv": ("case", "estimator", "aggregate", "lambda"),
         "batches.csv": ("case", "estimator", "aggregate", "lambda", "batch"),
         "lambda_sweep.csv": ("case", "aggregate", "lambda"),
         "gradients.csv": ("case", "estimator", "aggregate", "lambda", "mode"),
         "group_baselines.csv": ("case", "estimator", "aggregate", "baseline", "group"),
         "gates.csv": ("case", "gate", "delta")}
# Spreads: ≥ 0 (an empty cell is allowed: e.g. no std_se where the 4th moment is infinite).
_SPREADS = {"summary.csv": ("std", "se", "std_se", "ref_se"), "lambda_sweep.csv": ("std", "se")}
# Bounded columns: column → (lowest, highest, what it is), an empty cell allowed (no exact value). A KL is ≥ 0
# (+inf where the supports differ); ROUNDING below 0 is float64's error on an exact 0 (p = q up to a few
# ulps). An exact std, a batch size and an RMSE are ≥ 0; a fraction or a probability lies in [0, 1].
ROUNDING = 1e-9
_KL = (-ROUNDING, np.inf, "a KL: ≥ 0, or empty where no exact value exists")
_FRACTION = (-ROUNDING, 1 + ROUNDING, "a fraction: between 0 and 1, or empty")
_BOUNDED = {"summary.csv": {"true_kl": _KL, "exact_std": (0.0, np.inf, "a spread: ≥ 0, or empty"),
                            "n_for_10pct": (0.0, np.inf, "a batch size: ≥ 0, or empty"),
                            **{c: (0.0, np.inf, "an RMSE: ≥ 0, or empty") for c in ("rmse_b64", "rmse_b1024", "rmse_b16384")},
                            "ess": (0.0, np.inf, "a sample size: ≥ 0, or empty"),
                            "frac_negative": _FRACTION, "p_neg_b64": _FRACTION},
            "lambda_sweep.csv": {"true_kl": _KL, "exact_std": (0.0, np.inf, "a spread: ≥ 0, or empty"),
                                 "frac_negative": _FRACTION, "p_negative_exact": _FRACTION},
            "gates.csv": {c: _FRACTION for c in ("tokens_masked", "seq_masked", "worst_context")}}
# Statistics that every row with draws has (a NaN there is a writer's bug or an overflow, never a result),
# and those it has wherever that first one is finite.
_DEFINED = {"summary.csv": ("mean", ("std", "se")), "lambda_sweep.csv": ("mean", ("std", "se")),
            "batches.csv": ("batch_mean", ())}


def _parse_table(name: str, data: bytes, p: Path):
    """A results CSV checked against its schema and parsed as :func:`kl_bench.results.read_frame` does."""
    columns, required = _schemas()[name]
    df = parse_csv(data, p, required)
    check_numeric_columns(df, [c for c in columns if c in df.columns and c not in TEXT_COLUMNS], p)
    for c in _KEY_TEXT:
        if c in df.columns:
            empty = df.index[df[c].astype(str).str.strip() == ""]
            if len(empty):
                raise SpecError(f"column '{c}' is empty in row {int(empty[0]) + 1} (line {int(empty[0]) + 2})",
                                file=str(p))
    _check_values(name, df, p)
    return df


def undefined_statistic(name: str, df) -> tuple[str, np.ndarray, str] | None:
    """The first column of table ``name`` holding NaN where a number is due (see _DEFINED): (column,
    mask of the bad rows, what it must hold), or None."""
    main, others = _DEFINED.get(name, (None, ()))
    if main not in df.columns:
        return None
    has = df["draws"].to_numpy(dtype=float) > 0 if "draws" in df.columns else np.ones(len(df), bool)
    v = df[main].to_numpy(dtype=float)
    if (has & np.isnan(v)).any():
        return main, has & np.isnan(v), "must hold a number on every row with draws"
    if "heavy_tail" in df.columns:       # degenerate importance weights: the SE is unknown, and empty
        has = has & (df["heavy_tail"] != HeavyTail.DEGENERATE.value).to_numpy()
    for c in others:
        if c in df.columns and (bad := has & np.isfinite(v) & np.isnan(df[c].to_numpy(dtype=float))).any():
            return c, bad, f"must hold a number where {main} is finite"
    return None


def refuse_undefined_statistics(df, where: str) -> None:
    """Before results are written: a NaN statistic (float64 overflow in a case's numbers) is one line
    naming the case and the row, never an empty cell in summary.csv."""
    hit = undefined_statistic("summary.csv", df)
    if hit is not None:
        c, bad, _ = hit
        r = df.iloc[int(np.flatnonzero(bad)[0])]
        agg = r.get("aggregate")
        row = f"{r['estimator']} ({agg})" if isinstance(agg, str) and agg else str(r["estimator"])
        raise SpecError(f"the {c} of {row} is NaN: "
                        "the case's numbers overflow float64 (an extreme value in the spec or its files?); "
                        "no results were written", file=where, case=str(r["case"]))


def _check_values(name: str, df, p: Path) -> None:
    """Counts, spreads, statistics that must be defined, and one row per key (module docstring)."""
    def col(c: str) -> np.ndarray:
        return df[c].to_numpy(dtype=float)
    check_whole(df, _COUNTS.get(name, ()), p)
    for c in _SPREADS.get(name, ()):
        if c in df.columns:
            first_bad(df, c, col(c) < 0, "must be ≥ 0 (a spread)", p)
    for c, (lo, hi, what) in _BOUNDED.get(name, {}).items():
        if c in df.columns:       # NaN compares False: an empty cell passes
            first_bad(df, c, (col(c) < lo) | (col(c) > hi), f"must be {what}", p)
    hit = undefined_statistic(name, df)
    if hit is not None:
        c, bad, what = hit
        first_bad(df, c, bad, what, p)
    _check_unique_keys(df, [c for c in _KEYS.get(name, ()) if c in df.columns], p)


def _check_unique_keys(df, key: list[str], p: Path) -> None:
    """One row per value of the ``key`` columns (none: nothing to check)."""
    if not key:
        return
    frame = df[key].copy()
    if "lambda" in frame:         # λ as written (12 digits suffice to tell grid values apart)
        frame["lambda"] = frame["lambda"].astype(float).round(12)
    dup = np.flatnonzero(frame.duplicated(keep="first").to_numpy())
    if len(dup):
        i = int(dup[0])
        # .item(): numpy scalars as Python ones ('4', not 'np.int64(4)')
        shown = ", ".join(f"{c} {getattr(v, 'item', lambda: v)()!r}" for c in key
                          if str(v := df[c].iloc[i]) not in ("", "nan"))
        raise SpecError(f"row {i + 1} (line {i + 2}) repeats an earlier row's key ({shown}): one row per "
                        f"{', '.join(key)}", file=str(p))


def _load_reservoir(data: bytes, p: Path) -> dict[str, np.ndarray]:
    """A numeric .npz archive (reservoir.npz, gradients.npz), every array checked."""
    out = load_npz(data, str(p), cap_for(p.name))
    for k, v in out.items():
        if not np.issubdtype(v.dtype, np.number):
            raise SpecError(f"array {k!r} is not numeric ({v.dtype})", file=str(p))
    return out


def _check_recorded_cases(folder: Path, recorded: list[str], cases: list[str]) -> None:
    """run.json's cases are summary.csv's."""
    missing = [c for c in recorded if c not in cases]
    extra = [c for c in cases if c not in recorded]
    if missing or extra:
        raise SpecError("summary.csv and run.json disagree on the cases: "
                        + "; ".join(filter(None, [missing and "no rows for " + ", ".join(missing),
                                                  extra and "rows of unrecorded " + ", ".join(extra)])),
                        file=str(folder))


def _check_cases(folder: Path, env: dict, tables: dict) -> None:
    """summary.csv and run.json name the same cases; the other tables name none that summary.csv lacks."""
    cases = list(dict.fromkeys(tables["summary.csv"]["case"]))
    recorded = env.get("cases")
    if isinstance(recorded, dict) and recorded:
        _check_recorded_cases(folder, list(recorded), cases)
    for name in TABLES[1:]:
        t = tables[name]
        stray = [] if t is None else [c for c in dict.fromkeys(t["case"]) if c not in cases]
        if stray:
            raise SpecError(f"holds cases that summary.csv lacks: {', '.join(map(str, stray[:5]))}",
                            file=str(folder / name))


def read_results_folder(path: str | Path) -> FolderContents:
    """Verify a results folder (see the module docstring) and return its parsed contents."""
    folder = require_folder(path)
    env = read_envelope(folder / "run.json") if os.path.lexists(folder / "run.json") else None
    if env is not None:                           # a training's or an audit's folder: said as such, first
        require_kind(folder, format_of(env, str(folder / "run.json")), "run")
    for name in ("summary.csv", "run.json"):     # a FIFO or a dangling link there is said as such when read
        if not os.path.lexists(folder / name):
            raise SpecError(f"incomplete results folder: {name} is missing (run `kl-bench run` first)",
                            file=str(folder))
    present = [name for name in DATA_FILES if os.path.lexists(folder / name)]
    check_recorded(folder, env, present)
    blobs = {name: read_bytes(folder / name) for name in present}
    check_hashes(folder, env, blobs)
    tables = {name: _parse_table(name, blobs[name], folder / name) if name in blobs else None
              for name in TABLES}
    reservoir = _load_reservoir(blobs["reservoir.npz"], folder / "reservoir.npz") if "reservoir.npz" in blobs else None
    if "gradients.npz" in blobs:                  # readable and numeric (the Python API loads it on demand)
        _load_reservoir(blobs["gradients.npz"], folder / "gradients.npz")
    version_of(env, FORMATS["run"], str(folder / "run.json"))   # a newer format: one line, before any table is read
    summary = tables["summary.csv"]
    _check_cases(folder, env, tables)
    return migrate(FolderContents(folder, env, summary, tables["batches.csv"], tables["lambda_sweep.csv"],
                                  tables["gradients.csv"], reservoir, tables["group_baselines.csv"],
                                  tables["gates.csv"]), str(folder))


def check_results_match_spec(results, spec) -> None:
    """Raise :class:`SpecError` unless the results folder ``results`` (a path, or a
    :class:`kl_bench.present.report.Results`) was produced by an experiment of ``spec``'s name with exactly the
    spec's cases (run.json's ``cases`` and summary.csv's case column). ``spec``: a loaded
    :class:`kl_bench.experiment.spec.Spec` (anything with ``experiment.name``, ``cases`` and ``path``: reading
    results never parses a spec here)."""
    if isinstance(results, (str, Path)):
        contents = read_results_folder(results)
        folder, env, summary = contents.path, contents.envelope, contents.summary
    else:
        folder, env, summary = Path(results.path), results.envelope, results.summary
    spec_name = spec.experiment.name
    where = str(folder)
    ran = env.get("experiment")
    if isinstance(ran, str) and ran != spec_name:
        raise SpecError(f"holds the results of experiment '{ran}', not of '{spec_name}' ({spec.path}); "
                        f"pass the folder written by `kl-bench run {spec.path}`", file=where)
    wanted = [c.name for c in spec.cases]
    have_sets = [("summary.csv", list(dict.fromkeys(summary["case"])))]
    if isinstance(env.get("cases"), dict):
        have_sets.append(("run.json", list(env["cases"])))
    for source, have in have_sets:
        bits = _case_differences(wanted, have)
        if bits:
            raise SpecError(f"not the results of {spec.path}: {source} " + " and ".join(bits), file=where)
    _check_same_settings(env, spec, where)


def _check_same_settings(env: dict, spec, where: str) -> None:
    """Refuse results made from another version of ``spec`` (run.json's ``spec_text`` against the spec's
    text), unless only comments or :data:`RUN_SETTINGS` differ; and, where the spec's sha256 differs from
    the recorded one, a run.json whose spec text is missing or unreadable (nothing shows the change is
    harmless)."""
    recorded, text = env.get("spec_text"), getattr(spec, "text", None)
    if not isinstance(text, str) or recorded == text:
        return
    diffs = spec_differences(recorded, text) if isinstance(recorded, str) else None
    if diffs is None:
        if env.get("spec_sha256") not in (None, getattr(spec, "sha256", None)):
            raise SpecError(f"was made from another version of {spec.path} (spec sha256 differs) and its run.json "
                            "holds no spec text to compare: run it again", file=where)
        return
    changed = _measured_changes(diffs, spec, recorded)
    if changed:
        shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
        raise SpecError(f"was made from another version of {spec.path} ({shown} changed since): its numbers "
                        f"are not this spec's; run it again, or give the spec it was made from (run.json's "
                        f"spec_text)", file=where)


def _measured_changes(diffs: list[str], spec, recorded: str) -> list[str]:
    """The keys of ``diffs`` that change what a run measures (not :data:`RUN_SETTINGS`). Texts that differ beyond
    run settings may be the same spec in other words (./q.npy for q.npy, a default written out, a sweep's values
    reordered): none then, when the spec, parsed, says so (it parses the recorded text; a spec that cannot, or
    a plain object, leaves the text's verdict)."""
    changed = [k for k in diffs if not _run_setting(k)]
    measured = getattr(spec, "measured_differences", None)
    return [] if changed and callable(measured) and measured(recorded) == [] else changed


# Spec keys that change how a run is made, or what else it writes, not what its summary measures: results
# made with other values are still this spec's (the gate's exact values and standard errors hold for any of
# them). Also every [train] key (kl-bench train's, not a run's) and a case's own draws.
RUN_SETTINGS = frozenset({"experiment.draws", "experiment.seed", "experiment.batches", "experiment.device",
                          "experiment.chunk", "experiment.gradients", "experiment.baseline_groups"})
# Lists whose order does not change a summary's rows.
ORDERLESS = frozenset({"experiment.estimators", "experiment.lambdas"})


def _run_setting(key: str) -> bool:
    return key in RUN_SETTINGS or key == "train" or key.startswith("train.") or (
        key.startswith("case '") and key.endswith("'.draws"))


def spec_differences(recorded: str, current: str) -> list[str] | None:
    """The keys whose values differ between two spec texts, in the spec's words: "experiment.estimators",
    "case 'gauss'.p.mean", "case 'new'" (a case on one side only). Comments, spacing and order are no
    difference. A text is TOML (a spec file) or JSON (a dict spec, as kl_bench.experiment.spec records it);
    None where either is neither (nothing to compare: the caller's sha256 note stands)."""
    a, b = _spec_table(recorded), _spec_table(current)
    if a is None or b is None:
        return None
    a, b = _flat(a), _flat(b)
    missing = object()
    return sorted(k for k in a.keys() | b.keys() if a.get(k, missing) != b.get(k, missing))


def _spec_table(text: str) -> dict | None:
    import json
    from ..foundation.safe_io import tomllib
    for parse in (tomllib.loads, json.loads):
        try:
            table = parse(text)
        except (ValueError, RecursionError):     # TOMLDecodeError and JSONDecodeError are ValueErrors
            continue
        if isinstance(table, dict):
            return table
    return None


def _flat(table: dict, prefix: str = "") -> dict[str, Any]:
    """A parsed spec as {dotted key: value}; the [[case]] tables keyed by their names."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        elif key == "case" and not prefix and isinstance(value, list) and all(isinstance(c, dict) for c in value):
            out.update(_flat_cases(value))
        elif name in ORDERLESS and isinstance(value, list):
            out[name] = sorted(json.dumps(_number(v), sort_keys=True) for v in value)
        else:
            out[name] = _number(value)
    return out


def _flat_cases(cases: list[dict]) -> dict[str, Any]:
    """The [[case]] tables flat, keyed by their names (a case on one side only differs: its key is there)."""
    out: dict[str, Any] = {}
    for i, case in enumerate(cases):
        label = f"case '{case.get('name', i)}'"
        out[label] = True
        out.update(_flat({k: v for k, v in case.items() if k != "name"}, label + "."))
    return out


def _number(value: Any) -> Any:
    """``value`` with every int as a float (1 and 1.0 are one λ, one clamp), through lists and tables."""
    if isinstance(value, bool) or not isinstance(value, (int, list, dict)):
        return value
    if isinstance(value, int):
        return float(value)
    if isinstance(value, list):
        return [_number(v) for v in value]
    return {k: _number(v) for k, v in value.items()}


def _case_differences(wanted: list[str], have: list[str]) -> list[str]:
    """What a folder's cases lack and hold beyond a spec's, in words (empty: the same cases)."""
    missing = [c for c in wanted if c not in have]
    extra = [c for c in have if c not in wanted]
    bits = []
    if missing:
        bits.append("lacks the spec's case" + ("s " if len(missing) > 1 else " ") + _names(missing))
    if extra:
        bits.append("holds case" + ("s " if len(extra) > 1 else " ") + _names(extra) + " that the spec lacks")
    return bits


def _names(names: list[str], most: int = 6) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")

