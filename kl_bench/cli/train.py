"""``kl-bench train``: optimisation trajectories of every [train] combination (docs/training.md)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import typer

from .common import DEFAULT_RUNS, Command, app, err_console, out_console, user_errors


@app.command(cls=Command)
def train(spec: Path = typer.Argument(..., metavar="SPEC", help="spec with a [train] table (TOML)", show_default=False),
          out: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="results folder [default: runs/<name>/]"),
          seed: Optional[int] = typer.Option(None, "--seed", metavar="S", help="override [experiment] seed"),
          device: Optional[str] = typer.Option(None, "--device", metavar="DEVICE", help="override [experiment] device"),
          quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress line and no summary lines")) -> None:
    """Train the policy of every case with each [train] combination (exact and/or sampled updates) and write
    train.csv and run.json atomically (docs/training.md). Under torchrun the trajectories and sampled runs are
    split across the processes and rank 0 writes: the same bytes as one process."""
    from ..distributed import env_world
    world = env_world()
    quiet_rank = world is not None and world[0] != 0        # only rank 0 speaks
    from .. import api
    from ..spec import load_spec
    from ..storage import check_output_dir, output_dir
    with _errors(quiet_rank):
        sp = load_spec(spec)
        out_dir = check_output_dir(output_dir(out if out is not None else DEFAULT_RUNS / sp.experiment.name))
        progress = not (quiet or quiet_rank)          # a line on a terminal's stderr, none in a pipe
        result = api.train(sp, seed=seed, device=device, progress=progress, console=err_console) if world is None \
            else _train_ranks(sp, seed, device, progress)
        if result is None:                                   # another rank of the job: rank 0 writes
            return
        result.write(out_dir)
    if not quiet:
        for line in result.summary_lines():
            out_console.print(line, markup=False)
        out_console.print(f"→ {out_dir}/train.csv", markup=False)


def _train_ranks(sp, seed, device, progress: bool):
    """The job's share of this process (kl_bench.training.train_rows): rank 0 gets the result."""
    from .. import api
    from ..distributed import RankFailure, start, stop
    from ..errors import SpecError
    dev = api.resolve_device(device or sp.experiment.device, str(sp.path),
                             "--device" if device is not None else "experiment.device")
    try:
        ranks, dev = start(dev)
        return api.train(sp, seed=seed, device=str(dev), ranks=ranks, progress=progress, console=err_console)
    except RankFailure as e:
        raise SpecError(str(e)) from None
    finally:
        stop()


@contextlib.contextmanager
def _errors(quiet_rank: bool):
    """One line, exit 2, for bad input; a rank other than 0 of a torchrun job exits 2 without a word
    (every rank finds the same error: one line is enough)."""
    if not quiet_rank:
        with user_errors():
            yield
        return
    from ..errors import SpecError
    try:
        yield
    except SpecError:
        raise typer.Exit(2) from None
