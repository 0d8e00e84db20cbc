"""Command-line interface (a thin layer): run, exact, list."""
from __future__ import annotations

import contextlib
import datetime as _dt
import math
import platform
import subprocess
import sys
import time
import signal
from importlib import metadata
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from . import __version__
from .display import print_tables
from .draws import row_label
from .engine import resolve_device
from .errors import SpecError
from .estimators import ESTIMATORS, resolve_estimator
from .pairs import CASE_KINDS, build_pair
from .results import atomic_write_bytes, exact_rows, frame_to_csv_bytes, to_frame, write_results
from .spec import load_spec, with_overrides

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="kl-bench: bias, variance and failure modes of Monte Carlo KL estimators, "
                       "measured next to the exact truth.")
out_console = Console(highlight=False, width=200)
err_console = Console(stderr=True, highlight=False)

# Show the progress bar only once a run has lasted this long.
_PROGRESS_AFTER_S = 2.0


def _fail(err: SpecError) -> None:
    err_console.print(f"error: {err}", markup=False, soft_wrap=True)
    raise typer.Exit(2)


class _LazyProgress:
    """A rich progress bar that appears only after a couple of seconds (and never with --quiet)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.done = total, enabled, 0
        self.t0 = time.perf_counter()
        self.bar: Progress | None = None

    def advance(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is None and time.perf_counter() - self.t0 > _PROGRESS_AFTER_S:
            self.bar = Progress(TextColumn("draws"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                console=err_console, transient=True)
            self.bar.start()
            self.task = self.bar.add_task("run", total=self.total, completed=self.done)
        elif self.bar is not None:
            self.bar.update(self.task, completed=self.done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "kl-bench": __version__}
    for pkg in ("torch", "numpy", "scipy", "pandas"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    try:
        yield
    except SpecError as e:
        _fail(e)


def _warn_infinite(df, console: Console) -> None:
    """One warning per case and kind of trouble, naming the estimators."""
    reasons = {
        "infinite variance": "infinite variance (E_q[r²] = ∞)",
        "infinite 4th moment": "an infinite 4th moment (the measured std converges slowly and is usually too low)",
        "kurtosis > draws": "a kurtosis E[R⁴]/E[R²]² beyond the number of draws (the measured std is usually "
                            "far too low)",
        "unstable batches": "one batch carrying most of the sum of squares (a heavy tail)",
    }
    for case in dict.fromkeys(df["case"]):
        c = df[df["case"] == case]
        miss = c["support_miss"].max() if "support_miss" in c else 0.0
        if miss > 0:
            weighted = "IS weights" in str(c["sampler"].iloc[0])
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
    from .experiment import run_spec, validate_oracles
    from .storage import (FolderLock, checkpoint_identity, clean_stale, load_checkpoint, remove_checkpoint,
                          save_checkpoint)
    with _user_errors():
        sp = with_overrides(load_spec(spec), draws=draws, seed=seed, device=device)
        exp = sp.experiment
        dev = resolve_device(exp.device)
        pairs = [build_pair(c, str(spec)) for c in sp.cases]   # validates files before sampling
        validate_oracles(sp, pairs, str(spec))
        if checkpoint_every < 0:
            raise SpecError(f"must be ≥ 0, got {checkpoint_every}", key="--checkpoint-every")
    out_dir = out or Path("results") / exp.name
    case_draws = [c.draws or exp.draws for c in sp.cases]
    identity = checkpoint_identity(sp, dev, case_draws)
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

        progress = _LazyProgress(sum(case_draws), enabled=not quiet)
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            outcome = run_spec(sp, pairs, dev, progress=progress.advance, resume=done, on_sums=on_sums)
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
        runs = [o.run for o in outcome.cases]
        df = outcome.summary
        envelope = {
            "kl_bench_run": 1,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "spec_path": str(spec), "spec_sha256": sp.sha256, "spec_text": sp.text,
            "experiment": exp.name, "seed": exp.seed,
            "draws_per_case": {c.name: n for c, n in zip(sp.cases, case_draws)}, "batches": exp.batches,
            "device": str(dev), "device_name": _device_name(dev), "versions": _versions(),
            "git_commit": _git_commit(), "wall_seconds": round(outcome.wall, 3), "resumed": bool(done),
            "draws_per_second": round(sum(r.draws for r in runs) / max(sum(r.seconds for r in runs), 1e-9)),
            "cases": {r.pair.name: {"kind": r.pair.kind, "description": r.pair.describe(),
                                    "label": getattr(r.pair, "label", ""), "length": getattr(r.pair, "length", None),
                                    "seconds": round(r.seconds, 3)} for r in runs},
        }
        write_results(out_dir, outcome.files(), envelope)
        remove_checkpoint(out_dir)
    if not quiet:
        lengths = {r.pair.name: r.pair.length for r in runs if r.pair.kind == "rollout"}
        print_tables(out_console, df, {r.pair.name: r.pair.describe() for r in runs}, lengths=lengths)
        if outcome.gradients is not None:
            from .display import gradient_table
            out_console.print()
            out_console.print(gradient_table(outcome.gradients))
        _warn_infinite(df, err_console)
        out_console.print(f"\n{sum(r.draws for r in runs):,} draws in {outcome.wall:.1f} s "
                          f"({envelope['draws_per_second']:,} draws/s on {dev}) → {out_dir}/summary.csv")
    if report_:
        _write_report([out_dir], out_dir / "report", quiet)


def _device_name(dev) -> str:
    import torch
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()


def _write_report(dirs: list[Path], out: Path, quiet: bool = False) -> None:
    from .report import build_report
    with _user_errors():
        files = build_report(dirs)
    for name, data in files.items():
        atomic_write_bytes(out / name, data)
    if not quiet:
        out_console.print(f"report → {out}/report.html ({sum(n.startswith('figures/') for n in files)} figures)")


@app.command()
def report(dirs: list[Path] = typer.Argument(..., help="one or more results folders written by `kl-bench run`"),
           out: Optional[Path] = typer.Option(None, "--out", help="report folder [default: DIR/report, or "
                                              "results/report for several folders]")) -> None:
    """Plots, the paper-style table (LaTeX and Markdown) and a browsable report from results folders."""
    target = out or (dirs[0] / "report" if len(dirs) == 1 else Path("results") / "report")
    _write_report(dirs, target)


def _summary_for(spec_path: Path, results: Optional[Path], draws, seed, device, quiet: bool):
    """(spec, summary DataFrame): from --results DIR, or by running the spec in memory."""
    from .experiment import run_spec, validate_oracles
    with _user_errors():
        sp = with_overrides(load_spec(spec_path), draws=draws, seed=seed, device=device)
        if results is not None:
            from .report import load_results
            res = load_results(results)
            if res.envelope.get("spec_sha256") != sp.sha256:
                out_console.print(f"note: {results} was produced by a different version of {spec_path} "
                                  f"(spec sha256 {str(res.envelope.get('spec_sha256'))[:12]}… vs {sp.sha256[:12]}…)",
                                  markup=False)
            return sp, res.summary
        dev = resolve_device(sp.experiment.device)
        pairs = [build_pair(c, str(spec_path)) for c in sp.cases]
        validate_oracles(sp, pairs, str(spec_path))
    progress = _LazyProgress(sum(c.draws or sp.experiment.draws for c in sp.cases), enabled=not quiet)
    try:
        outcome = run_spec(sp, pairs, dev, progress=progress.advance)
    finally:
        progress.close()
    return sp, outcome.summary


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
    from rich.table import Table

    from .check import baseline_comparisons, exact_comparisons, holm, load_baseline
    with _user_errors():
        if not 0 < alpha < 1:
            raise SpecError(f"must lie in (0, 1), got {alpha}", key="--alpha")
        sp0 = load_spec(spec)
        base_path = baseline or Path("results") / "baselines" / f"{sp0.experiment.name}.json"
        base = load_baseline(base_path) if (baseline is not None or base_path.exists()) else None
    sp, df = _summary_for(spec, results, draws, seed, device, quiet=True)
    comparisons = exact_comparisons(df)
    notes: list[str] = []
    if base is not None:
        if base.get("spec_sha256") != sp.sha256:
            out_console.print(f"note: the spec changed since the baseline {base_path} was made (sha256 "
                              f"{str(base.get('spec_sha256'))[:12]}… then, {sp.sha256[:12]}… now); rows are matched "
                              "by case, estimator, aggregate and λ", markup=False)
        more, notes = baseline_comparisons(df, base)
        comparisons += more
    holm(comparisons, alpha)
    failed = [c for c in comparisons if not c.passed]
    if not quiet:
        t = Table(show_edge=False, pad_edge=False, title=f"{len(comparisons)} comparisons, family-wise α = {alpha:g} "
                  "(Holm)", title_justify="left")
        for col in ["row", "statistic", "value", "reference", "z", "|z| limit", "result"]:
            t.add_column(col, justify="left" if col in ("row", "statistic", "result") else "right")
        for c in comparisons:
            t.add_row(c.row, c.statistic, f"{c.value:.6g}", f"{c.reference:.6g}", f"{c.z:+.2f}",
                      f"{c.threshold:.2f}", "pass" if c.passed else "[bold red]FAIL[/]")
        out_console.print(t)
    for n in notes:
        out_console.print(f"note: {n}", markup=False)
    for c in failed:
        out_console.print(f"FAIL {c.sentence()}", markup=False)
    verdict = (f"check: {len(comparisons) - len(failed)} passed, {len(failed)} failed "
               f"({len(comparisons)} comparisons against exact values"
               + (f" and baseline {base_path}" if base is not None else "") + f"; family-wise α = {alpha:g}, Holm)")
    out_console.print(verdict, markup=False)
    if failed:
        raise typer.Exit(1)


@app.command()
def baseline(spec: Path = typer.Argument(..., help="experiment spec (TOML)"),
             out: Optional[Path] = typer.Option(None, "--out", help="baseline JSON [default: results/baselines/<name>.json]"),
             results: Optional[Path] = typer.Option(None, "--results", help="take the numbers from this results folder")) -> None:
    """Run SPEC (or read --results) and store its statistics as a versioned JSON baseline."""
    from .check import baseline_bytes, make_baseline
    sp, df = _summary_for(spec, results, None, None, None, quiet=False)
    target = out or Path("results") / "baselines" / f"{sp.experiment.name}.json"
    atomic_write_bytes(target, baseline_bytes(make_baseline(df, sp)))
    out_console.print(f"baseline of {len(df)} rows → {target}", markup=False)


@app.command()
def exact(spec: Path = typer.Argument(..., help="experiment spec (TOML)"),
          out: Optional[Path] = typer.Option(None, "--out", help="also write the exact table to this CSV file")) -> None:
    """Print the exact KL and estimator moments of every case, without sampling."""
    with _user_errors():
        sp = load_spec(spec)
        pairs = [build_pair(c, str(spec)) for c in sp.cases]
    ests = [resolve_estimator(n) for n in sp.experiment.estimators]
    rows = [row for p in pairs for row in exact_rows(p, ests)]
    df = to_frame(rows).drop(columns=["draws", "batches", "mean", "std", "se", "bias", "rel_bias", "rel_std",
                                      "z", "frac_negative"])
    print_tables(out_console, df, {p.name: p.describe() for p in pairs}, exact_only=True)
    _warn_infinite(df, err_console)
    if out is not None:
        atomic_write_bytes(out, frame_to_csv_bytes(df))
        out_console.print(f"→ {out}")


@app.command("list")
def list_() -> None:
    """List the registered estimators and case kinds, one line each."""
    for name, e in ESTIMATORS.items():
        out_console.print(f"estimator  {name:<8} {e.formula:<18} target {e.target}"
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
