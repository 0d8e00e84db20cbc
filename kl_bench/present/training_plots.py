"""Training figures: each function takes train.csv's DataFrame (and an optional matplotlib ``ax``) and returns
the figure; nothing global changes (figures are :class:`matplotlib.figure.Figure` objects, no pyplot, the one
style of every figure applied only while drawing: kl_bench.present.plot_helpers.themed). :func:`render_training_figures` is the one
function that writes files: one PNG per case of a results folder.

Lines: one per combination, in its estimator's colour (kl_bench.present.figstyle: k1 is the same colour here as in
every other figure) with its mode's marker (filled: a sequence-level or single-draw combination; hollow: a
per-token one); solid for the exact trajectory; sampled trajectories are the mean over seeds (dashed, same
colour and marker; long dashes, figstyle.DASHED) with a ±1 sd band (the spread of one sampled run). An exact
trajectory equal to one drawn before (e.g. reward+loss and reward-to-go, which follow ∇J like k1 in the reward)
is dotted on top of it (round dots, figstyle.DOTTED: matplotlib's ":" and "--" read alike) and says which one
it equals, so that no line hides another.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.ticker
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from .figstyle import DASHED, DOTTED, mode_style, plain_log_labels, short_label
from .pages import file_stems, quiet_drawing
from .plot_helpers import themed
from ..results import read_frame

LABELS = {"kl_rev": "KL(q‖p)", "kl_fwd": "KL(p‖q)", "entropy": "entropy of q (nats)",
          "objective": "J = E[reward] − β KL(q‖p)", "reward": "E_q[reward]",
          "kl_opt": "KL(q‖q*): distance to the optimum (log)"}
# The panels of a case, in reading order; KL(q‖q*) is what the summary ranks the combinations by.
PANELS = ("kl_rev", "kl_fwd", "entropy", "reward", "objective", "kl_opt")
LOG_METRICS = {"kl_opt"}
MARKERS_PER_LINE = 8


def _combo_style(g: pd.DataFrame, k: int, n_steps: int) -> dict:
    """A combination's line: its estimator's colour and its mode's marker (hollow for a per-token
    combination), markers spread along the line and staggered between lines so that they do not coincide."""
    r = g.iloc[0]
    style = mode_style(str(r["estimator"]), str(r["mode"]))
    every = max(1, n_steps // MARKERS_PER_LINE)
    hollow = str(r.get("aggregate", "") or "") == "tok"
    return {"color": style.color, "marker": style.marker, "ms": 5, "markevery": (k % every, every),
            "mfc": "white" if hollow else style.color}


@themed
def plot_metric(df: pd.DataFrame, metric: str = "kl_rev", ax=None, case: str | None = None, legend: bool = True):
    """``metric`` against step, one line per combination of ``case`` (default: the first case). Returns the figure."""
    if ax is None:
        fig = Figure(figsize=(6, 4), layout="constrained")
        ax = fig.add_subplot()
    ax.grid(True)
    case = case if case is not None else df["case"].iloc[0]
    d = df[df["case"] == case]
    drawn: list[tuple[str, np.ndarray]] = []
    log = _loggable(d[metric], metric)
    n_steps = max(1, d["step"].nunique())
    for k, (combo, g) in enumerate(d.groupby("combination", sort=False)):
        style = _combo_style(g, k, n_steps)
        ex, sa = g[g["gradients"] == "exact"], g[g["gradients"] == "sampled"]
        if len(ex):
            y = _shown(ex[metric], metric, log)
            same = _same_as(drawn, y)
            ax.plot(ex["step"], y, lw=2.5 if same else 2, ls=DOTTED if same else "-", dash_capstyle="round",
                    label=combo if same is None else f"{combo} (= {same})", **style)
            drawn.append((combo, y))
        if len(sa):
            _plot_sampled(ax, sa, metric, log, f"{combo}, {int(sa['draws'].iloc[0])} draws/step" if len(ex) == 0 else None,
                          style)
    _axis(ax, metric, log)
    if legend:
        ax.legend(handles=legend_handles(ax), fontsize="small")
    return ax.figure


def _same_as(drawn: list[tuple[str, np.ndarray]], y: np.ndarray) -> str | None:
    """The combination already drawn whose exact curve is ``y`` (to float64 rounding), or None."""
    return next((c for c, prev in drawn
                 if prev.shape == y.shape and np.allclose(y, prev, rtol=1e-9, atol=1e-12, equal_nan=True)), None)


def _plot_sampled(ax, sa: pd.DataFrame, metric: str, log: bool, label: str | None, style: dict) -> None:
    """A combination's sampled mean (dashed) with its ±1 sd band across seeds."""
    ax.plot(sa["step"], _shown(sa[metric], metric, log), lw=1.2, ls=DASHED, label=label, **style)
    sd = sa[f"{metric}_sd"].fillna(0)
    ax.fill_between(sa["step"], _shown(sa[metric] - sd, metric, log), _shown(sa[metric] + sd, metric, log),
                    color=style["color"], alpha=0.2, lw=0)


