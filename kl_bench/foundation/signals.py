"""Signals as one line: the first SIGINT, SIGTERM or SIGHUP (an SSH session or terminal that closes) stops the
command (a KeyboardInterrupt), exit code 130 whichever it was; later ones
(Ctrl-C pressed three times, torchrun's SIGTERM during the shutdown that the first began) are counted
and ignored, so the exit is the first's one line and code 130, never a second traceback or a death by
signal. :func:`phase` marks the boundaries where a signal that some library swallowed (a
KeyboardInterrupt raised inside a finaliser is only printed) still stops the run before it writes.

No torch, no pandas: the console script installs these handlers before anything heavy loads."""
from __future__ import annotations

import contextlib
import signal
import sys
from typing import Callable

seen = [0]                  # signals received so far

# The signals that stop a command with one line: Ctrl-C, kill's default, and the hang-up an SSH session or a
# terminal sends when it closes. SIGHUP is left ignored where the process started with it ignored (nohup, a
# parent that ignores it): judged once, when this module is first imported (at the console script's start).
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_HUP_IGNORED = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN

# Called with the phase's name at every boundary (start, pairs, write, staged: a folder's files are staged
# beside it, not yet swapped in; written, report-written). Empty in
# production; tests/kl_test_hooks.py adds one that signals the process at a chosen phase (tests need no sleeps).
listeners: list[Callable[[str], None]] = []


def on_signal(signum, frame) -> None:
    seen[0] += 1
    if seen[0] == 1:
        raise KeyboardInterrupt


def _unraisable(hook):
    """``sys.unraisablehook`` that stays silent about the KeyboardInterrupt of our own signal: raised inside
    a finaliser or a weakref callback (garbage collection during matplotlib's drawing, say), Python cannot
    propagate it and prints an 'Exception ignored in' traceback. The signal is counted in ``seen``, and
    :func:`phase` stops the command at its next boundary; anything else goes to the previous hook."""
    def unraisable(info) -> None:
        if not (isinstance(info.exc_value, KeyboardInterrupt) and seen[0]):
            hook(info)
    unraisable.kl_bench = True
    return unraisable


def install() -> None:
    """SIGTERM and SIGHUP handled like SIGINT from the first moment: one line, never a traceback. A signal that
    the process inherited as ignored (SIGHUP under nohup) stays ignored."""
    for sig in STOPPING:
        if not (sig == signal.SIGHUP and _HUP_IGNORED):
            signal.signal(sig, on_signal)
    if not getattr(sys.unraisablehook, "kl_bench", False):
        sys.unraisablehook = _unraisable(sys.unraisablehook)


def ignore() -> None:
    """The job is ending and what went wrong has been (or is being) said: later signals add nothing."""
    for sig in STOPPING:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def held():
    """SIGINT, SIGTERM and SIGHUP held (delivered when the block ends). Around imports of compiled extensions: a
    KeyboardInterrupt raised inside a pybind11 callback during ``import torch`` aborts the process
    (std::terminate, exit −6) or kills it by the signal, instead of the one line and exit 130."""
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOPPING))
    except (AttributeError, ValueError, OSError):        # not POSIX, or not the main thread
        old = None
    try:
        yield
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def import_heavy() -> None:
    """The compiled extensions every command loads (torch, numpy, pandas, scipy's special functions,
    and FFT) imported with the signals held (see :func:`held`); a signal that came meanwhile is
    raised right after, in Python, where it is one line."""
    with held():
        import numpy  # noqa: F401
        import pandas  # noqa: F401
        import scipy.fft  # noqa: F401
        import scipy.special  # noqa: F401
        import torch  # noqa: F401


def import_plotting() -> None:
    """matplotlib (with pyplot) and seaborn imported with the signals held (see :func:`held`), for the
    commands that draw: matplotlib.ft2font's C++ start-up calls back into Python, and a KeyboardInterrupt
    raised there became "ImportError: initialization failed" with a traceback, or an abort (exit 134)."""
    with held():
        import matplotlib  # noqa: F401
        import matplotlib.pyplot  # noqa: F401
        import seaborn  # noqa: F401


def release() -> None:
    """Deliver the signals the console script held during start-up (kl_bench.__main__), if any."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOPPING))


def phase(name: str) -> None:
    """A phase boundary: tell the listeners, then stop if a signal came and was swallowed."""
    for listener in listeners:
        listener(name)
    if seen[0]:
        raise KeyboardInterrupt


def interrupted_anywhere() -> str:
    """The line for an interrupt the command did not report itself: what this process has written."""
    storage = sys.modules.get("kl_bench.foundation.storage")      # never imported (with torch) just to say nothing
    written = storage.written_folders() if storage is not None else []
    return (f"interrupted after writing {', '.join(written)} (complete)" if written
            else "interrupted: nothing was written")
