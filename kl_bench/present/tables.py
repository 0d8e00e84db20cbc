"""Readable terminal tables: the per-case detail table and Schulman's layout, fitted to the terminal.

At a terminal every table fits its width or is stacked (:func:`stacked`: the key columns repeated over
parts that each fit), and prose wraps at the width (:func:`prose`); a file or a pipe gets every table at
its natural width and every sentence on one line, so that grep and diff see whole lines. Numbers and
words follow kl_bench.foundation.formatting's vocabulary.
"""
from __future__ import annotations

import math
import re
import textwrap

import pandas as pd
from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..core.aggregates import PER_TOKEN
from ..core.draws import draws_from_b, row_label
from ..analysis.gate import z_at_exact_spread
from ..core.planning import never_words
from ..foundation.formatting import NEVER, UNKNOWN, count, fmt, measured_cells, pct
from .cells import bias_cells, dagger, pm, num as _num, unknown_mean, with_reference  # noqa: F401  (re-exported)
from ..core.stats import HeavyTail, unknown_reason


_TRAILING = re.compile(r"[ \t]+((?:\x1b\[[0-9;]*m)*)$")     # spaces before any closing style codes


def show(console: Console, table, wide: bool = False, keys: int = 1, fold: bool = False) -> None:
    """Print a table: boxed for a terminal, and fitted to its width: a table wider than the terminal is
    :func:`stacked` (its first ``keys`` columns repeated in each part), never cut; with ``fold``, rich
    wraps its wrappable columns instead (their cells fold onto a second line), when that fits. Plain text
    when stdout is not a terminal (a file, a pipe, CI): no box-drawing, one space between columns, nothing
    around, at the table's natural width. Lines never end in spaces (rich pads every line to the table's
    width). ``wide``: at the table's natural width, cells whole, even where lines are longer than the
    terminal."""
    if not console.is_terminal:
        table.box = None
        table.padding = (0, 1)
        table.pad_edge = False
        table.show_edge = False
    width = console.width
    title, caption = table.title, table.caption
    if not console.is_terminal:     # a pipe: title and caption whole, on lines of their own (rich wraps them)
        table.title = table.caption = None
    if wide:                # rich never prints wider than the console: widen it for this table alone
        console.width = max(natural_width(console, table), width)
    parts = _fitted(console, table, keys, fold) if console.is_terminal and not wide else [table]
    try:
        with console.capture() as cap:
            if title and not console.is_terminal:
                console.print(title, soft_wrap=True)
            for i, part in enumerate(parts):
                if i:
                    console.print()
                console.print(part)
            if caption and not console.is_terminal:
                console.print(caption, soft_wrap=True)
    finally:
        console.width = width
    text = "".join(_TRAILING.sub(r"\1", line) + "\n" for line in cap.get().splitlines())
    console.file.write(text)
    console.file.flush()


def fits(console: Console, table) -> bool:
    """Whether a table's natural width fits the console (a pipe is 400 columns wide: see cli)."""
    return natural_width(console, table) <= console.width


def natural_width(console: Console, table) -> int:
    """The columns a table takes when nothing constrains it (rich caps a measure at the console's width)."""
    return console.measure(table, options=console.options.update_width(100_000)).maximum


def _fitted(console: Console, table: Table, keys: int, fold: bool) -> list[Table]:
    """The table as it fits a terminal: whole, or folded (``fold``), or without its box, or stacked."""
    if fits(console, table) or (fold and _folds(console, table)):
        return [table]
    table.box, table.padding, table.show_edge = None, (0, 1), False     # without its box first
    return [table] if fits(console, table) else stacked(console, table, keys)


def _folds(console: Console, table: Table) -> bool:
    """Whether rich fits the table to the console by wrapping only its wrappable columns: the columns
    that do not wrap take their natural width, the others at least their narrowest (a word's) width."""
    return console.measure(table, options=console.options.update_width(100_000)).minimum <= console.width


