"""The report: figures, the paper-style table (LaTeX booktabs and Markdown) and a browsable report
(Markdown and a self-contained HTML page), from one or more results folders; the advice (what to log,
what to put in the loss) first, as ``kl-bench run`` prints it.

:func:`build_report` returns {relative path: bytes}; :func:`report_files` picks the report of a run, a
training or an audit folder; the CLI writes them. Every number follows the one vocabulary of
docs/results.md ("Units and words"): bias/true in %, std/true a plain ratio, n ±10% an integer with
thousands separators ("never": the bias alone exceeds ±10%; "—": no exact bias is known).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd

from ..core.aggregates import AGGREGATES
from ..core.draws import row_key, row_label
from ..foundation.formatting import measured_cells, pct, plural, sig
from .cells import bias_se, bias_std_cells, diff_cell  # noqa: F401  (bias_se: re-exported)
from .figstyle import short_label
from .pages import (ALL_FORMATS, CSS, figure_files, figure_html, file_stems, html_inline, html_text, md_text, page,  # noqa: F401
                    scroll, table_html, table_md as md_table_of, unique_files, vector_links)
from .pages import figure_bytes as _figure_bytes
from ..foundation.errors import SpecError
from ..foundation.registry import Registry
from ..results import SWEEP_PREFIX
from ..foundation.safe_io import read_regular
from ..foundation.storage import same_path, write_folder
from ..results import folders
from ..results.reservoir import reservoir_key
from ..results.verify import read_results_folder


@dataclass
class Results:
    """One results folder written by `kl-bench run`."""
    path: Path
    name: str
    summary: pd.DataFrame
    envelope: dict
    sweep: pd.DataFrame | None
    batches: pd.DataFrame | None
    reservoir: dict[str, np.ndarray] | None
    gradients: pd.DataFrame | None = None
    group_baselines: pd.DataFrame | None = None


def load_results(path: Path) -> Results:
    """Read and verify a results folder (kl_bench.results.verify: sha256 of every data file against run.json,
    schema and dtypes of every table, consistent cases); a missing, incomplete or corrupted folder is a
    one-line SpecError."""
    got = read_results_folder(path)          # in today's format (kl_bench.results.migrate)
    name = got.envelope.get("experiment") if isinstance(got.envelope.get("experiment"), str) else got.path.name
    return Results(got.path, name, got.summary, got.envelope, got.sweep, got.batches, got.reservoir,
                   got.gradients, got.group_baselines)


# ----------------------------------------------------------------------------- numbers
_TEX = {"\\": r"\textbackslash{}", "_": r"\_", "%": r"\%", "&": r"\&", "#": r"\#", "$": r"\$", "{": r"\{",
        "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "²": r"\textsuperscript{2}",
        "σ": r"$\sigma$", "μ": r"$\mu$", "λ": r"$\lambda$", "‖": r"$\|$", "−": "$-$", "·": r"$\cdot$",
        "∞": r"$\infty$", "–": "--", "—": "---", "×": r"$\times$", "≤": r"$\le$", "≥": r"$\ge$", "±": r"$\pm$",
        "†": r"$^\dagger$", "≈": r"$\approx$"}


def tex(text: str) -> str:
    return "".join(_TEX.get(ch, ch) for ch in str(text))


def tex_number(s: str) -> str:
    """A number as the tables show it, in LaTeX: 1.2e-5 as 1.2×10⁻⁵, a percentage's % escaped, a minus sign
    as math's minus ($-$), never a text hyphen."""
    if s.endswith("%"):
        return tex_number(s[:-1]) + r"\%"
    if s.lstrip("+-−") in ("inf", "∞"):
        return "$" + s.replace("−", "-").replace("inf", r"\infty").replace("∞", r"\infty") + "$"
    if "e" in s and s not in ("—",):
        mant, exp = s.split("e")
        return f"${mant.replace('−', '-')}\\times 10^{{{int(exp)}}}$"
    if s[:1] in "-−" and len(s) > 1:         # a real minus, not a text hyphen
        return "$-$" + tex(s[1:])
    return tex(s)


# ----------------------------------------------------------------------------- the vocabulary (docs/results.md)
def batch_cell(n: float, exact_bias: float) -> str:
    """n ±10%: the draws a mean needs to land within ±10% of the truth with 95% probability, an integer
    with thousands separators; "never" where the bias alone is larger (or the variance infinite); "—"
    where no exact bias is known (a logged or sampled reference: the measured bias cannot decide it)."""
    if not (isinstance(exact_bias, (int, float)) and math.isfinite(exact_bias)):
        return "—"
    if n is None or n != n:
        return ""
    return "never" if math.isinf(n) else f"{n:,.0f}"


# ----------------------------------------------------------------------------- paper table
def paper_table(df: pd.DataFrame):
    """Schulman's layout: rows are estimators; per case bias/true (in %) and std/true (a ratio), measured
    ± SE and exact.

    A case without an exact value but with a Monte Carlo reference (model continuations, logged log-probs)
    shows its measured values against that reference (display.with_reference), its title marked ≈ and its
    exact cells —.

    Returns (cases [(key, title, true_kl, kind)], rows [(label, [cells per case: 4 strings])]): the
    measured cells are "value ± SE", with † where the row is heavy-tailed (its SE is not valid); the title
    of a case against a reference ends in " ≈" (see kl_head)."""
    from .tables import with_reference
    df = with_reference(df[df["lambda"].isna() | (df["estimator"] == "cv_opt")])
    cases = []
    for key in dict.fromkeys(df["key"]):
        c = df[df["key"] == key]
        approx = "approx" in c and bool(c["approx"].iloc[0])
        cases.append((key, key + (" ≈" if approx else ""), float(c["true_kl"].iloc[0]), str(c["kind"].iloc[0])))
    labels = list(dict.fromkeys(df["label"]))
    rows = []
    for lab in labels:
        cells = []
        for key, _, _, _ in cases:
            hit = df[(df["key"] == key) & (df["label"] == lab)]
            if hit.empty:
                cells.append(["", "", "", ""])
                continue
            cells.append(paper_cells(hit.iloc[0]))
        rows.append((lab, cells))
    return cases, rows


