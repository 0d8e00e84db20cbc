"""Plot functions: each takes a DataFrame (and an optional ``ax``) and returns the figure.

Nothing here writes files; the CLI does. A colour is an estimator's, in every figure (kl_bench.present.figstyle: k1
is the same blue whichever estimators a run has); an aggregate (seq, tok, ...) is a line style and a
marker. Where lines can coincide (the ECDFs of k3 and fwd_k3 at small KL), earlier lines are drawn wider,
so that every one stays visible.

Importing this module changes no global state: no backend is selected and neither matplotlib's
rcParams nor seaborn's theme are touched. Each plot function applies the report's look (seaborn's
whitegrid style, notebook context, colorblind colour cycle) through :func:`matplotlib.rc_context`
only while it builds its figure. New figures are :class:`matplotlib.figure.Figure` objects, not
pyplot figures, so they need no GUI backend and pyplot does not keep them open; ``fig.savefig``
renders them with Agg on a headless machine.
"""
from __future__ import annotations

import functools
import inspect
import math

import matplotlib
import matplotlib.ticker
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from ..core.draws import row_label
from ..core.aggregates import AGGREGATES
from ..foundation.formatting import ROUNDING
from .figstyle import Style, estimator_colour, figure_styles, plain_log_labels, row_style, short_label
from ..core.modes import MODES
from ..core.planning import never_words

PALETTE = sns.color_palette("colorblind")

# What sns.set_theme(context="notebook", style="whitegrid", palette=PALETTE) would set globally; applied
# only inside the plot functions (sns.axes_style / sns.plotting_context with a name just build the dicts).
THEME: dict = {**sns.axes_style("whitegrid"), **sns.plotting_context("notebook"),
               "font.family": ["sans-serif"], "axes.prop_cycle": matplotlib.cycler(color=PALETTE)}


def _themed(fn):
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


def _symlog_ticks(ax, lo: float, hi: float, linthresh: float, max_ticks: int = 7, formatter=None) -> None:
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


def _log_axis(ax, axis: str, label: str) -> bool:
    """``axis`` of ``ax`` on a log scale with plain labels and ``label`` + "  (log)", where something drawn
    has a value > 0 there; else linear, its label saying so: with nothing above 0 (every std 0, as a
    Rao–Blackwellised row alone has; a KL of 0) matplotlib warns or refuses to draw a log axis."""
    log = _positive_data(ax, axis)
    if log:
        getattr(ax, f"set_{axis}scale")("log")
        plain_log_labels(getattr(ax, f"{axis}axis"))
    getattr(ax, f"set_{axis}label")(f"{label}  (log)" if log else f"{label}  (no value > 0: linear)")
    return log


def _percent(v: float) -> str:
    """A relative value as a percentage for tick labels: 0.01 → 1%, −0.5 → −50%, 3 → 300%."""
    if v == 0:
        return "0"
    pct = abs(v) * 100
    text = f"{pct:,.0f}" if pct >= 1 else f"{pct:.2g}"
    return ("−" if v < 0 else "") + text + "%"


def _axes(ax, ncols=1, width=6.4, height=4.0):
    """(figure, ax) from a given ax (or array of axes), or a new figure."""
    if ax is not None:
        return np.atleast_1d(ax).ravel()[0].figure, ax
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(1, ncols)


def _drawn(artist) -> bool:
    """Whether a legend handle's artist shows anything: a line or markers with a finite point, bars with
    a finite size, a filled area. Legend entries of artists that draw nothing are left out."""
    from matplotlib.collections import Collection, PathCollection
    from matplotlib.container import BarContainer, Container
    from matplotlib.lines import Line2D
    if isinstance(artist, BarContainer):
        return any(np.isfinite([p.get_width(), p.get_height()]).all() and (p.get_width() or p.get_height())
                   for p in artist.patches)
    if isinstance(artist, Container):
        return any(_drawn(a) for a in artist.get_children() if isinstance(a, (Line2D, Collection)))
    if isinstance(artist, Line2D):
        x, y = artist.get_data(orig=True)
        try:
            x, y = np.broadcast_arrays(np.asarray(x, dtype=float), np.asarray(y, dtype=float))
        except (TypeError, ValueError):
            return True
        return bool(np.any(np.isfinite(x) & np.isfinite(y)))
    if isinstance(artist, PathCollection):
        off = np.asarray(artist.get_offsets(), dtype=float).reshape(-1, 2)
        return bool(len(artist.get_paths())) and bool(np.isfinite(off).all(axis=1).any())
    if isinstance(artist, Collection):
        return any(len(p.vertices) and np.isfinite(p.vertices).all(axis=1).any() for p in artist.get_paths())
    return True


