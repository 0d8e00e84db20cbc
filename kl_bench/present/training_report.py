"""The report of a training folder (``kl-bench report DIR`` where DIR holds train.csv): one figure per case,
report.md and a self-contained report.html (the figures embedded) with the combination that ends closest to
the optimum q* of every case, the final values of every combination and the figures."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..foundation.formatting import fmt, plural
from .pages import DEFAULT_FORMATS, figure_bytes, figure_files, figure_html, html_text, page, table_html, table_md
from .pages import file_stems, md_text, vector_links
from ..results import folders
from .training_plots import plot_training
from ..training.result import final_rows, summary_lines

FINAL = [("kl_rev", "KL(q‖p)"), ("kl_fwd", "KL(p‖q)"), ("entropy", "entropy"), ("reward", "E[reward]"),
         ("objective", "J"), ("kl_opt", "KL(q‖q*)")]
INTRO = ("Exact values at every step (the policy is known); sampled rows are the mean ± sd over seeds. KL(q‖q*) "
         "is the distance to the optimum q* ∝ p·exp(reward/β) (docs/training.md): the combinations are ranked by it.")


def final_cells(df: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """(header, rows): per case and combination, the last step's values (sampled: mean ± sd over seeds)."""
    header = ["case", "combination", "gradients", "step", *(label for _, label in FINAL)]
    rows = []
    for r in final_rows(df).itertuples():
        cells = []
        for col, _ in FINAL:
            v, sd = getattr(r, col), getattr(r, f"{col}_sd")
            # the one number format (foundation.formatting.fmt): "8.576e-5", never "8.576e-05" beside "0.0001261"
            cells.append(fmt(v, 4) + (f" ± {fmt(sd, 2)}" if r.gradients == "sampled" and pd.notna(sd) else ""))
        rows.append([str(r.case), str(r.combination), str(r.gradients), str(r.step), *cells])
    return header, rows


def final_table(df: pd.DataFrame) -> str:
    """Markdown: per case and combination, the last step's values (sampled: mean ± sd over seeds)."""
    header, rows = final_cells(df)
    return table_md(header, rows, [False] * 3 + [True] * (1 + len(FINAL))) + "\n"


def _figures(df: pd.DataFrame, formats, progress) -> list[tuple[str, str, dict[str, bytes]]]:
    """[(file name (.png), case, {format: bytes})], one figure per case."""
    cases = list(df["case"].unique())
    if progress is not None:
        progress.set_total(len(cases))
    out = []
    stems = file_stems(cases)           # one file per case, whatever its name (pages.file_stems)
    for case in cases:
        safe = stems[str(case)]
        if progress is not None:
            progress.label(f"training_{safe}.png")
        out.append((f"training_{safe}.png", case, figure_bytes(plot_training(df, case), formats)))
        if progress is not None:
            progress.advance(1)
    return out


def training_report_files(folder: str | Path, formats=DEFAULT_FORMATS, progress=None) -> dict[str, bytes]:
    """{relative path: bytes} of the report: figures/training_<case>.<format> (``formats``: PNG by default;
    PDF, SVG), report.md and report.html. ``progress``: told of each figure."""
    stored = folders.read(folder, "train")            # verified: run.json, every file against its sha256
    folder, df = stored.path, folders.read_table(stored, "train.csv")
    figs = _figures(df, formats, progress)
    files = {path: data for name, _, by_fmt in figs for path, data in figure_files(name[:-4], by_fmt).items()}
    title = f"Training trajectories: {folder.name}"
    closest = summary_lines(df)
    header, rows = final_cells(df)
    md = [f"# {md_text(title)}", "", INTRO, "", "## Closest to the optimum", "", *[f"- {md_text(line)}" for line in closest], "",
          "## Final values", "", final_table(df), f"## Figures ({plural(len(figs), 'case')})", ""]
    for name, case, by_fmt in figs:
        links = vector_links(name[:-4], by_fmt)
        md += [f"![{md_text(case)}](figures/{name})", ""] + ([links, ""] if links else [])
    files["report.md"] = "\n".join(md).encode()
    parts = [f"<p>{html_text(INTRO)}</p>", "<h2>Closest to the optimum</h2><ul>"
             + "".join(f"<li>{html_text(line)}</li>" for line in closest) + "</ul>",
             "<h2>Final values</h2>" + table_html(header, rows), "<h2>Figures</h2>"]
    parts += [figure_html(name, f"{case}: every combination against the step", by_fmt["png"])
              for name, case, by_fmt in figs]
    files["report.html"] = page(title, parts).encode()
    return files