def paper_cells(r) -> list[str]:
    """A row's four cells of the paper table: bias/true ± SE (%), exact, std/true ± SE, exact, by the one
    digit rule (formatting.measured_cells: each measured value to its SE's precision, the exact value beside
    it to as many digits); where the KL is 0 (p = q: every trainer's step 0) no relative value exists, so
    bias ± SE, its exact value, std ± SE and the exact std are absolute, as `kl-bench run` shows them (the
    case's heading says so, kl_head); "—" where no exact value exists, "unknown" where the mean is."""
    from .cells import dagger, unknown_mean
    bias, exact_bias, std, exact_std = bias_std_cells(r)
    if unknown_mean(r):
        return ["unknown", exact_bias or "—", "unknown", exact_std or "—"]
    return [bias + dagger(r) if bias else "—", exact_bias or "—", std + dagger(r) if std else "—", exact_std or "—"]


def _caption(results: list[Results]) -> tuple[str, str]:
    """(the tables' short caption, the runs' provenance: draws per case, seed, device, cases)."""
    bits = []
    for res in results:
        env = res.envelope
        draws = env.get("draws_per_case")
        if isinstance(draws, dict):
            values = sorted(set(draws.values()))
            draws_txt = " / ".join(f"{v:,}" for v in values)
        else:
            draws_txt = f"{draws:,}" if isinstance(draws, int) else "?"
        cases = "; ".join(f"{name}: {meta.get('description', '')}" for name, meta in env.get("cases", {}).items())
        bits.append(f"{res.name}: {draws_txt} draws per case, seed {env.get('seed')}, device {env.get('device')}. "
                    f"Cases: {cases}.")
    approx = any(meta.get("reference", "").startswith("full mean") for res in results
                 for meta in res.envelope.get("cases", {}).values() if isinstance(meta.get("reference"), str))
    note = ("A case marked ≈ has no exact value: its values are measured against the reference, the "
            "Rao–Blackwellised full mean (Monte Carlo), and its exact columns are —. ") if approx else ""
    if any(_zero_cases(res.summary) for res in results):
        note += "A case with KL = 0 (p = q) shows its bias and std absolute, not /true: no relative value exists. "
    note += _aggregate_note(results)
    return ("Bias and per-draw std of each KL estimator relative to the true KL (bias/true in %, std/true a "
            "ratio): measured ± SE to the SE's last digit, exact beside it; † a heavy tail (its std, SE and z are "
            "not valid). " + note).strip(), " ".join(bits)


def _zero_cases(summary: pd.DataFrame) -> list[str]:
    """The cases whose every row's true value is 0 (p = q)."""
    true = summary["true_kl"].astype(float)
    return [c for c, t in true.groupby(summary["case"], sort=False) if bool((t == 0).all())]


def _aggregate_note(results: list[Results]) -> str:
    """What each aggregate of the rows is, in the AGGREGATES table's words, and which are per token."""
    present = [a for a in AGGREGATES if a and any(res.summary["aggregate"].eq(a).any() for res in results)]
    if not present:
        return ""
    note = "Rows: " + "; ".join(f"{a}: {AGGREGATES[a].label}" for a in present) + ". "
    per_token = [a for a in present if AGGREGATES[a].per_token]
    if per_token:
        note += f"{' and '.join(per_token)} rows are relative to the KL per generated token, KL/E|y|. "
    return note


ZERO_HEAD = "KL = 0 (p = q): bias and std absolute, not /true"


def kl_head(title: str, true: float) -> tuple[str, str]:
    """(case title, "KL = x" or "KL ≈ x" for a case measured against its Monte Carlo reference; at KL = 0,
    that its bias and std are absolute: no relative value exists)."""
    if title.endswith(" ≈"):
        return title[:-2], f"KL ≈ {sig(true)}"
    return title, ZERO_HEAD if true == 0 else f"KL = {sig(true)}"


def column_heads(true: float) -> list[str]:
    """The four column heads of a case in the paper table: relative, or absolute where the KL is 0."""
    if true == 0:
        return ["bias ± SE", "exact", "std ± SE", "exact"]
    return ["bias/true ± SE", "exact", "std/true ± SE", "exact"]


TEX_ROWS_PER_TABLE = 40        # body rows of one table float: one page of an article at \small


def _tex_families(cases, rows) -> list[list[tuple]]:
    """The cases in groups of one kind each (in order), cut so that no table has more than
    TEX_ROWS_PER_TABLE body rows: [[(case, [(label, 4 cells)])]]."""
    groups: list[list[tuple]] = []
    kind, size = None, 0
    for i, case in enumerate(cases):
        body = [(label, cells[i]) for label, cells in rows if any(cells[i])]
        if not groups or case[3] != kind or size + len(body) + 1 > TEX_ROWS_PER_TABLE:
            groups.append([])
            kind, size = case[3], 0
        groups[-1].append((case, body))
        size += len(body) + 1
    return groups