KEY = "legend-key"        # the gid of an artist drawn only for the legend (it stands for a kind of mark)


def key_line(label: str, **style):
    """A legend entry that says what a mark means (drawn nowhere, always in the legend)."""
    from matplotlib.lines import Line2D
    return Line2D([], [], label=label, gid=KEY, **style)


def _legend(target, handles=None, labels=None, **kwargs):
    """ax.legend / fig.legend with only the entries whose artists draw something (none: no legend)."""
    if handles is None:
        handles, labels = target.get_legend_handles_labels()
    # a legend key (what a kind of mark means) is drawn nowhere and always kept
    keep = [(h, lab) for h, lab in zip(handles, labels) if getattr(h, "get_gid", lambda: None)() == KEY or _drawn(h)]
    if not keep:
        return None
    return target.legend([h for h, _ in keep], [lab for _, lab in keep], **kwargs)


def _heavy(d: pd.DataFrame) -> np.ndarray:
    """[rows] bool: heavy-tailed rows (their measured SE, so every CI drawn from it, is not valid)."""
    if "heavy_tail" not in d:
        return np.zeros(len(d), dtype=bool)
    return d["heavy_tail"].fillna("").astype(str).str.len().gt(0).to_numpy()


def _against(df: pd.DataFrame) -> str:
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




@_themed
def plot_bias_std(df: pd.DataFrame, axes=None, title: str = ""):
    """Bias/true (with 95% CI) and std/true (with 95% CI) per estimator of one case; exact values as ×.
    Each point in its estimator's colour; several runs side by side, one marker each. Heavy-tailed rows are
    hollow and their labels end in †: their CIs are not valid.

    ``df``: summary rows of one case (a ``run`` column, if present, separates results folders).
    """
    df = df[df["lambda"].isna()].copy()
    df["label"] = [row_label(r) + (" †" if h else "") for (_, r), h in zip(df.iterrows(), _heavy(df))]
    runs = list(dict.fromkeys(df["run"])) if "run" in df and df["run"].nunique() > 1 else [None]
    fig, axes = _axes(axes, 2, 11, 0.45 * df["label"].nunique() + 1.6)
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
    for ax in axes:
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        for tick, key in zip(ax.get_yticklabels(), dict.fromkeys(row_keys(df))):
            tick.set_color(styles[key].color)      # the label in its estimator's colour, as its points
    _bias_std_scales(axes, df)
    _legend(axes[1], loc="best", fontsize="small")
    fig.suptitle(title)
    return fig


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
    heavy = _heavy(d)
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
        _symlog_ticks(axes[0], float(bias.min()), float(bias.max()), lt, max_ticks=5, formatter=_percent)
    axes[0].tick_params(axis="x", labelsize="small")
    axes[0].set_xlabel(f"bias / {_against(df)}  (symlog; 0 = unbiased)")
    stds = pd.concat([df["rel_std"], df["exact_rel_std"]]).astype(float).replace([np.inf, -np.inf], np.nan).dropna()
    stds = stds[stds > ROUNDING]                    # as the exact points: a rounding-level std is a 0
    if _log_axis(axes[1], "x", f"per-draw std / {_against(df)}") and not stds.empty:
        axes[1].set_xlim(stds.min() / 2, stds.max() * 2)