def _shown(values: pd.Series, metric: str, log: bool = True) -> np.ndarray:
    """The values as drawn: on a log axis, values ≤ 0 (an exact optimum: 0 up to rounding) are not drawn."""
    y = values.to_numpy(dtype=float)
    return np.where(y > 0, y, np.nan) if metric in LOG_METRICS and log else y


def _loggable(values: pd.Series, metric: str) -> bool:
    """Whether ``metric`` goes on a log axis: it is one of LOG_METRICS and some value is > 0 (a case whose
    every combination sits at the optimum, KL(q‖q*) = 0 at every step, e.g. vocab = 1, has nothing a log
    axis can show: matplotlib refuses to draw it)."""
    v = values.to_numpy(dtype=float)
    return metric in LOG_METRICS and bool((np.isfinite(v) & (v > 0)).any())


def _axis(ax, metric: str, log: bool) -> None:
    """Labels and scales: whole steps on the step axis; KL(q‖q*) on a log axis where it has a value > 0,
    else on a linear one that says why."""
    ax.set_xlabel("step")
    ax.set_ylabel(LABELS.get(metric, metric) if log or metric not in LOG_METRICS
                  else LABELS.get(metric, metric).replace(" (log)", ""))
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if log:
        ax.set_yscale("log")
        plain_log_labels(ax.yaxis)
    elif metric in LOG_METRICS:
        ax.set_title("0 at every step (up to rounding): the optimum; linear axis", fontsize="small")


def legend_handles(ax) -> list:
    """The combinations' lines of ``ax``, then what solid, dashed (and dotted, where drawn) mean."""
    handles = [h for h in ax.get_lines() if not h.get_label().startswith("_")]
    key = [Line2D([], [], color="black", lw=2, label="exact (expected update)"),
           Line2D([], [], color="black", lw=1.2, ls=DASHED, label="sampled: mean over seeds, band ±1 sd")]
    if any("(= " in h.get_label() for h in handles):        # an exact line equal to another: dotted on top of it
        key.append(Line2D([], [], color="black", lw=2.5, ls=DOTTED, dash_capstyle="round",
                          label="exact, equal to the one it names"))
    return handles + key


@themed
def plot_training(df: pd.DataFrame, case: str | None = None, axes=None):
    """The six panels of a case: KL(q‖p), KL(p‖q), entropy, E[reward], J and KL(q‖q*) (the distance to the
    optimum, by which the summary ranks the combinations) against step, one legend beside them. Returns the
    figure."""
    own = axes is None
    if own:
        fig = Figure(figsize=(14, 8.5), layout="constrained")
        axes = fig.subplots(2, 3).ravel()
    case = case if case is not None else df["case"].iloc[0]
    for metric, ax in zip(PANELS, axes):
        plot_metric(df, metric, ax=ax, case=case, legend=False)
    fig = axes[0].figure
    handles = legend_handles(axes[0])
    if own:        # under the panels: beside them it would run under the title
        fig.legend(handles=handles, loc="outside lower center", fontsize="small", ncol=min(4, len(handles)))
    else:
        axes[0].legend(handles=handles, fontsize="small")
    fig.suptitle(f"{short_label(case)}: each combination's trajectory (colour: estimator; marker: mode, hollow per token)")
    return fig


def render_training_figures(folder: str | Path, out_dir: str | Path) -> list[Path]:
    """Write training_<case>.png for every case of ``folder``/train.csv into ``out_dir``; the paths written."""
    df = read_frame(Path(folder) / "train.csv")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    stems = file_stems(df["case"].unique())        # one file per case, whatever its name (pages.file_stems)
    for case in df["case"].unique():
        path = out_dir / f"training_{stems[str(case)]}.png"
        with quiet_drawing():             # glyphs the font lacks: the file still names the case (pages)
            plot_training(df, case).savefig(path, dpi=110)
        paths.append(path)
    return paths
