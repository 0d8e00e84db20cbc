"""The figures of rollouts and gradients: std/true against the sequence length T (:func:`plot_rollout_growth`),
and the expected cosine of a batch-mean gradient with ∇KL(q‖p) against the batch size, per estimator × mode
(:func:`plot_gradient_cosine`)."""
from __future__ import annotations

import math

import matplotlib.ticker
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..core.draws import row_label
from ..core.modes import MODES
from .figstyle import figure_styles, row_style
from .plot_helpers import figure_axes, label_key, layered, legend, log_axis, row_keys, themed


def _growth_lines(ax, df: pd.DataFrame, styles: dict) -> bool:
    """One line per row against T: exact with the row's line and marker and a × for the measured value, or
    (no exact value: model continuations) the measured values with the row's hollow markers. Rows that
    coincide (seq k1 and tok k1 are one value) are layered: the first wider, the next narrower on top.
    Whether any row had an exact line."""
    parts = [d.sort_values("T") for _, d in df.groupby("label", sort=False)]
    exact = [bool(np.isfinite(d["exact_rel_std"].astype(float)).any()) for d in parts]
    shown = [np.log10(np.maximum((d["exact_rel_std"] if e else d["rel_std"]).replace(np.inf, np.nan)
                                 .to_numpy(dtype=float), 1e-300)) for d, e in zip(parts, exact)]
    grid = sorted(set(df["T"]))
    curves = [np.interp(grid, d["T"], y, left=np.nan, right=np.nan) if len(d) else np.full(len(grid), np.nan)
              for d, y in zip(parts, shown)]
    layers = layered(curves, 0.02, wide=4.5, thin=1.6)
    for d, e, (lw, dash) in zip(parts, exact, layers):
        label, st = d["label"].iloc[0], styles[row_keys(d)[0]]
        if e:
            ax.plot(d["T"], d["exact_rel_std"].replace(np.inf, np.nan), lw=lw, label=label,
                    **{**st.kwargs(), "ls": st.ls if dash == "-" else dash})
            ax.scatter(d["T"], d["rel_std"], color=st.color, marker="x", s=50, zorder=3)
        else:
            ax.plot(d["T"], d["rel_std"], lw=min(lw, 0.8), ms=7, mfc="none", mew=1.6, label=label, **st.kwargs())
    return any(exact)


@themed
def plot_rollout_growth(summary: pd.DataFrame, lengths: dict[str, int], ax=None, title: str = ""):
    """Rollouts: exact std/true (lines) and measured (markers) against T, log-log, per estimator and
    aggregation. ``summary``: rows of rollout cases that differ only in their length T."""
    df = summary[summary["lambda"].isna() & summary["case"].isin(lengths)].copy()
    df["T"] = df["case"].map(lengths)
    df["label"] = [row_label(r) for _, r in df.iterrows()]
    # The legend sits beside the axes, one line per row: the figure grows with it.
    fig, ax = figure_axes(ax, width=9.5, height=max(4.0, 0.24 * (df["label"].nunique() + 2)))
    styles = figure_styles(row_keys(df))
    any_exact = _growth_lines(ax, df, styles)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("sequence length T  (log)")
    if any_exact:
        log_axis(ax, "y", "per-rollout std / true KL")
        ax.set_title(title + "\n(lines: exact; ×: measured)")
    else:       # no exact value: measured against the Monte Carlo reference, no lines to announce
        log_axis(ax, "y", "per-rollout std / reference")
        ax.set_title(title + "\n(measured; reference: the full mean, Monte Carlo)")
    legend(ax, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


_STYLES = ["-", "--", ":", "-."]


@themed
def plot_gradient_cosine(grads: pd.DataFrame, ax=None, title: str = ""):
    """Expected cosine of a batch-mean gradient with ∇KL(q‖p) against the batch size, per estimator ×
    mode: cos_n ≈ (m·u)/√(|m|² + tr Σ / n) with the exact mean m (u the unit reverse-KL gradient) and
    the exact trace of the per-draw covariance, or the measured one where none exists (rollouts; the
    title then says so).

    Faceted by mode: one panel per mode, each estimator in its own colour (the same in every panel), one
    legend. Given a single ``ax`` (or fewer axes than modes), every line is drawn there, coloured by
    estimator and styled by mode, so that no two lines look alike."""
    g = grads[np.isfinite(grads["exact_along_reverse"].astype(float))].copy()
    g["est_label"] = [row_label(r, aggregate=False) for _, r in g.iterrows()]
    order = list(MODES)           # the modes' table order; a mode it does not know goes last
    modes = sorted(dict.fromkeys(g["mode"]), key=lambda m: (order.index(m) if m in order else len(order), m))
    modes = modes or [""]
    fig, panels = _mode_panels(ax, len(modes))
    faceted = len(panels) >= len(modes) and len(modes) > 1
    handles, measured = _cosine_lines(g, panels, modes, faceted)
    used = panels[:len(modes)] if faceted else panels[:1]
    _cosine_axes(used, modes if faceted else None, handles)
    for p in panels[len(used):]:
        p.set_visible(False)
    if measured:
        title += "\n(exact mean gradient, measured per-draw variance)"
    _cosine_labels(fig, used, handles, title, faceted, own_figure=ax is None)
    return fig


def _cosine_axes(used: list, modes: list[str] | None, handles: dict) -> None:
    """The cos = 0.9 line, a log batch axis, a y range shared by the panels, and (``modes``: faceted)
    each panel's mode as its title."""
    for k, p in enumerate(used):
        handles.setdefault("cos = 0.9", p.axhline(0.9, color="grey", lw=1, ls=":", label="cos = 0.9"))
        p.set_xscale("log")
        if modes is not None:
            words = MODES[modes[k]].label if modes[k] in MODES else ""
            p.set_title(f"mode: {modes[k]}" + (f"\n({words})" if words else ""), fontsize="medium")
    lows = [float(np.nanmin(line.get_ydata())) for p in used for line in p.get_lines()
            if len(np.atleast_1d(line.get_ydata())) > 2 and np.isfinite(line.get_ydata()).any()]
    for p in used:
        p.set_ylim(min([-0.05, *lows]) - 0.05, 1.05)


def _mode_panels(ax, n_modes: int):
    """(figure, axes list): one panel per mode on a new figure (two columns), or the given axes."""
    if ax is not None:
        panels = list(np.atleast_1d(ax).ravel())
        return panels[0].figure, panels
    ncols = min(2, n_modes)
    nrows = int(np.ceil(n_modes / ncols))
    fig = Figure(figsize=(4.6 * ncols + 2.2, 3.3 * nrows + 0.8), layout="constrained")
    return fig, list(np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True)).ravel())


