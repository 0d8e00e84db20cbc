"""The report's figures: a registry of figure kinds (:data:`FIGURES`, :func:`figure`), each choosing its
panels from the results (:class:`FigureContext` → :class:`Panel`), drawn by a kl_bench.present.plots
function and saved in each format asked for (:func:`build_figures`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd

from ..core.draws import row_key, row_label
from ..foundation.registry import Registry
from ..results import SWEEP_PREFIX
from ..results.reservoir import reservoir_key
from .cells import with_reference
from .figstyle import short_label
from .pages import figure_bytes as pages_figure_bytes, file_stems, unique_files
from .report_data import Results


FIGURE_FORMATS = ("png",)     # the default of `kl-bench report --formats`: PNG, which the pages show


def figure_bytes(fig, formats=None) -> dict[str, bytes]:
    """{format: the figure saved in it} (PNG at 110 dpi; ``formats``: default FIGURE_FORMATS; PDF and SVG
    for a paper, with no dates, so the bytes repeat), then the figure is closed."""
    return pages_figure_bytes(fig, formats or FIGURE_FORMATS)


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
            draws = pd.concat(parts, ignore_index=True)
            # the shading exists only where some estimate is negative (KL = 0: every draw is 0, nothing shaded)
            shaded = " (negative region shaded)" if bool((draws["value"] < 0).any()) else " (no negative estimate)"
            yield Panel(f"{ctx.prefix}distribution_{ctx.stem(case)}.png",
                        f"{case}: per-draw distribution of each estimator (ECDF)",
                        f"{short_label(case)}: per-draw estimates{shaded}", draws)


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
    panels = [(kind, p) for ctx in _contexts(results, df) for kind in FIGURES.values()
              if kind.per_run == (ctx.res is not None) for p in kind.panels(ctx)]
    # A file name made of parts (a run, a case, an aggregate) can still meet another: one file per figure.
    files = unique_files([p.file for _, p in panels], [p.caption for _, p in panels])
    return [(kind, replace(p, file=f)) for (kind, p), f in zip(panels, files)]


def _contexts(results: list[Results], df: pd.DataFrame) -> list[FigureContext]:
    """What the figures over all runs see, then what each run's see."""
    # Cases without an exact value (model continuations, logged log-probs) are plotted against their
    # Monte Carlo reference (ref_kl), as the tables show them.
    df = with_reference(df)
    # Cases made by [[sweep]] tables are shown against their swept keys, not one figure set per case
    # (a 12 × 3 grid would otherwise make a hundred figures).
    swept_keys = [c for c in df.columns if c.startswith(SWEEP_PREFIX)]
    swept = set(df.loc[df[swept_keys].notna().any(axis=1), "case"]) if swept_keys else set()
    top = FigureContext(results, df, swept, stems=_stems(results, df, swept_keys))
    runs = file_stems(res.name for res in results)          # a run's figures are prefixed with its name
    return [top] + [FigureContext(results, df, swept, res, with_reference(res.summary),
                                  f"{runs[res.name]}_" if len(results) > 1 else "", top.stems) for res in results]


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