def table_tex(cases, rows, caption: str, provenance: str = "") -> str:
    """The paper table as LaTeX a paper can include as it is: one booktabs table per family of cases (same
    kind, at most TEX_ROWS_PER_TABLE rows), five columns (estimator, bias/true ± SE, exact, std/true ± SE,
    exact), a case's title as a row above its estimators, a short caption; no \\resizebox, so the type
    stays the document's. ``provenance`` (draws, seeds, devices) goes in a comment at the top."""
    lines = [r"% kl-bench paper tables; need \usepackage{booktabs}"]
    lines += [f"% {line}" for line in provenance.splitlines() if line]
    groups = _tex_families(cases, rows)
    for g, group in enumerate(groups):
        part = f" ({g + 1} of {len(groups)})" if len(groups) > 1 else ""
        lines += [r"\begin{table}[t]", r"\centering", r"\small", r"\begin{tabular}{lrrrr}", r"\toprule",
                  r"estimator & bias/true $\pm$ SE & exact & std/true $\pm$ SE & exact \\"]
        for (key, title, true, _), body in group:
            rel = r"$\approx$" if title.endswith(" ≈") else "$=$"
            head = tex(kl_head(title, true)[1]) if true == 0 else f"KL {rel} {tex_number(sig(true))}"
            lines += [r"\midrule", rf"\multicolumn{{5}}{{l}}{{\emph{{{tex(kl_head(title, true)[0])}}} "
                      rf"({head})}} \\"]
            lines += [tex(label) + " & " + " & ".join(tex_cell(c) for c in cells) + r" \\" for label, cells in body]
        lines += [r"\bottomrule", r"\end{tabular}", rf"\caption{{{tex(caption)}{part}}}",
                  rf"\label{{tab:kl-bench-{g + 1}}}", r"\end{table}", ""]
    return "\n".join(lines)


def tex_cell(cell: str) -> str:
    """A table cell in LaTeX: "v ± se†" with each number as tex_number shows it."""
    mark = "$^\\dagger$" if cell.endswith("†") else ""
    parts = cell.removesuffix("†").split(" ± ")
    return " $\\pm$ ".join(tex_number(p) for p in parts) + mark if cell else ""


def table_md(cases, rows, caption: str) -> str:
    """The paper table in Markdown; names from the data escaped (pages.md_text: a | in a case name would
    split its cell)."""
    head = "| estimator | " + " | ".join("{} ({}) {} | {} | {} | {}".format(
        *map(md_text, kl_head(title, true)), *column_heads(true)) for _, title, true, _ in cases) + " |"
    sep = "|---|" + "---:|" * (4 * len(cases))
    body = ["| " + md_text(label) + " | " + " | ".join(md_text(c) for cell in cells for c in cell) + " |"
            for label, cells in rows]
    return "\n".join([head, sep, *body, "", f"*{md_text(caption)}*", ""])


# ----------------------------------------------------------------------------- figures
FIGURE_FORMATS = ("png",)     # the default of `kl-bench report --formats`: PNG, which the pages show


def figure_bytes(fig, formats=None) -> dict[str, bytes]:
    """{format: the figure saved in it} (PNG at 110 dpi; ``formats``: default FIGURE_FORMATS; PDF and SVG
    for a paper, with no dates, so the bytes repeat), then the figure is closed."""
    return _figure_bytes(fig, formats or FIGURE_FORMATS)


def png_bytes(fig) -> bytes:
    return figure_bytes(fig, ("png",))["png"]


def growth_frame(case: str, growth: dict) -> tuple[pd.DataFrame, dict[str, int]]:
    """A model case's growth metadata (std/ref per prefix length) as summary-like rows for
    plots.plot_rollout_growth: one pseudo-case per prefix length, measured markers only (no exact line)."""
    rows, lengths = [], {}
    for i, t in enumerate(growth["T"]):
        name = f"{case}@T={t}"
        lengths[name] = t
        for label, values in growth.items():
            if label in ("T", "paths") or values[i] is None:
                continue
            agg, est = label.split(" ", 1)
            rows.append({"case": name, "estimator": est, "aggregate": agg, "lambda": math.nan,
                         "rel_std": values[i], "exact_rel_std": math.nan})
    return pd.DataFrame(rows), lengths


@dataclass
class FigureContext:
    """What a figure's panels are chosen from: every row (``df``, against the reference where no exact
    value exists), the cases made by [[sweep]] tables (``swept``, shown against their swept keys), and for
    a per-run figure the run (``res``), its summary ``s`` and its file-name ``prefix``."""
    results: list[Results]
    df: pd.DataFrame
    swept: set
    res: Results | None = None
    s: pd.DataFrame | None = None
    prefix: str = ""
    stems: dict[str, str] = field(default_factory=dict)

    def stem(self, name: str) -> str:
        """A case's (or a swept key's) part of a file name: unique among the report's names (pages.file_stems)."""
        return self.stems.get(name) or file_stems([name])[name]


@dataclass(frozen=True)
class Panel:
    """One figure file: ``plot(data, title=title, **kwargs)`` saved as ``file`` with ``caption``."""
    file: str
    caption: str
    title: str
    data: Any
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class FigureKind:
    """A registered figure: ``plot`` names a kl_bench.present.plots function (data, ax, title, ...) → figure
    (imported on first use: matplotlib is slow to load); ``panels(ctx)`` yields its Panels; ``per_run``:
    drawn for each results folder rather than once over all of them."""
    name: str
    plot: str
    panels: Callable[[FigureContext], Iterator[Panel]]
    per_run: bool


FIGURES: Registry[FigureKind] = Registry("figure")


def figure(name: str, plot: str, *, per_run: bool = False):
    """Register a function ``panels(ctx) -> Iterator[Panel]`` as a figure of the report (in order)."""
    def register(panels: Callable[[FigureContext], Iterator[Panel]]):
        FIGURES.add(name, FigureKind(name, plot, panels, per_run))
        return panels
    return register


def _finite(rows: pd.DataFrame, cols=("rel_std", "exact_rel_std")) -> bool:
    return bool(np.isfinite(rows[list(cols)].astype(float).to_numpy()).any())


@figure("sweep", "plot_sweep")
def _sweep_panels(ctx: FigureContext) -> Iterator[Panel]:
    for key in [c for c in ctx.df.columns if c.startswith(SWEEP_PREFIX)]:
        name = key.removeprefix(SWEEP_PREFIX)
        yield Panel(f"sweep_{ctx.stem(name)}.png", f"std/true and bias/true against {name}, one line per estimator "
                    "(lines with markers: measured; dashed: exact)", f"estimators across the sweep of {name}",
                    ctx.df[ctx.df[key].notna()], {"key": key})


