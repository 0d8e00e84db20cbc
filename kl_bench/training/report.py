"""The report of a training folder (``kl-bench report DIR`` where DIR holds train.csv): one figure per case
(PNG and PDF), and report.md with the final values of every combination and the distance to the optimum."""
from __future__ import annotations

import io
from pathlib import Path

import pandas as pd

from ..results import read_frame
from ..safe_io import read_regular
from .plots import plot_training

FINAL = [("kl_rev", "KL(q‖p)"), ("kl_fwd", "KL(p‖q)"), ("entropy", "entropy"), ("reward", "E[reward]"),
         ("objective", "J"), ("kl_opt", "KL(q‖q*)")]


def is_training_folder(folder: str | Path) -> bool:
    """A folder written by ``kl-bench train``: train.csv, and no summary.csv."""
    folder = Path(folder)
    return (folder / "train.csv").is_file() and not (folder / "summary.csv").exists()


def final_table(df: pd.DataFrame) -> str:
    """Markdown: per case and combination, the last step's values (sampled: mean ± sd over seeds)."""
    last = df[df["step"] == df.groupby(["case", "combination", "gradients"])["step"].transform("max")]
    head = "| case | combination | gradients | step | " + " | ".join(label for _, label in FINAL) + " |"
    lines = [head, "|" + "---|" * (4 + len(FINAL))]
    for r in last.itertuples():
        cells = []
        for col, _ in FINAL:
            v, sd = getattr(r, col), getattr(r, f"{col}_sd")
            cells.append(f"{v:.4g}" + (f" ± {sd:.2g}" if r.gradients == "sampled" and pd.notna(sd) else ""))
        lines.append(f"| {r.case} | {r.combination} | {r.gradients} | {r.step} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def training_report_files(folder: str | Path) -> dict[str, bytes]:
    """{relative path: bytes} of the report: figures/training_<case>.png and .pdf, report.md."""
    folder = Path(folder)
    df = read_frame(read_regular(folder / "train.csv", "summary.csv"))
    files: dict[str, bytes] = {}
    figures = []
    for case in df["case"].unique():
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in case)
        fig = plot_training(df, case)
        for ext in ("png", "pdf"):
            buf = io.BytesIO()
            fig.savefig(buf, format=ext, dpi=110, metadata={"CreationDate": None} if ext == "pdf" else None)
            files[f"figures/training_{safe}.{ext}"] = buf.getvalue()
        figures.append(f"![{case}](figures/training_{safe}.png)")
    md = (f"# Training trajectories: {folder.name}\n\nExact values at every step (the policy is known); sampled "
          "rows are the mean ± sd over seeds. KL(q‖q*) is the distance to the optimum q* ∝ p·exp(reward/β) "
          "(docs/training.md).\n\n## Final values\n\n" + final_table(df) + "\n## Figures\n\n"
          + "\n\n".join(figures) + "\n")
    files["report.md"] = md.encode()
    return files
