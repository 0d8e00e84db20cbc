"""What every command shares: the typer app, the two consoles, one-line errors (exit 2) and interrupts
(exit 130), and the presentation helpers a run and ``exact`` print with."""
from __future__ import annotations

import contextlib
import decimal
import re
import sys
from pathlib import Path
from typing import Iterator, Optional

import typer
import typer.core
from rich.console import Console

from ..foundation.errors import SpecError

app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="kl-bench: bias, variance and failure modes of Monte Carlo KL estimators, "
                       "measured next to the exact truth.",
                  # pointers a new user follows from --help (tests/test_cli_help.py: each page and section exists)
                  epilog='Start with README, "Install and run (one command)"; the tables explained: README, '
                         '"Reading the output"; every command: README, "Commands"; specs: docs/spec.md; every '
                         'column: docs/results.md.')


class Command(typer.core.TyperCommand):
    """Usage lines as users know them: `kl-bench run [OPTIONS] SPEC`, not `{SPEC}`."""

    def collect_usage_pieces(self, ctx):
        return [p.replace("{", "").replace("}", "") for p in super().collect_usage_pieces(ctx)]


# A terminal gets tables fitted to its width; a file or pipe gets plain text lines that never wrap (soft_wrap:
# a sentence stays on one line whatever its length, for grep; tables keep their natural width up to 400).
out_console = Console(highlight=False, width=None if sys.stdout.isatty() else 400, soft_wrap=not sys.stdout.isatty())
# A message to a log is one line, never wrapped; at a terminal a notice wraps at its width (errors stay one line).
err_console = Console(stderr=True, highlight=False, soft_wrap=not sys.stderr.isatty())

interrupt_reported = [False]
DEFAULT_RUNS = Path("runs")        # where `kl-bench run` and `train` write without --out (git-ignored)


def interrupted(message: str) -> None:
    """Say what an interrupt left behind, in one line, and exit 130."""
    err_console.print(message, markup=False)
    interrupt_reported[0] = True
    raise typer.Exit(130)


def say_error(text: str) -> None:
    """An error's one line on stderr ("error: TEXT"). Under torchrun a rank other than 0 (a follower,
    kl_bench.engine.distributed.follower) says nothing of an error found before it joined the job: every rank
    reads the same arguments, spec and files, so rank 0 finds the same error and says it once. What a
    follower finds after joining is its own (its share of the batches): said, as "rank N: TEXT"."""
    from ..engine.distributed import follower, joined
    rank = follower()
    if rank is not None:
        if not joined():
            return
        text = f"rank {rank}: {text}"
    err_console.print(f"error: {text}", markup=False, soft_wrap=True)


def fail(err: SpecError) -> None:
    """Bad input: one line (:func:`say_error`: once under torchrun, by rank 0) and exit 2 on every rank."""
    say_error(str(err.as_flags()))       # the API names its arguments (draws=), the command line its flags
    raise typer.Exit(2)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    try:
        yield
    except SpecError as e:
        fail(e)


def warn_rows(df, console: Console) -> None:
    from ..analysis.advice import warnings
    from ..present.terminal import prose
    for line in warnings(df):
        prose(console, line)


def advise(advice) -> None:
    """The advice lines (kl_bench.analysis.advice.advice_lines): what to log, what to put in the loss, a
    sentence that holds for several cases alike printed once. Wrapped at a terminal's width, one line each to
    a file or a pipe (kl_bench.present.tables.prose)."""
    from ..analysis.advice import advice_lines
    from ..present.terminal import prose
    out_console.print()
    for line in advice_lines(advice):
        prose(out_console, line)


def advice_options(batch: int, tolerance: float) -> None:
    """A bad --batch or --tolerance: one line, exit 2, before any sampling."""
    from ..analysis.advice import AdviceOptionError, check_options
    try:
        check_options(batch, tolerance)
    except AdviceOptionError as e:
        fail(SpecError(str(e), key=f"--{e.key}"))


def whole_number(value: str) -> int | None:
    """``value`` as a spec writes a whole number: 10000000, 10_000_000 or 1e7 (exactly an integer: not 1.5e0,
    nan or inf); None for anything else. Read as a decimal (no float rounding: 12345678901234567891 stays
    itself), ASCII only (int() reads other scripts' digits, "٣": a spec's TOML does not)."""
    raw = value.strip()
    # Underscores only between digits, as TOML allows them (10_000; not _1000, 1__000 or 1000_)
    if "_" in raw and not re.fullmatch(r"[+-]?\d+(_\d+)*([eE][+-]?\d+)?", raw):
        return None
    text = raw.replace("_", "")
    if not text.isascii() or not text:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        d = decimal.Decimal(text)
    except decimal.InvalidOperation:
        return None
    # a finite integer of at most 4,000 digits (int() of 1e999999999 would build a billion digits)
    if not d.is_finite() or d != d.to_integral_value() or d.adjusted() > 4000:
        return None
    return int(d)


