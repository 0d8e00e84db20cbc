"""The figures of the draws themselves: each estimator's per-draw distribution as an ECDF on a symlog axis
(:func:`plot_distribution`), and the running estimate against the draws with its ±2 SE band
(:func:`plot_convergence`)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from ..core.draws import row_label
from .figstyle import DASHED, DOTTED, figure_styles, row_style
from .plot_helpers import (DistinctTicks, figure_axes, heavy_rows, key_line, label_key, layered, legend, symlog_ticks,
                           themed)


def _symlog(x: np.ndarray, linthresh: float) -> np.ndarray:
    """Where x falls on a symlog axis (linear within ±linthresh, logarithmic outside), up to a scale."""
    return np.sign(x) * np.log10(1 + np.abs(x) / linthresh)


def _quantiles(v: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """``v``'s quantiles at ``levels``, interpolated where every value is finite; with infinite or NaN draws,
    the draws themselves (no interpolation between ±inf) and NaN where a quantile is not finite (it is off
    the axis)."""
    if np.isfinite(v).all():
        return np.quantile(v, levels)
    v = v[~np.isnan(v)]                     # NaN has no place in an order (one made every quantile NaN)
    if not len(v):
        return np.full(len(levels), np.nan)
    q = np.quantile(v, levels, method="inverted_cdf")
    return np.where(np.isfinite(q), q, np.nan)


def _ecdf_lines(ax, values: dict[str, np.ndarray], linthresh: float) -> list:
    """Draw every ECDF (layered where lines coincide on the symlog axis, :func:`layered`), with markers at
    staggered quantiles; the legend's keys, one per line."""
    levels = np.linspace(0.01, 0.99, 99)
    curves = [_symlog(_quantiles(v, levels), linthresh) if len(v) else np.full(len(levels), np.nan)
              for v in values.values()]
    span = np.nanmax([np.nanmax(np.abs(c)) for c in curves] + [1.0]) * 2
    layers = layered(curves, 0.012 * span)
    styles = figure_styles([label_key(label) for label in values])
    handles = []
    for k, (label, v) in enumerate(values.items()):
        x = np.sort(v)
        y = np.arange(1, len(x) + 1) / max(len(x), 1)
        st, (lw, dash) = styles[label_key(label)], layers[k]
        ax.step(x, y, where="post", color=st.color, ls=dash, lw=lw, label=label, zorder=2 + k)
        # markers at quantiles 0.1, 0.3, ..., shifted by each line's rank: two lines never share a marker
        at = np.clip(((np.arange(0.1, 1.0, 0.2) + 0.04 * k) * len(x)).astype(int), 0, max(len(x) - 1, 0))
        if len(x):
            ax.plot(x[at], y[at], ls="none", marker=st.marker, color=st.color, mec="white", mew=0.6, ms=6, zorder=2 + k)
        handles.append(key_line(label, color=st.color, ls=dash, lw=min(lw, 3.0), marker=st.marker, mec="white", ms=6))
    return handles


def _ecdf_axis(values: dict[str, np.ndarray]) -> tuple[float, float, float]:
    """(lowest, highest, the symlog axis's linear threshold) of the finite values."""
    shown = {label: v[np.isfinite(v)] for label, v in values.items()}
    lo = min((float(np.min(v)) for v in shown.values() if len(v)), default=-1.0)
    hi = max((float(np.max(v)) for v in shown.values() if len(v)), default=1.0)
    finite = np.concatenate([np.abs(v[v != 0]) for v in shown.values()] or [np.ones(1)])
    # The linear zone of the symlog axis: a decade boundary below most |values| (5th percentile).
    return lo, hi, 10.0 ** np.floor(np.log10(np.quantile(finite, 0.05))) if finite.size else 1e-3


@themed
def plot_distribution(draws: pd.DataFrame, ax=None, title: str = ""):
    """ECDF of each estimator's per-draw value on a symlog axis; the negative region is shaded. Each line
    in its estimator's colour with its aggregate's markers (at staggered quantiles); lines that coincide to
    the eye (k3 and fwd_k3 at small KL) are layered: the first drawn widest and solid, the next narrower and
    dashed on top of it, so that every one stays visible.

    ``draws``: one row per draw, columns ``label`` (the row's label) and ``value`` (its per-draw value)."""
    values = {label: part["value"].to_numpy(dtype=float) for label, part in draws.groupby("label", sort=False)}
    # The legend sits beside the axes, one line per estimator: the figure grows with it (or it squeezes the axes).
    fig, ax = figure_axes(ax, width=9, height=max(4.0, 0.24 * (len(values) + 2)))
    # Limits from the finite values: a draw with log r = ±inf (p = 0 where q > 0) has an infinite estimate,
    # which the ECDF reaches at ±inf (off the axis): said in a note under the axes.
    lo, hi, linthresh = _ecdf_axis(values)
    handles = _ecdf_lines(ax, values, linthresh)
    if lo < 0:
        handles.append(ax.axvspan(min(lo, -linthresh) * 3, 0, color="red", alpha=0.08, label="negative estimates"))
    ax.set_xscale("symlog", linthresh=linthresh)
    symlog_ticks(ax, min(lo, 0.0), hi, linthresh)
    ax.tick_params(axis="x", labelsize="small")
    off = sum(int(np.sum(~np.isfinite(v))) for v in values.values())
    ax.set_xlabel("per-draw estimate  (symlog)" + (f"; {off:,} infinite or NaN draws off the axis" if off else ""))
    ax.set_ylabel("fraction of draws ≤ x  (ECDF)")
    ax.set_title(title)
    legend(ax, handles, [h.get_label() for h in handles], fontsize="small", loc="upper left",
            bbox_to_anchor=(1.01, 1.0))
    return fig


