"""Test hooks, kept out of the package: ``python tests/kl_test_hooks.py ARGS`` (:data:`tests.helpers.HOOKS`) is
the console script with the hooks that the environment asks for installed first.

- ``KL_BENCH_SELF_SIGNAL=PHASE[:SIGTERM]``: the process signals itself (SIGINT by default) at that phase
  boundary (:func:`kl_bench.foundation.signals.phase`: start, pairs, write, staged, written, report-written), so that the
  signal tests need no sleeps.
- ``KL_BENCH_RANK_FAIL=RANK:PHASE[:N]``: the process of that rank (torchrun's ``RANK``) dies by SIGKILL, as a
  crashed or OOM-killed process would, the Nth time (default the first) it reaches PHASE: ``start`` (it
  joined the process group), ``main`` (it drew its slice of a round of a main or pilot pass, before the
  gather), ``gradients`` (it added a batch of a gradient pass).
- ``KL_BENCH_KILL_AFTER_STAGED=N``: the process dies by SIGKILL right after the Nth file it stages in a results
  folder's staging folder (:func:`kl_bench.foundation.storage.write_folder`): a folder half staged, the swap
  not done, whatever the machine's speed (a sleep had stood in for that event).
- ``KL_BENCH_KILL_AFTER_CHECKPOINT=N``: the process dies by SIGKILL right after its Nth checkpoint is
  written, mid-run whatever the machine's speed (the resume test's kill is an event, not a time).
"""
from __future__ import annotations

import importlib
import os
import signal
import sys
from pathlib import Path

SELF_SIGNAL_ENV = "KL_BENCH_SELF_SIGNAL"
RANK_FAIL_ENV = "KL_BENCH_RANK_FAIL"
KILL_AFTER_STAGED_ENV = "KL_BENCH_KILL_AFTER_STAGED"
KILL_AFTER_CHECKPOINT_ENV = "KL_BENCH_KILL_AFTER_CHECKPOINT"


def install_from_env() -> None:
    _install_self_signal()
    _install_rank_fail()
    _install_kill_after_staged()
    _install_kill_after_checkpoint()


def _install_kill_after_checkpoint() -> None:
    _kill_after(KILL_AFTER_CHECKPOINT_ENV, "api.run_folder", "save_checkpoint")


def _install_kill_after_staged() -> None:
    _kill_after(KILL_AFTER_STAGED_ENV, "foundation.storage", "stage_file")


def _kill_after(env: str, module: str, name: str) -> None:
    """``kl_bench.<module>.<name>`` dies by SIGKILL right after its Nth call returns, N from ``env`` (unset or
    0: nothing installed, and the module not imported)."""
    nth = int(os.environ.get(env, "0") or 0)
    if not nth:
        return
    owner = importlib.import_module(f"kl_bench.{module}")
    original, calls = getattr(owner, name), [0]

    def then_die(*args, **kwargs) -> None:
        original(*args, **kwargs)
        calls[0] += 1
        if calls[0] == nth:
            os.kill(os.getpid(), signal.SIGKILL)
    setattr(owner, name, then_die)


def _install_self_signal() -> None:
    want = os.environ.get(SELF_SIGNAL_ENV, "")
    if not want:
        return
    from kl_bench.foundation import signals
    target, sig = want.split(":")[0], signal.SIGTERM if want.endswith(":SIGTERM") else signal.SIGINT

    def listener(name: str) -> None:
        if name == target:
            os.kill(os.getpid(), sig)
    signals.listeners.append(listener)


def _install_rank_fail() -> None:
    want = os.environ.get(RANK_FAIL_ENV, "").split(":")
    if len(want) < 2 or want[0] != os.environ.get("RANK", "0"):
        return
    phase, nth, reached = want[1], int(want[2]) if len(want) > 2 else 1, [0]
    # Imported only here: the plain test runs keep the console script's light start-up.
    from kl_bench.engine import distributed, monte_carlo as engine

    def point(name: str) -> None:
        if name == phase:
            reached[0] += 1
            if reached[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)

    start, gather, add_batches = distributed.start, distributed.Ranks.gather, engine.add_batches

    def start_then_fail(device):
        out = start(device)
        point("start")
        return out

    def fail_then_gather(self, obj):
        if not isinstance(obj, tuple):      # a main pass's rows (a tensor, or None); gradient passes send tuples
            point("main")
        return gather(self, obj)

    def add_then_fail(acc, batches, progress):
        out = []
        for batch in batches:
            out += add_batches(acc, [batch], progress)
            point("gradients")
        return out
    distributed.start, distributed.Ranks.gather, engine.add_batches = start_then_fail, fail_then_gather, add_then_fail


if __name__ == "__main__":
    # Run by path, Python put tests/ first on sys.path; the repository root stands there instead, as under
    # ``python -m`` from it: kl_bench is this checkout's, and no module of tests/ shadows another's name.
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    install_from_env()
    from kl_bench.__main__ import entry
    entry()
