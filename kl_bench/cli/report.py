"""``kl-bench report``: figures, the paper tables and report.html from results folders."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import DEFAULT_RUNS, Command, advice_options, app, user_errors, write_report
from .common import batch_option, quiet_option, tolerance_option


@app.command(cls=Command)
def report(dirs: list[Path] = typer.Argument(..., metavar="DIR", show_default=False,
                                             help="one or more results folders written by `kl-bench run` (or one "
                                             "folder of `kl-bench train` or of an audit)"),
           out: Optional[Path] = typer.Option(None, "--out", help="report folder [default: DIR/report, or "
                                              "runs/report for several folders]"),
           formats: str = typer.Option("png", "--formats", metavar="LIST",
                                       help="figure files to write, comma-separated from png, pdf, svg (PDF and SVG: "
                                       "vectors for a paper; PNG is always written, the pages show it)"),
           batch: int = batch_option(),
           tolerance: float = tolerance_option(),
           quiet: bool = quiet_option("no progress line and no summary line")) -> None:
    """Plots, the paper-style table (LaTeX and Markdown), the advice and a self-contained report.html from
    results folders (a training or audit folder: its figures, report.md and report.html)."""
    from ..present.pages import parse_formats
    advice_options(batch, tolerance)
    with user_errors():
        chosen = parse_formats(formats)
    target = out or (dirs[0] / "report" if len(dirs) == 1 else DEFAULT_RUNS / "report")
    write_report(dirs, target, quiet, formats=chosen, batch=batch, tolerance=tolerance)
