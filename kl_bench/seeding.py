"""Seeds and batches. Batch i of a case draws from a generator seeded by (seed, case, stream, i) alone, so
results do not depend on how batches are grouped into chunks or split across processes."""
from __future__ import annotations

import hashlib

import torch


def batch_seed(seed: int, case: str, batch: int) -> int:
    """A 63-bit seed for one batch, derived from (seed, case name [/stream], batch index) only."""
    digest = hashlib.blake2b(f"kl-bench/{seed}/{case}/{batch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def batch_generator(seed: int, tag: str, batch: int, device: torch.device) -> torch.Generator:
    """The generator of one batch: ``tag`` is the case name, or "case/stream" for an independent stream."""
    return torch.Generator(device=device).manual_seed(batch_seed(seed, tag, batch))


def batch_sizes(draws: int, batches: int) -> list[int]:
    """Split ``draws`` into min(batches, draws) batches whose sizes differ by at most one."""
    k = min(batches, draws)
    base, extra = divmod(draws, k)
    return [base + (i < extra) for i in range(k)]