def _running(b: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(draws so far, running mean, running batch-means SE) after each of a row's batches, in batch order."""
    n = b["draws"].to_numpy(dtype=float)
    m = b["batch_mean"].to_numpy(dtype=float)
    cum_n = np.cumsum(n)
    run_mean = np.cumsum(n * m) / cum_n
    k_idx = np.arange(1, len(m) + 1)
    # Running batch-means SE: spread of the batch means so far around the running mean, / √(batches − 1).
    with np.errstate(invalid="ignore"):                   # inf − inf where a batch mean is infinite: NaN
        sq = np.cumsum(n * m * m) / cum_n - run_mean**2
    return cum_n, run_mean, np.sqrt(np.maximum(sq, 0) / np.maximum(k_idx - 1, 1))


def _convergence_panel(ax, batches: pd.DataFrame, r) -> bool:
    """One row's panel of :func:`plot_convergence`; whether the row is biased (its exact mean drawn)."""
    sel = (batches["estimator"] == r["estimator"]) & (batches["aggregate"].fillna("") == (r["aggregate"] or "")) \
        & batches["lambda"].isna()
    cum_n, run_mean, se = _running(batches[sel].sort_values("batch"))
    color = row_style(r["estimator"], r["aggregate"]).color
    ax.plot(cum_n, run_mean, color=color, lw=1.5)
    heavy = bool(heavy_rows(pd.DataFrame([r]))[0])
    ax.fill_between(cum_n[1:], (run_mean - 2 * se)[1:], (run_mean + 2 * se)[1:], color=color, alpha=0.2,
                    hatch="//" if heavy else None)
    if math.isfinite(r["true_kl"]):
        ax.axhline(r["true_kl"], color="black", lw=1.6, ls=DOTTED, dash_capstyle="round", label="true KL")
    biased = math.isfinite(r["exact_mean"]) and not math.isclose(r["exact_mean"], r["true_kl"], rel_tol=1e-6)
    if biased:
        ax.axhline(r["exact_mean"], color="grey", lw=1.2, ls=DASHED, label="exact mean (biased)")
    ax.set_xscale("log")
    ax.yaxis.set_major_formatter(DistinctTicks())
    # A heavy tail: the band is drawn from an SE that is not valid (hatched, and the title says so).
    ax.set_title(row_label(r) + ("  † heavy tail: band not valid" if heavy else ""), fontsize="medium")
    ax.tick_params(labelsize="small")
    ax.set_xlabel("draws  (log)", fontsize="small")      # per panel: a figure-wide one ran into the legend
    return biased


@themed
def plot_convergence(batches: pd.DataFrame, summary: pd.DataFrame, axes=None, title: str = ""):
    """Running estimate against draws, one panel per estimator: ±2 SE band (batch means so far), the
    true KL (dotted) and, for biased estimators, their exact mean (dashed); one legend under the panels (inside
    a panel it sat over the true KL's line), and y labels with as few digits as tell them apart.

    ``batches``: batches.csv rows of one case; ``summary``: its summary rows.
    """
    keep = [r for _, r in summary[summary["lambda"].isna()].iterrows()]
    ncols = min(3, max(1, len(keep)))
    nrows = int(np.ceil(len(keep) / ncols)) or 1
    if axes is None:
        fig = Figure(figsize=(4.2 * ncols, 2.8 * nrows), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False, sharex=True)
    else:
        fig = np.atleast_1d(axes).ravel()[0].figure
    flat = np.atleast_1d(axes).ravel()
    any_biased = False
    for k, r in enumerate(keep):
        any_biased |= _convergence_panel(flat[k], batches, r)
    handles = [key_line("running estimate, ±2 SE band", color="grey", lw=1.5),
               key_line("true KL", color="black", lw=1.6, ls=DOTTED, dash_capstyle="round")]
    if any_biased:
        handles.append(key_line("exact mean (biased)", color="grey", lw=1.2, ls=DASHED))
    if len(keep):
        legend(fig, handles, [h.get_label() for h in handles], loc="outside lower center", fontsize="small",
               ncol=len(handles))
    for ax in flat[len(keep):]:
        ax.set_visible(False)
    fig.supylabel("running estimate (±2 SE)")
    fig.suptitle(title)
    return fig
