"""Command-line interface: a thin layer over the Python API (kl_bench.api), which does the work.

Heavy modules (pandas, scipy, matplotlib) are imported inside the commands that need them, so that
``kl-bench --help`` and ``kl-bench list`` start quickly.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import typer
import typer.core
from rich.console import Console

from .errors import SpecError

app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="kl-bench: bias, variance and failure modes of Monte Carlo KL estimators, "
                       "measured next to the exact truth.")
class _Command(typer.core.TyperCommand):
    """Usage lines as users know them: `kl-bench run [OPTIONS] SPEC`, not `{SPEC}`."""

    def collect_usage_pieces(self, ctx):
        return [p.replace("{", "").replace("}", "") for p in super().collect_usage_pieces(ctx)]


# A terminal gets tables fitted to its width; a file or pipe gets plain text lines that never wrap.
out_console = Console(highlight=False, width=None if sys.stdout.isatty() else 400)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)   # a message is one line, never wrapped


_interrupt_reported = [False]


def _interrupted(message: str) -> None:
    """Say what an interrupt left behind, in one line, and exit 130."""
    err_console.print(message, markup=False)
    _interrupt_reported[0] = True
    raise typer.Exit(130)


def _version(value: bool) -> None:
    if value:
        from .version import __version__
        print(f"kl-bench {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """kl-bench: bias, variance and failure modes of Monte Carlo KL estimators, measured next to the exact truth."""


def _fail(err: SpecError) -> None:
    err_console.print(f"error: {err}", markup=False, soft_wrap=True)
    raise typer.Exit(2)


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    try:
        yield
    except SpecError as e:
        _fail(e)


def _warn_rows(df, console: Console) -> None:
    """One warning per case and kind of trouble (infinite targets, heavy tails, a sampler missing mass,
    token-mean rows leaving draws out), naming the estimators."""
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
        if "draws" in c and len(c):
            # Rows with one value per group of B (tok_batch) use only the draws in whole groups of a batch.
            most = int(c["draws"].max())
            short = c[c["draws"] < 0.99 * most]
            if not short.empty:
                used = int(short["draws"].min())
                console.print(f"warning: case '{case}': tok_batch rows use {used:,} of {most:,} draws (only whole "
                              "groups of token_mean_batch within each batch count): make draws / batches a "
                              "multiple of token_mean_batch", markup=False)
        if "heavy_tail" not in c:
            continue
        for kind, text in reasons.items():
            hit = c[(c["heavy_tail"] == kind) & (c["true_kl"] != math.inf)]
            if not hit.empty:
                names = ", ".join(row_label(r) for _, r in hit.iterrows())
                console.print(f"warning: case '{case}': {names}: {text}; measured std and se are not "
                              f"trustworthy", markup=False)


def _draws_flag(value: Optional[str]):
    """``--draws`` as a spec writes draws: 10000000, 10_000_000 or 1e7. Anything else is passed on as
    text, for the spec's own check to refuse in one line naming the file and ``--draws``."""
    if value is None:
        return None
    text = value.strip().replace("_", "")
    try:
        return int(text)
    except ValueError:
        pass
    try:
        f = float(text)
    except ValueError:
        return value
    return int(f) if math.isfinite(f) and f.is_integer() else value


@app.command(cls=_Command)
def run(spec: Path = typer.Argument(..., metavar="SPEC", help="experiment spec (TOML)", show_default=False),
        out: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="results folder [default: results/<name>/]"),
        draws: Optional[str] = typer.Option(None, "--draws", metavar="N", callback=_draws_flag,
                                            help="draws for every case (1e7 and 10_000_000 work, as in a spec): "
                                            "replaces [experiment] draws and each case's own draws"),
        seed: Optional[int] = typer.Option(None, "--seed", metavar="S", help="override [experiment] seed"),
        device: Optional[str] = typer.Option(None, "--device", metavar="DEVICE",
                                             help="override [experiment] device: auto|cpu|cuda|cuda:N"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar and no tables"),
        report_: bool = typer.Option(False, "--report", help="then write the report into DIR/report/"),
        resume: bool = typer.Option(False, "--resume", help="continue an interrupted run from its checkpoint"),
        checkpoint_every: float = typer.Option(30.0, "--checkpoint-every", metavar="SECONDS",
                                               help="write a checkpoint at most this often (> 0; inf: never)"),
        no_checkpoint: bool = typer.Option(False, "--no-checkpoint", help="never write a checkpoint")) -> None:
    """Sample every case of SPEC and write summary.csv, run.json (and batches.csv, reservoir.npz,
    lambda_sweep.csv) into the results folder, atomically. Under torchrun the batches are split across
    the processes and rank 0 writes the very bytes one process would (README "Scaling out")."""
    from .distributed import RankFailure
    hs = _Handshake()
    try:
        _run(hs, spec, out, draws, seed, device, quiet, report_, resume, checkpoint_every, no_checkpoint)
    except RankFailure as e:
        _ignore_signals()          # torchrun's SIGTERM to the survivors must not add a second line
        hs.cancel()
        err_console.print(f"error: rank {hs.ranks.rank}: {e}; no results were written", markup=False)
        raise typer.Exit(1)
    except BaseException:
        if hs.ranks.world_size > 1:
            _ignore_signals()
        hs.cancel()
        raise
    finally:
        hs.close()


