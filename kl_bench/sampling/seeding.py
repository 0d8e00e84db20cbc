"""Seeds, batches and pieces.

Batch i of a case draws from generators seeded by (seed, case, stream, i) alone, so results do not
depend on how batches are grouped into chunks or split across processes. A batch larger than one
**piece** is drawn piece by piece: piece j of batch i has its own generator, seeded by (seed, case,
stream, i, j), and the batch's sums are the piece sums added in piece order. The piece size is fixed
per device type (never by ``chunk``), so memory stays bounded whatever the batch size and the bytes
stay the same whatever the chunk size. Piece 0 uses the batch's own seed, so a batch that fits in one
piece draws exactly what it drew before pieces existed.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

# Draws per piece. CPU: 2^16 keeps a piece's per-draw features (≈ 3 float64 per estimator row) in a
# few tens of MiB while per-call overhead stays negligible; CUDA: 2^20, enough to fill a GPU.
PIECE_DRAWS = {"cpu": 1 << 16, "cuda": 1 << 20}
# A categorical token piece holds token ids only while they are drawn and counted (≈ 50 bytes a draw, no
# per-draw features), so on CUDA it is 16 general pieces (2^24 draws): 10^10 draws make ~600 pieces, each
# with its generator and a dozen kernels, instead of ~10^4 (issue 33; not yet timed on a GPU:
# benchmarks/bench_gpu.py times both sizes). The CPU keeps one piece, and with it its bytes.
TOKEN_PIECES = {"cpu": 1, "cuda": 16}
# A rollout's per-step sums (L, the analytic KL, the token rows) are added once per block of this many steps
# (kl_bench.kinds.rollout.sampler): each estimator then runs once a block rather than once a step, fewer
# operations (on a GPU, kernel launches: issue 33) for the same elementwise work. Within a block the steps
# are added in a fixed order (a pairwise tree that depends on the block's length alone), so a path's sums
# do not depend on its neighbours or the chunk. The CPU adds every step on its own, and keeps its bytes.
# CUDA: 8 steps, chosen by operation count (benchmarks/README.md), not yet timed on a GPU.
STEP_BLOCKS = {"cpu": 1, "cuda": 8}
# A rollout batch draws its paths' uniforms for this many steps in one call ([paths, steps], path-major),
# instead of one call a step: a chunk of many small batches (200 batches of 5,000 paths share one piece
# of 2^20 on a GPU) otherwise makes a kernel per batch at every step, ~9× the rest of a step's kernels
# (issue 33). Memory: 8 bytes a path and step of the block (512 MiB at 2^20 paths on CUDA). A batch's
# numbers come from its own generator in one call, so they do not depend on the chunk; on CUDA they differ
# from one call a step (Philox's offsets), on the CPU one row a call is the same stream as before.
UNIFORM_STEPS = {"cpu": 1, "cuda": 64}


def device_key(device) -> torch.device:
    """The device a tensor made on ``device`` lands on ("cuda" → "cuda:N", the current one): the key of a
    per-device cache, so that "cuda" and "cuda:0" share one copy of a table."""
    key = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if key.type == "cuda" and key.index is None else key


def piece_draws(device: torch.device) -> int:
    """The fixed piece size on ``device``'s type (draws)."""
    return PIECE_DRAWS.get(torch.device(device).type, PIECE_DRAWS["cpu"])


def step_block(device: torch.device) -> int:
    """The rollout sampler's steps per block of sums on ``device``'s type (:data:`STEP_BLOCKS`)."""
    return STEP_BLOCKS.get(torch.device(device).type, STEP_BLOCKS["cpu"])


def uniform_steps(device: torch.device) -> int:
    """The rollout sampler's steps of uniforms a batch draws at once on ``device``'s type (:data:`UNIFORM_STEPS`)."""
    return UNIFORM_STEPS.get(torch.device(device).type, UNIFORM_STEPS["cpu"])


def token_piece_draws(device: torch.device) -> int:
    """The fixed piece size of categorical token ids on ``device``'s type (draws)."""
    return piece_draws(device) * TOKEN_PIECES.get(torch.device(device).type, 1)


def batch_seed(seed: int, case: str, batch: int, piece: int = 0) -> int:
    """A 63-bit seed for one piece of one batch, from (seed, case name [/stream], batch, piece) only."""
    key = f"kl-bench/{seed}/{case}/{batch}" + (f"/{piece}" if piece else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def batch_generator(seed: int, tag: str, batch: int, device: torch.device, piece: int = 0) -> torch.Generator:
    """The generator of one batch (piece): ``tag`` is the case name, or "case/stream" for an independent
    stream."""
    return torch.Generator(device=device).manual_seed(batch_seed(seed, tag, batch, piece))


def batch_sizes(draws: int, batches: int) -> list[int]:
    """Split ``draws`` into min(batches, draws) batches whose sizes differ by at most one."""
    k = min(batches, draws)
    base, extra = divmod(draws, k)
    return [base + (i < extra) for i in range(k)]


def piece_sizes(n: int, piece: int) -> list[int]:
    """Split a batch of ``n`` draws into full pieces of ``piece`` draws and a remainder (fixed by n)."""
    full, rest = divmod(n, piece)
    return [piece] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class BatchStream:
    """The random stream of one batch: batch ``index`` of ``size`` draws of the stream ``tag``.

    A kind draws the batch piece by piece (:meth:`pieces`) or, where a batch statistic can be drawn
    directly (a categorical's count vector), from :meth:`numpy_generator` (on the host) or
    :meth:`counts_generator` (on the device). Either way what it draws depends on (seed, tag, index)
    alone, never on which other batches share the call.
    """
    seed: int
    tag: str
    index: int
    size: int
    device: torch.device

    def pieces(self, piece: int | None = None) -> Iterator[tuple[int, torch.Generator]]:
        """(draws, generator) of every piece, in order; ``piece``: the piece size (default: the device's)."""
        for j, m in enumerate(piece_sizes(self.size, piece or piece_draws(self.device))):
            yield m, batch_generator(self.seed, self.tag, self.index, self.device, j)

    def numpy_generator(self) -> np.random.Generator:
        """A numpy generator for the whole batch (PCG64, seeded like piece 0 but a separate family)."""
        return np.random.Generator(np.random.PCG64(batch_seed(self.seed, self.tag + "#np", self.index)))

    def counts_generator(self) -> torch.Generator:
        """A torch generator on the batch's device for the whole batch's count vector (kl_bench.sampling.multinomial),
        seeded like piece 0 but a separate family."""
        return batch_generator(self.seed, self.tag + "#counts", self.index, self.device)


def batch_streams(seed: int, tag: str, sizes: list[int], device: torch.device) -> list[BatchStream]:
    """One stream per batch."""
    return [BatchStream(seed, tag, i, n, torch.device(device)) for i, n in enumerate(sizes)]
