"""The figures against a swept value: std/true of the control variate cv(λ) against λ
(:func:`plot_lambda_curve`), and std/true and bias/true against a [[sweep]] table's key (:func:`plot_sweep`)."""
from __future__ import annotations

import math

import matplotlib.ticker
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..core.draws import row_label
from .figstyle import DASHED, Style, estimator_colour, figure_styles
from .plot_helpers import (HEAVY_NOTE, figure_axes, heavy_rows, key_line, label_key, legend, log_axis, percent,
                           symlog_axis_ticks, themed)


@themed
def plot_lambda_curve(sweep: pd.DataFrame, ax=None, title: str = ""):
    """std/true of cv(λ) = −log r + λ(r−1) against λ: exact line, measured dashed, λ* and k1/k3 marked.

    ``sweep``: lambda_sweep.csv rows of one case and aggregate.
    """
    fig, ax = figure_axes(ax)
    s = sweep.sort_values("lambda")
    cv = estimator_colour("cv")          # the curve is cv(λ)'s; its λ = 0 and 1 points are k1's and k3's
    exact = s["exact_rel_std"].replace(np.inf, np.nan)
    # a lone finite point (λ = 0 where every other λ's variance is infinite) draws no line: its dot says it
    ax.plot(s["lambda"], exact, color=cv, lw=2, label="exact" if exact.notna().sum() >= 2 else None)
    ax.plot(s["lambda"], s["rel_std"], color="black", lw=1.5, ls=DASHED, label="measured (one pass)")
    _infinite_spans(ax, s)
    star = float(s["lambda_star"].iloc[0])
    if math.isfinite(star):
        ax.axvline(star, color=estimator_colour("cv_opt"), lw=1.5, label=f"λ* = {star:.3g}")
    for lam, name, color in ((0.0, "k1 (λ=0)", estimator_colour("k1")), (1.0, "k3 (λ=1)", estimator_colour("k3"))):
        hit = s[s["lambda"] == lam]
        if not hit.empty:
            v = hit["exact_rel_std"].iloc[0]
            v = hit["rel_std"].iloc[0] if not np.isfinite(v) else v
            ax.scatter([lam], [v], s=90, color=color, zorder=4, label=name, edgecolor="black")
    log_axis(ax, "y", "per-draw std / true KL")
    ax.set_xlabel("λ")
    ax.set_title(title)
    legend(ax, fontsize="small")
    return fig


def _infinite_spans(ax, s: pd.DataFrame) -> None:
    """Shade the λ where the exact variance is infinite (E_q[r²] diverges: a heavy-tailed p): there no exact line
    exists, and the measured std, however smooth it looks, estimates nothing (it grows without bound with the
    draws). Each run of such λ is shaded from midway to its finite neighbours."""
    lam = s["lambda"].to_numpy(dtype=float)
    inf = np.isinf(s["exact_rel_std"].to_numpy(dtype=float))
    if not inf.any():
        return
    edges = np.concatenate([[lam[0] - (lam[1] - lam[0]) / 2 if len(lam) > 1 else lam[0] - 0.5],
                            (lam[1:] + lam[:-1]) / 2,
                            [lam[-1] + (lam[-1] - lam[-2]) / 2 if len(lam) > 1 else lam[-1] + 0.5]])
    label = "exact std infinite:\nmeasured not valid"
    i = 0
    while i < len(lam):
        if inf[i]:
            j = i
            while j + 1 < len(lam) and inf[j + 1]:
                j += 1
            ax.axvspan(edges[i], edges[j + 1], color="red", alpha=0.1, lw=0, label=label)
            label = None
            i = j + 1
        else:
            i += 1
    if inf.all():
        ax.text(0.5, 0.97, "the exact variance is infinite at every λ: no exact line, and the measured std "
                "estimates nothing", transform=ax.transAxes, ha="center", va="top", fontsize="small", color="darkred")


@themed
def plot_sweep(summary: pd.DataFrame, key: str, axes=None, title: str = ""):
    """std/true (log) and bias/true (asinh: linear within ±1%, logarithmic beyond) against one swept case key,
    one line per estimator: measured as markers joined by a thin line, exact as a broad pale band of the same
    colour under it (a dashed exact line of the same colour vanished under the measured one wherever the two
    agree, which is everywhere they should).

    ``summary``: summary rows of the cases of a [[sweep]] (``key``: one of its ``sweep.*`` columns). When
    the sweep has other keys, each of their value combinations gets its own row of panels (at most 4; with
    more, only the middle combination is shown and the title says so).
    """
    df = summary[summary["lambda"].isna() & summary[key].notna()].copy()
    df["label"] = [row_label(r) for _, r in df.iterrows()]
    others, combos, note = _sweep_rows(df, key)
    if axes is None:
        fig = Figure(figsize=(11, 3.4 * len(combos) + 0.8), layout="constrained")
        axes = fig.subplots(len(combos), 2, squeeze=False)
    else:
        fig = np.atleast_1d(axes).ravel()[0].figure
        axes = np.atleast_1d(axes).reshape(-1, 2)
    x_all = df[key]
    numeric = pd.api.types.is_numeric_dtype(x_all)
    # Text values sit at evenly spaced positions, in order of appearance.
    positions = None if numeric else {v: i for i, v in enumerate(dict.fromkeys(x_all))}
    labels = list(dict.fromkeys(df["label"]))
    styles = figure_styles([label_key(label) for label in labels])
    for i, combo in enumerate(combos):
        part = df
        for k, v in zip(others, combo):
            part = part[part[k] == v]
        for label in labels:
            d = part[part["label"] == label].sort_values(key)
            x = d[key].to_numpy(dtype=float) if numeric else d[key].map(positions).to_numpy(dtype=float)
            _sweep_line(axes[i], x, d, label, styles[label_key(label)])
        _sweep_axes(axes[i], key, _setting(others, combo), x_all, positions)
    _sweep_legend(fig, labels, styles, heavy_rows(df).any())
    fig.suptitle(title + note)
    return fig


