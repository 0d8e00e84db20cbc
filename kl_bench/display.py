"""Readable terminal tables: the per-case detail table and Schulman's layout."""
from __future__ import annotations

import math
import re

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .draws import PER_TOKEN, row_label
from .formatting import count, fmt, fmt_rel, pct


_TRAILING = re.compile(r"[ \t]+((?:\x1b\[[0-9;]*m)*)$")     # spaces before any closing style codes


def show(console: Console, table, wide: bool = False) -> None:
    """Print a table: boxed for a terminal (rich fits it to the terminal's width); plain text when stdout
    is not a terminal (a file, a pipe, CI): no box-drawing, one space between columns, nothing around.
    Lines never end in spaces (rich pads every line to the table's width). ``wide``: at the table's
    natural width, cells whole, even where lines are longer than the terminal."""
    if not console.is_terminal:
        table.box = None
        table.padding = (0, 1)
        table.pad_edge = False
        table.show_edge = False
    width = console.width
    if wide:                # rich never prints wider than the console: widen it for this table alone
        console.width = max(natural_width(console, table), width)
    try:
        with console.capture() as cap:
            console.print(table)
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


def _with_exact(measured: str, exact: str) -> str:
    """"measured (exact)", or the measured value alone where no exact value exists (no empty brackets)."""
    return f"{measured} ({exact})" if exact else measured


def dagger(r) -> str:
    """"†" for a heavy-tailed row (its measured std, SE, CI and z are not valid), else "". Every column
    whose value leans on the measured SE carries it, not only the std."""
    heavy = r.get("heavy_tail")
    return "†" if isinstance(heavy, str) and heavy else ""      # NaN (from a CSV) is no flag


def _std_cell(r, value: float) -> str:
    # A std measured on a heavy tail is not to be trusted: mark it instead of printing it plainly.
    return fmt(value) + dagger(r)


def target_cell(r) -> str:
    """The row's target as shown: rows divided by lengths (tok_mean, tok_batch) estimate it per token."""
    agg = r.get("aggregate", "")
    return f"{r['target']}/token" if isinstance(agg, str) and agg in PER_TOKEN else r["target"]


def detail_table(df: pd.DataFrame, case: str, description: str) -> Table:
    """One case: measured value ± SE next to the exact one, relative bias and noise, z."""
    t = Table(title=escape(f"{case}: {description}"), title_justify="left", show_edge=False, pad_edge=False)
    for col, just in [("estimator", "left"), ("target", "left"), ("true", "right"), ("mean ± se", "right"),
                      ("exact mean", "right"), ("bias/true", "right"), ("exact", "right"),
                      ("std/true", "right"), ("exact", "right"), ("z", "right"), ("P(<0)", "right")]:
        t.add_column(col, justify=just)
    for _, r in df[df["case"] == case].iterrows():
        z = r["z"]
        true = fmt(r["true_kl"], 4)
        if _has_reference(r):       # no exact value: the Monte Carlo reference, marked as such
            z, true = r.get("z_ref", math.nan), f"≈{fmt(r['ref_kl'], 4)} ± {fmt(r['ref_se'], 2)}"
        zs = fmt(z, 2) + dagger(r)
        if isinstance(z, float) and math.isfinite(z) and abs(z) >= 5:
            zs = f"[bold red]{zs}[/]"
        t.add_row(row_label(r), target_cell(r), true,
                  f"{fmt(r['mean'], 4)} ± {fmt(r['se'], 2)}{dagger(r)}", fmt(r["exact_mean"], 4),
                  fmt_rel(r["rel_bias"]) + dagger(r), fmt_rel(r["exact_rel_bias"]), _std_cell(r, r["rel_std"]),
                  fmt(r["exact_rel_std"]), zs, fmt(r["frac_negative"], 2))
    captions = []
    if df.loc[df["case"] == case, "heavy_tail"].fillna("").astype(str).str.len().gt(0).any():
        captions.append("† heavy tail (see heavy_tail): the measured std, se and z are not trustworthy")
    if any(_has_reference(r) for _, r in df[df["case"] == case].iterrows()):
        captions.append("≈: no exact value exists; 'true' is the reference, the Rao–Blackwellised full mean ± SE "
                        "(Monte Carlo, not exact), and z is z_ref against it")
    if captions:
        t.caption = "\n".join(captions)
        t.caption_justify = "left"
    return t