def _ignore_signals() -> None:
    """The job is ending and what went wrong has been (or is being) said: later signals add nothing."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class _Handshake:
    """Under torchrun, rank 0 checks the output folder and reads the checkpoint alone, then tells the other
    ranks to start (with the resumed sums) or to stop (it has reported an error): :meth:`send` once, or
    :meth:`cancel`."""

    def __init__(self):
        from .distributed import SINGLE
        self.ranks, self.sent = SINGLE, False

    def join(self, prep):
        from .distributed import start
        self.ranks, prep.device = start(prep.device)
        return self.ranks

    def send(self, done) -> None:
        self.sent = True
        self.ranks.broadcast(done)

    def cancel(self) -> None:
        from .distributed import RankFailure
        if self.ranks.root and self.ranks.world_size > 1 and not self.sent:
            self.sent = True
            with contextlib.suppress(RankFailure):
                self.ranks.broadcast(None)

    def close(self) -> None:
        if self.ranks.world_size > 1:
            from .distributed import stop
            stop()


def _follow(prep, ranks) -> None:
    """A rank other than 0: draw its share of the batches; rank 0 writes and prints everything."""
    from .api import execute
    done = ranks.broadcast(None)
    if done is None:            # rank 0 refused the run and said why
        raise typer.Exit(2)
    execute(prep, resume=done, ranks=ranks)


def _run(hs: _Handshake, spec: Path, out: Optional[Path], draws: Optional[int], seed: Optional[int],
         device: Optional[str], quiet: bool, report_: bool, resume: bool, checkpoint_every: float,
         no_checkpoint: bool) -> None:
    from .api import execute, prepare
    from .progress import LazyProgress
    from .storage import (CHECKPOINT, FolderLock, check_output_dir, checkpoint_identity, clean_stale, fs_error,
                          load_checkpoint, output_dir, remove_checkpoint, save_checkpoint)
    with _user_errors():
        if not checkpoint_every > 0:          # also refuses NaN
            raise SpecError(f"must be > 0 (inf, or --no-checkpoint: never), got {checkpoint_every}",
                            key="--checkpoint-every")
        every = math.inf if no_checkpoint else checkpoint_every
        prep = prepare(spec, draws=draws, seed=seed, device=device)
        if not hs.join(prep).root:
            return _follow(prep, hs.ranks)
        self_signal("pairs")
        sp = prep.spec
        out_dir = output_dir(out if out is not None else Path("results") / sp.experiment.name)
        if resume and not (out_dir / CHECKPOINT).exists():      # before anything is created
            raise SpecError("nothing to resume: no checkpoint in the results folder", file=str(out_dir),
                            key="--resume")
        out_dir = check_output_dir(out_dir)
    case_draws = sp.case_draws()
    identity = checkpoint_identity(sp, prep.device, case_draws)
    with _user_errors(), FolderLock(out_dir):
        clean_stale(out_dir)
        done = load_checkpoint(out_dir, identity, {c.name: min(sp.experiment.batches, n)
                                                   for c, n in zip(sp.cases, case_draws)}) if resume else {}
        hs.send(done)
        state = dict(done)
        last = [time.monotonic()]

        def on_sums(case: str, sums) -> None:
            state[case] = sums
            if time.monotonic() - last[0] >= every:
                try:
                    save_checkpoint(out_dir, identity, state)
                except OSError as e:
                    raise fs_error(e, out_dir, "cannot write a checkpoint") from None
                last[0] = time.monotonic()

        from .experiment import total_draws
        progress = LazyProgress(total_draws(sp), enabled=not quiet, console=err_console)
        try:
            result = execute(prep, progress=progress, resume=done, on_sums=on_sums, ranks=hs.ranks)
        except KeyboardInterrupt:
            progress.close()
            saved = False
            if math.isfinite(every) and state:
                with contextlib.suppress(OSError):
                    save_checkpoint(out_dir, identity, state)
                    saved = True
            why = " (a process of the torchrun job failed, or the job was stopped)" if hs.ranks.world_size > 1 else ""
            _interrupted(f"interrupted{why}: no results were written; earlier results in {out_dir} are untouched"
                         + ("; continue with --resume" if saved else ""))
        finally:
            progress.close()
        try:
            self_signal("write")
            result.write_files(out_dir)
        except KeyboardInterrupt:
            _interrupted(f"interrupted while writing: no results were written; earlier results in {out_dir} "
                         "are untouched")
        except OSError as e:
            raise fs_error(e, out_dir) from None
        remove_checkpoint(out_dir)
    if not quiet:
        from .display import gradient_table, print_tables, show
        df = result.summary
        lengths = {name: meta["length"] for name, meta in result.envelope["cases"].items() if meta.get("length")}
        print_tables(out_console, df, result.descriptions(), lengths=lengths)
        if result.gradients is not None:
            out_console.print()
            show(out_console, gradient_table(result.gradients))
        _warn_rows(df, err_console)
        from .display import recommendations
        out_console.print()
        for line in recommendations(df):
            out_console.print(line, markup=False)
        env = result.envelope
        total = (f", {result.outcome.wall:.1f} s in all" if result.outcome.wall > 1.2 * env["sampling_seconds"] + 0.5
                 else "")
        cases = f" over {len(result.pairs)} cases" if len(result.pairs) > 1 else ""
        out_console.print(f"\n{result.draws:,} draws{cases} sampled in {env['sampling_seconds']:.1f} s "
                          f"({env['draws_per_second']:,} draws/s on {prep.device}){total} → {out_dir}/summary.csv")
    if report_:
        _write_report([out_dir], out_dir / "report", quiet)


def _write_report(dirs: list[Path], out: Path, quiet: bool = False) -> None:
    from .report import write_report
    with _user_errors():
        write_report(dirs, out)
    if not quiet:
        out_console.print(f"report → {out}/report.html ({len(list((out / 'figures').glob('*.png')))} figures)")


@app.command(cls=_Command)
def report(dirs: list[Path] = typer.Argument(..., metavar="DIR", show_default=False,
                                             help="one or more results folders written by `kl-bench run`"),
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
            from .verify import check_results_match_spec
            check_results_match_spec(res, sp)          # another experiment's folder: one line, exit 2
            if res.envelope.get("spec_sha256") != sp.sha256:
                out_console.print(f"note: {results} was produced by a different version of {spec_path} "
                                  f"(spec sha256 {str(res.envelope.get('spec_sha256'))[:12]}… vs {sp.sha256[:12]}…)",
                                  markup=False)
            return sp, res.summary
        result = run(sp, progress=not quiet)
    return sp, result.summary


@app.command(cls=_Command)
def check(spec: Path = typer.Argument(..., metavar="SPEC", help="experiment spec (TOML)", show_default=False),
          baseline: Optional[Path] = typer.Option(None, "--baseline", help="baseline JSON [default: "
                                                  "results/baselines/<name>.json when it exists]"),
          results: Optional[Path] = typer.Option(None, "--results", help="check this results folder instead of running"),
          alpha: float = typer.Option(0.001, "--alpha", help="family-wise error rate (Holm)"),
          seed: Optional[int] = typer.Option(None, "--seed", help="override [experiment] seed"),
          draws: Optional[str] = typer.Option(None, "--draws", metavar="N", callback=_draws_flag,
                                              help="override [experiment] draws"),
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
    sp, df = _summary_for(spec, results, draws, seed, device, quiet=quiet)
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
        from .display import show
        show(out_console, t)
    for note in rep.notes:
        out_console.print(f"note: {note}", markup=False)
    for c in rep.failures:
        out_console.print(f"FAIL {c.sentence()}", markup=False)
    out_console.print(rep.verdict, markup=False)
    if not rep.passed:
        raise typer.Exit(1)


@app.command(cls=_Command)
def baseline(spec: Path = typer.Argument(..., metavar="SPEC", help="experiment spec (TOML)", show_default=False),
             out: Optional[Path] = typer.Option(None, "--out", metavar="FILE",
                                                help="baseline JSON [default: results/baselines/<name>.json]"),
             results: Optional[Path] = typer.Option(None, "--results", metavar="DIR",
                                                    help="take the numbers from this results folder"),
             draws: Optional[str] = typer.Option(None, "--draws", metavar="N", callback=_draws_flag,
                                                 help="override the draws of every case"),
             seed: Optional[int] = typer.Option(None, "--seed", metavar="S", help="override [experiment] seed"),
             device: Optional[str] = typer.Option(None, "--device", metavar="DEVICE", help="override [experiment] device"),
             quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar")) -> None:
    """Run SPEC (or read --results) and store its statistics as a versioned JSON baseline."""
    from .gate import baseline_bytes, make_baseline
    from .storage import atomic_write_bytes, check_output_file, fs_error
    if out is not None:
        with _user_errors():
            check_output_file(out)
    sp, df = _summary_for(spec, results, draws, seed, device, quiet=quiet)
    target = out or Path("results") / "baselines" / f"{sp.experiment.name}.json"
    with _user_errors():
        try:
            atomic_write_bytes(target, baseline_bytes(make_baseline(df, sp)))
        except OSError as e:
            raise fs_error(e, target) from None
    if not quiet:
        out_console.print(f"baseline of {len(df)} rows → {target}", markup=False)


@app.command(cls=_Command)
def exact(spec: Path = typer.Argument(..., metavar="SPEC", help="experiment spec (TOML)", show_default=False),
          out: Optional[Path] = typer.Option(None, "--out", help="also write the exact table to this CSV file")) -> None:
    """Print the exact KL and estimator moments of every case, without sampling."""
    from . import api
    from .display import print_tables
    from .storage import check_output_file, fs_error
    with _user_errors():
        if out is not None:
            check_output_file(out)
        df = api.exact(spec)
    print_tables(out_console, df, df.attrs["descriptions"], exact_only=True)
    _warn_rows(df, err_console)
    if out is not None:
        from .results import frame_to_csv_bytes
        from .storage import atomic_write_bytes
        with _user_errors():
            try:
                atomic_write_bytes(out, frame_to_csv_bytes(df))
            except OSError as e:
                raise fs_error(e, out) from None
        out_console.print(f"→ {out}")


@app.command("list", cls=_Command)
def list_() -> None:
    """List the registered estimators, pair-supplied rows and case kinds, one line each."""
    from .estimators import ESTIMATORS, PAIR_ROWS
    from .pairs import CASE_KINDS
    rows = [*ESTIMATORS.items(), *PAIR_ROWS.items()]
    wn = max(len(name) for name, _ in rows)
    wf = max(len(e.formula) for _, e in rows)
    for name, e in rows:
        what = "row      " if e.analytic else "estimator"
        out_console.print(f"{what}  {name:<{wn}}  {e.formula:<{wf}}  target {e.target}"
                          f"{'  unbiased' if e.unbiased else '  biased'}{'  ≥0' if e.nonnegative else ''}",
                          markup=False)
    from importlib.metadata import entry_points
    for ep in entry_points(group="kl_bench.estimators"):
        if ep.name not in ESTIMATORS:
            out_console.print(f"plug-in    {ep.name:<{wn}}  {ep.value}  (entry point, loaded when used)", markup=False)
    for name, k in CASE_KINDS.items():
        out_console.print(f"kind       {name:<{wn}}  {k.description}", markup=False)


# ----------------------------------------------------------------------------- models (issue 14)
@app.command("dump-logits", cls=_Command)
def dump_logits(policy: Path = typer.Option(..., "--policy", help="policy model folder (save_pretrained)"),
                reference: Path = typer.Option(..., "--reference", help="reference model folder"),
                prompts: Path = typer.Option(..., "--prompts", help="prompts: .txt (one a line) or .jsonl (input_ids)"),
                out: Path = typer.Option(..., "--out", help="output folder"),
                length: int = typer.Option(1, "--length", help="T > 1: also sample continuations of T tokens"),
                samples: int = typer.Option(0, "--samples", help="continuations to sample; 0: one per prompt", show_default=False),
                seed: int = typer.Option(0, "--seed"),
                eos: Optional[int] = typer.Option(None, "--eos", help="a continuation ends at this token id"),
                dtype: str = typer.Option("float32", "--dtype"),
                batch_size: int = typer.Option(64, "--batch-size"),
                device: str = typer.Option("auto", "--device")) -> None:
    """Write both models' next-token log-probs [B, V] (next_token.pt) and, with --length > 1, sampled
    continuations' per-token log-probs with a mask (continuations.pt), to benchmark on any machine."""
    from .pairs.model.dump import dump_logits as dump
    with _user_errors():
        written = dump(policy, reference, prompts, out, length=length, samples=samples, seed=seed, dtype=dtype,
                       batch_size=batch_size, eos=eos, device=device)
    for what, path in written.items():
        out_console.print(f"{what}: {path}", markup=False)
    nt = written["next_token"]
    out_console.print(f'use: [[case]] kind = "categorical", q = {{file = "{nt}", key = "policy"}}, '
                      f'p = {{file = "{nt}", key = "reference"}}', markup=False)
    if "continuations" in written:
        out_console.print(f'use: [[case]] kind = "logprobs", file = "{written["continuations"]}"', markup=False)


