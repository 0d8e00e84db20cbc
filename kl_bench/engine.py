"""The streaming Monte Carlo engine.

Draws for batch i of a case come from a generator seeded by (seed, case, i) alone, so results do not
depend on how batches are grouped into chunks (the chunk size only bounds memory) and a split of the
batches across processes reproduces the same numbers. Every estimator sees the same draws (common
random numbers). Per batch we keep float64 sums of a few per-draw features; memory is O(batches),
never O(draws).

Features per estimator f, shifted by a constant c (its exact mean when finite, else 0):
    f − c,  (f − c)²,  1[f < 0].
The shift makes the per-draw variance Σ(f − c)²/N − (Σ(f − c)/N)² free of the catastrophic
cancellation of E[f²] − E[f]² when the std is small relative to the mean, and keeps the sums small.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import SpecError
from .estimators import ESTIMATORS, Estimator
from .pairs import Pair

FEATURES_PER_ESTIMATOR = 3  # f − c, (f − c)², 1[f < 0]


def resolve_device(name: str) -> torch.device:
    """'auto' → CUDA when available, else CPU. Asking for CUDA without one is an input error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecError(f"device '{name}' requested but CUDA is not available here", key="device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SpecError(f"device '{name}' requested but only {torch.cuda.device_count()} GPU(s) exist",
                            key="device")
    return dev


def batch_seed(seed: int, case: str, batch: int) -> int:
    """A 63-bit seed for one batch, derived from (seed, case name, batch index) only."""
    digest = hashlib.blake2b(f"kl-bench/{seed}/{case}/{batch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def batch_sizes(draws: int, batches: int) -> list[int]:
    """Split ``draws`` into min(batches, draws) batches whose sizes differ by at most one."""
    k = min(batches, draws)
    base, extra = divmod(draws, k)
    return [base + (i < extra) for i in range(k)]


JOINT_FEATURES = 5  # a − ca, b − cb, (a − ca)², (b − cb)², (a − ca)(b − cb) for a = −log r, b = r − 1


def make_features(estimators: list[Estimator], shifts: list[float],
                  joint_shift: tuple[float, float] | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Per-draw features: logr [...] → [..., 3E (+5)] float64 (see module docstring).

    With ``joint_shift`` = (ca, cb) the joint moments of a = −log r and b = r − 1 are appended: every
    cv(λ) = a + λb has mean and variance linear and quadratic in λ, so these five sums give the whole
    λ curve from one pass.
    """
    shift = torch.tensor(shifts, dtype=torch.float64)

    def features(logr: torch.Tensor) -> torch.Tensor:
        parts = []
        if estimators:
            f = torch.stack([e.fn(logr) for e in estimators], dim=-1)   # [..., E]
            centred = f - shift.to(f.device)
            parts = [centred, centred * centred, (f < 0).to(torch.float64)]
        if joint_shift is not None:
            a = -logr - joint_shift[0]
            b = torch.expm1(logr) - joint_shift[1]
            parts.append(torch.stack([a, b, a * a, b * b, a * b], dim=-1))
        return torch.cat(parts, dim=-1)
    return features


@dataclass
class CaseRun:
    """Everything sampled for one case: per-batch feature sums plus the exact reference."""
    pair: Pair
    estimators: list[Estimator]
    shifts: list[float]
    sizes: torch.Tensor          # [K] int64, draws per batch
    sums: torch.Tensor           # [K, 3E] float64 per-batch feature sums (CPU)
    exact: dict[str, tuple[float, float]] = field(default_factory=dict)  # label → (mean, var)
    seconds: float = 0.0
    joint_shift: tuple[float, float] | None = None    # (ca, cb) when the joint block is present
    small_batch_negative: dict[str, float] = field(default_factory=dict)  # label → P(mean of 64 < 0)

    @property
    def joint_sums(self) -> torch.Tensor | None:
        """[K, 5] per-batch sums of the joint (a, b) features, or None."""
        if self.joint_shift is None:
            return None
        return self.sums[:, FEATURES_PER_ESTIMATOR * len(self.estimators):]

    @property
    def draws(self) -> int:
        return int(self.sizes.sum())


def label(est: Estimator) -> str:
    """Unique key of an estimator within a run: cv variants differ by λ."""
    return est.name if est.lam is None else f"{est.name}@{est.lam!r}"


def exact_moments(pair: Pair, estimators: list[Estimator]) -> dict[str, tuple[float, float]]:
    return {label(e): pair.exact_moments(e) for e in estimators}


def _resolve(estimators) -> list[Estimator]:
    return [ESTIMATORS.get(e) if isinstance(e, str) else e for e in estimators]


def run_case(pair: Pair, estimators, *, draws: int, seed: int, batches: int,
             chunk: int, device: torch.device, joint: bool = False, stream: str = "",
             progress: Callable[[int], None] | None = None) -> CaseRun:
    """Sample ``draws`` draws of ``pair`` in batches and accumulate every estimator's features.

    ``estimators``: registry names or :class:`Estimator` objects. ``joint`` adds the (−log r, r − 1)
    moments for the λ curve. ``stream`` names an independent random stream (e.g. "pilot").
    """
    estimators = _resolve(estimators)
    exact = exact_moments(pair, estimators)
    shifts = [m if math.isfinite(m) else 0.0 for m, _ in (exact[label(e)] for e in estimators)]
    joint_shift = None
    if joint:
        jm = pair.exact_joint()
        joint_shift = tuple(x if math.isfinite(x) else 0.0 for x in (jm.mean_a, jm.mean_b))
    features = make_features(estimators, shifts, joint_shift)
    sizes = batch_sizes(draws, batches)
    run = pair.batch_sums(features, device)
    per_chunk = pair.batches_per_chunk(max(sizes), chunk)
    tag = pair.name + (f"/{stream}" if stream else "")
    t0 = time.perf_counter()
    out = []
    for start in range(0, len(sizes), per_chunk):
        idx = range(start, min(start + per_chunk, len(sizes)))
        gens = [torch.Generator(device=device).manual_seed(batch_seed(seed, tag, i)) for i in idx]
        part = [sizes[i] for i in idx]
        out.append(run(part, gens).cpu())
        if progress is not None:
            progress(sum(part))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return CaseRun(pair, estimators, shifts, torch.tensor(sizes), torch.cat(out), exact,
                   time.perf_counter() - t0, joint_shift)


def small_batch_negative(pair: Pair, estimators, *, batch: int, batches: int, seed: int,
                         device: torch.device) -> dict[str, float]:
    """P(mean of ``batch`` draws < 0) per estimator, simulated on ``batches`` batches of actual draws
    (an independent stream: seeded from (seed, case/small-batch))."""
    estimators = _resolve(estimators)
    g = torch.Generator(device=device).manual_seed(batch_seed(seed, f"{pair.name}/small-batch", 0))
    logr = pair.sample_logr(batch * batches, g, device).view(batches, batch)
    return {label(e): float((e.fn(logr).mean(dim=1) < 0).double().mean()) for e in estimators}
