"""A tile's elementwise work fused by ``torch.compile`` (opt-in: ``fused=True``).

Eagerly, each of a tile's ~38 elementwise operations (normalisers, u and ψ(u), the monomial products and
row sums: kl_bench.audit.first_pass) reads and writes the whole chunk × tile buffer: on one CPU thread
they cost ~1.3 float32 head forwards beside the three tile matmuls' 2.45 (benchmarks/README.md, table C).
Compiled, they become a few loops over each row that keep it in cache. The formulas are the same; the
float32 row sums are inductor's (vectorised lanes) instead of torch's pairwise ones, and they stay within
the float32 bound the eager sums are tested against (tests/test_audit_fused.py).

The price is a compile at the first call (~30 s on a CPU with an empty inductor cache) and again for each
new variant of the work: another dtype, sampler family, set of outputs, or EOS ban (the shapes are
dynamic); and a C++ compiler (CPU) or Triton (GPU) at run time. Where compiling or the compiled call
fails, the eager operations run instead, with one warning per process."""
from __future__ import annotations

import warnings
from typing import Callable

import torch

# Compiled variants kept per function before torch.compile stops compiling it (its default, 8, is soon
# reached by a process that audits with several dtypes, samplers or outputs; past it dynamo would run the
# function uncompiled without a Python warning).
RECOMPILES = 64
# torch.compile's own imports warn so on this torch; a caller's test suite run with warnings as errors
# must not fail on it.
_TORCH_DEPRECATION = dict(message="`torch.jit.script_method` is deprecated", category=DeprecationWarning)

_COMPILED: dict[Callable, Callable] = {}
_FAILED: dict[Callable, str] = {}


def _compiled(fn: Callable) -> Callable:
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True, fullgraph=True, recompile_limit=RECOMPILES)
    return _COMPILED[fn]


def call(fn: Callable, fused_args: tuple, eager_args: tuple):
    """``fn(*fused_args)`` through its compiled version (made once per process); ``fn(*eager_args)`` where
    that fails, and from then on (warned once: the values are the same, only slower).

    ``fn`` must not modify ``fused_args`` (the eager rerun after a failure reads them as they were); a
    failure that is the inputs' fault fails the eager rerun too, and that error is raised."""
    if fn in _FAILED:
        return fn(*eager_args)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", **_TORCH_DEPRECATION)
            return _compiled(fn)(*fused_args)
    except Exception as e:                      # torch.compile's failures have many types: the rerun decides
        out = fn(*eager_args)
        cause = getattr(e, "inner_exception", None) or e        # BackendCompilerFailed wraps the cause
        first = (str(cause).strip().splitlines() or [""])[0]
        _FAILED[fn] = f"{type(cause).__name__}: {first}"[:200]
        warnings.warn(f"fused=True: torch.compile could not build or run the audit's tile kernels "
                      f"({_FAILED[fn]}); the unfused operations run instead (same values, slower)",
                      RuntimeWarning, stacklevel=2)
        return out
