"""The tables of one case, as `kl-bench run` and `kl-bench exact` print them: its heading line
(:func:`heading`: the truth of each target), the full table (:func:`detail_table`, a case with a finite,
non-zero exact truth), the compact one in ≤ 80 columns (:func:`compact_frame`, :func:`compact_table`), the
exact values alone (:func:`exact_table`) and the lines that say what the marks of its rows mean
(:func:`caption_lines`). Numbers and words follow kl_bench.foundation.formatting's vocabulary."""
from __future__ import annotations

import math

import pandas as pd
from rich.markup import escape
from rich.table import Table

from ..analysis.gate import z_at_exact_spread
from ..core.aggregates import PER_TOKEN
from ..core.draws import row_label
from ..core.planning import never_words
from ..core.stats import HeavyTail, unknown_reason
from ..foundation.formatting import NEVER, UNKNOWN, count, fmt, measured_cells, num as _num, pct
from .cells import bias_cells, dagger, pm, ratio_cell, unknown_mean


def target_cell(r) -> str:
    """The row's target as shown: rows divided by lengths (tok_mean, tok_batch) estimate it per token."""
    agg = r.get("aggregate", "")
    return f"{r['target']}/token" if isinstance(agg, str) and agg in PER_TOKEN else r["target"]


def _has_reference(r) -> bool:
    """A row of a case without an exact value that has a Monte Carlo reference (issue 14: ref_kl)."""
    return math.isfinite(_num(r.get("ref_kl", math.nan))) and not math.isfinite(_num(r["true_kl"]))


def _zero_case(rows: pd.DataFrame) -> bool:
    """Every target of the case is exactly 0 (p = q: every trainer's step 0): relative columns do not exist,
    so the tables show absolute bias and std."""
    truth = [_num(r["ref_kl"]) if _has_reference(r) else _num(r["true_kl"]) for _, r in rows.iterrows()]
    return bool(truth) and all(t == 0 for t in truth)


def exact_case(rows: pd.DataFrame) -> bool:
    """A case whose every row has a finite, non-zero exact truth: the full table's relative columns exist."""
    true = rows["true_kl"].map(_num)
    return bool(len(rows)) and bool(true.map(math.isfinite).all()) and not bool((true == 0).any())


def n_cell(r) -> str:
    """``n ±10%``: the batch size, or "never" (the bias alone exceeds 10%), or "—" where no exact bias is
    known (no exact value, or only a measured mean: a batch size from a measured bias is not planned on)."""
    if not (math.isfinite(_num(r.get("exact_mean", math.nan))) and not math.isnan(_num(r["true_kl"]))):
        return UNKNOWN
    return count(_num(r.get("n_for_10pct", math.nan))) or UNKNOWN


def _z_cell(z: float, mark: str = "") -> str:
    cell = fmt(z, 2) + mark
    return f"[bold red]{escape(cell)}[/]" if math.isfinite(z) and abs(z) >= 5 else escape(cell)


def detail_table(df: pd.DataFrame, case: str, description: str) -> Table:
    """One case: measured value ± SE next to the exact one, relative bias (%) and noise, z. For a case
    with a finite non-zero exact truth on every row (others: :func:`compact_table`)."""
    t = Table(title=escape(f"{case}: {description}"), title_justify="left", show_edge=False, pad_edge=False)
    for col, just in [("estimator", "left"), ("target", "left"), ("true", "right"), ("mean ± se", "right"),
                      ("exact mean", "right"), ("bias/true", "right"), ("exact", "right"),
                      ("std/true", "right"), ("exact", "right"), ("z", "right"), ("P(<0)", "right")]:
        t.add_column(col, justify=just)
    rows = df[df["case"] == case]
    for _, r in rows.iterrows():
        mark = dagger(r)
        truth = _num(r["true_kl"])
        mean, se, exact_mean = measured_cells(r["mean"], r["se"], r["exact_mean"])
        mean = pm(mean, se, mark)
        bias, _, exact_bias = bias_cells(r["mean"] - truth, r["se"], r["exact_mean"] - truth, truth, False)
        std, exact_std = measured_cells(r["rel_std"], r["std_se"] / abs(truth), r["exact_rel_std"])[::2]
        std, z = (std + mark if std else ""), _z_cell(r["z"], mark)
        if unknown_mean(r):
            mean, bias, std, z = "unknown", "unknown", "", ""
        else:
            bias = pm(bias, "", mark)
        t.add_row(row_label(r), target_cell(r), fmt(truth, 4), mean, exact_mean, bias, exact_bias, std, exact_std,
                  z, fmt(r["frac_negative"], 2))
    return t


