"""Command-line interface: a thin layer over the Python API (kl_bench.api), which does the work.

Heavy modules (pandas, scipy, matplotlib) are imported inside the commands that need them, so that
``kl-bench --help`` and ``kl-bench list`` start quickly.
"""
from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console

from .errors import SpecError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="kl-bench: bias, variance and failure modes of Monte Carlo KL estimators, "
                       "measured next to the exact truth.")
out_console = Console(highlight=False, width=200)
err_console = Console(stderr=True, highlight=False)


def _fail(err: SpecError) -> None:
    err_console.print(f"error: {err}", markup=False, soft_wrap=True)
    raise typer.Exit(2)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    try:
        yield
    except SpecError as e:
        _fail(e)


def _warn_infinite(df, console: Console) -> None:
    """One warning per case and kind of trouble, naming the estimators."""
    from .draws import row_label
    from .stats import HeavyTail
    reasons = {h.value: h.explanation for h in HeavyTail if h not in (HeavyTail.NONE, HeavyTail.SUPPORT_MISS)}
    for case in dict.fromkeys(df["case"]):
        c = df[df["case"] == case]
        miss = c["support_miss"].max() if "support_miss" in c else 0.0
        if miss > 0:
            weighted = (c["heavy_tail"] == HeavyTail.SUPPORT_MISS.value).any()
            console.print(f"warning: case '{case}': the sampler never draws {miss:.3g} of q's mass (worst "
                          f"context or step): " + ("the importance weight q/b is infinite there, so the "
                          "weighted estimates miss that mass (flagged heavy_tail)" if weighted else
                          "every estimate is biased; the exact bias is shown"), markup=False)
        for target in dict.fromkeys(c.loc[c["true_kl"] == math.inf, "target"]):
            names = ", ".join(row_label(r) for _, r in c[c["target"] == target].iterrows())
            console.print(f"warning: case '{case}': {target} is infinite (a zero probability where the other "
                          f"side has mass); {names} cannot estimate it", markup=False)
        if "heavy_tail" not in c:
            continue
        for kind, text in reasons.items():
            hit = c[(c["heavy_tail"] == kind) & (c["true_kl"] != math.inf)]
            if not hit.empty:
                names = ", ".join(row_label(r) for _, r in hit.iterrows())
                console.print(f"warning: case '{case}': {names}: {text}; measured std and se are not "
                              f"trustworthy", markup=False)


