"""What the plot functions of kl_bench.present (plots_bias, plots_sweep, plots_distribution, plots_rollout)
share: the report's look applied only while a figure is built (:func:`themed`, :data:`THEME`), a new figure
or the given axes (:func:`figure_axes`), log and symlog axes with plain labels (:func:`log_axis`,
:func:`symlog_ticks`, :func:`percent`), a legend of only what is drawn (:func:`legend`, :func:`key_line`),
lines layered where they coincide (:func:`layered`), and what a row is (:func:`row_keys`, :func:`label_key`,
:func:`heavy_rows`, :func:`against`).

Importing this module changes no global state: no backend is selected and neither matplotlib's rcParams
nor seaborn's theme are touched (seaborn's dicts are built, not set)."""
from __future__ import annotations

import functools
import inspect

import matplotlib
import matplotlib.ticker
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from ..core.aggregates import AGGREGATES
from .figstyle import plain_log_labels

PALETTE = sns.color_palette("colorblind")

# What sns.set_theme(context="notebook", style="whitegrid", palette=PALETTE) would set globally; applied
# only inside the plot functions (sns.axes_style / sns.plotting_context with a name just build the dicts).
THEME: dict = {**sns.axes_style("whitegrid"), **sns.plotting_context("notebook"),
               "font.family": ["sans-serif"], "axes.prop_cycle": matplotlib.cycler(color=PALETTE)}


def themed(fn):
    """Run a plot function under ``rc_context(THEME)``; rcParams are restored afterwards, also on error.

    Tick objects are created lazily, at the first draw, from the rcParams in force then, and the number
    of ticks depends on the tick label size, which is also looked up at draw time; the report saves
    figures after the function returns, outside the context. So for each axis the function drew on, the
    first major and minor tick is made to exist here, inside it (ticks added later copy its properties),
    and the tick label size is fixed in points.
    """
    sig = inspect.signature(fn)
    param = "axes" if "axes" in sig.parameters else "ax"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        given = sig.bind(*args, **kwargs).arguments.get(param)
        with matplotlib.rc_context(THEME):
            fig = fn(*args, **kwargs)
            for ax in (fig.axes if given is None else np.atleast_1d(given).ravel()):
                for axis in (ax.xaxis, ax.yaxis):
                    for which, ticks in (("major", axis.get_major_ticks(1)), ("minor", axis.get_minor_ticks(1))):
                        axis.set_tick_params(which=which, labelsize=ticks[0].label1.get_fontsize())
        return fig
    return wrapper


def symlog_ticks(ax, lo: float, hi: float, linthresh: float, max_ticks: int = 7, formatter=None) -> None:
    """Decade ticks outside ±linthresh plus 0, at most ``max_ticks`` of them (decades are thinned from
    the inside out, the outermost kept), and limits with room for the outermost points. ``formatter``:
    a function of the tick value giving its label (default: matplotlib's 10^k labels)."""
    sides = {}
    for sign, end in ((1, hi), (-1, -lo)):
        exps = []
        if end > linthresh:
            exps = list(range(int(np.floor(np.log10(linthresh))) + 1, int(np.ceil(np.log10(end))) + 1))
        sides[sign] = exps
    step = 1
    while 1 + sum(len(e[::-1][::step]) for e in sides.values()) > max_ticks and step < 64:
        step += 1          # every step-th decade, counted from the outermost, on both sides alike
    ticks = [0.0] + [sign * 10.0**e for sign, exps in sides.items() for e in exps[::-1][::step]]
    ticks = sorted(ticks)
    ax.set_xticks(ticks)
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    if formatter is not None:
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: formatter(v)))
    # room for the outermost points, and for the outermost ticks, so that each end of the axis is labelled
    ax.set_xlim(min(lo * 2, -linthresh, ticks[0] * 1.2), max(hi * 2, linthresh, ticks[-1] * 1.2))


def _positive_data(ax, axis: str) -> bool:
    """Whether anything drawn on ``ax`` (lines, error-bar markers, scatter points) has a finite value > 0 on
    ``axis`` ('x' or 'y')."""
    k = 0 if axis == "x" else 1

    def data(transform) -> bool:      # in data coordinates on this axis: not an axvline's 0 to 1 of the axes
        return transform.contains_branch_seperately(ax.transData)[k]
    arrays = [line.get_xydata() for line in ax.get_lines() if data(line.get_transform())]
    arrays += [c.get_offsets() for c in ax.collections if data(c.get_offset_transform())]
    arrays = [np.ma.filled(np.ma.asarray(a, dtype=float), np.nan) for a in arrays]
    return any(a.ndim == 2 and a.shape[0] and bool((np.isfinite(a[:, k]) & (a[:, k] > 0)).any()) for a in arrays)


