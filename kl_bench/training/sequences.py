"""A per-sequence reward R(y) of a rollout's whole token sequence y = (x_1, …, x_|y|): the registry of
reward functions (built-in names, ``"module:object"`` plug-ins found beside the spec too, and the entry-point
group ``kl_bench.sequence_rewards``) and the checked call of one (docs/training.md, "A per-sequence reward").
The kinds that train against R enumerate their sequences themselves (kl_bench.kinds.rollout.sequences).

A reward function is called as ``fn(tokens, mask)``: ``tokens`` int64 [N, T] (T the case's length) with −1
past each sequence's end, ``mask`` bool [N, T], True on the sequence's tokens (EOS included). It returns N
finite numbers (a tensor, an array or a list), one per sequence. It must be deterministic: the exact values
call it once on every sequence, the sampled updates on the sampled paths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..foundation.errors import SpecError
from ..foundation.registry import Registry



@dataclass(frozen=True)
class SequenceReward:
    """A named reward of whole sequences: ``fn(tokens, mask) -> [N]`` (module docstring)."""
    name: str
    fn: Callable[[torch.Tensor, torch.Tensor], Any]


def _adapt(ref: str, obj: Any) -> SequenceReward:
    if isinstance(obj, SequenceReward):
        return obj
    if not callable(obj):
        raise SpecError(f"sequence reward plug-in '{ref}' is a {type(obj).__name__}, not a function of "
                        "(tokens, mask)")
    return SequenceReward(ref, obj)


SEQUENCE_REWARDS: Registry[SequenceReward] = Registry("sequence reward", entry_points="kl_bench.sequence_rewards",
                                                      adapt=_adapt)


def _length(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """|y|, the number of tokens (EOS included); additive: a per-token table of ones gives the same."""
    return mask.sum(-1).to(torch.float64)


def _distinct(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The number of distinct token ids in y; not a sum over steps."""
    s = torch.sort(tokens, -1).values                  # −1 (past the end) sorts first
    new = torch.ones_like(s, dtype=torch.bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    return (new & (s >= 0)).sum(-1).to(torch.float64)


SEQUENCE_REWARDS.add("length", SequenceReward("length", _length))
SEQUENCE_REWARDS.add("distinct", SequenceReward("distinct", _distinct))


def rewards_of(reward: SequenceReward, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """R on N sequences, float64 [N]; an exception, a wrong shape or a non-finite value is one line."""
    n = tokens.shape[0]
    try:
        out = reward.fn(tokens.clone(), mask.clone())
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever the plug-in raised is the user's input error
        first = (str(e).strip().splitlines() or [""])[0]
        raise SpecError(f"sequence reward '{reward.name}' raised {type(e).__name__}: {first}") from None
    try:
        # host: a user's reward values, checked on the host (then moved with the problem's tables)
        values = torch.as_tensor(out.detach() if isinstance(out, torch.Tensor) else out).to("cpu", torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise SpecError(f"sequence reward '{reward.name}' returned a {type(out).__name__}, not {n} numbers") from None
    if tuple(values.shape) != (n,):
        raise SpecError(f"sequence reward '{reward.name}' returned shape {list(values.shape)} for {n} sequences; "
                        f"it must return one number per sequence, shape [{n}]")
    bad = (~torch.isfinite(values)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise SpecError(f"sequence reward '{reward.name}' returned {float(values[i])} for the sequence "
                        f"{tokens[i][mask[i]].tolist()}: rewards must be finite")
    return values


def categorical_table(reward: SequenceReward, rows: int, vocab: int) -> torch.Tensor:
    """A categorical's "sequence" is one token: R([x]) in every context is a reward table [rows, V]."""
    tokens = torch.arange(vocab)[:, None]  # host: a spec's reward table
    return rewards_of(reward, tokens, torch.ones_like(tokens, dtype=torch.bool)).expand(rows, vocab).clone()
