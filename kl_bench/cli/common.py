"""What every command shares: the typer app, the two consoles, one-line errors (exit 2) and interrupts
(exit 130), and the presentation helpers a run and ``exact`` print with."""
from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path
from typing import Iterator, Optional

import typer
import typer.core
from rich.console import Console

from ..errors import SpecError

app = typer.Typer(add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="kl-bench: bias, variance and failure modes of Monte Carlo KL estimators, "
                       "measured next to the exact truth.")


class Command(typer.core.TyperCommand):
    """Usage lines as users know them: `kl-bench run [OPTIONS] SPEC`, not `{SPEC}`."""

    def collect_usage_pieces(self, ctx):
        return [p.replace("{", "").replace("}", "") for p in super().collect_usage_pieces(ctx)]


# A terminal gets tables fitted to its width; a file or pipe gets plain text lines that never wrap.
out_console = Console(highlight=False, width=None if sys.stdout.isatty() else 400)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)   # a message is one line, never wrapped

interrupt_reported = [False]
DEFAULT_RUNS = Path("runs")        # where `kl-bench run` and `train` write without --out (git-ignored)


def interrupted(message: str) -> None:
    """Say what an interrupt left behind, in one line, and exit 130."""
    err_console.print(message, markup=False)
    interrupt_reported[0] = True
    raise typer.Exit(130)


def fail(err: SpecError) -> None:
    err_console.print(f"error: {err}", markup=False, soft_wrap=True)
    raise typer.Exit(2)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    try:
        yield
    except SpecError as e:
        fail(e)


def warn_rows(df, console: Console) -> None:
    from ..advice import warnings
    for line in warnings(df):
        console.print(line, markup=False)


def advise(advice) -> None:
    """The advice lines (kl_bench.advice): what to log, what to put in the loss. A sentence that holds
    for several cases alike (the on-policy identities) is printed once, naming them."""
    out_console.print()
    general: dict[str, list[str]] = {}
    for a in advice:
        if a.general:
            general.setdefault(a.detail, []).append(a.case)
        else:
            out_console.print(a.text, markup=False, soft_wrap=True)
    for detail, cases in general.items():
        out_console.print(f"{', '.join(cases)}: {detail}", markup=False, soft_wrap=True)


def advice_options(batch: int, tolerance: float) -> None:
    """A bad --batch or --tolerance: one line, exit 2, before any sampling."""
    from ..advice import AdviceOptionError, check_options
    try:
        check_options(batch, tolerance)
    except AdviceOptionError as e:
        fail(SpecError(str(e), key=f"--{e.key}"))


def draws_flag(value: Optional[str]):
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


def write_report(dirs: list[Path], out: Path, quiet: bool = False) -> None:
    """The report of results folders into ``out`` (a folder): one line on success, one on any error or
    interrupt; a report that fails leaves nothing behind (no folder, no half-written files)."""
    from .. import signals
    from ..report import write_report as write
    from ..runner import interrupt_line
    from ..storage import check_output_dir, fs_error
    from ..audit.report import audit_report_files, is_audit_folder
    from ..storage import write_folder
    from ..training.report import is_training_folder, training_report_files
    from ..results.verify import require_folder
    with user_errors():
        for d in dirs:              # what was asked for is said first, before the (default) --out is judged
            require_folder(d)
        check_report_out(Path(out))
        out = check_output_dir(out)
        earlier = "an earlier report in {out} is untouched" if out.exists() else "nothing was created"
        try:
            if len(dirs) == 1 and is_training_folder(dirs[0]):       # a `kl-bench train` folder
                write_folder(out, training_report_files(dirs[0]))
            elif len(dirs) == 1 and is_audit_folder(dirs[0]):        # an audit (TRL callback, kl-bench audit)
                write_folder(out, audit_report_files(dirs[0]))
            else:
                write(dirs, out)
            signals.phase("report-written")
        except KeyboardInterrupt:
            interrupted(interrupt_line(out, "report files", earlier))
        except OSError as e:
            raise fs_error(e, out, "cannot write the report") from None
    if not quiet:
        page = "report.html" if (out / "report.html").exists() else "report.md"
        out_console.print(f"report → {out}/{page} ({len(list((out / 'figures').glob('*.png')))} figures)")
        if (out / "differences.csv").exists():
            for line in difference_lines(out / "differences.csv"):
                out_console.print(line, markup=False)


def difference_lines(path: Path, most: int = 8) -> list[str]:
    """The runs' differences for the terminal: how many rows were compared, then the largest |z| first
    (at most ``most`` lines; all of them in differences.csv)."""
    from ..display import fmt
    from ..results import read_frame
    d = read_frame(path)
    if d.empty:
        return ["differences: the runs share no (case, row) to compare"]
    d = d.assign(az=d["z"].abs()).sort_values("az", ascending=False, na_position="last")
    lines = [f"differences: {len(d)} rows compared with the first run; |z| > 5 in {int((d['az'] > 5).sum())} "
             f"(largest first; all in {path.name})"]
    for _, r in d.head(most).iterrows():
        lines.append(f"  {r['run']} vs {r['against']}: {r['case']} {r['row']}: diff/true {fmt(r['rel_diff'])} "
                     f"± {fmt(r['se'] / abs(r['diff'] / r['rel_diff']) if r['rel_diff'] else float('nan'), 2)}, "
                     f"z {fmt(r['z'], 2)}{r['heavy_tail']}")
    return lines


def write_outputs(targets: dict) -> None:
    """Extra output files (path → a function making their bytes), written atomically; None paths skipped.
    An interrupt's line names those already written (each is whole)."""
    from .. import signals
    from ..storage import atomic_write_bytes, fs_error, mark_written
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