def _cosine_lines(g: pd.DataFrame, panels: list, modes: list[str], faceted: bool) -> tuple[dict, bool]:
    """Draw cos_n ≈ (m·u)/√(|m|² + tr Σ / n) of every row; ({legend label: line}, whether a measured trace
    stood in for a missing exact one). Faceted: a panel per mode, a colour (and style) per estimator;
    else one panel, coloured by estimator and styled by mode."""
    ests = list(dict.fromkeys(g["est_label"]))
    looks = figure_styles([(e,) for e in ests], lambda e: row_style(label_key(e)[0]))
    colour = {e: looks[(e,)].color for e in ests}
    est_style = {e: looks[(e,)].ls for e in ests}
    n = np.logspace(0, 7, 200)
    measured = False
    handles: dict[str, object] = {}
    for _, r in g.iterrows():
        trace = r["exact_trace_cov"]
        if not math.isfinite(trace):
            trace, measured = r["trace_cov"], True
        cos = r["exact_along_reverse"] / np.sqrt(r["exact_norm"] ** 2 + trace / n)
        if faceted:
            target, ls, label = panels[modes.index(r["mode"])], est_style[r["est_label"]], r["est_label"]
        else:
            k = modes.index(r["mode"]) if r["mode"] in modes else 0
            target, ls, label = panels[0], _STYLES[k % len(_STYLES)], f"{r['est_label']} {r['mode']}"
        (line,) = target.plot(n, cos, color=colour[r["est_label"]], ls=ls, lw=1.8, label=label)
        handles.setdefault(label, line)
    return handles, measured


def _cosine_labels(fig, used: list, handles: dict, title: str, faceted: bool, own_figure: bool) -> None:
    """Axis labels, title and the one legend: beside the figure when faceted on its own figure."""
    xlabel, ylabel = "batch size n  (log)", "expected cos(batch-mean gradient, ∇KL(q‖p))"
    if faceted and own_figure:
        fig.supxlabel(xlabel)
        fig.supylabel(ylabel)
        fig.suptitle(title)
        # under the panels: beside them a long title would run under the legend
        legend(fig, list(handles.values()), list(handles), fontsize="small", loc="outside lower center",
                ncol=min(len(handles), 6))
        return
    for p in used:
        p.set_xlabel(xlabel, fontsize="small" if faceted else None)
    used[0].set_ylabel(ylabel)
    (fig.suptitle if faceted else used[0].set_title)(title)
    legend(used[-1], list(handles.values()), list(handles), fontsize="x-small", ncol=1 if faceted else 2,
            loc="upper left", bbox_to_anchor=(1.01, 1.0))
