"""A tile's elementwise work fused by ``torch.compile`` (opt-in: ``fused=True``).

Eagerly, each of a tile's ~38 elementwise operations (normalisers, u and ψ(u), the monomial products and
row sums: kl_bench.audit.first_pass) reads and writes the whole chunk × tile buffer: on one CPU thread
they cost ~1.3 float32 head forwards beside the three tile matmuls' 2.45 (benchmarks/README.md, table C).
Compiled, they become a few loops over each row that keep it in cache. The formulas are the same; the
float32 row sums are inductor's (vectorised lanes) instead of torch's pairwise ones, and they stay within
the float32 bound the eager sums are tested against (tests/test_audit_fused.py).

The price is a compile (~30 s on a CPU with an empty inductor cache, once per process and plan; shapes are dynamic) at the first call,
and a C++ compiler (CPU) or Triton (GPU) at run time. Where compiling fails, the eager operations run
instead, with one warning per process."""
from __future__ import annotations

import warnings
from typing import Callable

import torch

_COMPILED: dict[Callable, Callable] = {}
_FAILED: dict[Callable, str] = {}


def _compile_error(e: Exception) -> bool:
    """An error of torch.compile's own machinery (no compiler, a backend failure), not of the inputs."""
    return type(e).__module__.startswith(("torch._dynamo", "torch._inductor"))


def call(fn: Callable, *args):
    """``fn(*args)`` through its compiled version (made once per process, dynamic shapes); ``fn`` itself
    where compiling failed (warned once: the values are the same, only slower)."""
    if fn in _FAILED:
        return fn(*args)
    compiled = _COMPILED.get(fn)
    if compiled is None:
        compiled = _COMPILED[fn] = torch.compile(fn, dynamic=True)
    try:
        return compiled(*args)
    except Exception as e:                      # narrowed at once: only torch.compile's own failures
        if not _compile_error(e):
            raise
        _FAILED[fn] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        warnings.warn(f"fused=True: torch.compile could not build the audit's tile kernels "
                      f"({_FAILED[fn][:200]}); the unfused operations run instead (same values, slower)",
                      RuntimeWarning, stacklevel=2)
        return fn(*args)