@_themed
def plot_lambda_curve(sweep: pd.DataFrame, ax=None, title: str = ""):
    """std/true of cv(λ) = −log r + λ(r−1) against λ: exact line, measured dashed, λ* and k1/k3 marked.

    ``sweep``: lambda_sweep.csv rows of one case and aggregate.
    """
    fig, ax = _axes(ax)
    s = sweep.sort_values("lambda")
    cv = estimator_colour("cv")          # the curve is cv(λ)'s; its λ = 0 and 1 points are k1's and k3's
    ax.plot(s["lambda"], s["exact_rel_std"].replace(np.inf, np.nan), color=cv, lw=2, label="exact")
    ax.plot(s["lambda"], s["rel_std"], color="black", lw=1.5, ls="--", label="measured (one pass)")
    star = float(s["lambda_star"].iloc[0])
    if math.isfinite(star):
        ax.axvline(star, color=estimator_colour("cv_opt"), lw=1.5, label=f"λ* = {star:.3g}")
    for lam, name, color in ((0.0, "k1 (λ=0)", estimator_colour("k1")), (1.0, "k3 (λ=1)", estimator_colour("k3"))):
        hit = s[s["lambda"] == lam]
        if not hit.empty:
            v = hit["exact_rel_std"].iloc[0]
            v = hit["rel_std"].iloc[0] if not np.isfinite(v) else v
            ax.scatter([lam], [v], s=90, color=color, zorder=4, label=name, edgecolor="black")
    _log_axis(ax, "y", "per-draw std / true KL")
    ax.set_xlabel("λ")
    ax.set_title(title)
    _legend(ax, fontsize="small")
    return fig


LAYER_DASHES = ("-", (0, (5, 2)), (0, (1.5, 1.5)), (0, (7, 2, 1.5, 2)), (0, (3, 1)), (0, (1, 3)))


def _symlog(x: np.ndarray, linthresh: float) -> np.ndarray:
    """Where x falls on a symlog axis (linear within ±linthresh, logarithmic outside), up to a scale."""
    return np.sign(x) * np.log10(1 + np.abs(x) / linthresh)


def _layers(curves: list[np.ndarray], tol: float, wide: float = 6.0, thin: float = 1.8) -> list[tuple[float, object]]:
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
    """Draw every ECDF (layered where lines coincide on the symlog axis, :func:`_layers`), with markers at
    staggered quantiles; the legend's keys, one per line."""
    levels = np.linspace(0.01, 0.99, 99)
    curves = [_symlog(_quantiles(v, levels), linthresh) if len(v) else np.full(len(levels), np.nan)
              for v in values.values()]
    span = np.nanmax([np.nanmax(np.abs(c)) for c in curves] + [1.0]) * 2
    layers = _layers(curves, 0.012 * span)
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


@_themed
def plot_distribution(draws: pd.DataFrame, ax=None, title: str = ""):
    """ECDF of each estimator's per-draw value on a symlog axis; the negative region is shaded. Each line
    in its estimator's colour with its aggregate's markers (at staggered quantiles); lines that coincide to
    the eye (k3 and fwd_k3 at small KL) are layered: the first drawn widest and solid, the next narrower and
    dashed on top of it, so that every one stays visible.

    ``draws``: one row per draw, columns ``label`` (the row's label) and ``value`` (its per-draw value)."""
    values = {label: part["value"].to_numpy(dtype=float) for label, part in draws.groupby("label", sort=False)}
    # The legend sits beside the axes, one line per estimator: the figure grows with it (or it squeezes the axes).
    fig, ax = _axes(ax, width=9, height=max(4.0, 0.24 * (len(values) + 2)))
    # Limits from the finite values: a draw with log r = ±inf (p = 0 where q > 0) has an infinite estimate,
    # which the ECDF reaches at ±inf (off the axis): said in a note under the axes.
    shown = {label: v[np.isfinite(v)] for label, v in values.items()}
    lo = min((float(np.min(v)) for v in shown.values() if len(v)), default=-1.0)
    hi = max((float(np.max(v)) for v in shown.values() if len(v)), default=1.0)
    finite = np.concatenate([np.abs(v[v != 0]) for v in shown.values()] or [np.ones(1)])
    # The linear zone of the symlog axis: a decade boundary below most |values| (5th percentile).
    linthresh = 10.0 ** np.floor(np.log10(np.quantile(finite, 0.05))) if finite.size else 1e-3
    handles = _ecdf_lines(ax, values, linthresh)
    if lo < 0:
        handles.append(ax.axvspan(min(lo, -linthresh) * 3, 0, color="red", alpha=0.08, label="negative estimates"))
    ax.set_xscale("symlog", linthresh=linthresh)
    _symlog_ticks(ax, min(lo, 0.0), hi, linthresh)
    ax.tick_params(axis="x", labelsize="small")
    off = sum(int(np.sum(~np.isfinite(v))) for v in values.values())
    ax.set_xlabel("per-draw estimate  (symlog)" + (f"; {off:,} infinite or NaN draws off the axis" if off else ""))
    ax.set_ylabel("fraction of draws ≤ x  (ECDF)")
    ax.set_title(title)
    _legend(ax, handles, [h.get_label() for h in handles], fontsize="small", loc="upper left",
            bbox_to_anchor=(1.01, 1.0))
    return fig