SHORT_TARGET = {"KL(q||p)": "q||p", "KL(p||q)": "p||q"}


def heading(df: pd.DataFrame, case: str, description: str) -> str:
    """A case's heading line: its name, its q and p, and the truth of each target (exact, or the Monte
    Carlo reference marked ≈ where no exact value exists)."""
    c = df[df["case"] == case]
    truths = []
    for target in dict.fromkeys(c["target"]):
        r = c[c["target"] == target].iloc[0]
        if _has_reference(r):
            truths.append(f"{target} ≈ {fmt(r['ref_kl'], 4)} ± {fmt(r['ref_se'], 2)} (Monte Carlo reference)")
        elif isinstance(r["true_kl"], float) and not math.isnan(r["true_kl"]):
            truths.append(f"{target} = {fmt(r['true_kl'], 4)}")
    return f"{case}: {description}" + (f"\n  {', '.join(truths)}" if truths else "")


COMPACT_COLUMNS = ["estimator", "target", "bias/true ± se", "exact", "std/true", "n ±10%", "z", "P(<0)"]


def compact_frame(df: pd.DataFrame, case: str) -> pd.DataFrame:
    """One case's rows as the compact table shows them (strings, columns COMPACT_COLUMNS): relative bias
    measured ± SE with the exact one, std/true († where its SE is not valid), the batch for ±10% with 95%
    probability, z (against the reference where no exact value exists) and P(<0)."""
    cells = []
    for _, r in df[df["case"] == case].iterrows():
        true, z = r["true_kl"], r["z"]
        if _has_reference(r):
            true, z = r["ref_kl"], r.get("z_ref", math.nan)
        ok = isinstance(true, float) and math.isfinite(true) and true != 0
        bias = pct((r["mean"] - true) / abs(true)) if ok else ""
        se = pct(r["se"] / abs(true), sign=False) if ok else ""
        mark = dagger(r)
        short = SHORT_TARGET.get(r["target"], r["target"]) + target_cell(r)[len(r["target"]):]
        cells.append([row_label(r), short, f"{bias} ± {se}{mark}" if bias else "", pct(r["exact_rel_bias"]),
                      _std_cell(r, r["rel_std"] if ok else math.nan), count(r.get("n_for_10pct", math.nan)),
                      fmt(z, 2) + mark, fmt(r["frac_negative"], 2)])
    return pd.DataFrame(cells, columns=COMPACT_COLUMNS)


def compact_table(df: pd.DataFrame, case: str) -> Table:
    """One case in ≤ 80 columns, one line per row (:func:`compact_frame`). The truth is in :func:`heading`;
    `--wide` gives :func:`detail_table`."""
    t = Table(show_edge=False, pad_edge=False, box=None, padding=(0, 1))
    for col in COMPACT_COLUMNS:
        t.add_column(col, justify="left" if col in ("estimator", "target") else "right", no_wrap=True)
    for cells in compact_frame(df, case).itertuples(index=False):
        cells = [escape(c) for c in cells]
        z = cells[6].rstrip("†")               # † (heavy tail) after the number
        if z and z not in ("inf", "-inf") and abs(float(z)) >= 5:
            cells[6] = f"[bold red]{z}[/]"
        t.add_row(*cells)
    return t


