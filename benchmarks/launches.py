"""How many ATen operations a call dispatches: a proxy for the kernel launches it makes on a GPU (views and
``empty`` launch none, a few operators such as ``nonzero`` or ``cumsum`` launch several; every one costs host
time), measured on any device, so that the paths that were launch-bound on an H100 (issue 33) are kept in
check on a CPU-only machine in CI. benchmarks/bench_gpu.py --ops prints it.

With it, a proxy for the memory traffic of the same kernels, for the paths whose vectors are long enough that
a GPU's time follows bytes rather than launches: the bytes each kernel streams (reads its operands and writes
its result once each, a broadcast operand counted once) and the elements it gathers from an index (a random
read of at least one 32-byte sector each on a GPU, counted apart because a gather from a table larger than the
cache costs a sector whatever the element's size). It is an estimate from shapes, not a measurement: caches,
fused kernels and operators that read their input twice are not modelled.
"""
from __future__ import annotations

import collections
import math
from typing import Callable, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

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


# Operators that read their first operand (the table) only at the rows an index names: its bytes are the
# gathered elements, not the table's size. embedding_bag gathers a row of the table per index.
GATHERS = frozenset({"index_select", "index", "gather", "take", "embedding", "_embedding_bag",
                     "_embedding_bag_forward_only"})
# Operators that write their first operand only at the rows an index names.
SCATTERS = frozenset({"index_add_", "index_put_", "_index_put_impl_", "scatter_add_", "scatter_", "index_copy_"})
SECTOR = 32                                  # bytes a GPU's memory system moves for one random read


class Ops(collections.Counter):
    """ATen operators dispatched, by name (``sum(ops.values())``: all of them), and :attr:`launching`, those
    that make a kernel on a GPU (about one launch each); :attr:`streamed` (bytes) and :attr:`sectors`
    (random 32-byte reads), by name, the memory-traffic proxy of the module's docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.free: set[str] = set()          # names of the operators that made no kernel
        self.streamed: collections.Counter = collections.Counter()
        self.sectors: collections.Counter = collections.Counter()

    @property
    def launching(self) -> int:
        return sum(v for k, v in self.items() if k not in self.free)

    @property
    def traffic(self) -> int:
        """Bytes in all: the streamed bytes and a sector per random read."""
        return sum(self.streamed.values()) + SECTOR * sum(self.sectors.values())


SELF_COPY = "copy_ onto itself"


def _same(a, b) -> bool:
    """Whether ``a`` and ``b`` are one view of one storage (a copy between them moves nothing)."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and
            a.device == b.device and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


def _bytes(t: torch.Tensor) -> int:
    """Bytes a kernel moves for ``t``: its distinct elements (an expanded dimension, stride 0, once; a 0-dim
    tensor is a kernel argument: 0), a sector each where no two of them share one (a column of a row-major
    block: its innermost stride spans a sector or more)."""
    if t.dim() == 0:
        return 0
    sizes = [(n, st) for n, st in zip(t.shape, t.stride()) if st != 0 and n > 1]
    apart = bool(sizes) and min(abs(st) for _, st in sizes) * t.element_size() >= SECTOR
    return (SECTOR if apart else t.element_size()) * math.prod(n for n, _ in sizes)


def _operands(args: tuple, kwargs: dict, out) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors an operator read (``out=`` left out) and those it returned."""
    ins = [t for t in tree_flatten((args, {k: v for k, v in kwargs.items() if k != "out"}))[0]
           if isinstance(t, torch.Tensor)]
    return ins, [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _gathered(name: str, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> tuple[int, int]:
    """A gather's traffic: its index operands and result streamed, a sector per index for the table (an
    embedding_bag row per index, whose result is summed over a bag; else the result's share of an index)."""
    table, rest = ins[0], ins[1:]
    reads = max((t.numel() for t in rest if not t.is_floating_point()), default=0)
    each = table.element_size() * math.prod(table.shape[1:]) if name.startswith("_embedding_bag") else \
        _bytes(outs[0]) // max(reads, 1)
    return sum(map(_bytes, rest)) + _bytes(outs[0]), reads * -(-max(each, 1) // SECTOR)


def _traffic(name: str, args: tuple, kwargs: dict, out) -> tuple[int, int]:
    """(bytes streamed, random sector reads) of one kernel-making operator ``name`` called on ``args``/``kwargs``
    that returned ``out``: operands and results once each (an in-place operand read and written), a gathered
    table at its gathered rows, a scattered one at its written rows."""
    ins, outs = _operands(args, kwargs, out)
    if name in GATHERS and ins and outs:
        return _gathered(name, ins, outs)
    if name == "searchsorted" and len(ins) > 1:
        # A binary search over the sorted operand: a random read per level below the top 20 (their 2^20
        # sectors, 32 MiB, taken as cached).
        levels = max(0, math.ceil(math.log2(max(ins[0].shape[-1], 1))) - 20)
        return sum(map(_bytes, ins[1:])) + sum(map(_bytes, outs)), ins[1].numel() * levels
    if name in SCATTERS and len(ins) > 1:
        rest = ins[1:]
        return sum(map(_bytes, rest)) + max(t.numel() for t in rest) * ins[0].element_size(), 0
    return sum(map(_bytes, ins)) + sum(map(_bytes, outs)), 0


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = Ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        if name == "copy_" and _same(*args[:2]):
            name = SELF_COPY                 # x[a:b] += y ends with x[a:b] = x[a:b]: ATen returns at once
        self.ops[name] += 1
        out = func(*args, **kwargs)
        if name == SELF_COPY or launches_nothing(func):
            self.ops.free.add(name)
        else:
            streamed, sectors = _traffic(name, args, kwargs, out)
            self.ops.streamed[name] += streamed
            self.ops.sectors[name] += sectors
        return out


def count_ops(fn: Callable[[], T]) -> tuple[T, Ops]:
    """``fn()``'s result and the ATen operators it dispatched (:class:`Ops`: by name, and how many launch a
    kernel)."""
    with _Count() as c:
        out = fn()
    return out, c.ops


__all__ = ["GATHERS", "NO_KERNEL", "SCATTERS", "SECTOR", "SELF_COPY", "Ops", "count_ops", "launches_nothing"]