def stacked(console: Console, table: Table, keys: int = 1) -> list[Table]:
    """A table too wide for the console as several tables that each fit: the first ``keys`` columns (what
    names a row) in every part, the other columns in order, as many to a part as fit; every cell is kept.
    The title goes on the first part (with "1/n" on each part), the caption on the last. A key part that
    alone is too wide gets one other column a part, and rich folds its cells rather than cut them."""
    cols = list(table.columns)
    key, rest = cols[:keys], cols[keys:]
    groups: list[list] = []
    for col in rest:
        if groups and fits(console, _part(table, key + groups[-1] + [col])):
            groups[-1].append(col)
        else:
            groups.append([col])
    parts = []
    for i, group in enumerate(groups or [[]]):
        part = _part(table, key + group)
        title = table.title if isinstance(table.title, str) else ""
        part.title = f"{title} ({i + 1}/{len(groups)})" if i == 0 and title else f"({i + 1}/{len(groups)})"
        part.title_justify = "left"
        part.caption = table.caption if i == len(groups) - 1 else None
        parts.append(part)
    return parts


def _part(table: Table, cols: list) -> Table:
    """A table of some of ``table``'s columns, with its rows, style and box (title and caption unset)."""
    t = Table(box=table.box, show_edge=table.show_edge, pad_edge=table.pad_edge, padding=table.padding,
              show_header=table.show_header, title_justify=table.title_justify, caption_justify=table.caption_justify)
    for c in cols:
        t.add_column(c.header, justify=c.justify, no_wrap=c.no_wrap, overflow="fold", min_width=c.min_width)
    for cells in zip(*(list(c.cells) for c in cols)):
        t.add_row(*cells)
    return t


def prose(console: Console, text: str, indent: str = "  ", markup: bool = False) -> None:
    """A sentence or a paragraph: at a terminal wrapped on words at its width, lines after the first
    indented by ``indent`` (so that a wrapped line reads as a continuation); to a file or a pipe each line
    whole, never wrapped (grep finds a sentence on one line). ``text``'s own line breaks are kept."""
    if not console.is_terminal:
        console.print(text, markup=markup, soft_wrap=True, highlight=False)
        return
    width = max(console.width, 20)
    lines = []
    for line in text.split("\n"):
        lead = line[:len(line) - len(line.lstrip(" "))]
        lines += textwrap.wrap(line, width=width, subsequent_indent=lead + indent, break_on_hyphens=False,
                               drop_whitespace=True) or [""]
    # textwrap counts characters; a wide character (CJK in a case name) takes two cells: cut such lines
    lines = [piece for line in lines for piece in _cells_within(line, width)]
    console.print("\n".join(lines), markup=markup, soft_wrap=True, highlight=False)


def _cells_within(line: str, width: int) -> list[str]:
    if cell_len(line) <= width:
        return [line]
    out, cur = [], ""
    for ch in line:
        if cell_len(cur + ch) > width:
            out.append(cur)
            cur = ""
        cur += ch
    return out + [cur]


def _with_exact(measured: str, exact: str) -> str:
    """"measured (exact)", or the measured value alone where no exact value exists (no empty brackets)."""
    return f"{measured} ({exact})" if exact else measured


def _exact_measured(exact: str, measured: str) -> str:
    """"exact (measured)", with either one alone where the other is blank (no empty brackets)."""
    return " ".join(x for x in (exact, f"({measured})" if measured else "") if x)


def _std_cell(r, value: float) -> str:
    # A std measured on a heavy tail is not to be trusted: mark it instead of printing it plainly.
    return _ratio(value) + dagger(r) if _ratio(value) else ""


def _ratio(x: float) -> str:
    """A plain ratio (std/true): rounding below 1e-12 (the std of a constant row) prints as 0."""
    return fmt(x, scale=1.0)


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


def _exact_case(rows: pd.DataFrame) -> bool:
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
    std_cell = fmt(std) if zero else _ratio(std / abs(truth)) if math.isfinite(truth) and truth != 0 else ""
    return head + [bias, exact, std_cell + mark if std_cell else ""] \
        + tail + [fmt(z, 2) + mark if math.isfinite(z) else "", neg]


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