SHORT_TARGET = {"KL(q||p)": "q||p", "KL(p||q)": "p||q"}


def heading(df: pd.DataFrame, case: str, description: str) -> str:
    """A case's heading line: its name, its q and p, and the truth of each target (exact, or the Monte
    Carlo reference marked ≈ where no exact value exists); KL = 0 (p = q) said as such."""
    c = df[df["case"] == case]
    truths = []
    for target in dict.fromkeys(c["target"]):
        r = c[c["target"] == target].iloc[0]
        if _has_reference(r):
            truths.append(f"{target} ≈ {fmt(r['ref_kl'], 4)} ± {fmt(r['ref_se'], 2)} (Monte Carlo reference)")
        elif not math.isnan(_num(r["true_kl"])):
            truths.append(f"{target} = {fmt(_num(r['true_kl']), 4)}")
        else:       # no exact value and no reference for this target (KL(p||q) of model continuations, logs)
            truths.append(f"{target} unknown (no exact value, no reference)")
    line = f"{case}: {description}" + (f"\n  {', '.join(truths)}" if truths else "")
    if _zero_case(c):
        line += ("\n  KL = 0 (p = q where q samples): no relative bias exists, so bias and std are absolute, "
                 "not /true")
    return line


COMPACT_COLUMNS = ["estimator", "target", "bias/true ± se", "exact", "std/true", "n ±10%", "z", "P(<0)"]
ZERO_COLUMNS = ["estimator", "target", "bias ± se", "exact", "std", "n ±10%", "z", "P(<0)"]


def compact_frame(df: pd.DataFrame, case: str) -> pd.DataFrame:
    """One case's rows as the compact table shows them (strings, columns COMPACT_COLUMNS; ZERO_COLUMNS when
    the KL is 0): the bias measured ± its SE with the exact one, std/true († where its SE is not valid),
    the batch for ±10% with 95% probability, z and P(<0). Against the Monte Carlo reference where no exact
    value exists: ref_diff ± ref_diff_se, the SE that z_ref divides by (logged data: the log's own)."""
    rows = df[df["case"] == case]
    zero = _zero_case(rows)
    cells = [_compact_cells(r, zero) for _, r in rows.iterrows()]
    return pd.DataFrame(cells, columns=ZERO_COLUMNS if zero else COMPACT_COLUMNS)


def _compact_cells(r, zero: bool) -> list[str]:
    """One row of :func:`compact_frame`: unescaped text (a † after the numbers whose SE is not valid)."""
    mark = dagger(r)
    short = SHORT_TARGET.get(r["target"], r["target"]) + target_cell(r)[len(r["target"]):]
    head, tail = [row_label(r), short], [n_cell(r)]
    truth, diff, se, z, std = _against_truth(r)
    # the exact bias: none against a Monte Carlo reference (logged data's exact mean is the log's, not q's)
    exact_diff = math.nan if _has_reference(r) else _num(r["exact_mean"]) - truth
    bias, bias_se, exact = bias_cells(diff, se, exact_diff, truth, zero)
    bias = pm(bias, bias_se, mark)
    neg = fmt(r["frac_negative"], 2)
    if _has_reference(r) and diff == 0 and se == 0 and not zero:      # the reference row itself
        return head + ["reference", "", fmt(std / abs(truth)) if truth else fmt(std)] + tail + ["", neg]
    if unknown_mean(r) or (math.isfinite(diff) and math.isnan(se)):
        return head + ["unknown", exact, ""] + tail + ["", neg]
    std_cell = _std_cell(std, truth, zero)
    return head + [bias, exact, std_cell + mark if std_cell else ""] \
        + tail + [fmt(z, 2) + mark if math.isfinite(z) else "", neg]


def _std_cell(std: float, truth: float, zero: bool) -> str:
    """The std column: absolute where the KL is 0, else std/true (blank without a finite, non-zero truth)."""
    if zero:
        return fmt(std)
    return ratio_cell(std / abs(truth)) if math.isfinite(truth) and truth != 0 else ""


