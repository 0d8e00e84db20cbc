"""The statistical regression gate: compare a run's statistics with exact values and with a stored
baseline, correcting for the number of comparisons (Holm's step-down at a family-wise level α).

Each comparison is a z statistic with a two-sided p-value:
- mean vs exact:     (mean − exact_mean) / se
- std vs exact:      (std − exact_std) / std_se
- mean vs baseline:  (mean − mean_b) / √(se² + se_b²)
- std vs baseline:   (std − std_b) / √(std_se² + std_se_b²)
Standard errors come from K batch means, so the statistic is Student-t with K − 1 degrees of freedom
(Welch–Satterthwaite for two runs), not normal: with K = 12 a normal p-value would call |z| = 5.9 a
one-in-10⁸ event when it is one in 10⁴. Rows whose measured spread cannot be trusted (heavy tails) skip
the std comparisons, and rows with an infinite variance skip the mean's too: their SE means nothing.
"""
from __future__ import annotations

import copy
import datetime as _dt
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
# scipy.special, not scipy.stats (1 s to import in every command): ndtr/stdtr are what
# stats.norm.sf/stats.t.sf call, so the p-values and thresholds are the same bits.
from scipy import special

from .draws import row_label
from .errors import SpecError
from .estimators import CV_OPT
from .safe_io import parse_json, read_regular
from .stats import HeavyTail, z_score

BASELINE_VERSION = 1
BASELINE_FIELDS = ["case", "estimator", "lambda", "aggregate", "target", "draws", "mean", "std", "se", "std_se",
                   "exact_mean", "exact_std", "heavy_tail", "batches"]
# Fields a baseline may lack (written by later versions; older baselines still load): treated as unknown.
_LATER_FIELDS = ("batches",)


# Heavy-tail findings that come from the exact oracle (HeavyTail.exact): the measured spread (and its SE)
# cannot be trusted, so std comparisons are skipped. "unstable batches" is only a heuristic on the draws:
# with finite exact moments it is a symptom to test, not a reason to look away (a float32 accumulator
# that rounds later batches to zero shows up exactly so).
EXACT_HEAVY = {h.value for h in HeavyTail if h.exact}


@dataclass
class Comparison:
    row: str                  # "case: estimator"
    statistic: str            # "mean vs exact", "std vs baseline", ...
    value: float
    reference: float
    se: float
    z: float
    p: float
    dof: float = math.inf     # degrees of freedom of the SE (batch means: K − 1); inf: normal
    threshold: float = math.nan   # |z| threshold at this comparison's Holm rank
    passed: bool = True

    def sentence(self) -> str:
        what = self.statistic.split()[0]
        ref = self.statistic.split()[-1]
        rel = (self.value - self.reference) / abs(self.reference) if self.reference else math.inf
        return (f"{self.row}: the {what} moved from {self.reference:.6g} ({ref}) to {self.value:.6g} "
                f"({rel:+.3g} relative, {abs(self.value - self.reference) / self.se if self.se else math.inf:.1f} "
                f"standard errors; |z| must stay below {self.threshold:.2f})")


def row_key(r) -> tuple:
    """Rows match across runs by case, estimator, aggregate and λ; cv_opt's λ is fitted, so not by λ."""
    lam = r["lambda"]
    if r["estimator"] == CV_OPT or lam is None or (isinstance(lam, float) and math.isnan(lam)):
        lam = ""
    else:
        lam = round(float(lam), 12)
    return (r["case"], r["estimator"], r["aggregate"] or "", lam)


def row_name(r) -> str:
    return f"{r['case']}: {row_label(r)}"


def _dof(*parts: tuple[float, float]) -> float:
    """Degrees of freedom of a standard error √(Σ se_i²) whose se_i come from K_i batch means
    (Welch–Satterthwaite: (Σ se_i²)² / Σ se_i⁴/(K_i − 1)); inf where a K_i is unknown or an SE is zero."""
    num = den = 0.0
    for se, batches in parts:
        try:
            k = float(batches)          # a number from a DataFrame row (numpy) or a baseline (float)
        except (TypeError, ValueError):
            return math.inf
        if not (math.isfinite(k) and k >= 2 and math.isfinite(se)):
            return math.inf
        num += se * se
        den += se**4 / (k - 1)
    return num * num / den if den > 0 else math.inf


def _tail(z: float, dof: float) -> float:
    """Two-sided p-value of z under Student-t with ``dof`` degrees of freedom (normal when inf). A NaN z
    (a NaN statistic or reference) has p = 0: the gate fails it rather than pass a number it cannot read."""
    if math.isnan(z):
        return 0.0
    return float(2 * (special.ndtr(-abs(z)) if math.isinf(dof) else special.stdtr(dof, -abs(z))))


