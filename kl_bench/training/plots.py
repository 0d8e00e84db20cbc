"""Training figures: each function takes train.csv's DataFrame (and an optional matplotlib ``ax``) and returns
the figure; nothing global changes (figures are :class:`matplotlib.figure.Figure` objects, no pyplot, styles
applied through :func:`matplotlib.rc_context` only while drawing). :func:`render_training_figures` is the one
function that writes files: one PNG per case of a results folder.

Lines: one per combination, solid for the exact trajectory; sampled trajectories are the mean over seeds
(dashed, same colour) with a ±1 sd band (the spread of one sampled run). An exact trajectory equal to one
drawn before (e.g. reward+loss and reward-to-go, which follow ∇J like k1 in the reward) is dotted on top of
it and says which one it equals, so that no line hides another.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from ..results import read_frame

PALETTE = sns.color_palette("colorblind")
_STYLE = {**sns.axes_style("whitegrid"), "axes.prop_cycle": matplotlib.cycler(color=PALETTE)}
LABELS = {"kl_rev": "KL(q‖p)", "kl_fwd": "KL(p‖q)", "entropy": "entropy of q (nats)", "objective": "J = E[reward] − β KL(q‖p)",
          "reward": "E_q[reward]", "kl_opt": "KL(q‖q*) (distance to the optimum)"}
PANELS = ("kl_rev", "kl_fwd", "entropy", "objective")


def plot_metric(df: pd.DataFrame, metric: str = "kl_rev", ax=None, case: str | None = None, legend: bool = True):
    """``metric`` against step, one line per combination of ``case`` (default: the first case). Returns the figure."""
    with matplotlib.rc_context(_STYLE):
        if ax is None:
            fig = Figure(figsize=(6, 4), layout="constrained")
            ax = fig.add_subplot()
        case = case if case is not None else df["case"].iloc[0]
        d = df[df["case"] == case]
        drawn: list[tuple[str, np.ndarray]] = []
        for k, (combo, g) in enumerate(d.groupby("combination", sort=False)):
            color = PALETTE[k % len(PALETTE)]
            ex, sa = g[g["gradients"] == "exact"], g[g["gradients"] == "sampled"]
            if len(ex):
                y = ex[metric].to_numpy()
                same = next((c for c, prev in drawn if prev.shape == y.shape and np.allclose(y, prev, rtol=1e-9, atol=1e-12)),
                            None)
                ax.plot(ex["step"], y, color=color, lw=2.5 if same else 2, ls=":" if same else "-",
                        label=combo if same is None else f"{combo} (= {same})")
                drawn.append((combo, y))
            if len(sa):
                n = int(sa["draws"].iloc[0])
                ax.plot(sa["step"], sa[metric], color=color, lw=1.2, ls="--",
                        label=f"{combo}, {n} draws/step" if len(ex) == 0 else None)
                sd = sa[f"{metric}_sd"].fillna(0)
                ax.fill_between(sa["step"], sa[metric] - sd, sa[metric] + sd, color=color, alpha=0.2, lw=0)
        ax.set_xlabel("step")
        ax.set_ylabel(LABELS.get(metric, metric))
        if legend:
            ax.legend(fontsize="small")
        return ax.figure


def plot_training(df: pd.DataFrame, case: str | None = None, axes=None):
    """The four panels of a case: KL(q‖p), KL(p‖q), entropy and J against step. Returns the figure."""
    if axes is None:
        fig = Figure(figsize=(11, 7.5), layout="constrained")
        axes = fig.subplots(2, 2).ravel()
    case = case if case is not None else df["case"].iloc[0]
    for i, (metric, ax) in enumerate(zip(PANELS, axes)):
        plot_metric(df, metric, ax=ax, case=case, legend=i == 0)
    fig = axes[0].figure
    fig.suptitle(f"{case}: exact trajectories (solid); sampled mean ± sd over seeds (dashed, band)")
    return fig


def render_training_figures(folder: str | Path, out_dir: str | Path) -> list[Path]:
    """Write training_<case>.png for every case of ``folder``/train.csv into ``out_dir``; the paths written."""
    df = read_frame(Path(folder) / "train.csv")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for case in df["case"].unique():
        path = out_dir / f"training_{''.join(c if c.isalnum() or c in '-_.' else '_' for c in case)}.png"
        plot_training(df, case).savefig(path, dpi=110)
        paths.append(path)
    return paths