def log_axis(ax, axis: str, label: str) -> bool:
    """``axis`` of ``ax`` on a log scale with plain labels and ``label`` + "  (log)", where something drawn
    has a value > 0 there; else linear, its label saying so: with nothing above 0 (every std 0, as a
    Rao–Blackwellised row alone has; a KL of 0) matplotlib warns or refuses to draw a log axis."""
    log = _positive_data(ax, axis)
    if log:
        getattr(ax, f"set_{axis}scale")("log")
        plain_log_labels(getattr(ax, f"{axis}axis"))
    getattr(ax, f"set_{axis}label")(f"{label}  (log)" if log else f"{label}  (no value > 0: linear)")
    return log


class DistinctTicks(matplotlib.ticker.Formatter):
    """Tick labels with the fewest significant digits (2 to 8) that tell every tick of the axis apart, in the
    one number format of every output (kl_bench.foundation.formatting.fmt): a running estimate that settles
    within 0.1% of its value got labels of 8 digits from matplotlib's default formatter."""

    def format_ticks(self, values):
        from ..foundation.formatting import fmt
        values = list(values)
        for digits in range(2, 9):
            labels = [fmt(v, digits) for v in values]
            if len(set(labels)) == len(labels):
                return labels
        return labels

    def __call__(self, x, pos=None):
        from ..foundation.formatting import fmt
        return fmt(x, 3)


def symlog_axis_ticks(ax, values: np.ndarray, width: float, formatter) -> None:
    """The y axis of ``ax`` on matplotlib's "asinh" scale (linear within about ±``width``, logarithmic beyond: a
    bias of ±2,500% and one of −3% both readable on one axis, and no kink at ±width as symlog has), ticked at 0
    and at the powers of ten from ``width`` up that the data reaches (3s too on a side under two decades; at
    most 4 a side), labelled by ``formatter``."""
    ax.set_yscale("asinh", linear_width=width)
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    ticks = [0.0]
    for sign in (1, -1):
        top = float(np.max(sign * v)) if v.size else 0.0
        if top <= width / 2:
            continue
        decades = range(int(np.floor(np.log10(width))), int(np.ceil(np.log10(top))) + 1)
        thirds = (1, 3) if len(decades) <= 2 else (1,)        # 3s between the decades only on a short side
        marks = [m * 10.0**k for k in decades for m in thirds]
        marks = [m for m in marks if width <= m <= top * 1.05]
        ticks += [sign * m for m in marks[::-1][::max(1, int(np.ceil(len(marks) / 4)))]]
    ax.set_yticks(sorted(ticks))
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda t, _: formatter(t)))


def percent(v: float) -> str:
    """A relative value as a percentage for tick labels: 0.01 → 1%, −0.5 → −50%, 3 → 300%."""
    if v == 0:
        return "0"
    pct = abs(v) * 100
    text = f"{pct:,.0f}" if pct >= 1 else f"{pct:.2g}"
    return ("−" if v < 0 else "") + text + "%"


def figure_axes(ax, ncols=1, width=6.4, height=4.0):
    """(figure, ax) from a given ax (or array of axes), or a new figure."""
    if ax is not None:
        return np.atleast_1d(ax).ravel()[0].figure, ax
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(1, ncols)


def _drawn(artist) -> bool:
    """Whether a legend handle's artist shows anything: a line or markers with a finite point, bars with
    a finite size, a filled area. Legend entries of artists that draw nothing are left out."""
    from matplotlib.collections import Collection
    from matplotlib.container import BarContainer, Container
    from matplotlib.lines import Line2D
    if isinstance(artist, BarContainer):
        return any(np.isfinite([p.get_width(), p.get_height()]).all() and (p.get_width() or p.get_height())
                   for p in artist.patches)
    if isinstance(artist, Container):
        return any(_drawn(a) for a in artist.get_children() if isinstance(a, (Line2D, Collection)))
    if isinstance(artist, Line2D):
        return _line_drawn(artist)
    if isinstance(artist, Collection):
        return _collection_drawn(artist)
    return True