def _caption_lines(rows: pd.DataFrame) -> list[str]:
    """What the marks of a case's rows mean: †, ≈, unknown (with the effective sample size)."""
    out = []
    if any(dagger(r) and not unknown_mean(r) for _, r in rows.iterrows()):      # a † is printed
        out.append("† heavy tail (see heavy_tail): the measured std, se and z are not trustworthy")
        at_exact = [f"{row_label(r)} {fmt(z, 2)}" for _, r in rows.iterrows() if math.isfinite(z := z_at_exact_spread(r))]
        if at_exact:        # what `kl-bench check` compares: the same story as check's
            out.append("† z with the SE at the exact std, as `kl-bench check` takes it: " + ", ".join(at_exact))
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


def lambda_table(df: pd.DataFrame) -> Table:
    """Per case: λ*, and std/true at k1 (λ = 0), k3 (λ = 1), λ* and the pilot-fitted cv_opt."""
    t = Table(title="control variate cv(λ) = −log r + λ(r−1): exact std/true (measured)", title_justify="left",
              show_edge=False, pad_edge=False)
    for col in ["case", "λ* exact", "λ* measured", "k1 (λ=0)", "k3 (λ=1)", "cv(λ*)", "cv_opt (λ)",
                "k3 / cv(λ*)"]:
        t.add_column(col, justify="left" if col == "case" else "right")
    cvs = df[df["estimator"].isin(["cv", "cv_opt"])]
    for case, agg in dict.fromkeys(zip(cvs["case"], cvs["aggregate"].fillna(""))):
        t.add_row(*_lambda_cells(cvs[(cvs["case"] == case) & (cvs["aggregate"].fillna("") == agg)], case, agg))
    return t


def _lambda_cells(c: pd.DataFrame, case: str, agg: str) -> list[str]:
    """One case (and aggregate) of :func:`lambda_table`: its cv rows ``c``."""
    r0 = c.iloc[0]

    def at(lam):
        hit = c[(c["estimator"] == "cv") & (c["lambda"] == lam)]
        return "" if hit.empty else _exact_measured(_ratio(hit.iloc[0]["exact_rel_std"]),
                                                    _std_cell(hit.iloc[0], hit.iloc[0]["rel_std"]))
    star = r0["lambda_star"]
    # Exact std at λ*: from any cv row, std(λ)/(1 + excess_std(λ)).
    usable = c[c["exact_std"].map(math.isfinite) & c["excess_std"].map(math.isfinite)]
    best = usable.iloc[0]["exact_std"] / (1 + usable.iloc[0]["excess_std"]) / r0["true_kl"] if len(usable) else math.nan
    opt = c[c["estimator"] == "cv_opt"]
    opt_cell = "" if opt.empty else \
        f"{_exact_measured(_ratio(opt.iloc[0]['exact_rel_std']), _std_cell(opt.iloc[0], opt.iloc[0]['rel_std']))} " \
        f"λ={opt.iloc[0]['lambda']:.3g}".lstrip()
    k3 = c[(c["estimator"] == "cv") & (c["lambda"] == 1.0)]
    ratio = f"{k3.iloc[0]['excess_std'] + 1:.3g}×" if not k3.empty else ""
    heavy = c["heavy_tail"].fillna("").astype(str).str.len().gt(0).any()
    mc = r0["lambda_star_mc"]
    measured = f"{fmt(mc)} ± {fmt(r0['lambda_star_mc_se'], 2)}" + ("†" if heavy else "") \
        if isinstance(mc, float) and math.isfinite(mc) else ""
    sampled = draws_from_b(r0.get("sampler", ""))
    return [escape(f"{case} ({agg})" if agg else case), "n/a (sampler)" if sampled and not math.isfinite(star)
            else fmt(star), measured, at(0.0), at(1.0), _ratio(best), opt_cell, ratio]


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


MAX_TABLE_CASES = 8     # the side-by-side table's case columns beyond which it is not printed