@figure("bias_std", "plot_bias_std")
def _bias_std_panels(ctx: FigureContext) -> Iterator[Panel]:
    for case in dict.fromkeys(ctx.df["case"]):
        rows = ctx.df[ctx.df["case"] == case]
        if case in ctx.swept or not _finite(rows):
            continue          # neither a true value nor a reference to scale by (a log without kl_full)
        ref = "approx" in rows and bool(rows["approx"].any())
        what = "the full-mean reference (Monte Carlo, no exact value)" if ref else "the true KL"
        marks = "95% CI; no exact values, so no ×" if ref else "95% CI; × exact"
        yield Panel(f"bias_std_{ctx.stem(case)}.png", f"{case}: bias and std per estimator relative to {what} ({marks})",
                    f"{short_label(case)}: bias and noise relative to {what}", rows)


@figure("lambda", "plot_lambda_curve", per_run=True)
def _lambda_panels(ctx: FigureContext) -> Iterator[Panel]:
    if ctx.res.sweep is None:
        return
    for (case, agg), sw in ctx.res.sweep.groupby(["case", "aggregate"], sort=False):
        name = f"{case} ({agg})" if agg else case
        if _finite(sw):             # else no true value to scale by (model continuations): the table has λ*
            # the aggregate as the file names have always had it (lambda_roll-T4-seq.png)
            yield Panel(f"{ctx.prefix}lambda_{ctx.stem(case)}{f'-{agg}' if agg else ''}.png",
                        f"{name}: std/true of cv(λ) against λ",
                        f"{short_label(case)}{f' ({agg})' if agg else ''}: control variate −log r + λ(r−1)", sw)


def _unswept(ctx: FigureContext) -> list[str]:
    return [c for c in dict.fromkeys(ctx.s["case"]) if c not in ctx.swept]


@figure("distribution", "plot_distribution", per_run=True)
def _distribution_panels(ctx: FigureContext) -> Iterator[Panel]:
    if not ctx.res.reservoir:
        return
    for case in _unswept(ctx):
        rows = ctx.s[(ctx.s["case"] == case) & ctx.s["lambda"].isna()]
        parts = []
        for _, r in rows.iterrows():
            key = reservoir_key(case, row_key(r['estimator'], None, r['aggregate']))
            if key in ctx.res.reservoir:       # NaN: draws in no whole token-mean group
                v = ctx.res.reservoir[key]
                parts.append(pd.DataFrame({"label": row_label(r), "value": v[~np.isnan(v)]}))
        if parts:
            yield Panel(f"{ctx.prefix}distribution_{ctx.stem(case)}.png",
                        f"{case}: per-draw distribution of each estimator (ECDF)",
                        f"{short_label(case)}: per-draw estimates (negative region shaded)", pd.concat(parts, ignore_index=True))


@figure("convergence", "plot_convergence", per_run=True)
def _convergence_panels(ctx: FigureContext) -> Iterator[Panel]:
    if ctx.res.batches is None:
        return
    for case in _unswept(ctx):
        yield Panel(f"{ctx.prefix}convergence_{ctx.stem(case)}.png", f"{case}: running estimate against draws",
                    f"{short_label(case)}: convergence (±2 SE)", ctx.res.batches[ctx.res.batches["case"] == case],
                    {"summary": ctx.s[ctx.s["case"] == case]})


@figure("growth", "plot_rollout_growth", per_run=True)
def _model_growth_panels(ctx: FigureContext) -> Iterator[Panel]:
    for name, meta in ctx.res.envelope.get("cases", {}).items():
        if meta.get("growth"):
            frame, lengths = growth_frame(name, meta["growth"])
            yield Panel(f"{ctx.prefix}growth_{ctx.stem(name)}.png",
                        f"{name}: std/reference (the full mean, Monte Carlo) against T, from the prefixes of the "
                        "same paths as the summary (the main pass)",
                        f"{short_label(name)}: prefixes of the main pass's {meta['growth'].get('paths', '?')} paths", frame,
                        {"lengths": lengths})


@figure("rollout_growth", "plot_rollout_growth", per_run=True)
def _rollout_growth_panels(ctx: FigureContext) -> Iterator[Panel]:
    cases = ctx.res.envelope.get("cases", {})
    families: dict[str, dict[str, int]] = {}
    for name, meta in cases.items():
        if meta.get("length"):
            families.setdefault(meta.get("label", ""), {})[name] = meta["length"]
    for k, (label, members) in enumerate(families.items()):
        if len(set(members.values())) > 1:      # a curve against T needs two lengths at least
            s = ctx.s
            ref = "approx" in s and bool(s.loc[s["case"].isin(members), "approx"].any())
            what = "std/reference against T (reference: the full mean, Monte Carlo; ×: measured, no exact lines)" \
                if ref else "std/true against T (lines: exact; ×: measured)"
            yield Panel(f"{ctx.prefix}rollout_growth_{k}.png", f"rollouts ({label}): {what}",
                        f"rollouts: {short_label(label)}", s,
                        {"lengths": members})


@figure("gradient_cosine", "plot_gradient_cosine", per_run=True)
def _gradient_panels(ctx: FigureContext) -> Iterator[Panel]:
    grads = ctx.res.gradients
    if grads is None:
        return
    aggs = grads["aggregate"].astype("string").fillna("") if "aggregate" in grads else pd.Series("", index=grads.index)
    for (case, agg), part in grads.groupby([grads["case"], aggs], sort=False):
        tag, words = (f"_{agg}", f" ({agg} rows)") if agg else ("", "")
        yield Panel(f"{ctx.prefix}gradient_cosine_{ctx.stem(case)}{tag}.png",
                    f"{case}{words}: cosine to ∇KL(q‖p) against batch size, per estimator × mode",
                    f"{short_label(case)}{words}: what a batch gradient points at", part)


