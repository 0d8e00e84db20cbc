"""Command-line interface: a thin layer over the Python API, one module per command (run, report,
check and baseline, exact, train, list, dump-logits, audit). The work, including the run's lock, checkpoints
and interrupts, is in the API (:func:`kl_bench.api.run_folder.run_to_folder`); here are flags, tables and lines.

Heavy modules (pandas, scipy, matplotlib) are imported inside the commands that need them, so that
``kl-bench --help`` and ``kl-bench list`` start quickly.
"""
from __future__ import annotations

import sys

import typer

from ..foundation import signals
from ..foundation.errors import is_out_of_memory, memory_words
from . import run, exact, report, gate, train, audit, dump, listing  # noqa: F401  (each registers its command; in the order of a workflow, which --help shows)
from .common import app, err_console, interrupt_reported, say_error

__all__ = ["app", "main"]


def _version(value: bool) -> None:
    if value:
        from ..foundation.version import __version__
        print(f"kl-bench {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit")) -> None:
    """kl-bench: bias, variance and failure modes of Monte Carlo KL estimators, measured next to the exact truth."""


def _is_abort(e: BaseException) -> bool:
    # click turns a KeyboardInterrupt inside a command into its own Abort (typer vendors click)
    return type(e).__name__ == "Abort"


# The commands that split their work across torchrun's processes (docs/devices.md): every rank runs them. The
# others (report, check, baseline, exact, audit, dump-logits, list, and help) run on rank 0 alone.
DISTRIBUTED = frozenset({"run", "train"})
_HELP = {"-h", "--help", "--version", "--install-completion", "--show-completion"}


def _command_name(args: list[str]) -> str | None:
    """The command the arguments name: the first one that is not an option (None: none)."""
    return next((a for a in args if not a.startswith("-")), None)


def _left_to_rank_zero(args: list[str]) -> bool:
    """Whether this process is a rank other than 0 of a torchrun job and the arguments ask for something rank 0
    does alone (a command that does not split its work, help, the version): then it exits 0 at once, reading
    and writing nothing (two processes had made and swapped the same report folder at once, each printing its
    line). The job ends when rank 0 does (torchrun waits for every process) with rank 0's outcome."""
    from ..engine.distributed import follower
    if follower() is None:
        return False
    name = _command_name(args)
    return name not in DISTRIBUTED or bool(_HELP & set(args))


def _runs_a_command(args: list[str]) -> bool:
    """Whether the arguments run a command (help, the version, completion and a command name that does not
    exist need no torch: the usage error comes at once)."""
    if not args or _HELP & set(args):
        return False
    name = _command_name(args)
    return name is None or name in typer.main.get_command(app).commands


def _exit_code(rv) -> int:
    """A command's return value as the exit code, with the line an unreported interrupt needs."""
    if rv == 130 and not interrupt_reported[0]:     # typer turns a Ctrl-C in a command into 130
        err_console.print(signals.interrupted_anywhere(), markup=False)
    if signals.seen[0] and rv in (0, None):         # a signal some library swallowed: not a success
        err_console.print(signals.interrupted_anywhere(), markup=False)
        rv = 130
    return rv if isinstance(rv, int) else 0


def main(argv: list[str] | None = None) -> None:
    """The console script: every usage error is one line (exit 2), every interrupt one line (exit 130)."""
    signals.install()
    from typer._click.exceptions import ClickException, NoArgsIsHelpError
    args = sys.argv[1:] if argv is None else argv
    try:
        signals.phase("start")
        if _left_to_rank_zero(args):
            sys.exit(0)
        if _runs_a_command(args):
            signals.import_heavy()          # every command needs torch: imported where a signal is safe
        signals.release()                   # a signal held since start-up is raised here, as one line
        sys.exit(_exit_code(app(args=argv, standalone_mode=False, prog_name="kl-bench")))
    except NoArgsIsHelpError as e:
        print(e.ctx.get_help() if e.ctx is not None else str(e))
        sys.exit(0)
    except ClickException as e:
        say_error(' '.join(e.format_message().split()))       # under torchrun: rank 0's line alone
        sys.exit(e.exit_code)
    except typer.Exit as e:
        if e.exit_code == 130:
            signals.ignore()          # interrupted and said so: later signals add nothing
        sys.exit(e.exit_code)
    except (MemoryError, RuntimeError) as e:
        _failed(e, args)
    except (KeyboardInterrupt, typer.Abort):
        _interrupted()
    finally:
        signals.ignore()          # the outcome is said: a signal during shutdown must not add to it


def _failed(e: MemoryError | RuntimeError, args: list[str]) -> None:
    """A failed allocation is one line (exit 2), an abort (a C++ library's answer to a signal) an interrupt
    (exit 130); any other error is raised again, whole."""
    if is_out_of_memory(e):
        _out_of_memory(e, args)
    if isinstance(e, RuntimeError) and _is_abort(e):
        _interrupted()
    raise e


def _out_of_memory(e: BaseException, args: list[str]) -> None:
    """An allocation that failed: one line naming what to make smaller, and exit 2."""
    signals.ignore()
    e.__traceback__ = None          # let the failed allocation's tables go before saying it
    say_error(_out_of_memory_line(e, args))
    sys.exit(2)


def _interrupted() -> None:
    """An interrupt's one line (unless the command said it) and exit 130."""
    signals.ignore()              # before the line: a signal now must not interrupt saying it
    if not interrupt_reported[0]:
        err_console.print(signals.interrupted_anywhere(), markup=False)
    sys.exit(130)


# What to make smaller when a command runs out of memory where no case was being built, computed or sampled
# (those say so themselves: kl_bench.foundation.memory.out_of_memory_said), by command.
_SMALLER = {
    "run": "fewer draws at once (a smaller [experiment] chunk, more batches)",
    "check": "fewer draws at once (a smaller [experiment] chunk, more batches)",
    "baseline": "fewer draws at once (a smaller [experiment] chunk, more batches)",
    "exact": "smaller cases (vocab, contexts, length)",
    "train": "smaller cases (vocab, contexts, length), or fewer seeds",
    "report": "fewer results folders at once",
    "audit": "a smaller --tile or --chunk",
    "dump-logits": "a smaller --batch-size",
}


def _out_of_memory_line(e: BaseException, args: list[str]) -> str:
    """The one line of a failed allocation that no command located: the command, its words, what to change."""
    from ..foundation.memory import memory_advice
    name = _command_name(args)
    doing = f" in `kl-bench {name}`" if name in _SMALLER else ""
    return f"out of memory{doing} ({memory_words(e)}): {memory_advice(_SMALLER.get(name, 'smaller inputs'))}"
