"""The report's HTML renderer: report.html, one self-contained page (pages.page: one style sheet, escaped
text, figures embedded, tables that scroll in their own box) with what report.md says and a table of
every row (:func:`report_html`)."""
from __future__ import annotations

import pandas as pd

from ..foundation.formatting import sig
from .cells import with_reference
from .pages import figure_html, html_inline, html_text, page, scroll, table_html
from .report_differences import DIFF_HEADER, DIFF_NOTE, difference_cells
from .report_document import (BASELINE_NOTE, GATE_NOTE, ROW_HEADER, ReportDocument, gates_frame, advice_note, baselines_frame, column_heads,
                              kl_head, row_cells, run_lines)


def differences_html(diffs: pd.DataFrame) -> str:
    return table_html(DIFF_HEADER, [difference_cells(r) for _, r in diffs.iterrows()], classes="diffs")


def _paper_table_html(cases, rows) -> str:
    table = ["<table class='paper'><tr><th></th>" + "".join(
        "<th colspan='4'>{} ({})</th>".format(*map(html_text, kl_head(title, true))) for _, title, true, _ in cases)
        + "</tr>", "<tr><th>estimator</th>" + "".join(f"<th>{html_text(h)}</th>" for _, _, true, _ in cases
                                                       for h in column_heads(true)) + "</tr>"]
    for label, cells in rows:
        table.append(f"<tr><td>{html_text(label)}</td>" + "".join(f"<td>{html_text(c)}</td>" for cell in cells
                                                                   for c in cell) + "</tr>")
    table.append("</table>")
    return scroll("\n".join(table))


def report_html(results, df, figs, caption, cases, rows, diffs=None, advice=None, batch: int = 64,
                 tolerance: float = 0.1) -> str:
    parts = []
    for res in results:
        parts.append(f"<h2>{html_text(res.name)}</h2><ul>" + "".join(
            f"<li>{html_inline(line[2:])}</li>" for line in run_lines(res)) + "</ul>")
    parts += _advice_parts(advice, batch, tolerance)
    parts.append("<h2>Paper table</h2>" + _paper_table_html(cases, rows))
    parts.append(f"<p class='caption'>{html_inline(caption)}</p>")
    if diffs is not None:
        parts.append(f"<h2>Differences between runs</h2><p>{html_text(DIFF_NOTE)}</p>" + differences_html(diffs))
    bl = baselines_frame(results)
    if bl is not None:
        parts.append(f"<h2>Group baselines</h2><p>{html_text(BASELINE_NOTE)}</p>" + scroll(bl.to_html(
            index=False, float_format=lambda x: sig(x, 3), na_rep="", border=0, classes="rows").replace("`", "&#96;")))
    gt = gates_frame(results)
    if gt is not None:
        parts.append(f"<h2>Gates</h2><p>{html_text(GATE_NOTE)}</p>" + scroll(gt.to_html(
            index=False, na_rep="", border=0, classes="rows").replace("`", "&#96;")))
    parts.append("<h2>Figures</h2>")
    parts += [figure_html(name, cap, by_fmt["png"]) for name, cap, by_fmt in figs]
    parts.append("<h2>All rows</h2>" + _all_rows(df, len(results) > 1))
    return page("kl-bench report", parts)


def _advice_parts(advice: dict[str, list[str]] | None, batch: int, tolerance: float) -> list[str]:
    """The Advice section (none without advice): each case's sentences, under its name where there are several."""
    if not advice:
        return []
    return [f"<h2>Advice</h2><p>{html_inline(advice_note(batch, tolerance))}</p>"] + [
        (f"<h3>{html_text(name)}</h3>" if len(advice) > 1 else "") + "<ul class='advice'>"
        + "".join(f"<li>{html_text(line)}</li>" for line in lines) + "</ul>" for name, lines in advice.items()]


def _all_rows(df: pd.DataFrame, several: bool) -> str:
    """Every row of every run (a run column only for ``several`` runs: one would repeat its name on every row),
    rows without an exact value against the reference, as the paper table."""
    header = (["run"] if several else []) + ROW_HEADER
    body = [([str(r["run"])] if several else []) + row_cells(r) for _, r in with_reference(df).iterrows()]
    return table_html(header, body)


def render(doc: ReportDocument) -> dict[str, bytes]:
    """{"report.html": the report as one self-contained page}."""
    return {"report.html": report_html(doc.results, doc.df, doc.figs, doc.caption, doc.cases, doc.rows, doc.diffs,
                                       doc.advice, doc.batch, doc.tolerance).encode()}