def _has_reference(r) -> bool:
    """A row of a case without an exact value that has a Monte Carlo reference (issue 14: ref_kl)."""
    ref = r.get("ref_kl", math.nan)
    true = r["true_kl"]
    return isinstance(ref, float) and math.isfinite(ref) and not (isinstance(true, float) and math.isfinite(true))


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
        return "" if hit.empty else f"{fmt(hit.iloc[0]['exact_rel_std'])} ({_std_cell(hit.iloc[0], hit.iloc[0]['rel_std'])})"
    star = r0["lambda_star"]
    # Exact std at λ*: from any cv row, std(λ)/(1 + excess_std(λ)).
    usable = c[c["exact_std"].map(math.isfinite) & c["excess_std"].map(math.isfinite)]
    best = usable.iloc[0]["exact_std"] / (1 + usable.iloc[0]["excess_std"]) / r0["true_kl"] if len(usable) else math.nan
    opt = c[c["estimator"] == "cv_opt"]
    opt_cell = "" if opt.empty else \
        f"{fmt(opt.iloc[0]['exact_rel_std'])} ({_std_cell(opt.iloc[0], opt.iloc[0]['rel_std'])}) λ={opt.iloc[0]['lambda']:.3g}"
    k3 = c[(c["estimator"] == "cv") & (c["lambda"] == 1.0)]
    ratio = f"{k3.iloc[0]['excess_std'] + 1:.3g}×" if not k3.empty else ""
    heavy = c["heavy_tail"].fillna("").astype(str).str.len().gt(0).any()
    mc = r0["lambda_star_mc"]
    measured = f"{fmt(mc)} ± {fmt(r0['lambda_star_mc_se'], 2)}" + ("†" if heavy else "") \
        if isinstance(mc, float) and math.isfinite(mc) else ""
    sampled = isinstance(r0.get("sampler", ""), str) and r0.get("sampler", "") != ""
    return [escape(f"{case} ({agg})" if agg else case), "n/a (sampler)" if sampled and not math.isfinite(star)
            else fmt(star), measured, at(0.0), at(1.0), fmt(best), opt_cell, ratio]


def exact_table(df: pd.DataFrame, case: str, description: str) -> Table:
    t = Table(title=escape(f"{case}: {description}"), title_justify="left", show_edge=False, pad_edge=False)
    for col in ["estimator", "target", "true", "exact mean", "bias/true", "std/true"]:
        t.add_column(col, justify="left" if col in ("estimator", "target") else "right")
    for _, r in df[df["case"] == case].iterrows():
        t.add_row(row_label(r), target_cell(r), fmt(r["true_kl"], 4), fmt(r["exact_mean"], 4),
                  fmt_rel(r["exact_rel_bias"]), fmt(r["exact_rel_std"]))
    return t


def with_reference(df: pd.DataFrame) -> pd.DataFrame:
    """Rows without an exact value but with a Monte Carlo reference (ref_kl: model continuations, logged
    log-probs) get true_kl, rel_bias and rel_std measured against that reference, for the summary tables;
    their exact columns stay blank. Headers mark such cases with ≈."""
    if "ref_kl" not in df:
        return df
    df = df.copy()
    use = df["true_kl"].isna() & df["ref_kl"].notna()
    ref = df.loc[use, "ref_kl"].astype(float)
    df.loc[use, "true_kl"] = ref
    df.loc[use, "rel_bias"] = (df.loc[use, "mean"] - ref) / ref
    df.loc[use, "rel_std"] = df.loc[use, "std"] / ref
    df["approx"] = use
    return df


MAX_TABLE_CASES = 8     # the side-by-side table's case columns beyond which it is not printed