@figure("planning", "plot_planning", per_run=True)
def _planning_panels(ctx: FigureContext) -> Iterator[Panel]:
    s = ctx.s[~ctx.s["case"].isin(ctx.swept)]       # one bar group per case: too many for a sweep's grid
    if "n_for_10pct" in s and np.isfinite(s["n_for_10pct"].astype(float)).any():
        yield Panel(f"{ctx.prefix}planning.png", "draws for ±10% error with 95% probability",
                    f"{short_label(ctx.res.name)}: batch-size planning", s)


def figure_panels(results: list[Results], df: pd.DataFrame) -> list[tuple[FigureKind, Panel]]:
    """Every figure of :data:`FIGURES` the results support, not yet drawn: [(kind, panel)], the figures
    over all runs, then each run's."""
    from .tables import with_reference
    # Cases without an exact value (model continuations, logged log-probs) are plotted against their
    # Monte Carlo reference (ref_kl), as the tables show them.
    df = with_reference(df)
    # Cases made by [[sweep]] tables are shown against their swept keys, not one figure set per case
    # (a 12 × 3 grid would otherwise make a hundred figures).
    swept_keys = [c for c in df.columns if c.startswith(SWEEP_PREFIX)]
    swept = set(df.loc[df[swept_keys].notna().any(axis=1), "case"]) if swept_keys else set()
    top = FigureContext(results, df, swept, stems=_stems(results, df, swept_keys))
    runs = file_stems(res.name for res in results)          # a run's figures are prefixed with its name
    contexts = [top] + [FigureContext(results, df, swept, res, with_reference(res.summary),
                                      f"{runs[res.name]}_" if len(results) > 1 else "", top.stems) for res in results]
    panels = [(kind, p) for ctx in contexts for kind in FIGURES.values() if kind.per_run == (ctx.res is not None)
              for p in kind.panels(ctx)]
    # A file name made of parts (a run, a case, an aggregate) can still meet another: one file per figure.
    files = unique_files([p.file for _, p in panels], [p.caption for _, p in panels])
    return [(kind, replace(p, file=f)) for (kind, p), f in zip(panels, files)]


def _stems(results: list[Results], df: pd.DataFrame, swept_keys: list[str]) -> dict[str, str]:
    """One file-name stem per name over every case of the report and every swept key: two names that would
    share a file (a|b and a-b; Noise and noise) get a hash each (pages.file_stems)."""
    names = [*df["case"], *(c for res in results for c in res.envelope.get("cases", {}))]
    return file_stems(names + [k.removeprefix(SWEEP_PREFIX) for k in swept_keys])


def build_figures(results: list[Results], df: pd.DataFrame, formats=None,
                  progress=None) -> list[tuple[str, str, dict[str, bytes]]]:
    """[(file name (.png), caption, {format: bytes})] for every figure of :data:`FIGURES` the results
    support: the figures over all runs, then each run's. ``progress``: told of each figure (a
    :class:`kl_bench.foundation.progress.LazyProgress`: its total, the file being drawn, one step a figure)."""
    from . import plots
    panels = figure_panels(results, df)
    if progress is not None:
        progress.set_total(len(panels))
    figs = []
    for kind, p in panels:
        if progress is not None:
            progress.label(p.file)
        figs.append((p.file, p.caption, figure_bytes(getattr(plots, kind.plot)(p.data, title=p.title, **p.kwargs),
                                                      formats)))
        if progress is not None:
            progress.advance(1)
    return figs


# ----------------------------------------------------------------------------- report
def write_report(dirs: list[Path], out: Path, key: str = "--out", **options) -> Path:
    """Build the report of ``dirs`` (:func:`report_files`; ``options``: its keywords) and write it as the
    folder ``out``, atomically (every input is read and every figure drawn first; then the folder is
    swapped in whole, kl_bench.foundation.storage). A folder it reads is refused as ``out`` (the error names
    the argument ``key``): swapped in whole, the report would replace the results (it goes beside or inside
    them: DIR/report)."""
    for d in dirs:
        if same_path(out, d):
            raise SpecError("is a results folder this report reads: give another folder (default: "
                            f"{Path(d) / 'report'})", file=str(out), key=key)
    files = report_files(dirs, **options)
    write_folder(Path(out), files, replaces=previous_figures(Path(out), files))
    return Path(out)


def previous_figures(out: Path, files: dict[str, bytes]) -> tuple[str, ...]:
    """The figure files of an earlier report in ``out`` (those its report.md shows, in any of the formats
    beside them) that this report does not write: removed with the swap, while the user's own files in
    figures/ are carried over (kl_bench.foundation.storage.write_folder). None where ``out`` holds no
    report.md that kl-bench could have written (a folder, a link, a file too large to be one)."""
    try:
        text = read_regular(Path(out) / "report.md", "run.json", "report.md").decode("utf-8", "replace")
    except (SpecError, OSError):
        return ()
    stems = {Path(name).stem for name in re.findall(r"\]\(figures/([^)/\s]+)\)", text)}
    folder = Path(out) / "figures"
    if not stems or folder.is_symlink() or not folder.is_dir():
        return ()
    old = (f"figures/{e.name}" for e in folder.iterdir()
           if Path(e.name).stem in stems and e.is_file() and not e.is_symlink())
    return tuple(sorted(name for name in old if name not in files))