# ----------------------------------------------------------------------------- trainer audit (issue 24)
@app.command("audit", cls=_Command)
def audit(folder: Path = typer.Argument(..., metavar="DIR", help="folder of step-*.safetensors files (docs/audit.md)",
                                        show_default=False),
          out: Optional[Path] = typer.Option(None, "--out", help="results folder (default: DIR/audit)"),
          tile: int = typer.Option(8192, "--tile", help="vocabulary ids per tile (hidden-state steps)"),
          chunk: int = typer.Option(256, "--chunk", help="positions per chunk (hidden-state steps)")) -> None:
    """Audit saved training steps: the trainer's KL against the exact KL, bias by source, z, consistency."""
    from .audit.offline import audit_command
    with _user_errors():
        written = audit_command(folder, out, tile=tile, chunk=chunk, echo=lambda s: out_console.print(s, markup=False))
    out_console.print(f"→ {written}", markup=False)


# Test hook: "PHASE" or "PHASE:SIGTERM" makes the process signal itself at that phase of start-up or
# writing (start, spec, pairs, write), so that the signal tests need no sleeps.
_SELF_SIGNAL_ENV = "KL_BENCH_SELF_SIGNAL"


def self_signal(phase: str) -> None:
    want = os.environ.get(_SELF_SIGNAL_ENV, "")
    if want.split(":")[0] == phase:
        os.kill(os.getpid(), signal.SIGTERM if want.endswith(":SIGTERM") else signal.SIGINT)