def _sweep_legend(fig, labels: list[str], styles: dict, heavy: bool) -> None:
    """One legend under the panels (beside them it would run under the title): the estimators, then what
    a solid line with markers, a dashed line and a hollow marker mean."""
    handles = [key_line(label, color=styles[label_key(label)].color, marker=styles[label_key(label)].marker, lw=1.2)
               for label in labels]
    handles += [key_line("measured ± 95% CI", color="black", marker="o", lw=1.2),
                key_line("exact (pale band)", color="black", lw=EXACT_BAND, alpha=EXACT_ALPHA)]
    if heavy:
        handles.append(key_line(HEAVY_NOTE.replace("\n", " "), color="black", marker="o", mfc="white", ls="none"))
    legend(fig, handles, [h.get_label() for h in handles], loc="outside lower center", fontsize="small",
            ncol=min(len(handles), 6))


def _sweep_rows(df: pd.DataFrame, key: str) -> tuple[list[str], list[tuple], str]:
    """(the other swept keys, their value combinations to draw (a row each), a title note): at most 4
    rows; with more, only the middle combination, and the note says which."""
    others = [c for c in df.columns if c.startswith("sweep.") and c != key and df[c].notna().any()]
    combos = list(dict.fromkeys(tuple(r) for r in df[others].itertuples(index=False))) if others else [()]
    if len(combos) <= 4:
        return others, combos, ""
    mid = combos[len(combos) // 2]
    return others, [mid], f" (at {_setting(others, mid)})"


def _setting(keys: list[str], values: tuple) -> str:
    """'noise = 0.1, temperature = 0.8' for swept keys and their values."""
    return ", ".join(f"{k.removeprefix('sweep.')} = {v:g}" if isinstance(v, float) else
                     f"{k.removeprefix('sweep.')} = {v}" for k, v in zip(keys, values))


EXACT_BAND, EXACT_ALPHA = 6.0, 0.3       # the exact line: a broad pale band that shows around the measured line
BIAS_LINEAR = 0.01                      # bias/true is linear within ±1% on its asinh axis, logarithmic beyond


def _sweep_line(row_axes, x: np.ndarray, d: pd.DataFrame, label: str, style: Style) -> None:
    """One estimator's std/true and bias/true: measured with markers and 95% CIs on top, exact as a broad pale
    band beneath (seen around the measured line where they agree); heavy-tailed points hollow (their CIs are
    not valid)."""
    color, marker = style.color, style.marker
    true = d["true_kl"].abs().to_numpy(dtype=float)
    true = np.where(np.isfinite(true) & (true > 0), true, np.nan)     # no CI where no scale exists (KL = 0)
    heavy = heavy_rows(d)
    for ax, measured, se, exact in ((row_axes[0], d["rel_std"], d["std_se"], d["exact_rel_std"]),
                                    (row_axes[1], d["rel_bias"], d["se"], d["exact_rel_bias"])):
        y = measured.to_numpy(dtype=float)
        ci = 1.96 * se.fillna(0).to_numpy(dtype=float) / true
        ax.plot(x, exact.replace([np.inf, -np.inf], np.nan).to_numpy(dtype=float), color=color, lw=EXACT_BAND,
                alpha=EXACT_ALPHA, solid_capstyle="round", zorder=1)
        ax.plot(x, y, color=color, lw=1.2, zorder=3)
        ax.errorbar(x[~heavy], y[~heavy], yerr=ci[~heavy], fmt=marker, ms=4, color=color, capsize=2, lw=0.8, zorder=3)
        if heavy.any():
            ax.errorbar(x[heavy], y[heavy], yerr=ci[heavy], fmt=marker, ms=5, color=color, mfc="white", capsize=2,
                        lw=0.8, alpha=0.8, zorder=3)


def _sweep_axes(row_axes, key: str, row_title: str, x_all: pd.Series, positions: dict | None) -> None:
    """Scales, labels and ticks of one row of a sweep figure (std: log; bias: symlog in percent)."""
    ax_std, ax_bias = row_axes
    log_axis(ax_std, "y", "per-draw std / true KL")
    # Bias on an asinh axis: linear within ±1% (no spike at 0 to make noise read as structure, as symlog's kink
    # did), logarithmic beyond, so that k1's ±2,500% does not flatten k2's, k3's and fwd_k3's few percent.
    ax_bias.axhline(0, color="grey", lw=1)
    drawn = [np.asarray(line.get_ydata(), dtype=float) for line in ax_bias.get_lines()]
    symlog_axis_ticks(ax_bias, np.concatenate(drawn) if drawn else np.zeros(1), BIAS_LINEAR, percent)
    ax_bias.set_ylabel("bias / true KL  (± 95% CI; asinh)")
    wide = positions is None and (x_all > 0).all() and x_all.max() / x_all.min() >= 20
    for ax in (ax_std, ax_bias):
        if row_title:
            ax.set_title(row_title, fontsize="medium")
        if wide:
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        elif positions is not None:
            ax.set_xticks(range(len(positions)), [str(v) for v in positions])
        ax.set_xlabel(key.removeprefix("sweep."))