def report_files(dirs: list[Path], *, formats=None, progress=None, batch: int = 64,
                 tolerance: float = 0.1) -> dict[str, bytes]:
    """{relative path: bytes} of the report of ``dirs``: a training folder's (train.csv), an audit
    folder's (audit.csv) or results folders' (:func:`build_report`). ``formats``: the figure files
    (default :data:`FIGURE_FORMATS`; PNG always, the pages show it); ``progress``: told of each figure;
    ``batch``, ``tolerance``: the advice's (kl_bench.analysis.advice)."""
    # Every report draws figures: matplotlib's shared objects are mapped before the first table is read,
    # whose CSV reader reserves ~1 GB of address space (pandas with pyarrow) that a `ulimit -v` then lacks
    # for them (tests/test_hardening_io.py: reports under a 3 GB address space).
    from . import plots  # noqa: F401
    formats = formats or FIGURE_FORMATS
    refuse_repeated(dirs)
    kinds = [folders.kind_of(d) for d in dirs]          # what run.json says each folder is
    if kinds == ["run"] * len(dirs):
        return build_report(dirs, formats=formats, progress=progress, batch=batch, tolerance=tolerance)
    if len(dirs) > 1:
        odd, kind = next((d, k) for d, k in zip(dirs, kinds) if k != "run")
        raise SpecError(f"{folders.with_article(kind)} folder has a report of its own: give it alone, not with "
                        "other folders", file=str(odd))
    return REPORTS[kinds[0]]()(dirs[0], formats=formats, progress=progress)


def refuse_repeated(dirs: list[Path]) -> None:
    """One line naming a folder given twice (the same spelling, another one such as ./D, or a link to it):
    a report compares its folders as independent runs, and a run beside itself agrees exactly (diff 0,
    z 0), which says nothing."""
    for i, d in enumerate(dirs):
        twin = next((e for e in dirs[:i] if same_path(d, e)), None)
        if twin is not None:
            said = "is given twice" if str(twin) == str(d) else f"is {twin} again (one folder by two names)"
            raise SpecError(f"{said}: a report compares different runs, and a run beside itself would agree "
                            "exactly; give each folder once", file=str(d))


def _training_report():
    from .training_report import training_report_files
    return training_report_files


def _audit_report():
    from .audit_report import audit_report_files
    return audit_report_files


# The report of each kind of folder but runs (kl_bench.results.folders.FORMATS), loaded when used.
REPORTS: dict[str, Callable[[], Callable[..., dict[str, bytes]]]] = {"train": _training_report, "audit": _audit_report}


def summary_line(out: Path) -> str:
    """The line `kl-bench report` prints: the page to open and how many figures it shows."""
    page_name = "report.html" if (out / "report.html").exists() else "report.md"
    n = len(list((out / "figures").glob("*.png")))
    return f"report → {out}/{page_name} ({plural(n, 'figure')})"


def run_labels(results: list[Results]) -> list[str]:
    """How each folder is named in a report of several: its experiment; with its seed where experiments
    repeat; with its folder's name where those repeat too; numbered as a last resort (never a full path)."""
    exp = [r.name for r in results]
    seeded = [f"{r.name} seed {r.envelope.get('seed')}" for r in results]
    folders = [f"{r.name} ({r.path.name})" for r in results]
    for labels in (exp, seeded, folders):
        if len(set(labels)) == len(labels):
            return labels
    return [f"{lab} #{i + 1}" for i, lab in enumerate(folders)]


DIFF_COLUMNS = {                      # differences.csv: one row per (run, case, row) also found in the first run
    "run": "the run compared (its label in the report)",
    "against": "the run it is compared with: the first folder given that has the row",
    "case": "case name", "row": "the row's label (estimator, λ, aggregate)",
    "mean": "this run's mean", "mean_against": "the other run's mean",
    "diff": "mean − mean_against",
    "rel_diff": "diff / |true KL| (or the reference where no exact value exists)",
    "se": "SE of diff: √(se² + se_against²), the runs being independent",
    "rel_se": "se / |true KL|: the SE of rel_diff",
    "z": "diff / se: |z| > 5 says the runs measure different things (not valid where heavy_tail)",
    "heavy_tail": "† where either row is heavy-tailed (its SE, so z, is not valid)",
}


def differences(df: pd.DataFrame) -> pd.DataFrame:
    """Row-by-row differences between runs (columns :data:`DIFF_COLUMNS`): each run's row against the same
    (case, row) of the first run that has it. ``df``: the report's frame (columns run, case, label, mean,
    se, true_kl, heavy_tail)."""
    from .tables import dagger, with_reference
    d = with_reference(df)
    d = d[d["lambda"].isna() | (d["estimator"] == "cv_opt")]
    out = []
    for (case, label), g in d.groupby(["case", "label"], sort=False):
        if g["run"].nunique() < 2:
            continue
        a = g.iloc[0]
        for _, b in g.iloc[1:].iterrows():
            diff = float(b["mean"]) - float(a["mean"])
            se = math.hypot(float(a["se"]), float(b["se"]))
            true = abs(float(a["true_kl"]))
            scale = true if true and math.isfinite(true) else math.nan
            out.append({"run": b["run"], "against": a["run"], "case": case, "row": label, "mean": b["mean"],
                        "mean_against": a["mean"], "diff": diff, "rel_diff": diff / scale, "se": se,
                        "rel_se": se / scale, "z": _z(diff, se), "heavy_tail": dagger(a) or dagger(b)})
    return pd.DataFrame(out, columns=list(DIFF_COLUMNS))


def _z(diff: float, se: float) -> float:
    """diff / se; where both runs are exact (se = 0): 0 if they agree to the bit, else ±∞."""
    if se > 0 or math.isnan(se):
        return diff / se if se > 0 else math.nan
    return 0.0 if diff == 0 else math.copysign(math.inf, diff)


DIFF_HEADER = ["run", "against", "case", "row", "diff/true ± SE", "z"]


def difference_cells(r) -> list[str]:
    """One difference as the report and the terminal show it (:data:`DIFF_HEADER`): diff/true ± SE in %
    (the vocabulary of bias/true), z with † where it is not valid."""
    return [str(r["run"]), str(r["against"]), str(r["case"]), str(r["row"]),
            diff_cell(float(r["rel_diff"]), float(r["rel_se"])), f"{sig(r['z'], 2)}{r['heavy_tail']}"]


def differences_md(diffs: pd.DataFrame) -> str:
    """The differences as a Markdown table: the same columns, order and cells as the HTML's."""
    return md_table_of(DIFF_HEADER, [difference_cells(r) for _, r in diffs.iterrows()],
                       [False] * 4 + [True] * 2)