def draws_flag(value: Optional[str]):
    """``--draws`` as a spec writes draws: 10000000, 10_000_000 or 1e7. Anything else is passed on as
    text, for the spec's own check to refuse in one line naming the file and ``--draws``."""
    if value is None:
        return None
    n = whole_number(value)
    return value if n is None else n


def int_flag(value):
    """An integer option (--seed, --batch, --tile, ...) read as ``--draws`` is: 42, 1_000 or 1e3; anything
    else is a usage error naming the option and echoing the value (exit 2)."""
    if value is None or isinstance(value, int):       # the default
        return value
    n = whole_number(str(value))
    if n is None:
        raise typer.BadParameter(f"must be a whole number (as 1000, 1_000 or 1e3), got {str(value)!r}")
    return n


def float_flag(value):
    """A number option (--tolerance, --alpha, ...): anything float() reads; else a usage error naming the
    option and echoing the value (exit 2). Whether it is in range is the command's check."""
    if value is None or isinstance(value, float):
        return value
    text = str(value).strip()
    if text.isascii():                # float() reads other scripts' digits too
        with contextlib.suppress(ValueError):
            return float(text)
    raise typer.BadParameter(f"must be a number, got {str(value)!r}")


# Suffixes of the files a report holds: an --out ending in one names a file, and --out is a folder.
_FILE_SUFFIXES = (".html", ".htm", ".md", ".pdf", ".png", ".svg", ".tex", ".csv", ".json", ".txt")


def check_report_out(out: Path) -> None:
    """``--out`` of a report names the folder that report.html, the figures and the tables go into: a
    regular file there, or a new path that reads as a file name (report.html), is one line saying so."""
    try:
        is_file, exists = out.is_file(), out.exists()
    except OSError:          # a name too long, a folder that may not be searched: check_output_dir says so
        return
    if is_file:
        raise SpecError("is a file; --out names the report folder (report.html and figures/ go inside it)",
                        file=str(out), key="--out")
    if not exists and out.suffix.lower() in _FILE_SUFFIXES:
        raise SpecError(f"looks like a file name; --out names the report folder (report.html and figures/ go "
                        f"inside it): give e.g. --out {out.with_suffix('')}", file=str(out), key="--out")


def write_report(dirs: list[Path], out: Path, quiet: bool = False, **options) -> None:
    """The report of results folders into ``out`` (a folder): one line on success, one on any error or
    interrupt; a progress line meanwhile (not with ``quiet``, nor in a pipe); a report that fails leaves
    nothing behind (no folder, no half-written files). ``options``: kl_bench.present.report.report_files's
    (formats, batch, tolerance)."""
    from ..foundation import signals
    from ..foundation.progress import LazyProgress
    signals.import_plotting()       # a Ctrl-C inside matplotlib's compiled start-up: one line, not an abort
    from ..present.report import summary_line, write_report as write
    from ..api.run_folder import interrupt_line
    from ..foundation.atomic import fs_error
    from ..foundation.output_paths import check_output_dir
    from ..results.folders import require_folder
    with user_errors():
        for d in dirs:              # what was asked for is said first, before the (default) --out is judged
            require_folder(d)
        check_report_out(Path(out))
        out = check_output_dir(out)
        earlier = "an earlier report in {out} is untouched" if out.exists() else "nothing was created"
        bar = LazyProgress(0, enabled=not quiet, console=err_console, unit="figures")
        try:
            write(dirs, out, progress=bar, **options)
            signals.phase("report-written")
        except KeyboardInterrupt:
            bar.close()
            interrupted(interrupt_line(out, "report files", earlier))
        except OSError as e:
            raise fs_error(e, out, "cannot write the report") from None
        finally:
            bar.close()
    if not quiet:
        out_console.print(summary_line(out), markup=False)
        if (out / "differences.csv").exists():
            for line in difference_lines(out / "differences.csv"):
                out_console.print(line, markup=False)


