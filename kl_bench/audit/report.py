"""The report of an audit folder (``kl-bench report DIR`` where DIR holds audit.csv): per KL term (source),
the logged estimate against the exact value per step with its ±1.96 SE band, the bias split by source
(estimator, sampler, precision, noise), and P(f < 0) logged against its exact value; report.md with the
pooled verdict. Plot functions take audit.csv's DataFrame and an optional ``ax``, return the figure, and
change no global state (Figure objects, no pyplot)."""
from __future__ import annotations

import io
import math
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from ..results import read_frame
from ..safe_io import read_regular

PARTS = [("bias_estimator", "estimator"), ("bias_sampler", "sampler"), ("bias_precision", "precision"),
         ("noise", "noise")]


def is_audit_folder(folder: str | Path) -> bool:
    folder = Path(folder)
    return (folder / "audit.csv").is_file() and not (folder / "summary.csv").exists()


def _axes(ax):
    if ax is None:
        fig = Figure(figsize=(6, 4), layout="constrained")
        return fig, fig.add_subplot()
    return ax.figure, ax


def plot_logged_vs_exact(df: pd.DataFrame, source: str, ax=None) -> Figure:
    """Per step: the logged estimate, the exact value, and exact ± 1.96 SE (where an honest estimate lies)."""
    fig, ax = _axes(ax)
    d = df[df["source"] == source].sort_values("step")
    ax.fill_between(d["step"], d["exact"] - 1.96 * d["se"], d["exact"] + 1.96 * d["se"], alpha=0.25, lw=0,
                    label="exact ± 1.96 SE")
    ax.plot(d["step"], d["exact"], lw=2, label="exact (this step's positions)")
    ax.plot(d["step"], d["logged"], "o--", ms=4, label="logged by the trainer")
    ax.set_xlabel("step")
    ax.set_ylabel("KL per the trainer's aggregation")
    ax.set_title(f"{source}: logged against exact")
    ax.legend(fontsize="small")
    return fig


def plot_bias_split(df: pd.DataFrame, source: str, ax=None) -> Figure:
    """Per step, logged − exact split into its parts: estimator + sampler + precision + noise."""
    fig, ax = _axes(ax)
    d = df[df["source"] == source].sort_values("step")
    width = 0.8 * (min(d["step"].diff().dropna().min(), 1e9) if len(d) > 1 else 1.0)
    pos = neg = pd.Series(0.0, index=d.index)
    for col, label in PARTS:
        v = d[col].fillna(0.0)
        bottom = pos.where(v >= 0, neg)
        ax.bar(d["step"], v, width, bottom=bottom, label=label)
        pos, neg = pos + v.clip(lower=0), neg + v.clip(upper=0)
    ax.plot(d["step"], d["bias"], "k.", label="logged − exact")
    ax.axhline(0, color="0.5", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("bias")
    ax.set_title(f"{source}: bias by source")
    ax.legend(fontsize="small")
    return fig


def plot_negative(df: pd.DataFrame, source: str, ax=None) -> Figure:
    """Per step: the fraction of negative per-token values logged, and its exact probability."""
    fig, ax = _axes(ax)
    d = df[df["source"] == source].sort_values("step")
    ax.plot(d["step"], d["p_negative"], lw=2, label="exact P(f < 0)")
    ax.plot(d["step"], d["frac_negative"], "o--", ms=4, label="logged fraction < 0")
    ax.set_xlabel("step")
    ax.set_ylabel("per-token probability")
    ax.set_title(f"{source}: negative values")
    ax.legend(fontsize="small")
    return fig


def plot_audit(df: pd.DataFrame, source: str) -> Figure:
    fig = Figure(figsize=(15, 4.2), layout="constrained")
    for fn, ax in zip((plot_logged_vs_exact, plot_bias_split, plot_negative), fig.subplots(1, 3)):
        fn(df, source, ax)
    return fig


def pooled_line(d: pd.DataFrame) -> str:
    """All steps of one source pooled: Σ bias / √Σ se² (steps are independent given the policy)."""
    se = math.sqrt(float((d["se"] ** 2).sum()))
    z = float(d["bias"].sum()) / se if se > 0 else math.nan
    return (f"{len(d)} steps, mean logged {d['logged'].mean():.4g} against exact {d['exact'].mean():.4g} "
            f"(mean bias {d['bias'].mean():+.4g}; pooled z = {z:+.2f})")


def audit_report_files(folder: str | Path) -> dict[str, bytes]:
    """{relative path: bytes}: figures/audit_<source>.png and .pdf, report.md."""
    folder = Path(folder)
    df = read_frame(read_regular(folder / "audit.csv", "summary.csv"))
    files: dict[str, bytes] = {}
    lines = [f"# Trainer audit: {folder.name}\n", "The trainer's logged KL against the exact KL of the positions "
             "it audited; the bias split into the estimator's, the sampler's, precision and noise "
             "(docs/audit.md).\n"]
    for source in df["source"].unique():
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(source))
        fig = plot_audit(df, source)
        for ext in ("png", "pdf"):
            buf = io.BytesIO()
            fig.savefig(buf, format=ext, dpi=110, metadata={"CreationDate": None} if ext == "pdf" else None)
            files[f"figures/audit_{safe}.{ext}"] = buf.getvalue()
        lines += [f"## {source}\n", pooled_line(df[df["source"] == source]) + "\n",
                  f"![{source}](figures/audit_{safe}.png)\n"]
    files["report.md"] = "\n".join(lines).encode()
    return files
