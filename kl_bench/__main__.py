"""`python -m kl_bench` and the `kl-bench` console script: signal handlers first, then the CLI, so that a
Ctrl-C, SIGTERM or SIGHUP at any moment of start-up is one line (exit 130), never a traceback."""
import os
import signal
import sys
import tempfile

from .foundation import signals


def _temp_dir_without_probe() -> None:
    """A disk with no room: Python's first ``tempfile.gettempdir()`` writes a probe file in each candidate
    folder and, when every write fails, raises; some libraries call it at import (dill, which torch
    imports when it is installed, as the trl extra does), so ``import torch`` died with a traceback before
    kl-bench could say "no space left" in one line. Then the first candidate is taken unprobed: kl-bench's
    own writes find the full disk and say so (kl_bench.foundation.storage)."""
    try:
        tempfile.gettempdir()
    except OSError:
        tempfile.tempdir = os.environ.get("TMPDIR") or "/tmp"


def entry() -> None:
    try:
        _entry()
    finally:
        _forget_caught_interrupts()


def _forget_caught_interrupts() -> None:
    """Exit with the code the command chose, even if a KeyboardInterrupt (our signal) was once raised inside
    code run from a string (a dataclass's generated methods, a namedtuple's: exec and eval, say during an
    import the command made) and then caught and said in one line: CPython remembers that as "unhandled"
    (run_eval_code_obj) and, under ``python -m``, ends the process by SIGINT after the exit code was
    decided (exit −2, not 130). Running a string clears that memory; signals are ignored first (the
    outcome is said), so nothing can interrupt it."""
    for _ in range(3):
        try:
            signals.ignore()
            break
        except KeyboardInterrupt:        # a signal that had just come, run by signal.signal: ignored too
            continue
    exec("pass", {})                     # noqa: S102  (clears CPython's unhandled-KeyboardInterrupt flag)


def _entry() -> None:
    try:
        # Held until the command's compiled extensions are imported (kl_bench.cli.main releases them): a
        # KeyboardInterrupt raised inside a pybind11 callback of an import aborts the process (−6) or kills
        # it by the signal instead of the one line and exit 130. A signal that came meanwhile is raised
        # then. Held before the handlers go in, and all of it inside the try: a signal between installing
        # the handlers and holding them had raised out of entry() as a traceback and a death by SIGINT.
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, set(signals.STOPPING))
        # The first signal stops start-up; later ones (Ctrl-C pressed again) are ignored: one line, exit 130.
        signals.install()
        _temp_dir_without_probe()
        from .cli import main
    except KeyboardInterrupt:
        signals.ignore()
        sys.stderr.write("interrupted: nothing was written\n")
        sys.exit(130)
    try:
        main()
    except KeyboardInterrupt:
        # A KeyboardInterrupt that escaped main (a later signal that found Python's own handler) must not
        # end the process by SIGINT (Python re-raises an uncaught one as the signal): the line is said.
        signals.ignore()
        sys.exit(130)


if __name__ == "__main__":
    entry()
