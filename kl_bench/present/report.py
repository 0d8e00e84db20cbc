"""The report of one or more results folders: figures, the paper-style table (LaTeX booktabs and Markdown)
and a browsable report (Markdown and a self-contained HTML page); the advice (what to log, what to put in
the loss) first, as ``kl-bench run`` prints it.

:func:`build_report` returns {relative path: bytes}; :func:`report_files` picks the report of a run, a
training or an audit folder; :func:`write_report` writes it. The report is made in steps, a module each:
the folders are read (report_data), the figures drawn (report_figures), the differences between runs
taken (report_differences), and what the report says is made once (report_document.ReportDocument);
then each format's renderer writes its files from that document (report_md: table.md and report.md;
report_html: report.html; report_tex: table.tex). Adding an output format is adding one module with a
``render(doc: ReportDocument) -> {relative path: bytes}`` and naming its ``render`` in :data:`RENDERERS`.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from ..foundation.errors import SpecError
from ..foundation.formatting import plural
from ..foundation.safe_io import read_regular
from ..foundation.storage import same_path, write_folder
from ..results import folders, frame_to_csv_bytes
from . import report_figures, report_html, report_md, report_tex
from .pages import figure_files
from .report_data import load_report_results, report_frame
from .report_differences import differences
from .report_document import ReportDocument, advice_lines, captions, paper_table

# Every format's renderer, in order: render(doc: ReportDocument) -> {relative path: bytes}.
RENDERERS: tuple[Callable[[ReportDocument], dict[str, bytes]], ...] = (report_tex.render, report_md.render,
                                                                       report_html.render)


def write_report(dirs: list[Path], out: Path, key: str = "--out", **options) -> Path:
    """Build the report of ``dirs`` (:func:`report_files`; ``options``: its keywords) and write it as the
    folder ``out``, atomically (every input is read and every figure drawn first; then the folder is
    swapped in whole, kl_bench.foundation.storage). A folder it reads is refused as ``out`` (the error names
    the argument ``key``): swapped in whole, the report would replace the results (it goes beside or inside
    them: DIR/report)."""
    for d in dirs:
        if same_path(out, d):
            raise SpecError("is a results folder this report reads: give another folder (default: "
                            f"{Path(d) / 'report'})", file=str(out), key=key)
    files = report_files(dirs, **options)
    write_folder(Path(out), files, replaces=previous_figures(Path(out), files))
    return Path(out)


def previous_figures(out: Path, files: dict[str, bytes]) -> tuple[str, ...]:
    """The figure files of an earlier report in ``out`` (those its report.md shows, in any of the formats
    beside them) that this report does not write: removed with the swap, while the user's own files in
    figures/ are carried over (kl_bench.foundation.storage.write_folder). None where ``out`` holds no
    report.md that kl-bench could have written (a folder, a link, a file too large to be one)."""
    try:
        text = read_regular(Path(out) / "report.md", "run.json", "report.md").decode("utf-8", "replace")
    except (SpecError, OSError):
        return ()
    stems = {Path(name).stem for name in re.findall(r"\]\(figures/([^)/\s]+)\)", text)}
    folder = Path(out) / "figures"
    if not stems or folder.is_symlink() or not folder.is_dir():
        return ()
    old = (f"figures/{e.name}" for e in folder.iterdir()
           if Path(e.name).stem in stems and e.is_file() and not e.is_symlink())
    return tuple(sorted(name for name in old if name not in files))


def report_files(dirs: list[Path], *, formats=None, progress=None, batch: int = 64,
                 tolerance: float = 0.1) -> dict[str, bytes]:
    """{relative path: bytes} of the report of ``dirs``: a training folder's (train.csv), an audit
    folder's (audit.csv) or results folders' (:func:`build_report`). ``formats``: the figure files
    (default kl_bench.present.report_figures.FIGURE_FORMATS; PNG always, the pages show it); ``progress``: told of each figure;
    ``batch``, ``tolerance``: the advice's (kl_bench.analysis.advice)."""
    # Every report draws figures: matplotlib's shared objects are mapped before the first table is read,
    # whose CSV reader reserves ~1 GB of address space (pandas with pyarrow) that a `ulimit -v` then lacks
    # for them (tests/test_hardening_io.py: reports under a 3 GB address space).
    from . import plots  # noqa: F401
    formats = formats or report_figures.FIGURE_FORMATS
    refuse_repeated(dirs)
    kinds = [folders.kind_of(d) for d in dirs]          # what run.json says each folder is
    if kinds == ["run"] * len(dirs):
        return build_report(dirs, formats=formats, progress=progress, batch=batch, tolerance=tolerance)
    if len(dirs) > 1:
        odd, kind = next((d, k) for d, k in zip(dirs, kinds) if k != "run")
        raise SpecError(f"{folders.with_article(kind)} folder has a report of its own: give it alone, not with "
                        "other folders", file=str(odd))
    return REPORTS[kinds[0]]()(dirs[0], formats=formats, progress=progress)


def refuse_repeated(dirs: list[Path]) -> None:
    """One line naming a folder given twice (the same spelling, another one such as ./D, or a link to it):
    a report compares its folders as independent runs, and a run beside itself agrees exactly (diff 0,
    z 0), which says nothing."""
    for i, d in enumerate(dirs):
        twin = next((e for e in dirs[:i] if same_path(d, e)), None)
        if twin is not None:
            said = "is given twice" if str(twin) == str(d) else f"is {twin} again (one folder by two names)"
            raise SpecError(f"{said}: a report compares different runs, and a run beside itself would agree "
                            "exactly; give each folder once", file=str(d))


def _training_report():
    from .training_report import training_report_files
    return training_report_files


def _audit_report():
    from .audit_report import audit_report_files
    return audit_report_files


# The report of each kind of folder but runs (kl_bench.results.folders.FORMATS), loaded when used.
REPORTS: dict[str, Callable[[], Callable[..., dict[str, bytes]]]] = {"train": _training_report, "audit": _audit_report}


def summary_line(out: Path) -> str:
    """The line `kl-bench report` prints: the page to open and how many figures it shows."""
    page_name = "report.html" if (out / "report.html").exists() else "report.md"
    n = len(list((out / "figures").glob("*.png")))
    return f"report → {out}/{page_name} ({plural(n, 'figure')})"


def build_report(dirs: list[Path], *, formats=None, progress=None, batch: int = 64,
                 tolerance: float = 0.1) -> dict[str, bytes]:
    """{relative path: bytes} of the report of results folders ``dirs`` (see :func:`report_files`): the
    figures, differences.csv where there are several runs, and every renderer's files (:data:`RENDERERS`)."""
    if progress is not None:
        progress.label("reading " + ", ".join(str(d) for d in dirs))
    results = load_report_results(dirs)
    df = report_frame(results)
    short, provenance = captions(results)
    cases, rows = paper_table(df)
    figs = report_figures.build_figures(results, df, formats, progress)
    files = {path: data for name, _, by_fmt in figs for path, data in figure_files(name.removesuffix(".png"),
                                                                                    by_fmt).items()}
    diffs = differences(df) if len(results) > 1 else None
    if diffs is not None:
        files["differences.csv"] = frame_to_csv_bytes(diffs)
    doc = ReportDocument(results, df, cases, rows, short, provenance, figs, diffs,
                         advice_lines(results, batch, tolerance), batch, tolerance)
    for render in RENDERERS:
        made = render(doc)
        if clash := sorted(set(made) & set(files)):       # a new format must not overwrite another's files
            raise RuntimeError(f"{render.__module__} writes {', '.join(clash)}, which another part of the report "
                               f"already wrote")
        files.update(made)
    return files
