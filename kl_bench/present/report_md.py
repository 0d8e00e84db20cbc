"""The report's Markdown renderer: table.md (the paper table, :func:`table_md`) and report.md (the
runs, the advice, the paper table, the differences between runs, the group baselines, the figures and
the heavy tails, :func:`report_md`); names from the data escaped (pages.md_text)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..core.draws import row_label
from ..foundation.formatting import sig
from .pages import md_text, table_md as md_table_of, vector_links
from .report_data import Results
from .report_differences import DIFF_HEADER, DIFF_NOTE, difference_cells
from .report_document import (BASELINE_NOTE, GATE_NOTE, ReportDocument, gates_frame, advice_note, baselines_frame, column_heads, kl_head,
                              run_lines)


def table_md(cases, rows, caption: str) -> str:
    """The paper table in Markdown; names from the data escaped (pages.md_text: a | in a case name would
    split its cell)."""
    head = "| estimator | " + " | ".join("{} ({}) {} | {} | {} | {}".format(
        *map(md_text, kl_head(title, true)), *column_heads(true)) for _, title, true, _ in cases) + " |"
    sep = "|---|" + "---:|" * (4 * len(cases))
    body = ["| " + md_text(label) + " | " + " | ".join(md_text(c) for cell in cells for c in cell) + " |"
            for label, cells in rows]
    return "\n".join([head, sep, *body, "", f"*{md_text(caption)}*", ""])


def differences_md(diffs: pd.DataFrame) -> str:
    """The differences as a Markdown table: the same columns, order and cells as the HTML's."""
    return md_table_of(DIFF_HEADER, [difference_cells(r) for _, r in diffs.iterrows()],
                       [False] * 4 + [True] * 2)


def frame_md(df: pd.DataFrame) -> str:
    """A small DataFrame as a Markdown table: text left, numbers right, 3 significant digits."""
    num = [pd.api.types.is_numeric_dtype(df[c]) for c in df.columns]
    lines = ["| " + " | ".join(map(md_text, df.columns)) + " |", "|" + "|".join("---:" if n else "---" for n in num) + "|"]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(sig(float(v)) if n and not isinstance(v, (int, np.integer)) else md_text(v)
                                         for v, n in zip(row, num)) + " |")
    return "\n".join(lines)


def report_md(results: list[Results], md_table: str, figs, diffs: pd.DataFrame | None = None,
               advice: dict[str, list[str]] | None = None, batch: int = 64, tolerance: float = 0.1) -> str:
    out = ["# kl-bench report", ""]
    for res in results:
        out += [f"## {md_text(res.name)}", *run_lines(res), ""]
    out += _advice_lines(advice, batch, tolerance) + ["## Paper table", "", md_table]
    if diffs is not None:
        out += ["## Differences between runs", "", DIFF_NOTE, "", differences_md(diffs), ""]
    bl = baselines_frame(results)
    if bl is not None:
        out += ["## Group baselines", "", BASELINE_NOTE, "",
                frame_md(bl), ""]
    gt = gates_frame(results)
    if gt is not None:
        out += ["## Gates", "", GATE_NOTE, "", frame_md(gt), ""]
    out += ["## Figures", ""] + _figure_lines(figs)
    for res in results:
        out += _heavy_lines(res)
    return "\n".join(out)


def _advice_lines(advice: dict[str, list[str]] | None, batch: int, tolerance: float) -> list[str]:
    """The Advice section (none without advice): each case's sentences, under its name where there are several."""
    if not advice:
        return []
    out = ["## Advice", "", advice_note(batch, tolerance), ""]
    for name, lines in advice.items():
        out += ([f"### {md_text(name)}", ""] if len(advice) > 1 else []) + [f"- {line}" for line in lines] + [""]
    return out


def _figure_lines(figs) -> list[str]:
    """Each figure under its caption, with links to its vector files."""
    out = []
    for name, caption, by_fmt in figs:
        out += [f"### {md_text(caption)}", "", f"![{md_text(caption)}](figures/{name})", ""]
        links = vector_links(name.removesuffix(".png"), by_fmt)
        out += [links, ""] if links else []
    return out


def _heavy_lines(res: Results) -> list[str]:
    """A run's heavy-tailed rows, a section of their own (none where it has none)."""
    heavy = res.summary[res.summary["heavy_tail"] != ""]
    if heavy.empty:
        return []
    return [f"## Heavy tails ({md_text(res.name)})", "",
            *(f"- {md_text(r['case'])}: {md_text(row_label(r))}: {r['heavy_tail']}" for _, r in heavy.iterrows()), ""]


def render(doc: ReportDocument) -> dict[str, bytes]:
    """{"table.md": the paper table, "report.md": the report}."""
    table = table_md(doc.cases, doc.rows, doc.caption)
    return {"table.md": table.encode(),
            "report.md": report_md(doc.results, table, doc.figs, doc.diffs, doc.advice, doc.batch, doc.tolerance).encode()}