def _on_signal(signum, frame):
    raise KeyboardInterrupt


def _is_abort(e: BaseException) -> bool:
    # click turns a KeyboardInterrupt inside a command into its own Abort (typer vendors click)
    return type(e).__name__ == "Abort"


def main(argv: list[str] | None = None) -> None:
    """The console script: every usage error is one line (exit 2), every interrupt one line (exit 130)."""
    # SIGTERM is handled like SIGINT from the first moment: one line, never a traceback.
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
    try:
        self_signal("start")
        rv = app(args=argv, standalone_mode=False, prog_name="kl-bench")
        if rv == 130 and not _interrupt_reported[0]:     # typer turns a Ctrl-C in a command into 130
            err_console.print("interrupted: nothing was written", markup=False)
        sys.exit(rv if isinstance(rv, int) else 0)
    except NoArgsIsHelpError as e:
        print(e.ctx.get_help() if e.ctx is not None else str(e))
        sys.exit(0)
    except ClickException as e:
        err_console.print(f"error: {' '.join(e.format_message().split())}", markup=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, typer.Abort, RuntimeError) as e:
        if not isinstance(e, KeyboardInterrupt) and not _is_abort(e):
            raise
        err_console.print("interrupted: nothing was written", markup=False)
        sys.exit(130)


if __name__ == "__main__":
    main()