def _collection_drawn(artist) -> bool:
    """Markers (a PathCollection) with a finite offset, or a filled area with a finite vertex."""
    from matplotlib.collections import PathCollection
    if isinstance(artist, PathCollection):
        off = np.asarray(artist.get_offsets(), dtype=float).reshape(-1, 2)
        return bool(len(artist.get_paths())) and bool(np.isfinite(off).all(axis=1).any())
    return any(len(p.vertices) and np.isfinite(p.vertices).all(axis=1).any() for p in artist.get_paths())


def _line_drawn(line) -> bool:
    """Whether a line has a finite point (data it cannot read as numbers: drawn, as matplotlib may)."""
    x, y = line.get_data(orig=True)
    try:
        x, y = np.broadcast_arrays(np.asarray(x, dtype=float), np.asarray(y, dtype=float))
    except (TypeError, ValueError):
        return True
    return bool(np.any(np.isfinite(x) & np.isfinite(y)))


KEY = "legend-key"        # the gid of an artist drawn only for the legend (it stands for a kind of mark)


def key_line(label: str, **style):
    """A legend entry that says what a mark means (drawn nowhere, always in the legend)."""
    from matplotlib.lines import Line2D
    return Line2D([], [], label=label, gid=KEY, **style)


def legend(target, handles=None, labels=None, **kwargs):
    """ax.legend / fig.legend with only the entries whose artists draw something (none: no legend)."""
    if handles is None:
        handles, labels = target.get_legend_handles_labels()
    # a legend key (what a kind of mark means) is drawn nowhere and always kept
    keep = [(h, lab) for h, lab in zip(handles, labels) if getattr(h, "get_gid", lambda: None)() == KEY or _drawn(h)]
    if not keep:
        return None
    return target.legend([h for h, _ in keep], [lab for _, lab in keep], **kwargs)


def heavy_rows(d: pd.DataFrame) -> np.ndarray:
    """[rows] bool: heavy-tailed rows (their measured SE, so every CI drawn from it, is not valid)."""
    if "heavy_tail" not in d:
        return np.zeros(len(d), dtype=bool)
    return d["heavy_tail"].fillna("").astype(str).str.len().gt(0).to_numpy()


def against(df: pd.DataFrame) -> str:
    """What the values are relative to: the true KL, or the Monte Carlo reference where no exact value
    exists (display.with_reference marks those rows ``approx``)."""
    return "reference" if "approx" in df and bool(df["approx"].fillna(False).astype(bool).any()) else "true KL"


HEAVY_NOTE = "hollow, †: heavy tail\n(CI not valid)"
RUN_MARKERS = ("o", "s", "^", "D", "v", "P")


def label_key(label: str) -> tuple[str, str]:
    """(estimator, aggregate) of a row label as row_label writes it: 'tok k3' → ('k3', 'tok'),
    'cv(0.5)' → ('cv(0.5)', ''), 'k3 logr±20' → ('k3 logr±20', '')."""
    head, _, rest = str(label).partition(" ")
    return (rest, head) if rest and head in AGGREGATES else (str(label), "")


def row_keys(d: pd.DataFrame) -> list[tuple[str, str]]:
    """(estimator, aggregate) of every row of a summary-like frame (λ rows by their family's colour)."""
    aggs = d["aggregate"] if "aggregate" in d else pd.Series("", index=d.index)
    return [(str(e), a if isinstance(a, str) else "") for e, a in zip(d["estimator"], aggs)]


LAYER_DASHES = ("-", (0, (5, 2)), (0, (1.5, 1.5)), (0, (7, 2, 1.5, 2)), (0, (3, 1)), (0, (1, 3)))


def layered(curves: list[np.ndarray], tol: float, wide: float = 6.0, thin: float = 1.8) -> list[tuple[float, object]]:
    """(line width, dash) per line so that none hides another. ``curves``: each line's positions at the same
    probability levels (display coordinates); lines closer than ``tol`` everywhere coincide to the eye. In a
    group of coinciding lines the first drawn is widest and solid, later ones narrower and dashed, so that
    each shows on top of the one before; a line that coincides with none is drawn plainly."""
    n = len(curves)
    group = list(range(n))
    for i in range(n):
        for j in range(i):
            if np.nanmax(np.abs(curves[i] - curves[j]), initial=0.0) < tol:
                group[i] = group[j]
                break
    out = []
    for i in range(n):
        members = [k for k in range(n) if group[k] == group[i]]
        if len(members) == 1:
            out.append((thin, "-"))
            continue
        rank = members.index(i)
        width = thin + (wide - thin) * (len(members) - 1 - rank) / (len(members) - 1)
        out.append((width, LAYER_DASHES[rank % len(LAYER_DASHES)]))
    return out
