"""How many ATen operations a call dispatches: a proxy for the kernel launches it makes on a GPU (views and
``empty`` launch none, a few operators such as ``nonzero`` or ``cumsum`` launch several; every one costs host
time), measured on any device, so that the paths that were launch-bound on an H100 (issue 33) are kept in
check on a CPU-only machine in CI. benchmarks/bench_gpu.py --ops prints it.
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