def _z(value: float, ref: float, se: float, scale: float, dof: float = math.inf) -> tuple[float, float]:
    z = z_score(value, ref, se, scale)
    return z, _tail(z, dof)


def exact_comparisons(df: pd.DataFrame) -> list[Comparison]:
    out = []
    for _, r in df.iterrows():
        heavy = r.get("heavy_tail", "") or ""
        heavy = heavy if heavy in EXACT_HEAVY else ""
        if heavy == HeavyTail.INFINITE_VARIANCE or math.isinf(r["true_kl"]):
            continue
        k = r.get("batches", math.nan)
        if math.isfinite(r["exact_mean"]):
            dof = _dof((r["se"], k))
            z, p = _z(r["mean"], r["exact_mean"], r["se"], max(abs(r["mean"]), abs(r["exact_mean"])), dof)
            out.append(Comparison(row_name(r), "mean vs exact", r["mean"], r["exact_mean"], r["se"], z, p, dof))
        if not heavy and math.isfinite(r["exact_std"]) and math.isfinite(r.get("std_se", math.nan)):
            dof = _dof((r["std_se"], k))
            z, p = _z(r["std"], r["exact_std"], r["std_se"], max(abs(r["exact_mean"]), r["exact_std"]), dof)
            out.append(Comparison(row_name(r), "std vs exact", r["std"], r["exact_std"], r["std_se"], z, p, dof))
    return out


def baseline_comparisons(df: pd.DataFrame, baseline: dict[str, Any]) -> tuple[list[Comparison], list[str]]:
    """Two-sample comparisons with a baseline; also returns notes on rows found on one side only."""
    base = {row_key(r): r for r in baseline["rows"]}
    out, seen, notes = [], set(), []
    for _, r in df.iterrows():
        key = row_key(r)
        b = base.get(key)
        if b is None:
            notes.append(f"{row_name(r)}: not in the baseline")
            continue
        seen.add(key)
        heavy = {r.get("heavy_tail", "") or "", b.get("heavy_tail") or ""} & EXACT_HEAVY
        if HeavyTail.INFINITE_VARIANCE.value in heavy:
            continue
        k, k_b = r.get("batches", math.nan), b.get("batches", math.nan)
        se = math.hypot(r["se"], b["se"])
        dof = _dof((r["se"], k), (b["se"], k_b))
        z, p = _z(r["mean"], b["mean"], se, max(abs(r["mean"]), abs(b["mean"])), dof)
        out.append(Comparison(row_name(r), "mean vs baseline", r["mean"], b["mean"], se, z, p, dof))
        if not heavy and math.isfinite(r.get("std_se", math.nan)) and math.isfinite(b.get("std_se", math.nan)):
            se = math.hypot(r["std_se"], b["std_se"])
            dof = _dof((r["std_se"], k), (b["std_se"], k_b))
            z, p = _z(r["std"], b["std"], se, max(abs(r["mean"]), r["std"], b["std"]), dof)
            out.append(Comparison(row_name(r), "std vs baseline", r["std"], b["std"], se, z, p, dof))
    for key, b in base.items():
        if key not in seen:
            notes.append(f"{b['case']}: {b['estimator']}: in the baseline but not in this run")
    return out, notes


def holm(comparisons: list[Comparison], alpha: float) -> list[Comparison]:
    """Holm's step-down: the i-th smallest p-value (0-based) is tested at α/(m − i); after the first
    acceptance every larger p-value is accepted. Controls the family-wise error rate at α."""
    m = len(comparisons)
    order = sorted(range(m), key=lambda i: comparisons[i].p)
    rejecting = True
    for rank, i in enumerate(order):
        c = comparisons[i]
        level = alpha / (m - rank)
        c.threshold = float(-special.ndtri(level / 2) if math.isinf(c.dof) else -special.stdtrit(c.dof, level / 2))
        if rejecting and c.p <= level:
            c.passed = False
        else:
            rejecting = False
    return comparisons


# ----------------------------------------------------------------------------- baselines
def make_baseline(df: pd.DataFrame, spec) -> dict[str, Any]:
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
           timespec="seconds"), "spec_name": spec.experiment.name, "spec_sha256": spec.sha256,
           "seed": spec.experiment.seed, "rows": rows}
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
        key = row_key(r)
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
    if math.isfinite(r["mean"]) and (math.isnan(r["se"]) or math.isnan(r["std"])):
        raise SpecError(f"{name}: se and std must be numbers where the mean is finite (corrupted baseline?)",
                        file=where)
    if not (math.isnan(r["batches"]) or _whole(r["batches"])):
        raise SpecError(f"{name}: batches must be a whole number ≥ 1, got {r['batches']:g}", file=where)