def _against_truth(r) -> tuple[float, float, float, float, float]:
    """(truth, bias, its SE, z, std) of a row: against the exact truth, or against the Monte Carlo
    reference where none exists (ref_diff ± ref_diff_se, z_ref; the std over the log where it is exact)."""
    if _has_reference(r):
        truth, diff, se, z = (_num(r.get(k, math.nan)) for k in ("ref_kl", "ref_diff", "ref_diff_se", "z_ref"))
        std = _num(r["exact_std"]) if math.isfinite(_num(r["exact_std"])) else _num(r["std"])
        return truth, diff, se, z, std
    truth = _num(r["true_kl"])
    return truth, _num(r["mean"]) - truth, _num(r["se"]), _num(r["z"]), _num(r["std"])


def compact_table(df: pd.DataFrame, case: str) -> Table:
    """One case in ≤ 80 columns, one line per row (:func:`compact_frame`). The truth is in :func:`heading`;
    `--wide` gives :func:`detail_table`."""
    frame = compact_frame(df, case)
    t = Table(show_edge=False, pad_edge=False, box=None, padding=(0, 1))
    for col in frame.columns:        # a long row label folds onto a second line rather than split the table
        t.add_column(col, justify="left" if col in ("estimator", "target") else "right", no_wrap=col != "estimator",
                     overflow="fold")
    for cells in frame.itertuples(index=False):
        cells = [escape(c) for c in cells]
        z = cells[6].rstrip("†")               # † (heavy tail) after the number, kept after the style
        if z and z not in ("inf", "-inf") and abs(float(z)) >= 5:
            cells[6] = f"[bold red]{z}[/]" + cells[6][len(z):]
        t.add_row(*cells)
    return t


def caption_lines(rows: pd.DataFrame) -> list[str]:
    """What the marks of a case's rows mean: †, ≈, unknown (with the effective sample size)."""
    out = _dagger_lines(rows)
    if any(_has_reference(r) for _, r in rows.iterrows()):
        out.append("≈ no exact value: bias, se and z are against the Monte Carlo reference (the Rao–Blackwellised "
                   "full mean), with the SE of that difference")
    unknown = rows[rows["heavy_tail"] == HeavyTail.DEGENERATE.value]
    if len(unknown):
        r = unknown.iloc[0]
        out.append("unknown: " + unknown_reason(r["heavy_tail"], _num(r.get("ess", math.nan)), r["draws"],
                                                 r.get("batches", math.nan)))
    never = never_words(r for _, r in rows.iterrows() if n_cell(r) == NEVER)
    if never and "variance" in never:     # "never" reads as bias (docs/results.md): say when it is the variance
        out.append("never: " + never)
    return out


def _dagger_lines(rows: pd.DataFrame) -> list[str]:
    """What † means, where one is printed, and each such row's z at the exact spread (what `kl-bench check` takes)."""
    if not any(dagger(r) and not unknown_mean(r) for _, r in rows.iterrows()):
        return []
    out = ["† heavy tail (see heavy_tail): the measured std, se and z are not trustworthy"]
    at_exact = [f"{row_label(r)} {fmt(z, 2)}" for _, r in rows.iterrows() if math.isfinite(z := z_at_exact_spread(r))]
    if at_exact:        # what `kl-bench check` compares: the same story as check's
        out.append("† z with the SE at the exact std, as `kl-bench check` takes it: " + ", ".join(at_exact))
    return out


def exact_table(df: pd.DataFrame, case: str, description: str) -> Table:
    """One case's exact values (`kl-bench exact`): the truth, each row's exact mean, bias/true (%) and
    std/true; absolute bias and std where the KL is 0."""
    rows = df[df["case"] == case]
    zero = _zero_case(rows)
    t = Table(title=escape(f"{case}: {description}"), title_justify="left", show_edge=False, pad_edge=False)
    for col in ["estimator", "target", "true", "exact mean"] + (["bias", "std"] if zero else ["bias/true", "std/true"]):
        t.add_column(col, justify="left" if col in ("estimator", "target") else "right")
    for _, r in rows.iterrows():
        bias = fmt(_num(r["exact_mean"]) - _num(r["true_kl"])) if zero else pct(r["exact_rel_bias"])
        t.add_row(row_label(r), target_cell(r), fmt(r["true_kl"], 4), fmt(r["exact_mean"], 4), bias,
                  fmt(r["exact_std"]) if zero else fmt(r["exact_rel_std"]))
    if zero:
        t.caption, t.caption_justify = "KL = 0 (p = q): bias and std are absolute", "left"
    return t