@_themed
def plot_convergence(batches: pd.DataFrame, summary: pd.DataFrame, axes=None, title: str = ""):
    """Running estimate against draws, one panel per estimator: ±2 SE band (batch means so far), the
    true KL (dotted) and, for biased estimators, their exact mean (dashed).

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
    for k, r in enumerate(keep):
        ax = flat[k]
        sel = (batches["estimator"] == r["estimator"]) & (batches["aggregate"].fillna("") == (r["aggregate"] or "")) \
            & batches["lambda"].isna()
        b = batches[sel].sort_values("batch")
        n = b["draws"].to_numpy(dtype=float)
        m = b["batch_mean"].to_numpy(dtype=float)
        cum_n = np.cumsum(n)
        run_mean = np.cumsum(n * m) / cum_n
        k_idx = np.arange(1, len(m) + 1)
        # Running batch-means SE: spread of the batch means so far around the running mean, / √(batches − 1).
        with np.errstate(invalid="ignore"):                   # inf − inf where a batch mean is infinite: NaN
            sq = np.cumsum(n * m * m) / cum_n - run_mean**2
        se = np.sqrt(np.maximum(sq, 0) / np.maximum(k_idx - 1, 1))
        color = row_style(r["estimator"], r["aggregate"]).color
        ax.plot(cum_n, run_mean, color=color, lw=1.5)
        heavy = bool(_heavy(pd.DataFrame([r]))[0])
        ax.fill_between(cum_n[1:], (run_mean - 2 * se)[1:], (run_mean + 2 * se)[1:], color=color, alpha=0.2,
                        hatch="//" if heavy else None)
        if math.isfinite(r["true_kl"]):
            ax.axhline(r["true_kl"], color="black", lw=1.2, ls=":", label="true KL")
        biased = math.isfinite(r["exact_mean"]) and not math.isclose(r["exact_mean"], r["true_kl"], rel_tol=1e-6)
        if biased:
            ax.axhline(r["exact_mean"], color="grey", lw=1.2, ls="--", label="exact mean (biased)")
        ax.set_xscale("log")
        # A heavy tail: the band is drawn from an SE that is not valid (hatched, and the title says so).
        ax.set_title(row_label(r) + ("  † heavy tail: band not valid" if heavy else ""), fontsize="medium")
        ax.tick_params(labelsize="small")
        if k == 0 or biased:
            _legend(ax, fontsize="x-small")
    for ax in flat[len(keep):]:
        ax.set_visible(False)
    fig.supxlabel("draws  (log)")
    fig.supylabel("running estimate (±2 SE)")
    fig.suptitle(title)
    return fig


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
    layers = _layers(curves, 0.02, wide=4.5, thin=1.6)
    for d, e, (lw, dash) in zip(parts, exact, layers):
        label, st = d["label"].iloc[0], styles[row_keys(d)[0]]
        if e:
            ax.plot(d["T"], d["exact_rel_std"].replace(np.inf, np.nan), lw=lw, label=label,
                    **{**st.kwargs(), "ls": st.ls if dash == "-" else dash})
            ax.scatter(d["T"], d["rel_std"], color=st.color, marker="x", s=50, zorder=3)
        else:
            ax.plot(d["T"], d["rel_std"], lw=min(lw, 0.8), ms=7, mfc="none", mew=1.6, label=label, **st.kwargs())
    return any(exact)


@_themed
def plot_rollout_growth(summary: pd.DataFrame, lengths: dict[str, int], ax=None, title: str = ""):
    """Rollouts: exact std/true (lines) and measured (markers) against T, log-log, per estimator and
    aggregation. ``summary``: rows of rollout cases that differ only in their length T."""
    df = summary[summary["lambda"].isna() & summary["case"].isin(lengths)].copy()
    df["T"] = df["case"].map(lengths)
    df["label"] = [row_label(r) for _, r in df.iterrows()]
    # The legend sits beside the axes, one line per row: the figure grows with it.
    fig, ax = _axes(ax, width=9.5, height=max(4.0, 0.24 * (df["label"].nunique() + 2)))
    styles = figure_styles(row_keys(df))
    any_exact = _growth_lines(ax, df, styles)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("sequence length T  (log)")
    if any_exact:
        _log_axis(ax, "y", "per-rollout std / true KL")
        ax.set_title(title + "\n(lines: exact; ×: measured)")
    else:       # no exact value: measured against the Monte Carlo reference, no lines to announce
        _log_axis(ax, "y", "per-rollout std / reference")
        ax.set_title(title + "\n(measured; reference: the full mean, Monte Carlo)")
    _legend(ax, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


@_themed
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
    fig, ax = _axes(ax, width=8, height=0.28 * (len(df) + len(cases)) + 1.5)
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


_STYLES = ["-", "--", ":", "-."]


@_themed
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
        _legend(fig, list(handles.values()), list(handles), fontsize="small", loc="outside lower center",
                ncol=min(len(handles), 6))
        return
    for p in used:
        p.set_xlabel(xlabel, fontsize="small" if faceted else None)
    used[0].set_ylabel(ylabel)
    (fig.suptitle if faceted else used[0].set_title)(title)
    _legend(used[-1], list(handles.values()), list(handles), fontsize="x-small", ncol=1 if faceted else 2,
            loc="upper left", bbox_to_anchor=(1.01, 1.0))


@_themed
def plot_sweep(summary: pd.DataFrame, key: str, axes=None, title: str = ""):
    """std/true (log) and bias/true (symlog) against one swept case key, one line per estimator: measured
    as markers joined by a line, exact as a thin dashed line of the same colour.

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
    _sweep_legend(fig, labels, styles, _heavy(df).any())
    fig.suptitle(title + note)
    return fig


