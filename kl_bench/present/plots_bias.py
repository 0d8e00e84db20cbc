"""The figures of bias and noise per estimator (:func:`plot_bias_std`: bias/true and std/true with their
95% CIs, exact values as ×) and of batch-size planning (:func:`plot_planning`: the draws for ±10% with 95%
probability)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from ..core.draws import row_label
from ..core.planning import never_words
from ..foundation.formatting import ROUNDING
from .figstyle import figure_styles, short_label
from .plot_helpers import (HEAVY_NOTE, RUN_MARKERS, against, figure_axes, heavy_rows, key_line, legend, log_axis, percent,
                           row_keys, symlog_ticks, themed)


@themed
def plot_bias_std(df: pd.DataFrame, axes=None, title: str = ""):
    """Bias/true (with 95% CI) and std/true (with 95% CI) per estimator of one case; exact values as ×.
    Each point in its estimator's colour; several runs side by side, one marker each. Heavy-tailed rows are
    hollow and their labels end in †: their CIs are not valid.

    ``df``: summary rows of one case (a ``run`` column, if present, separates results folders).
    """
    df = df[df["lambda"].isna()].copy()
    df["label"] = [row_label(r) + (" †" if h else "") for (_, r), h in zip(df.iterrows(), heavy_rows(df))]
    runs = _runs(df)
    fig, axes = figure_axes(axes, 2, 11, 0.45 * df["label"].nunique() + 1.6)
    labels = list(dict.fromkeys(df["label"]))
    y = {lab: i for i, lab in enumerate(labels)}
    styles = figure_styles(row_keys(df))
    offsets = np.linspace(-0.2, 0.2, len(runs)) if len(runs) > 1 else [0.0]
    for k, run in enumerate(runs):
        d = df if run is None else df[df["run"] == run]
        yy = np.array([y[lab] for lab in d["label"]]) + offsets[k]
        colours = [styles[key].color for key in row_keys(d)]
        _bias_std_points(axes, d, yy, colours, RUN_MARKERS[k % len(RUN_MARKERS)], run, first=k == 0)
        if k == 0:
            _bias_std_exact(axes, d, yy)
    _row_labels(axes, labels, [styles[key].color for key in dict.fromkeys(row_keys(df))])
    _bias_std_scales(axes, df)
    legend(axes[1], loc="best", fontsize="small")
    fig.suptitle(title)
    return fig


def _runs(df: pd.DataFrame) -> list:
    """The results folders the rows come from, side by side; [None] for one."""
    return list(dict.fromkeys(df["run"])) if "run" in df and df["run"].nunique() > 1 else [None]


def _row_labels(axes, labels: list[str], colours: list) -> None:
    """The rows' labels down both axes, top first, each in its estimator's colour, as its points."""
    for ax in axes:
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        for tick, colour in zip(ax.get_yticklabels(), colours):
            tick.set_color(colour)


def _bias_std_exact(axes, d: pd.DataFrame, yy: np.ndarray) -> None:
    """The exact bias/true and std/true as black ×, where any exact value exists."""
    if np.isfinite(d[["exact_rel_bias", "exact_rel_std"]].astype(float).to_numpy()).any():
        axes[0].scatter(d["exact_rel_bias"], yy, marker="x", s=70, color="black", zorder=3, label="exact")
        # A std at the float64 rounding of its mean (a constant row: the analytic KL of one context, summed
        # over the vocabulary to 3e-16 of itself) is a std of 0: off the log axis, as an exact 0 is, rather
        # than a point at 1e-16 that squeezes every other row into the axis' last decade.
        std = d["exact_rel_std"].astype(float).replace(np.inf, np.nan)
        axes[1].scatter(std.where(std > ROUNDING), yy, marker="x", s=70, color="black", zorder=3, label="exact")


def _bias_std_points(axes, d: pd.DataFrame, yy: np.ndarray, colours: list, marker: str, run, first: bool) -> None:
    """One run's measured bias/true and std/true with 95% CIs, each row in its estimator's colour (the
    legend's entry in black: it stands for the run); heavy-tailed rows hollow (CIs not valid)."""
    true = np.abs(d["true_kl"].to_numpy(dtype=float))
    # No CI where no scale exists (a true KL of 0: relative values do not exist), rather than an infinite bar.
    scale = np.where(np.isfinite(true) & (true > 0), true, np.nan)
    heavy = heavy_rows(d)
    for i in range(len(d)):
        style = {"mfc": "white", "alpha": 0.8} if heavy[i] else {}
        for ax, value, se in ((axes[0], d["rel_bias"], d["se"]), (axes[1], d["rel_std"], d["std_se"].fillna(0))):
            ax.errorbar(value.iloc[i], yy[i], xerr=1.96 * se.iloc[i] / scale[i], fmt=marker, color=colours[i],
                        capsize=3, ls="none", **style)
    label = run or "measured ± 95% CI"
    for ax in axes:
        ax.add_line(key_line(label, marker=marker, color="black", ls="none"))
        if first and heavy.any():
            ax.add_line(key_line(HEAVY_NOTE, marker="o", color="black", mfc="white", ls="none"))


def _bias_std_scales(axes, df: pd.DataFrame) -> None:
    """Bias: symlog in percent around 0, ticks through the CIs and exact values; std: log."""
    axes[0].axvline(0, color="grey", lw=1)
    ci = 1.96 * df["se"] / df["true_kl"].astype(float)
    bias = pd.concat([df["rel_bias"], df["exact_rel_bias"], df["rel_bias"] - ci, df["rel_bias"] + ci])
    bias = bias.astype(float).replace([np.inf, -np.inf], np.nan).dropna()
    lt = 1e-3
    axes[0].set_xscale("symlog", linthresh=lt)
    if not bias.empty:
        symlog_ticks(axes[0], float(bias.min()), float(bias.max()), lt, max_ticks=5, formatter=percent)
    axes[0].tick_params(axis="x", labelsize="small")
    axes[0].set_xlabel(f"bias / {against(df)}  (symlog; 0 = unbiased)")
    stds = pd.concat([df["rel_std"], df["exact_rel_std"]]).astype(float).replace([np.inf, -np.inf], np.nan).dropna()
    stds = stds[stds > ROUNDING]                    # as the exact points: a rounding-level std is a 0
    if log_axis(axes[1], "x", f"per-draw std / {against(df)}") and not stds.empty:
        axes[1].set_xlim(stds.min() / 2, stds.max() * 2)


@themed
def plot_planning(summary: pd.DataFrame, ax=None, title: str = ""):
    """Draws a batch needs for its mean to be within 10% of the true KL with 95% probability: one group of
    bars per case, one bar per row in its estimator's colour (hatched: a per-token aggregate). A row that
    never gets there (its bias alone exceeds 10%, or its variance is infinite) keeps its place, marked
    "never"; a row with no exact bias (a Monte Carlo reference) is left out: the measured bias cannot
    decide it."""
    df = summary[summary["lambda"].isna()].copy()
    if "exact_rel_bias" in df:
        df = df[np.isfinite(df["exact_rel_bias"].astype(float))]
    df["label"] = [row_label(r) for _, r in df.iterrows()]
    cases = list(dict.fromkeys(df["case"]))
    fig, ax = figure_axes(ax, width=8, height=0.28 * (len(df) + len(cases)) + 1.5)
    styles = figure_styles(row_keys(df))
    n = df["n_for_10pct"].astype(float).to_numpy()
    finite = n[np.isfinite(n) & (n > 0)]
    never_at = float(finite.max()) * 1.5 if finite.size else 10.0
    y, ticks, names = 0.0, [], []
    for case in cases:
        rows = df[df["case"] == case]
        ticks.append(y + (len(rows) - 1) / 2)
        names.append(short_label(case, 32))        # a long name would squeeze the bars off the figure
        for (_, r), key in zip(rows.iterrows(), row_keys(rows)):
            v = float(r["n_for_10pct"])
            st = styles[key]
            if math.isfinite(v) and v > 0:
                ax.barh(y, v, height=0.8, color=st.color, hatch="///" if key[1] not in ("", "seq") else None,
                        edgecolor="white", label=r["label"])
                ax.text(v, y, f" {r['label']}", va="center", fontsize="x-small")
            else:
                ax.text(1.0, y, f" {r['label']}: never", va="center", fontsize="x-small", color=st.color)
            y += 1
        y += 1                      # a gap between cases
    ax.set_yticks(ticks, names)
    ax.set_ylim(y - 1, -1)            # every slot inside, bar or "never" (top to bottom)
    ax.set_xscale("log")
    ax.set_xlim(0.8, max(never_at, 10.0) * 4)
    never = (never_words(df.to_dict("records")) or "n/a").replace(" or ", ",\nor ")      # one reason a line
    ax.set_xlabel(f"draws for ±10% error with 95% probability  (log)\nnever: {never}")
    ax.set_title(title)
    return fig