def differences_html(diffs: pd.DataFrame) -> str:
    return table_html(DIFF_HEADER, [difference_cells(r) for _, r in diffs.iterrows()], classes="diffs")


def build_report(dirs: list[Path], *, formats=None, progress=None, batch: int = 64,
                 tolerance: float = 0.1) -> dict[str, bytes]:
    """{relative path: bytes} of the report of results folders ``dirs`` (see :func:`report_files`)."""
    if progress is not None:
        progress.label("reading " + ", ".join(str(d) for d in dirs))
    results = [load_results(d) for d in dirs]
    if len(results) > 1:
        for r, label in zip(results, run_labels(results)):
            r.name = label
    frames = []
    for res in results:
        d = res.summary.copy()
        d["run"] = res.name
        d["key"] = f"{res.name}/" + d["case"] if len(results) > 1 else d["case"]
        d["label"] = [row_label(r) for _, r in d.iterrows()]
        frames.append(d)
    df = pd.concat(frames, ignore_index=True)
    short, provenance = _caption(results)
    caption = f"{short} {provenance}"
    cases, rows = paper_table(df)
    tex_text, md_table = table_tex(cases, rows, short, provenance), table_md(cases, rows, caption)
    figs = build_figures(results, df, formats, progress)
    files = {path: data for name, _, by_fmt in figs for path, data in figure_files(name.removesuffix(".png"),
                                                                                    by_fmt).items()}
    files["table.tex"] = tex_text.encode()
    files["table.md"] = md_table.encode()
    diffs = differences(df) if len(results) > 1 else None
    if diffs is not None:
        from ..results import frame_to_csv_bytes
        files["differences.csv"] = frame_to_csv_bytes(diffs)
    advice = advice_lines(results, batch, tolerance)
    files["report.md"] = _report_md(results, md_table, figs, diffs, advice, batch, tolerance).encode()
    files["report.html"] = _report_html(results, df, figs, caption, cases, rows, diffs, advice, batch,
                                        tolerance).encode()
    return files


def _run_lines(res: Results) -> list[str]:
    env = res.envelope
    restored = env.get("restored_draws") or 0
    kept = f" ({restored:,} draws restored from a checkpoint)" if restored else ""
    return [f"- results: `{res.path}`; spec `{env.get('spec_path')}` (sha256 {str(env.get('spec_sha256'))[:12]}…)",
            f"- seed {env.get('seed')}, device {env.get('device')} ({env.get('device_name', '')}), "
            f"git commit {str(env.get('git_commit') or 'unknown')[:10]}, {env.get('wall_seconds')} s, "
            f"{env.get('draws_per_second', 0):,} draws/s{kept}"]


def advice_lines(results: list[Results], batch: int = 64, tolerance: float = 0.1) -> dict[str, list[str]]:
    """{run name: the advice lines `kl-bench run` prints for it} (kl_bench.analysis.advice: what to log, what to put
    in the loss); a sentence that holds for several cases alike is given once, naming them."""
    from ..analysis.advice import recommendations
    out = {}
    for res in results:
        lines, general = [], {}
        for a in recommendations(res.summary, res.gradients, batch=batch, tolerance=tolerance):
            if a.general:
                general.setdefault(a.detail, []).append(a.case)
            else:
                lines.append(a.text)
        out[res.name] = lines + [f"{', '.join(cases)}: {detail}" for detail, cases in general.items()]
    return out


def advice_note(batch: int, tolerance: float) -> str:
    return (f"For a batch of {batch:,} draws and a tolerance of ±{pct(tolerance, sign=False)} (`kl-bench report "
            "--batch B --tolerance T` for yours): what to log (or put in the reward), and what to put in the loss.")


DIFF_NOTE = ("Each run's rows against the same rows of the first folder that has them: the difference of "
             "the means relative to the true KL (in %) ± its SE √(se² + se′²), and z = difference / SE (|z| > 5: "
             "the runs disagree beyond their noise; † heavy-tailed, z not valid). All of them: differences.csv.")


BASELINE_NOTE = ("GRPO's group mean and RLOO's leave-one-out in the reward, G draws per group "
                 "(docs/weights.md#group-baselines-reward-mode): |E∇| over the no-baseline gradient's (exact), the "
                 "trace of the per-draw covariance over the no-baseline one (exact on categoricals, measured on "
                 "rollouts), and the larger |z| of the Monte Carlo checks. All columns: group_baselines.csv.")


def frame_md(df: pd.DataFrame) -> str:
    """A small DataFrame as a Markdown table: text left, numbers right, 3 significant digits."""
    num = [pd.api.types.is_numeric_dtype(df[c]) for c in df.columns]
    lines = ["| " + " | ".join(map(md_text, df.columns)) + " |", "|" + "|".join("---:" if n else "---" for n in num) + "|"]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(sig(float(v)) if n and not isinstance(v, (int, np.integer)) else md_text(v)
                                         for v, n in zip(row, num)) + " |")
    return "\n".join(lines)


def baselines_frame(results: list[Results]) -> pd.DataFrame | None:
    """The group-baseline rows of every run, as the report shows them (None: no run has them)."""
    frames = []
    for res in results:
        g = res.group_baselines
        if g is None or g.empty:
            continue
        agg = g["aggregate"] if "aggregate" in g else pd.Series("", index=g.index)
        z = pd.concat([g["z_reverse"].abs(), g["z_second"].abs()], axis=1).max(axis=1)
        frames.append(pd.DataFrame({
            "run": res.name, "case": g["case"],
            "estimator": [f"{a}-{e}" if isinstance(a, str) and a else e for a, e in zip(agg, g["estimator"])],
            "baseline": g["baseline"], "G": g["group"], "norm of E∇ / none's": g["exact_shrink"],
            "tr Cov / none's": g["variance_ratio"], "largest abs z": z}))
    if not frames:
        return None
    out = pd.concat(frames, ignore_index=True)
    return out.drop(columns="run") if len(results) == 1 else out