@app.command()
def run(spec: Path = typer.Argument(..., help="experiment spec (TOML)"),
        out: Optional[Path] = typer.Option(None, "--out", help="results folder [default: results/<name>/]"),
        draws: Optional[int] = typer.Option(None, "--draws", help="override [experiment] draws (per case)"),
        seed: Optional[int] = typer.Option(None, "--seed", help="override [experiment] seed"),
        device: Optional[str] = typer.Option(None, "--device", help="override [experiment] device: auto|cpu|cuda|cuda:N"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar and no tables"),
        report_: bool = typer.Option(False, "--report", help="then write the report into DIR/report/"),
        resume: bool = typer.Option(False, "--resume", help="continue an interrupted run from its checkpoint"),
        checkpoint_every: float = typer.Option(30.0, "--checkpoint-every", metavar="SECONDS",
                                               help="write a checkpoint at most this often (0: never)")) -> None:
    """Sample every case of SPEC and write summary.csv, run.json (and batches.csv, reservoir.npz,
    lambda_sweep.csv) into the results folder, atomically."""
    from .api import execute, prepare
    from .progress import LazyProgress
    from .storage import FolderLock, checkpoint_identity, clean_stale, load_checkpoint, remove_checkpoint, save_checkpoint
    with _user_errors():
        if not checkpoint_every >= 0:
            raise SpecError(f"must be ≥ 0, got {checkpoint_every}", key="--checkpoint-every")
        prep = prepare(spec, draws=draws, seed=seed, device=device)
    sp = prep.spec
    out_dir = out or Path("results") / sp.experiment.name
    case_draws = sp.case_draws()
    identity = checkpoint_identity(sp, prep.device, case_draws)
    with _user_errors(), FolderLock(out_dir):
        clean_stale(out_dir)
        done = load_checkpoint(out_dir, identity) if resume else {}
        state = dict(done)
        last = [time.monotonic()]

        def on_sums(case: str, sums) -> None:
            state[case] = sums
            if checkpoint_every and time.monotonic() - last[0] >= checkpoint_every:
                save_checkpoint(out_dir, identity, state)
                last[0] = time.monotonic()

        progress = LazyProgress(sum(case_draws), enabled=not quiet, console=err_console)
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            result = execute(prep, progress=progress.advance, resume=done, on_sums=on_sums)
        except KeyboardInterrupt:
            progress.close()
            if checkpoint_every and state:
                save_checkpoint(out_dir, identity, state)
            err_console.print(f"interrupted: no results were written; earlier results in {out_dir} are untouched"
                              + ("; continue with --resume" if checkpoint_every and state else ""))
            raise typer.Exit(130) from None
        finally:
            progress.close()
            signal.signal(signal.SIGTERM, previous)
        result.write_files(out_dir)
        remove_checkpoint(out_dir)
    if not quiet:
        from .display import gradient_table, print_tables
        df = result.summary
        lengths = {name: meta["length"] for name, meta in result.envelope["cases"].items() if meta.get("length")}
        print_tables(out_console, df, result.descriptions(), lengths=lengths)
        if result.gradients is not None:
            out_console.print()
            out_console.print(gradient_table(result.gradients))
        _warn_infinite(df, err_console)
        out_console.print(f"\n{result.draws:,} draws in {result.outcome.wall:.1f} s "
                          f"({result.envelope['draws_per_second']:,} draws/s on {prep.device}) → {out_dir}/summary.csv")
    if report_:
        _write_report([out_dir], out_dir / "report", quiet)


def _write_report(dirs: list[Path], out: Path, quiet: bool = False) -> None:
    from .report import write_report
    with _user_errors():
        write_report(dirs, out)
    if not quiet:
        out_console.print(f"report → {out}/report.html ({len(list((out / 'figures').glob('*.png')))} figures)")


@app.command()
def report(dirs: list[Path] = typer.Argument(..., help="one or more results folders written by `kl-bench run`"),
           out: Optional[Path] = typer.Option(None, "--out", help="report folder [default: DIR/report, or "
                                              "results/report for several folders]")) -> None:
    """Plots, the paper-style table (LaTeX and Markdown) and a browsable report from results folders."""
    target = out or (dirs[0] / "report" if len(dirs) == 1 else Path("results") / "report")
    _write_report(dirs, target)


def _summary_for(spec_path: Path, results: Optional[Path], draws, seed, device, quiet: bool):
    """(spec, summary DataFrame, spec sha256 of the results): from --results DIR, or by running the spec."""
    from .api import load, run
    with _user_errors():
        sp = load(spec_path, draws=draws, seed=seed, device=device)
        if results is not None:
            from .report import load_results
            res = load_results(results)
            if res.envelope.get("spec_sha256") != sp.sha256:
                out_console.print(f"note: {results} was produced by a different version of {spec_path} "
                                  f"(spec sha256 {str(res.envelope.get('spec_sha256'))[:12]}… vs {sp.sha256[:12]}…)",
                                  markup=False)
            return sp, res.summary
        result = run(sp, progress=not quiet)
    return sp, result.summary


@app.command()
def check(spec: Path = typer.Argument(..., help="experiment spec (TOML)"),
          baseline: Optional[Path] = typer.Option(None, "--baseline", help="baseline JSON [default: "
                                                  "results/baselines/<name>.json when it exists]"),
          results: Optional[Path] = typer.Option(None, "--results", help="check this results folder instead of running"),
          alpha: float = typer.Option(0.001, "--alpha", help="family-wise error rate (Holm)"),
          seed: Optional[int] = typer.Option(None, "--seed", help="override [experiment] seed"),
          draws: Optional[int] = typer.Option(None, "--draws", help="override [experiment] draws"),
          device: Optional[str] = typer.Option(None, "--device", help="override [experiment] device"),
          quiet: bool = typer.Option(False, "--quiet", "-q", help="print only failures and the verdict")) -> None:
    """Statistical regression gate: every statistic against its exact value and a stored baseline.
    Exit 0 when all pass, 1 when any fails, 2 for bad input."""
    from . import api
    with _user_errors():
        if not 0 < alpha < 1:
            raise SpecError(f"must lie in (0, 1), got {alpha}", key="--alpha")
        sp0 = api.load(spec)
        base_path = baseline or Path("results") / "baselines" / f"{sp0.experiment.name}.json"
        use_base = baseline is not None or base_path.exists()
        if use_base:
            from .gate import load_baseline
            load_baseline(base_path)          # a broken baseline fails before any sampling
    sp, df = _summary_for(spec, results, draws, seed, device, quiet=True)
    with _user_errors():
        rep = api.check(df, base_path if use_base else None, alpha, spec_sha256=sp.sha256)
    if not quiet:
        from rich.table import Table
        t = Table(show_edge=False, pad_edge=False, title=f"{len(rep.comparisons)} comparisons, family-wise α = "
                  f"{alpha:g} (Holm)", title_justify="left")
        for col in ["row", "statistic", "value", "reference", "z", "|z| limit", "result"]:
            t.add_column(col, justify="left" if col in ("row", "statistic", "result") else "right")
        for c in rep.comparisons:
            t.add_row(c.row, c.statistic, f"{c.value:.6g}", f"{c.reference:.6g}", f"{c.z:+.2f}",
                      f"{c.threshold:.2f}", "pass" if c.passed else "[bold red]FAIL[/]")
        out_console.print(t)
    for note in rep.notes:
        out_console.print(f"note: {note}", markup=False)
    for c in rep.failures:
        out_console.print(f"FAIL {c.sentence()}", markup=False)
    out_console.print(rep.verdict, markup=False)
    if not rep.passed:
        raise typer.Exit(1)


@app.command()
def baseline(spec: Path = typer.Argument(..., help="experiment spec (TOML)"),
             out: Optional[Path] = typer.Option(None, "--out", help="baseline JSON [default: results/baselines/<name>.json]"),
             results: Optional[Path] = typer.Option(None, "--results", help="take the numbers from this results folder")) -> None:
    """Run SPEC (or read --results) and store its statistics as a versioned JSON baseline."""
    from .gate import baseline_bytes, make_baseline
    from .storage import atomic_write_bytes
    sp, df = _summary_for(spec, results, None, None, None, quiet=False)
    target = out or Path("results") / "baselines" / f"{sp.experiment.name}.json"
    atomic_write_bytes(target, baseline_bytes(make_baseline(df, sp)))
    out_console.print(f"baseline of {len(df)} rows → {target}", markup=False)


@app.command()
def exact(spec: Path = typer.Argument(..., help="experiment spec (TOML)"),
          out: Optional[Path] = typer.Option(None, "--out", help="also write the exact table to this CSV file")) -> None:
    """Print the exact KL and estimator moments of every case, without sampling."""
    from . import api
    from .display import print_tables
    with _user_errors():
        df = api.exact(spec)
    print_tables(out_console, df, df.attrs["descriptions"], exact_only=True)
    _warn_infinite(df, err_console)
    if out is not None:
        from .results import frame_to_csv_bytes
        from .storage import atomic_write_bytes
        atomic_write_bytes(out, frame_to_csv_bytes(df))
        out_console.print(f"→ {out}")


@app.command("list")
def list_() -> None:
    """List the registered estimators, pair-supplied rows and case kinds, one line each."""
    from .estimators import ESTIMATORS, PAIR_ROWS
    from .pairs import CASE_KINDS
    for name, e in [*ESTIMATORS.items(), *PAIR_ROWS.items()]:
        what = "row      " if e.analytic else "estimator"
        out_console.print(f"{what}  {name:<8} {e.formula:<26} target {e.target}"
                          f"{'  unbiased' if e.unbiased else '  biased'}{'  ≥0' if e.nonnegative else ''}",
                          markup=False)
    for name, k in CASE_KINDS.items():
        out_console.print(f"kind       {name:<12} {k.description}", markup=False)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err_console.print("interrupted: nothing was written")
        sys.exit(130)


if __name__ == "__main__":
    main()