def schulman_table(df: pd.DataFrame) -> Table:
    """Schulman's layout: rows are estimators; per case, bias/true and stdev/true, measured (exact)."""
    df = with_reference(df)
    cases = list(dict.fromkeys(df["case"]))
    if len(cases) > MAX_TABLE_CASES:      # a sweep's grid: one column pair per case would not fit a screen
        t = Table(title=f"bias/true and stdev/true: {len(cases)} cases, too many for one table (see summary.csv "
                        "and the report's sweep figures)", title_justify="left", show_edge=False, pad_edge=False)
        return t
    t = Table(title="bias/true and stdev/true per estimator (measured, exact in brackets)",
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
        t.add_column(f"KL{approx}{fmt(true, 3)}\nstdev/true", justify="right")
    keys = list(dict.fromkeys(zip(df["estimator"], df["aggregate"].fillna(""))))
    for est, agg in keys:
        cells = [f"{agg} {est}" if agg else est]
        for c in cases:
            row = df[(df["case"] == c) & (df["estimator"] == est) & (df["aggregate"].fillna("") == agg)]
            if row.empty:
                cells += ["", ""]
                continue
            r = row.iloc[0]
            cells.append(_with_exact(fmt_rel(r['rel_bias']), fmt_rel(r['exact_rel_bias'])))
            cells.append(_with_exact(_std_cell(r, r['rel_std']), fmt(r['exact_rel_std'])))
        t.add_row(*cells)
    return t


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
    for _, r in df[df["sampler"].fillna("") != ""].iterrows():
        rel = r["exact_rel_bias"] if isinstance(r["exact_rel_bias"], float) and math.isfinite(r["exact_rel_bias"]) \
            else r["rel_bias"]
        arrow = "" if not math.isfinite(rel) or abs(rel) < 0.01 else ("[red]▲[/] " if rel > 0 else "[blue]▼[/] ")
        t.add_row(escape(r["case"]), escape(str(r["sampler"])), row_label(r), fmt(r["true_kl"], 4), fmt(r["exact_mean"], 4),
                  f"{arrow}{rel:+.1%}" if math.isfinite(rel) else "", f"{fmt(r['mean'], 4)} ± {fmt(r['se'], 2)}",
                  fmt(r["frac_negative"], 2), fmt(r.get("p_neg_b64", math.nan), 2))
    return t


def gradient_table(g: pd.DataFrame) -> Table:
    """What each estimator × mode optimises: exact cosines with ∇KL(q||p) and ∇KL(p||q), measured cosine,
    the exact relative error against ∇KL(q||p), the per-draw variance (measured in brackets where no
    exact value exists: rollouts) and the batch size for cos ≥ 0.9."""
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
                  f"{fmt(r['exact_cos_forward'])} ({fmt(r['cos_forward'])})", fmt(r["exact_relerr_reverse"]),
                  trace, fmt(r["n_for_cos90"]), fmt(zmax, 2))
    return t


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
    ``wide`` or where it fits a terminal. Side-by-side tables are printed where they fit (a pipe always
    fits), else one line says where their numbers are."""
    for case in dict.fromkeys(df["case"]):
        if exact_only:
            show(console, exact_table(df, case, descriptions[case]))
        else:
            full = detail_table(df, case, descriptions[case])
            if wide or (console.is_terminal and fits(console, full)):
                show(console, full, wide)
            else:
                console.print(escape(heading(df, case, descriptions[case])), soft_wrap=True)
                show(console, compact_table(df, case))
                _captions(console, df, case)
        console.print()
    if exact_only:
        return
    extra = []
    if df["case"].nunique() > 1:
        extra.append(("side-by-side", schulman_table(df[df["lambda"].isna()])))
    if lengths:
        extra.append(("rollout", rollout_table(df, lengths)))
    if "sampler" in df and (df["sampler"].fillna("") != "").any():
        extra.append(("sampling mismatch", mismatch_table(df)))
    if "estimator" in df and df["estimator"].isin(["cv", "cv_opt"]).any():
        extra.append(("control variate", lambda_table(df)))
    for name, table in extra:
        show_or_point(console, table, name, wide)


def show_or_point(console: Console, table: Table, name: str, wide: bool = False) -> None:
    """A secondary table where it fits the console (or with ``wide``); else one line pointing to it."""
    if wide or fits(console, table):
        show(console, table, wide)
    else:
        console.print(f"({name} table: {natural_width(console, table)} columns wide; --wide prints it, "
                      "summary.csv holds every number)", markup=False, soft_wrap=True)
    console.print()


def _captions(console: Console, df: pd.DataFrame, case: str) -> None:
    rows = df[df["case"] == case]
    if rows["heavy_tail"].fillna("").astype(str).str.len().gt(0).any():
        console.print("  † heavy tail: the measured std, se and z are not trustworthy", markup=False)
    if any(_has_reference(r) for _, r in rows.iterrows()):
        console.print("  ≈ no exact value: bias and z are against the Monte Carlo reference", markup=False)


def check_table(rep) -> Table:
    """The regression gate's comparisons (a :class:`kl_bench.api.CheckReport`), one line each."""
    t = Table(show_edge=False, pad_edge=False, title=f"{len(rep.comparisons)} comparisons, family-wise α = "
              f"{rep.alpha:g} (Holm)", title_justify="left")
    for col in ["row", "statistic", "value", "reference", "z", "|z| limit", "result"]:
        t.add_column(col, justify="left" if col in ("row", "statistic", "result") else "right")
    for c in rep.comparisons:
        t.add_row(escape(c.row), c.statistic, f"{c.value:.6g}", f"{c.reference:.6g}", f"{c.z:+.2f}",
                  f"{c.threshold:.2f}", "pass" if c.passed else "[bold red]FAIL[/]")
    return t