def check_output(path: Path, key: str, spec=None, inputs=(), baseline_ok: bool = False) -> None:
    """Refuse, before any work, an output file (kl_bench.foundation.output_paths.check_output_file) that would
    replace what a command reads or what kl-bench keeps: the spec ``spec`` (a loaded Spec) and every file its
    text names, ``inputs`` ((path, what) pairs), a file of any results folder (its data files and run.json:
    their recorded sha256 would then fail every read), and a kl-bench baseline (unless ``baseline_ok``:
    `kl-bench baseline`)."""
    from ..foundation.output_paths import check_output_file
    from ..results.folders import FOLDER_FILES
    path = Path(path)
    in_results = False
    reads = list(inputs)
    if spec is not None:
        reads += [(spec.path, "the spec"), *((f, "a file the spec reads") for f in spec.referenced_files())]
    check_output_file(path, key, reads)       # first: a path that cannot be looked at is said there, in one line
    with contextlib.suppress(OSError):
        in_results = path.name in FOLDER_FILES and (path.parent / "run.json").is_file()
    if in_results:
        raise SpecError(f"is a file of the results folder {path.parent}: give another file name", file=str(path),
                        key=key)
    if not baseline_ok and _is_baseline(path):
        raise SpecError("is a kl-bench baseline (a gate's reference; `kl-bench baseline --out` replaces one): give "
                        "another file name", file=str(path), key=key)


def _is_baseline(path: Path) -> bool:
    """Whether ``path`` is a regular file that starts as a kl-bench baseline does (opened as every read is,
    kl_bench.foundation.safe_io: never a blocked open; anything else, or nothing there, is no baseline)."""
    from ..foundation.safe_io import open_regular
    with contextlib.suppress(OSError, SpecError):
        with open_regular(path, "baseline") as fh:
            return b'"kl_bench_baseline"' in fh.read(256)
    return False


def stale_report_note(folder: Path) -> None:
    """A run that replaced a folder's results keeps the files it did not write (a user's notes, a report);
    a report there now describes the results it replaced: one line on stderr says so (whatever --quiet)."""
    from ..present.terminal import prose
    report = Path(folder) / "report"
    if report.is_dir() and not report.is_symlink():
        prose(err_console, f"note: {report}/ describes the results this run replaced: `kl-bench report {folder}` "
                           "remakes it")


def difference_lines(path: Path, most: int = 8) -> list[str]:
    """The runs' differences for the terminal: how many rows were compared, then the largest |z| first
    (at most ``most`` lines; all of them in differences.csv), in the report's words (diff/true ± SE in %)."""
    from ..foundation.formatting import plural
    from ..present.report_differences import difference_cells
    from ..results import read_frame
    d = read_frame(path)
    if d.empty:
        return ["differences: the runs share no (case, row) to compare"]
    d = d.assign(az=d["z"].abs()).sort_values("az", ascending=False, na_position="last")
    lines = [f"differences: {plural(len(d), 'row')} compared with the first run; |z| > 5 in {int((d['az'] > 5).sum())} "
             f"(largest first; all in {path.name})"]
    for _, r in d.head(most).iterrows():
        run, against, case, row, rel, z = difference_cells(r)
        lines.append(f"  {run} vs {against}: {case} {row}: diff/true {rel}, z {z}")
    return lines


def write_outputs(targets: dict) -> None:
    """Extra output files (path → a function making their bytes), written atomically; None paths skipped.
    An interrupt's line names those already written (each is whole)."""
    from ..foundation import signals
    from ..foundation.atomic import atomic_write_bytes, fs_error
    from ..foundation.storage import mark_written
    signals.phase("write")
    for path, make in targets.items():
        if path is None:
            continue
        with user_errors():
            try:
                atomic_write_bytes(path, make())
            except OSError as e:
                raise fs_error(e, path) from None
        mark_written(path)
    signals.phase("written")


# ----------------------------------------------------------------------------- options shared by commands
# Declared once here; each command passes only what differs (what --quiet silences for it, what --draws replaces).
def seed_option(default: int | None = None, help: str = "override [experiment] seed"):
    return typer.Option(default, "--seed", parser=int_flag, metavar="S", help=help)


def device_option(default: str | None = None, help: str = "override [experiment] device: auto|cpu|cuda|cuda:N"):
    return typer.Option(default, "--device", metavar="DEVICE", help=help)


def draws_option(help: str = "override [experiment] draws (1e7 and 10_000_000 work, as in a spec)"):
    return typer.Option(None, "--draws", metavar="N", callback=draws_flag, help=help)


def batch_option():
    return typer.Option(64, "--batch", parser=int_flag, metavar="B", help="the advice's batch size (draws per mean)")


def tolerance_option():
    return typer.Option(0.1, "--tolerance", parser=float_flag, metavar="T",
                        help="the advice's relative tolerance (0.05: ±5%)")


def quiet_option(silences: str):
    """``--quiet``/``-q``; ``silences``: what it leaves out for this command (its help)."""
    return typer.Option(False, "--quiet", "-q", help=silences)
