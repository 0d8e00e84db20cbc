"""Every sequence of a small rollout, enumerated: what a reward of whole sequences R(y) needs for exact
values, since R is not a sum over steps and no dynamic program applies (docs/training.md, "A per-sequence
reward"). At most :data:`MAX_SLOTS` token slots (sequences × T): V^T ≤ 2^22 / T without EOS."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...foundation.errors import SpecError
from ..trainable import SEQUENCE_REWARD_KEY as KEY

MAX_SLOTS = 1 << 22            # sequences × T enumerated (int64 tokens and keys: 64 MiB)


def count_sequences(vocab: int, length: int, eos: int | None) -> int:
    """How many sequences a rollout has: V^T without EOS; with it, those ending in EOS before step T
    (Σ_{t<T−1} (V−1)^t) and those of length T ((V−1)^{T−1}·V)."""
    if eos is None:
        return vocab ** length
    k = vocab - 1
    return sum(k ** t for t in range(length - 1)) + k ** (length - 1) * vocab


@dataclass(frozen=True)
class Sequences:
    """Every sequence of a rollout: ``tokens`` int64 [M, T] (−1 past the end), ``mask`` bool [M, T] and
    ``keys`` int64 [M, T], c·V + x of each step (c the bucket it was drawn in; 0 past the end)."""
    tokens: torch.Tensor
    mask: torch.Tensor
    keys: torch.Tensor


def enumerate_sequences(bucket: torch.Tensor, vocab: int, length: int, eos: int | None) -> Sequences:
    """Every sequence, shortest first, extending every live prefix by every token in turn (step 1 is drawn
    in bucket 0, step t + 1 in the bucket of x_t, as the rollout kind's sampler draws them)."""
    dev = bucket.device
    x = torch.arange(vocab, device=dev)
    tok, key = torch.zeros(1, 0, dtype=torch.int64, device=dev), torch.zeros(1, 0, dtype=torch.int64, device=dev)
    ctx = torch.zeros(1, dtype=torch.int64, device=dev)
    done_tok, done_key = [], []
    for t in range(length):
        a = tok.shape[0]
        nxt = x.repeat(a)
        tok = torch.cat([tok.repeat_interleave(vocab, 0), nxt[:, None]], 1)
        key = torch.cat([key.repeat_interleave(vocab, 0), (ctx.repeat_interleave(vocab) * vocab + nxt)[:, None]], 1)
        end = torch.full((tok.shape[0],), t == length - 1, device=dev) if eos is None or t == length - 1 else nxt == eos
        pad = length - t - 1
        done_tok.append(torch.nn.functional.pad(tok[end], (0, pad), value=-1))
        done_key.append(torch.nn.functional.pad(key[end], (0, pad), value=0))
        tok, key = tok[~end], key[~end]
        ctx = bucket[tok[:, -1]] if tok.numel() else ctx[:0]
    tokens = torch.cat(done_tok)
    return Sequences(tokens, tokens >= 0, torch.cat(done_key))


def enumerate_checked(bucket: torch.Tensor, vocab: int, length: int, eos: int | None, case: str) -> Sequences:
    """:func:`enumerate_sequences`, or one line when the case has more than :data:`MAX_SLOTS` token slots."""
    m = count_sequences(vocab, length, eos)
    if m * length > MAX_SLOTS:
        shape = f"V = {vocab}, T = {length}" + (", with EOS" if eos is not None else "")
        raise SpecError(f"a per-sequence reward is computed exactly by enumerating every sequence, and this case has "
                        f"{m:,} ({shape}): sequences × T must be ≤ 2^22 = {MAX_SLOTS:,}; use a smaller vocab or "
                        "length, or a per-token reward (random, file, tokens)", case=case, key=KEY)
    return enumerate_sequences(bucket, vocab, length, eos)