def schulman_table(df: pd.DataFrame) -> Table:
    """Schulman's layout: rows are estimators; per case, bias/true (%) and std/true, measured (exact)."""
    df = with_reference(df)
    cases = list(dict.fromkeys(df["case"]))
    if len(cases) > MAX_TABLE_CASES:      # a sweep's grid: one column pair per case would not fit a screen
        t = Table(title=f"bias/true and std/true: {len(cases)} cases, too many for one table (see summary.csv "
                        "and the report's sweep figures)", title_justify="left", show_edge=False, pad_edge=False)
        return t
    t = Table(title="bias/true and std/true per estimator (measured, exact in brackets)",
              title_justify="left", show_edge=False, pad_edge=False)
    if "approx" in df and df["approx"].any():
        t.caption = ("≈: no exact value; measured against the reference, the Rao–Blackwellised full mean "
                     "(Monte Carlo), and no exact value in brackets")
        t.caption_justify = "left"
    t.add_column("estimator")
    for c in cases:
        true = df.loc[df["case"] == c, "true_kl"].iloc[0]
        approx = "≈" if "approx" in df and df.loc[df["case"] == c, "approx"].iloc[0] else "="
        t.add_column(escape(f"{c}\nbias/true"), justify="right")
        t.add_column(f"KL{approx}{fmt(true, 3)}\nstd/true", justify="right")
    keys = list(dict.fromkeys(zip(df["estimator"], df["aggregate"].fillna(""))))
    for est, agg in keys:
        cells = [f"{agg} {est}" if agg else est]
        for c in cases:
            row = df[(df["case"] == c) & (df["estimator"] == est) & (df["aggregate"].fillna("") == agg)]
            if row.empty:
                cells += ["", ""]
                continue
            cells += _schulman_cells(row.iloc[0])
        t.add_row(*cells)
    return t


def _schulman_cells(r) -> list[str]:
    """bias/true and std/true, "measured (exact)", the measured to its SE's precision (the SE not shown)."""
    truth = _num(r["true_kl"])
    if not (math.isfinite(truth) and truth != 0):       # no relative value (KL = 0) or no truth
        return ["unknown" if unknown_mean(r) else "", ""]
    bias, _, exact = bias_cells(_num(r["rel_bias"]) * abs(truth), r["bias_se"], _num(r["exact_rel_bias"]) * abs(truth),
                                truth, False)
    std, _, exact_std = measured_cells(r["rel_std"], _num(r["std_se"]) / abs(truth), r["exact_rel_std"])
    if unknown_mean(r):
        return [_with_exact("unknown", exact), exact_std]
    return [_with_exact(bias + dagger(r), exact), _with_exact(std + dagger(r) if std else "", exact_std)]


ROLLOUT_COLUMNS = [("k1", "seq"), ("k3", "seq"), ("k3", "tok"), ("full", "tok")]


def rollout_table(df: pd.DataFrame, lengths: dict[str, int]) -> Table:
    """Rollout cases by length: exact std/true (measured) of seq-k1, seq-k3, tok-k3 and full."""
    t = Table(title="rollouts: std/true against sequence length T, exact (measured)", title_justify="left",
              show_edge=False, pad_edge=False)
    approx_any = False
    for col in ["case", "T", "KL(q||p)"] + [f"{a} {e}" for e, a in ROLLOUT_COLUMNS]:
        t.add_column(col, justify="left" if col == "case" else "right")
    df = with_reference(df)
    for case, length in lengths.items():
        c = df[df["case"] == case]
        approx = "≈" if "approx" in c and c["approx"].iloc[0] else ""     # a Monte Carlo reference, not exact
        approx_any = approx_any or bool(approx)
        cells = [case, str(length), approx + fmt(c["true_kl"].iloc[0], 3)]
        for est, agg in ROLLOUT_COLUMNS:
            hit = c[(c["estimator"] == est) & (c["aggregate"] == agg) & c["lambda"].isna()]
            if hit.empty:
                cells.append("")
                continue
            h = hit.iloc[0]
            measured = _std_cell(h, h["rel_std"])
            # No exact value: the measured std/reference alone, marked ≈ like the KL column.
            cells.append(f"{fmt(h['exact_rel_std'])} ({measured})" if fmt(h["exact_rel_std"]) else
                         (f"≈{measured}" if measured else ""))
        t.add_row(*cells)
    if approx_any:
        t.title = "rollouts: std/true against sequence length T, exact (measured); ≈: measured only, std/reference"
        t.caption = ("≈: no exact value; the measured std / the reference (the Rao–Blackwellised full mean, "
                     "Monte Carlo)")
        t.caption_justify = "left"
    return t


