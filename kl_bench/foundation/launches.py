"""How many ATen operations a call dispatches: on a GPU each is (at least) one kernel launch, so this count
is a launch count that can be measured and tested on a CPU-only machine (issue 33: the paths that were
launch-bound on an H100 are kept in check by it in CI, and benchmarks/bench_gpu.py prints it).

Only operators that reach the dispatcher are counted (views and metadata calls included, as they cost host
time too); a kernel that one operator launches several times on a GPU counts once.
"""
from __future__ import annotations

import collections
from typing import Callable, TypeVar

from torch.utils._python_dispatch import TorchDispatchMode

T = TypeVar("T")


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], T]) -> tuple[T, collections.Counter[str]]:
    """``fn()``'s result and the ATen operators it dispatched, by name (a Counter: ``sum(c.values())`` is the
    total)."""
    with _Count() as c:
        out = fn()
    return out, c.ops


__all__ = ["count_ops"]
