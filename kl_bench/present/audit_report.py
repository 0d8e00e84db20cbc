"""The report of an audit folder (``kl-bench report DIR`` where DIR holds audit.csv): per KL term (source),
the logged estimate against the exact value per step with its ±1.96 SE band, the bias split by source
(estimator, sampler, precision, noise), and P(f < 0) logged against its exact value; report.md and a
self-contained report.html with the pooled verdict and every step. Plot functions take audit.csv's
DataFrame and an optional ``ax``, return the figure, and change no global state (Figure objects, no
pyplot); the logged line is drawn in the colour of the trainer's estimator (kl_bench.present.figstyle)."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib.ticker
import pandas as pd
from matplotlib.figure import Figure

from .figstyle import DASHED, estimator_colour, short_label
from .plot_helpers import themed
from ..foundation.formatting import fmt, measured_cells, plural
from .pages import (DEFAULT_FORMATS, figure_bytes, figure_files, figure_html, file_stems, html_text, md_text, page,
                    table_html, table_md, vector_links)
from ..results import folders

# The parts of logged − exact, each with its colour (the estimator's own part: the estimator's colour).
PARTS = [("bias_estimator", "estimator"), ("bias_sampler", "sampler"), ("bias_mismatch", "mismatch"),
         ("bias_formula", "formula"), ("bias_precision", "precision"), ("noise", "noise")]
PART_COLOURS = {"sampler": "#7f7f7f", "mismatch": "#8c564b", "formula": "#d62728", "precision": "#bcbd22",
                "noise": "#c7c7c7"}
EXACT_COLOUR = "black"


def _axes(ax):
    if ax is None:
        fig = Figure(figsize=(6, 4), layout="constrained")
        return fig, fig.add_subplot()
    return ax.figure, ax


def _finish(fig: Figure, ax, steps, ylabel: str, title: str) -> Figure:
    """A per-step figure's step axis, y label, title and legend."""
    _steps_axis(ax, steps)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    return fig


def _steps_axis(ax, steps) -> None:
    """The step axis: the audited steps themselves as ticks (up to 12 of them), else whole numbers."""
    ax.set_xlabel("step")
    steps = sorted(set(int(s) for s in steps))
    if 0 < len(steps) <= 12:
        ax.set_xticks(steps)
    else:
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))


def _estimator(d: pd.DataFrame) -> str:
    return str(d["estimator"].iloc[0]) if "estimator" in d and len(d) else ""


@themed
def plot_logged_vs_exact(df: pd.DataFrame, source: str, ax=None) -> Figure:
    """Per step: the logged estimate, the exact value, and exact ± 1.96 SE (where an honest estimate lies)."""
    fig, ax = _axes(ax)
    d = df[df["source"] == source].sort_values("step")
    ax.fill_between(d["step"], d["exact"] - 1.96 * d["se"], d["exact"] + 1.96 * d["se"], alpha=0.15, lw=0,
                    color=EXACT_COLOUR, label="exact ± 1.96 SE")
    ax.plot(d["step"], d["exact"], lw=2, color=EXACT_COLOUR, label="exact (this step's positions)")
    est = _estimator(d)
    ax.plot(d["step"], d["logged"], marker="o", ls=DASHED, ms=4, color=estimator_colour(est),
            label=f"logged by the trainer ({est})" if est else "logged by the trainer")
    return _finish(fig, ax, d["step"], "KL per the trainer's aggregation", f"{short_label(source)}: logged against exact")


@themed
def plot_bias_split(df: pd.DataFrame, source: str, ax=None) -> Figure:
    """Per step, logged − exact split into its parts: estimator + sampler + mismatch + precision + noise
    (audit.csv files from before the mismatch part have none: 0)."""
    fig, ax = _axes(ax)
    d = df[df["source"] == source].sort_values("step")
    width = 0.8 * (min(d["step"].diff().dropna().min(), 1e9) if len(d) > 1 else 1.0)
    pos = neg = pd.Series(0.0, index=d.index)
    colours = {**PART_COLOURS, "estimator": estimator_colour(_estimator(d))}
    for col, label in PARTS:
        v = d[col].fillna(0.0) if col in d else pd.Series(0.0, index=d.index)
        bottom = pos.where(v >= 0, neg)
        ax.bar(d["step"], v, width, bottom=bottom, label=label, color=colours[label])
        pos, neg = pos + v.clip(lower=0), neg + v.clip(upper=0)
    ax.plot(d["step"], d["bias"], "k.", label="logged − exact")
    ax.axhline(0, color="0.5", lw=0.8)
    return _finish(fig, ax, d["step"], "bias", f"{short_label(source)}: bias by source")