def mismatch_table(df: pd.DataFrame) -> Table:
    """Cases drawn from a sampler b ≠ q: the sign and size of each estimator's bias, exact and measured."""
    t = Table(title="sampling mismatch: bias against the true KL(q||p) when draws come from b",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ["case", "sampler", "estimator", "true KL", "E_b exact", "bias/true", "measured ± se", "P(<0)",
                "P(mean64<0)"]:
        t.add_column(col, justify="left" if col in ("case", "sampler", "estimator") else "right")
    for _, r in df[df["sampler"].map(draws_from_b)].iterrows():
        rel = _num(r["exact_rel_bias"]) if math.isfinite(_num(r["exact_rel_bias"])) else _num(r["rel_bias"])
        arrow = "" if not math.isfinite(rel) or abs(rel) < 0.01 else ("[red]▲[/] " if rel > 0 else "[blue]▼[/] ")
        mean, se, exact = measured_cells(r["mean"], r["se"], r["exact_mean"])
        measured = "unknown" if unknown_mean(r) else pm(mean, se, dagger(r))
        t.add_row(escape(r["case"]), escape(str(r["sampler"])), row_label(r), fmt(r["true_kl"], 4), exact,
                  f"{arrow}{pct(rel)}" if math.isfinite(rel) else "", measured,
                  fmt(r["frac_negative"], 2), fmt(r.get("p_neg_b64", math.nan), 2))
    return t


def gradient_table(g: pd.DataFrame) -> Table:
    """What each estimator × mode optimises: exact cosines with ∇KL(q||p) and ∇KL(p||q), measured cosine,
    the exact relative error against ∇KL(q||p), the per-draw variance (measured in brackets where no
    exact value exists: rollouts) and the batch size for cos ≥ 0.9. Its first :data:`GRADIENT_KEYS` columns
    name a row (a terminal narrower than the table gets it stacked: see :func:`show`)."""
    t = Table(title="gradients: what each estimator optimises where it sits (exact; measured in brackets)",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ["case", "estimator", "mode", "E[∇] equals", "cos ∇KL(q||p)", "cos ∇KL(p||q)", "rel err (q||p)",
                "tr Cov", "n for cos ≥ 0.9", "z"]:
        t.add_column(col, justify="left" if col in ("case", "estimator", "mode", "E[∇] equals") else "right")
    for _, r in g.iterrows():
        lab = r["estimator"] if not (isinstance(r["lambda"], float) and math.isfinite(r["lambda"])) \
            else f"{r['estimator']}({r['lambda']:.3g})"
        agg = r.get("aggregate", "")
        if isinstance(agg, str) and agg:
            lab = f"{agg}-{lab}"
        eq = r["equals"] if isinstance(r["equals"], str) else ""
        style = {"reverse": "[green]reverse[/]", "forward": "[yellow]forward[/]", "zero": "[red]zero[/]",
                 "ukl": "[cyan]ukl[/]"}.get(eq, eq)
        zmax = max(abs(r["z_reverse"]), abs(r["z_forward"])) if math.isfinite(r["z_reverse"]) else math.nan
        trace = fmt(r["exact_trace_cov"]) if math.isfinite(r["exact_trace_cov"]) else f"({fmt(r['trace_cov'])})"
        t.add_row(escape(r["case"]), lab, r["mode"], style, f"{fmt(r['exact_cos_reverse'])} ({fmt(r['cos_reverse'])})",
                  f"{fmt(r['exact_cos_forward'])} ({fmt(r['cos_forward'])})", fmt(r["exact_relerr_reverse"], scale=1.0),
                  trace, count(r["n_for_cos90"]), fmt(zmax, 2))
    return t


GRADIENT_KEYS = 3       # case, estimator, mode
BASELINE_KEYS = 4       # case, estimator, baseline, G


def baseline_table(g: pd.DataFrame) -> Table:
    """Group baselines in the reward (group_baselines.csv): the exact shrink of the expected gradient against
    no baseline, the trace-of-covariance ratio (exact; measured in brackets on rollouts) and the larger |z|."""
    t = Table(title="group baselines: |E∇| and tr Cov over no baseline's (measured in brackets)",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ["case", "estimator", "baseline", "G", "|E∇| ratio", "tr Cov ratio", "z"]:
        t.add_column(col, justify="left" if col in ("case", "estimator", "baseline") else "right")
    for _, r in g.iterrows():
        agg = r.get("aggregate", "")
        lab = f"{agg}-{r['estimator']}" if isinstance(agg, str) and agg else r["estimator"]
        exact = math.isfinite(r["exact_trace_cov"])
        ratio = fmt(r["variance_ratio"]) if exact else f"({fmt(r['variance_ratio'])})"
        zs = [abs(r[c]) for c in ("z_reverse", "z_second") if math.isfinite(r[c])]
        t.add_row(escape(r["case"]), lab, r["baseline"], str(int(r["group"])), fmt(r["exact_shrink"]), ratio,
                  fmt(max(zs), 2) if zs else "")
    return t


def print_tables(console: Console, df: pd.DataFrame, descriptions: dict[str, str], exact_only: bool = False,
                 lengths: dict[str, int] | None = None, wide: bool = False) -> None:
    """Every table of a run (or of ``kl-bench exact``). Per case: the compact table, or the full one with
    ``wide`` or where it fits a terminal (a case with a finite, non-zero exact truth: the full table's
    relative columns exist). Side-by-side tables fit the terminal or are stacked (:func:`show`)."""
    for case in dict.fromkeys(df["case"]):
        rows = df[df["case"] == case]
        if exact_only:
            show(console, exact_table(df, case, descriptions[case]))
        else:
            full = detail_table(df, case, descriptions[case]) if _exact_case(rows) else None
            if full is not None and (wide or (console.is_terminal and fits(console, full))):
                show(console, full, wide)
            else:
                prose(console, heading(df, case, descriptions[case]))
                show(console, compact_table(df, case), fold=True)
            for line in _caption_lines(rows):
                prose(console, "  " + line, indent="  ")
        console.print()
    if exact_only:
        return
    for table, keys in side_tables(df, lengths):
        show(console, table, wide, keys)
        console.print()


def side_tables(df: pd.DataFrame, lengths: dict[str, int] | None = None) -> list[tuple[Table, int]]:
    """The tables across cases a run calls for, each with its key columns (what names a row when the
    table is stacked): side by side, rollouts by length, sampling mismatch, control variates."""
    extra = []
    if df["case"].nunique() > 1:
        extra.append((schulman_table(df[df["lambda"].isna()]), 1))
    if lengths:
        extra.append((rollout_table(df, lengths), 2))
    if "sampler" in df and df["sampler"].map(draws_from_b).any():
        extra.append((mismatch_table(df), 3))
    if "estimator" in df and df["estimator"].isin(["cv", "cv_opt"]).any():
        extra.append((lambda_table(df), 1))
    return extra


def check_table(rep) -> Table:
    """The regression gate's comparisons (a :class:`kl_bench.api.CheckReport`), one line each, under a line
    naming their case (so that a row need not repeat it: the table fits 80 columns where "case: row" would
    not), each row's comparisons together."""
    t = Table(title=f"{len(rep.comparisons):,} comparisons, family-wise α = {rep.alpha:g} (Holm)",
              title_justify="left", show_edge=False, pad_edge=False, box=None, padding=(0, 1))
    for col in ["row", "statistic", "value", "reference", "z", "limit", "result"]:
        t.add_column(col, justify="left" if col in ("row", "statistic", "result") else "right",
                     no_wrap=col != "row", overflow="fold")
    grouped: dict[str, dict[str, list]] = {}
    for c in rep.comparisons:
        case, _, label = c.row.rpartition(": ")
        grouped.setdefault(case, {}).setdefault(label, []).append(c)
    for case, labels in grouped.items():
        t.add_row(f"[bold]{escape(case)}[/]" if case else "", *[""] * 6)
        for label, comparisons in labels.items():
            for c in comparisons:         # value and reference to the SE's precision (measured_cells)
                value, _, reference = measured_cells(c.value, c.se, c.reference)
                t.add_row(escape(label), c.statistic, value, reference,
                          f"{c.z:+.2f}" if math.isfinite(c.z) else fmt(c.z, sign=True), f"{c.threshold:.2f}",
                          "pass" if c.passed else "[bold red]FAIL[/]")
    return t
