"""Logits and log-probs handed in by a caller, checked at the door: real tensors, and logits whose every row
is a distribution. Tensors in, tensors out; used by a spec's logits (kl_bench.sampling.logits), by
:func:`kl_bench.estimate` (which must not import the sampling package: it runs inside training loops) and
by the audit's :func:`kl_bench.position_values`."""
from __future__ import annotations

import torch

from ..foundation.errors import SpecError


def check_logits(logits: torch.Tensor, what: str = "", key: str | None = None) -> None:
    """Reject NaN, +inf, and rows that put no mass anywhere (−inf marks a zero probability): each would come
    out of the softmax as NaN values, silently. The message starts with ``what`` (a spec's case side) or
    names the argument ``key`` (the Python API), and gives the first bad index."""
    head = f"{what}: " if what else ""
    for bad, name in ((torch.isnan(logits), "NaN"), (torch.isposinf(logits), "+inf")):
        if bool(bad.any()):
            raise SpecError(f"{head}logits contain {name} (at index {first_index(bad)})", key=key)
    dead = torch.isneginf(logits).all(dim=-1)
    if bool(dead.any()):
        raise SpecError(f"{head}a row of logits is all −inf, no token has probability > 0 (at index "
                        f"{first_index(dead)})", key=key)


def first_index(flags: torch.Tensor) -> list[int]:
    """The index of the first True of ``flags`` (any shape), as a list (for a message)."""
    return [int(i) for i in torch.nonzero(flags)[0]]


def as_real_tensor(value, key: str, logical: bool = False) -> torch.Tensor:
    """``value`` (a tensor, an ndarray, nested lists of numbers) as a tensor; anything else (a string, a
    dict) is one SpecError naming the argument ``key``, not torch's "new(): invalid data type". Bool only if
    ``logical`` (a mask): True as a logit or a log-prob is a mistake."""
    try:
        t = torch.as_tensor(value)      # host: a tensor keeps its device; an ndarray or a list is the caller's host data
    except (TypeError, ValueError, RuntimeError):
        raise SpecError(f"must be a tensor (or an ndarray, or nested lists of numbers), got {type(value).__name__}",
                        key=key) from None
    if t.is_complex() or (t.dtype == torch.bool and not logical):
        raise SpecError(f"must hold real numbers, got dtype {t.dtype}", key=key)
    return t


def as_mask(value, key: str = "mask") -> torch.Tensor:
    """``value`` as a mask tensor (:func:`as_real_tensor`): bool, or numbers that are all 0 or 1. Anything
    else (−1, 0.5, 2, NaN) is one SpecError naming ``key`` with the first bad value and its index: such a
    mask was read as bool by the per-token values (every nonzero counts) but as a weight by an aggregation
    (Σ v·m / Σ m), so the two disagreed silently."""
    t = as_real_tensor(value, key, logical=True)
    if t.dtype == torch.bool:
        return t
    if t.device.type == "meta":
        raise SpecError("a tensor on the 'meta' device has a shape but no data", key=key)
    bad = (t != 0) & (t != 1)               # NaN differs from both
    if bool(bad.any()):
        raise SpecError(f"must be bool or hold only 0 and 1 (1: a position that counts, 0: padding), got "
                        f"{t[bad][0].item():g} at index {first_index(bad)}", key=key)
    return t
