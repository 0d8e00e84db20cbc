"""``kl-bench audit DIR``: saved training steps against the exact KL (docs/audit.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import Command, app, err_console, int_flag, out_console, quiet_option, user_errors


@app.command("audit", cls=Command)
def audit(folder: Path = typer.Argument(..., metavar="DIR", help="folder of step-*.safetensors files, or a KLAudit results folder "
                                             "(docs/audit.md)",
                                        show_default=False),
          out: Optional[Path] = typer.Option(None, "--out", help="results folder (default: DIR/audit)"),
          tile: Optional[int] = typer.Option(None, "--tile", parser=int_flag, help="vocabulary ids per tile (hidden-state steps, "
                                             "read on the CPU: default 4096)", show_default=False),
          chunk: Optional[int] = typer.Option(None, "--chunk", parser=int_flag, help="positions per chunk (hidden-state steps, "
                                              "read on the CPU: default 256)", show_default=False),
          quiet: bool = quiet_option("no progress line (there is none in a pipe)")) -> None:
    """Audit saved training steps: the trainer's KL against the exact KL, bias by source, z, consistency.

    DIR: a folder of step-*.safetensors files, or the results folder KLAudit(out=DIR) writes (its steps/
    with save_steps=True are audited again; without them, its audit.csv is read back and its verdicts
    printed). Exit 0 when every check passes, 1 when any fails (a step's or the pooled |z|, the
    consistency check, the rollout engine, the trainer's formula), 2 for bad input; warnings about
    settings (the sampler, dropout, bf16) do not fail the run."""
    from ..audit.offline_command import audit_command
    from ..foundation.progress import LazyProgress
    from ..present.terminal import prose
    bar = LazyProgress(0, enabled=not quiet, console=err_console, unit="steps")
    with user_errors():
        try:
            outcome = audit_command(folder, out, tile=tile, chunk=chunk, echo=lambda s: prose(out_console, s),
                                    progress=bar)
        finally:
            bar.close()
    if outcome.written is not None:
        prose(out_console, f"→ {outcome.written}")
    if outcome.failed:
        raise typer.Exit(1)
