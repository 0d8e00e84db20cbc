"""One intra-op thread for every number kl-bench computes, so that bytes never depend on the machine.

A float64 sum over a large tensor (a vocabulary's exact moments) or a BLAS product (a batch's count
vector times the feature table) is split across torch's intra-op threads, and the partial sums are
added in an order that depends on how many threads there are: one thread and two give results that
differ in the last bits. torchrun gives each process one thread, a plain run uses every core; to keep
"the same spec, seed and device give the same bytes whatever the number of processes", every entry
point of the API computes with one intra-op thread and restores the caller's setting afterwards.
Parallelism comes from processes (``torchrun --nproc-per-node N``) or the GPU instead.
"""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def single_threaded(fn: F) -> F:
    """Run ``fn`` with one torch intra-op thread (the caller's count is restored on return)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        n = torch.get_num_threads()
        if n == 1:
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(n)
    return wrapper  # type: ignore[return-value]
