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


# Operators that make no kernel on a GPU besides the views: allocation without a fill (resize_ too: the
# out= of torch.rand(..., out=x) dispatches one), and the 0-dim host tensors that wrap a Python scalar
# (torch.where(c, x, 0.0)), which a kernel takes as an argument.
NO_KERNEL = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "resize_", "scalar_tensor",
                       "lift_fresh"})


def launches_nothing(func) -> bool:
    """Whether the ATen operator ``func`` (an OpOverload) makes no kernel: one of :data:`NO_KERNEL`, or a view
    (``func.is_view``: its input aliased by its output, not written: select, slice, view, expand, unbind...;
    an in-place operator aliases its input too, but writes it)."""
    return func.overloadpacket.__name__ in NO_KERNEL or bool(func.is_view)


class Ops(collections.Counter):
    """ATen operators dispatched, by name (``sum(ops.values())``: all of them), and :attr:`launching`, those
    that make a kernel on a GPU (about one launch each)."""

    def __init__(self) -> None:
        super().__init__()
        self.free: set[str] = set()          # names of the operators that made no kernel

    @property
    def launching(self) -> int:
        return sum(v for k, v in self.items() if k not in self.free)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = Ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if launches_nothing(func):
            self.ops.free.add(name)
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], T]) -> tuple[T, Ops]:
    """``fn()``'s result and the ATen operators it dispatched (:class:`Ops`: by name, and how many launch a
    kernel)."""
    with _Count() as c:
        out = fn()
    return out, c.ops


__all__ = ["NO_KERNEL", "Ops", "count_ops", "launches_nothing"]
