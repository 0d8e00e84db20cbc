"""Test hooks, kept out of the production paths: ``python -m kl_bench._testing ARGS`` is the console
script with the hooks that the environment asks for installed first.

- ``KL_BENCH_SELF_SIGNAL=PHASE[:SIGTERM]``: the process signals itself (SIGINT by default) at that phase
  boundary (:func:`kl_bench.signals.phase`: start, pairs, write, written, report-written), so that the
  signal tests need no sleeps.
"""
from __future__ import annotations

import os
import signal

SELF_SIGNAL_ENV = "KL_BENCH_SELF_SIGNAL"


def install_from_env() -> None:
    want = os.environ.get(SELF_SIGNAL_ENV, "")
    if not want:
        return
    from . import signals
    target, sig = want.split(":")[0], signal.SIGTERM if want.endswith(":SIGTERM") else signal.SIGINT

    def listener(name: str) -> None:
        if name == target:
            os.kill(os.getpid(), sig)
    signals.listeners.append(listener)


if __name__ == "__main__":
    install_from_env()
    from .__main__ import entry
    entry()
