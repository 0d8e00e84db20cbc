"""``kl-bench report``: figures, the paper tables and report.html from results folders."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import DEFAULT_RUNS, Command, app, write_report


@app.command(cls=Command)
def report(dirs: list[Path] = typer.Argument(..., metavar="DIR", show_default=False,
                                             help="one or more results folders written by `kl-bench run`"),
           out: Optional[Path] = typer.Option(None, "--out", help="report folder [default: DIR/report, or "
                                              "runs/report for several folders]")) -> None:
    """Plots, the paper-style table (LaTeX and Markdown) and a browsable report from results folders."""
    target = out or (dirs[0] / "report" if len(dirs) == 1 else DEFAULT_RUNS / "report")
    write_report(dirs, target)