@themed
def plot_negative(df: pd.DataFrame, source: str, ax=None) -> Figure:
    """Per step: the fraction of negative per-token values logged, and its exact probability."""
    fig, ax = _axes(ax)
    d = df[df["source"] == source].sort_values("step")
    ax.plot(d["step"], d["p_negative"], lw=2, color=EXACT_COLOUR, label="exact P(f < 0)")
    ax.plot(d["step"], d["frac_negative"], marker="o", ls=DASHED, ms=4, color=estimator_colour(_estimator(d)),
            label="logged fraction < 0")
    return _finish(fig, ax, d["step"], "per-token probability", f"{short_label(source)}: negative values")


@themed
def plot_audit(df: pd.DataFrame, source: str) -> Figure:
    """The three panels of one source, in the one style of every figure (plot_helpers.themed)."""
    fig = Figure(figsize=(15, 4.2), layout="constrained")
    for fn, ax in zip((plot_logged_vs_exact, plot_bias_split, plot_negative), fig.subplots(1, 3)):
        fn(df, source, ax)
    return fig


def pooled_line(d: pd.DataFrame) -> str:
    """All steps of one source pooled: Σ bias / √Σ se² (steps are independent given the policy)."""
    se = math.sqrt(float((d["se"] ** 2).sum()))
    z = float(d["bias"].sum()) / se if se > 0 else math.nan
    return (f"{plural(len(d), 'step')}, mean logged {fmt(d['logged'].mean(), 4)} against exact "
            f"{fmt(d['exact'].mean(), 4)} (mean bias {fmt(d['bias'].mean(), 4, sign=True)}; pooled z = "
            f"{fmt(z, 2, sign=True)})")


STEP_HEADER = ["step", "logged", "exact", "bias", "se", "z", "logged < 0", "exact P(f < 0)"]


def step_cells(d: pd.DataFrame) -> list[list[str]]:
    """Every step of one source (:data:`STEP_HEADER`)."""
    rows = []
    for r in d.sort_values("step").itertuples():
        bias, se, _ = measured_cells(r.bias, r.se, sign=True)        # the bias to its SE's precision
        rows.append([str(int(r.step)), fmt(r.logged, 4), fmt(r.exact, 4), bias, se, fmt(r.z, 2, sign=True),
                     fmt(r.frac_negative, 3), fmt(r.p_negative, 3)])
    return rows


INTRO = ("The trainer's logged KL against the exact KL of the positions it audited; the bias split into the "
         "estimator's, the sampler's, the mismatch between the pass that drew the tokens and the loss pass, "
         "precision and noise (docs/audit.md).")


def audit_report_files(folder: str | Path, formats=DEFAULT_FORMATS, progress=None) -> dict[str, bytes]:
    """{relative path: bytes}: figures/audit_<source>.<format> (``formats``: PNG by default; PDF, SVG),
    report.md and report.html. ``progress``: told of each figure."""
    stored = folders.read(folder, "audit")            # verified: run.json, every file against its sha256
    folder, df = stored.path, folders.read_table(stored, "audit.csv")
    sources = list(df["source"].unique())
    if progress is not None:
        progress.set_total(len(sources))
    files: dict[str, bytes] = {}
    title = f"Trainer audit: {folder.name}"
    md, parts = [f"# {md_text(title)}\n", INTRO + "\n"], [f"<p>{html_text(INTRO)}</p>"]
    stems = file_stems(sources)         # one file per source, whatever its name (pages.file_stems)
    for source in sources:
        safe = stems[str(source)]
        if progress is not None:
            progress.label(f"audit_{safe}.png")
        d = df[df["source"] == source]
        by_fmt = figure_bytes(plot_audit(df, source), formats)
        files.update(figure_files(f"audit_{safe}", by_fmt))
        links = vector_links(f"audit_{safe}", by_fmt)
        md += [f"## {md_text(source)}\n", pooled_line(d) + "\n", f"![{md_text(source)}](figures/audit_{safe}.png)\n",
               *([links + "\n"] if links else []), table_md(STEP_HEADER, step_cells(d), [True] * len(STEP_HEADER)) + "\n"]
        parts += [f"<h2>{html_text(source)}</h2><p>{html_text(pooled_line(d))}</p>",
                  figure_html(f"audit_{safe}.png", f"{source}: logged against exact, the bias by part, negative values",
                              by_fmt["png"]), table_html(STEP_HEADER, step_cells(d), classes="steps")]
        if progress is not None:
            progress.advance(1)
    files["report.md"] = "\n".join(md).encode()
    files["report.html"] = page(title, parts).encode()
    return files
