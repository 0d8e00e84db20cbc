"""``kl-bench train``: optimisation trajectories of every [train] combination (docs/training.md)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import typer

from .common import Command, app, err_console, out_console, stale_report_note, user_errors
from .common import device_option, quiet_option, seed_option


@app.command(cls=Command)
def train(spec: Path = typer.Argument(..., metavar="SPEC", help="spec with a [train] table (TOML)", show_default=False),
          out: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="results folder [default: runs/<name>/]"),
          seed: Optional[int] = seed_option(),
          device: Optional[str] = device_option(),
          quiet: bool = quiet_option("no progress line and no summary lines")) -> None:
    """Train the policy of every case with each [train] combination (exact and/or sampled updates) and write
    train.csv and run.json atomically (docs/training.md). Under torchrun the trajectories and sampled runs are
    split across the processes and rank 0 writes: the same bytes as one process."""
    from ..engine.distributed import env_world
    world = env_world()
    quiet_rank = world is not None and world[0] != 0        # only rank 0 speaks
    from ..api.run_folder import train_to_folder
    with _errors(quiet_rank):
        result = train_to_folder(spec, out, seed=seed, device=device, progress=not (quiet or quiet_rank),
                                 console=err_console)        # a progress line on a terminal's stderr only
        if result is None:                                   # another rank of the job: rank 0 writes
            return
    from ..present.terminal import prose
    if not quiet:
        for line in result.summary_lines():
            prose(out_console, line)
        out_console.print(f"→ {result.path}/train.csv", markup=False)
    for line in result.warnings():
        prose(err_console, line)
    stale_report_note(result.path)


@contextlib.contextmanager
def _errors(quiet_rank: bool):
    """One line, exit 2, for bad input; a rank other than 0 of a torchrun job exits 2 without a word
    (every rank finds the same error: one line is enough)."""
    if not quiet_rank:
        with user_errors():
            yield
        return
    from ..foundation.errors import SpecError
    try:
        yield
    except SpecError:
        raise typer.Exit(2) from None