def _sweep_legend(fig, labels: list[str], styles: dict, heavy: bool) -> None:
    """One legend under the panels (beside them it would run under the title): the estimators, then what
    a solid line with markers, a dashed line and a hollow marker mean."""
    handles = [key_line(label, color=styles[label_key(label)].color, marker=styles[label_key(label)].marker, lw=1.2)
               for label in labels]
    handles += [key_line("measured ± 95% CI", color="black", marker="o", lw=1.2),
                key_line("exact", color="black", lw=0.9, ls="--")]
    if heavy:
        handles.append(key_line(HEAVY_NOTE.replace("\n", " "), color="black", marker="o", mfc="white", ls="none"))
    _legend(fig, handles, [h.get_label() for h in handles], loc="outside lower center", fontsize="small",
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


def _sweep_line(row_axes, x: np.ndarray, d: pd.DataFrame, label: str, style: Style) -> None:
    """One estimator's std/true and bias/true: measured with markers and 95% CIs, exact thin and dashed;
    heavy-tailed points hollow (their CIs are not valid)."""
    color, marker = style.color, style.marker
    true = d["true_kl"].abs().to_numpy(dtype=float)
    true = np.where(np.isfinite(true) & (true > 0), true, np.nan)     # no CI where no scale exists (KL = 0)
    heavy = _heavy(d)
    for ax, measured, se, exact in ((row_axes[0], d["rel_std"], d["std_se"], d["exact_rel_std"]),
                                    (row_axes[1], d["rel_bias"], d["se"], d["exact_rel_bias"])):
        y = measured.to_numpy(dtype=float)
        ci = 1.96 * se.fillna(0).to_numpy(dtype=float) / true
        ax.plot(x, y, color=color, lw=1.2)
        ax.errorbar(x[~heavy], y[~heavy], yerr=ci[~heavy], fmt=marker, ms=4, color=color, capsize=2, lw=0.8)
        if heavy.any():
            ax.errorbar(x[heavy], y[heavy], yerr=ci[heavy], fmt=marker, ms=5, color=color, mfc="white", capsize=2,
                        lw=0.8, alpha=0.8)
        ax.plot(x, exact.replace([np.inf, -np.inf], np.nan).to_numpy(dtype=float), color=color, lw=0.9, ls="--")


def _sweep_axes(row_axes, key: str, row_title: str, x_all: pd.Series, positions: dict | None) -> None:
    """Scales, labels and ticks of one row of a sweep figure (std: log; bias: symlog in percent)."""
    ax_std, ax_bias = row_axes
    _log_axis(ax_std, "y", "per-draw std / true KL")
    # Bias on a linear axis with its CIs: a symlog axis spikes at 0 and makes noise read as structure.
    ax_bias.axhline(0, color="grey", lw=1)
    ax_bias.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: _percent(v)))
    ax_bias.set_ylabel("bias / true KL  (± 95% CI)")
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
