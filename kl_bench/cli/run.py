"""``kl-bench run``: :func:`kl_bench.api.run_folder.run_to_folder`, then the tables, warnings and advice."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer

from .common import (Command, advice_options, advise, app, err_console, float_flag, interrupted,
                     out_console, stale_report_note, user_errors, warn_rows, write_report)
from .common import batch_option, device_option, draws_option, quiet_option, seed_option, tolerance_option


@app.command(cls=Command)
def run(spec: Path = typer.Argument(..., metavar="SPEC", help="experiment spec (TOML)", show_default=False),
        out: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="results folder [default: runs/<name>/]"),
        draws: Optional[str] = draws_option("draws for every case (1e7 and 10_000_000 work, as in a spec): "
                                            "replaces [experiment] draws and each case's own draws"),
        seed: Optional[int] = seed_option(),
        device: Optional[str] = device_option(),
        quiet: bool = quiet_option("no progress bar and no tables"),
        report_: bool = typer.Option(False, "--report", help="then write the report into DIR/report/"),
        resume: bool = typer.Option(False, "--resume", help="continue an interrupted run from its checkpoint"),
        checkpoint_every: float = typer.Option(30.0, "--checkpoint-every", parser=float_flag, metavar="SECONDS",
                                               help="write a checkpoint at most this often (> 0; inf: never)"),
        no_checkpoint: bool = typer.Option(False, "--no-checkpoint", help="never write a checkpoint"),
        wide: bool = typer.Option(False, "--wide", help="the full per-case tables whatever the width (summary.csv: every column)"),
        batch: int = batch_option(),
        tolerance: float = tolerance_option()) -> None:
    """Sample every case of SPEC and write summary.csv, run.json (and batches.csv, reservoir.npz,
    lambda_sweep.csv) into the results folder, atomically. Under torchrun the batches are split across
    the processes and rank 0 writes the very bytes one process would (docs/ci.md, "Scaling out")."""
    from ..foundation.errors import SpecError
    from ..api.run_folder import RankFailed, RefusedByRankZero, RunInterrupted, run_to_folder
    advice_options(batch, tolerance)
    with user_errors():
        if not checkpoint_every > 0:          # also refuses NaN
            raise SpecError(f"must be > 0 (inf, or --no-checkpoint: never), got {checkpoint_every}",
                            key="--checkpoint-every")
        if report_ and out is not None:       # a report folder that cannot be written: said before sampling
            from ..foundation.output_paths import check_output_dir
            check_output_dir(Path(out) / "report", key="--report")
        try:
            result = run_to_folder(spec, out, draws=draws, seed=seed, device=device, resume=resume,
                                   checkpoint_every=math.inf if no_checkpoint else checkpoint_every,
                                   progress=not quiet, console=err_console)
        except RunInterrupted as e:
            interrupted(e.message)
        except RankFailed as e:
            err_console.print(f"error: {e}", markup=False)
            raise typer.Exit(1)
        except RefusedByRankZero:
            raise typer.Exit(2)
    if result is None:          # a rank other than 0 of a torchrun job: rank 0 reports
        return
    if not quiet:
        show_run(result, wide, batch, tolerance)
    if report_:
        write_report([result.path], result.path / "report", quiet, batch=batch, tolerance=tolerance)
    else:
        stale_report_note(result.path)


def show_run(result, wide: bool, batch: int, tolerance: float) -> None:
    """What a person reads after a run: the tables, the warnings, the advice, and the time it took."""
    from ..present.run_tables import BASELINE_KEYS, GATE_KEYS, GRADIENT_KEYS, baseline_table, gate_table, gradient_table
    from ..present.tables import print_tables
    from ..present.terminal import prose, show
    from ..foundation.formatting import plural
    df = result.summary
    lengths = {name: meta["length"] for name, meta in result.envelope["cases"].items() if meta.get("length")}
    print_tables(out_console, df, result.descriptions(), lengths=lengths, wide=wide)
    if result.gradients is not None:
        show(out_console, gradient_table(result.gradients), wide, keys=GRADIENT_KEYS)
        out_console.print()
    if result.group_baselines is not None:
        show(out_console, baseline_table(result.group_baselines), wide, keys=BASELINE_KEYS)
        out_console.print()
    if result.gates is not None:
        show(out_console, gate_table(result.gates), wide, keys=GATE_KEYS)
        out_console.print()
    warn_rows(df, err_console)
    advise(result.recommendations(batch=batch, tolerance=tolerance))
    env = result.envelope
    total = (f", {result.outcome.wall:.1f} s in all" if result.outcome.wall > 1.2 * env["sampling_seconds"] + 0.5
             else "")
    cases = f" over {plural(len(result.pairs), 'case')}" if len(result.pairs) > 1 else ""
    restored = env.get("restored_draws", 0)       # --resume: restored draws took no time here
    kept = f" ({restored:,} more restored from the checkpoint)" if restored else ""
    out_console.print()
    prose(out_console, f"{plural(result.draws - restored, 'draw')}{cases} sampled in {env['sampling_seconds']:.1f} s "
          f"({env['draws_per_second']:,} draws/s on {result.device}){kept}{total} → {result.path}/summary.csv")
