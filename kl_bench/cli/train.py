"""``kl-bench train``: optimisation trajectories of every [train] combination (docs/training.md)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import DEFAULT_RUNS, Command, app, out_console, user_errors


@app.command(cls=Command)
def train(spec: Path = typer.Argument(..., metavar="SPEC", help="spec with a [train] table (TOML)", show_default=False),
          out: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="results folder [default: runs/<name>/]"),
          seed: Optional[int] = typer.Option(None, "--seed", metavar="S", help="override [experiment] seed"),
          device: Optional[str] = typer.Option(None, "--device", metavar="DEVICE", help="override [experiment] device"),
          quiet: bool = typer.Option(False, "--quiet", "-q", help="no summary lines")) -> None:
    """Train the policy of every case with each [train] combination (exact and/or sampled updates) and write
    train.csv and run.json atomically (docs/training.md). One process: under torchrun it refuses to start."""
    from ..distributed import env_world, one_process
    with user_errors():
        # Under torchrun: refused before the spec is read; rank 0 says why in one line, the others exit quietly.
        world = env_world()
        if world is not None and world[0] != 0:
            raise typer.Exit(2)
        one_process("kl-bench train", str(spec))
    from .. import api
    from ..spec import load_spec
    from ..storage import check_output_dir, output_dir
    with user_errors():
        sp = load_spec(spec)
        out_dir = check_output_dir(output_dir(out if out is not None else DEFAULT_RUNS / sp.experiment.name))
        result = api.train(sp, seed=seed, device=device)
        result.write(out_dir)
    if not quiet:
        for line in result.summary_lines():
            out_console.print(line, markup=False)
        out_console.print(f"→ {out_dir}/train.csv", markup=False)