def _report_md(results: list[Results], md_table: str, figs, diffs: pd.DataFrame | None = None,
               advice: dict[str, list[str]] | None = None, batch: int = 64, tolerance: float = 0.1) -> str:
    out = ["# kl-bench report", ""]
    for res in results:
        out += [f"## {md_text(res.name)}", *_run_lines(res), ""]
    if advice:
        out += ["## Advice", "", advice_note(batch, tolerance), ""]
        for name, lines in advice.items():
            out += ([f"### {md_text(name)}", ""] if len(advice) > 1 else []) + [f"- {line}" for line in lines] + [""]
    out += ["## Paper table", "", md_table]
    if diffs is not None:
        out += ["## Differences between runs", "", DIFF_NOTE, "", differences_md(diffs), ""]
    bl = baselines_frame(results)
    if bl is not None:
        out += ["## Group baselines", "", BASELINE_NOTE, "",
                frame_md(bl), ""]
    out += ["## Figures", ""]
    for name, caption, by_fmt in figs:
        out += [f"### {md_text(caption)}", "", f"![{md_text(caption)}](figures/{name})", ""]
        links = vector_links(name.removesuffix(".png"), by_fmt)
        out += [links, ""] if links else []
    for res in results:
        heavy = res.summary[res.summary["heavy_tail"] != ""]
        if not heavy.empty:
            out += [f"## Heavy tails ({md_text(res.name)})", ""]
            out += [f"- {md_text(r['case'])}: {md_text(row_label(r))}: {r['heavy_tail']}" for _, r in heavy.iterrows()]
            out.append("")
    return "\n".join(out)


ROW_HEADER = ["case", "row", "target", "true KL", "mean ± SE", "exact mean", "bias/true", "exact", "std/true",
              "exact", "n ±10%", "z", "P(<0)", "heavy tail"]


def row_cells(r) -> list[str]:
    """One summary row for the HTML's table of every row (:data:`ROW_HEADER`), in the vocabulary of the
    tables: each measured value to its SE's precision beside the exact one (formatting.measured_cells),
    bias/true in %, std/true a ratio, n ±10% an integer ("never", "—"), † on every cell that leans on the
    measured SE."""
    from .cells import dagger, pm, unknown_mean
    approx = "≈" if bool(r.get("approx", False)) else ""      # against the Monte Carlo reference
    mean, se, exact_mean = measured_cells(r["mean"], r["se"], r["exact_mean"])
    bias, exact_bias, std, exact_std = bias_std_cells(r)
    mark = dagger(r)
    cells = [pm(mean, se, mark), bias + mark if bias else "", std.split(" ± ")[0] + mark if std else ""]
    if unknown_mean(r):
        cells = ["unknown"] * 3
    return [str(r["case"]), row_label(r), str(r["target"]), approx + sig(r["true_kl"], 4), cells[0], exact_mean,
            cells[1], exact_bias, cells[2], exact_std, batch_cell(r["n_for_10pct"], r["exact_rel_bias"]),
            sig(r["z"], 2) + mark if r["z"] == r["z"] else "", sig(r["frac_negative"], 2), str(r["heavy_tail"] or "")]


def _paper_table_html(cases, rows) -> str:
    table = ["<table class='paper'><tr><th></th>" + "".join(
        "<th colspan='4'>{} ({})</th>".format(*map(html_text, kl_head(title, true))) for _, title, true, _ in cases)
        + "</tr>", "<tr><th>estimator</th>" + "".join(f"<th>{html_text(h)}</th>" for _, _, true, _ in cases
                                                       for h in column_heads(true)) + "</tr>"]
    for label, cells in rows:
        table.append(f"<tr><td>{html_text(label)}</td>" + "".join(f"<td>{html_text(c)}</td>" for cell in cells
                                                                   for c in cell) + "</tr>")
    table.append("</table>")
    return scroll("\n".join(table))


def _report_html(results, df, figs, caption, cases, rows, diffs=None, advice=None, batch: int = 64,
                 tolerance: float = 0.1) -> str:
    parts = []
    for res in results:
        parts.append(f"<h2>{html_text(res.name)}</h2><ul>" + "".join(
            f"<li>{html_inline(line[2:])}</li>" for line in _run_lines(res)) + "</ul>")
    if advice:
        parts.append(f"<h2>Advice</h2><p>{html_inline(advice_note(batch, tolerance))}</p>")
        for name, lines in advice.items():
            parts.append((f"<h3>{html_text(name)}</h3>" if len(advice) > 1 else "") + "<ul class='advice'>"
                         + "".join(f"<li>{html_text(line)}</li>" for line in lines) + "</ul>")
    parts.append("<h2>Paper table</h2>" + _paper_table_html(cases, rows))
    parts.append(f"<p class='caption'>{html_inline(caption)}</p>")
    if diffs is not None:
        parts.append(f"<h2>Differences between runs</h2><p>{html_text(DIFF_NOTE)}</p>" + differences_html(diffs))
    bl = baselines_frame(results)
    if bl is not None:
        parts.append(f"<h2>Group baselines</h2><p>{html_text(BASELINE_NOTE)}</p>" + scroll(bl.to_html(
            index=False, float_format=lambda x: sig(x, 3), na_rep="", border=0, classes="rows").replace("`", "&#96;")))
    parts.append("<h2>Figures</h2>")
    parts += [figure_html(name, cap, by_fmt["png"]) for name, cap, by_fmt in figs]
    parts.append("<h2>All rows</h2>")
    several = len(results) > 1          # one folder: a run column would repeat its name on every row
    header = (["run"] if several else []) + ROW_HEADER
    from .tables import with_reference         # no exact value: against the reference, as the paper table
    body = [([str(r["run"])] if several else []) + row_cells(r) for _, r in with_reference(df).iterrows()]
    parts.append(table_html(header, body))
    return page("kl-bench report", parts)
