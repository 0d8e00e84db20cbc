"""The streaming Monte Carlo engine.

Draws for batch i of a case come from generators seeded by (seed, case, i) alone (piece by piece for a
batch larger than a piece, see kl_bench.sampling.seeding), so results do not depend on how batches are grouped
into chunks (the chunk size only sets how often progress and checkpoints happen) and a split of the
batches across processes reproduces the same numbers. Memory is one piece of draws per case, whatever
the batch size. Every estimator sees the same draws (common
random numbers). Per batch we keep float64 sums of a few per-draw features; memory is O(batches),
never O(draws).

Features per row f (see kl_bench.core.draws), shifted by a constant c (its exact mean when finite, else 0):
    f − c,  (f − c)²,  1[f < 0].
The shift makes the per-draw variance Σ(f − c)²/N − (Σ(f − c)/N)² free of the catastrophic
cancellation of E[f²] − E[f]² when the std is small relative to the mean, and keeps the sums small
(docs/statistics.md#shifted-sums).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..core.draws import Draws, Row
from ..core.aggregates import group_starts, groups_in, row_values, tok_rows
from .distributed import SINGLE, Ranks, block, drawn_by_rank, rounds
from ..foundation.errors import SpecError
from ..core.estimators import resolve_estimator
from ..core.modes import GradBatch, GradItem
from ..kinds.protocols import BatchSums, CasePair, GradientAccumulator, gradient_oracle, no_gradients
from ..sampling.seeding import BatchStream, batch_generator, batch_sizes, batch_streams

FEATURES_PER_ESTIMATOR = 3  # f − c, (f − c)², 1[f < 0]


JOINT_FEATURES = 5  # a − ca, b − cb, (a − ca)², (b − cb)², (a − ca)(b − cb) for a = −log r, b = r − 1
WEIGHT_FEATURES = 2  # W, W² of the draw's importance weight (a weighted sampler b ≠ q): its effective sample size


def make_features(rows: list[Row], shifts: list[float],
                  joint: list[tuple[str, float, float]] | None = None,
                  weights: bool = False) -> Callable[[Draws], torch.Tensor]:
    """Per-draw features: Draws [n] → [n, 3·rows (+ 5·joint blocks) (+ 2)] float64 (see module docstring).

    Each joint block (aggregate, ca, cb) appends the shifted moments of a = −log r and b = r − 1
    (b = Σ_t (r_t − 1) for the "tok" aggregate): every cv(λ) = a + λb has mean and variance linear
    and quadratic in λ, so these five sums give the whole λ curve from one pass. ``weights`` appends W and
    W² of the draw's importance weight (``Draws.weight``; 1 where None): Kish's effective sample size
    (ΣW)²/ΣW² says whether the weighted rows' means mean anything (kl_bench.core.stats.kish_ess). Unshifted:
    E_b[W] = 1, and a W that underflows to 0 is a draw that carries nothing, as the rows see it.
    """
    shift = torch.tensor(shifts, dtype=torch.float64)  # host: copied to each device once, below
    on_device: dict[torch.device, torch.Tensor] = {}
    grouped = [(j, r.group) for j, r in enumerate(rows) if r.group > 1]

    def features(draws: Draws) -> torch.Tensor:
        parts = []
        if rows:
            groups: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            f = row_values(draws, rows, groups)                          # [n, Q]
            if f.device not in on_device:
                on_device[f.device] = shift.to(f.device)
            centred = f - on_device[f.device]
            parts = [centred, centred * centred, (f < 0).to(torch.float64)]
            if grouped:
                # A group row's value is repeated at each member of its group: count it once, at the
                # group's first draw (zero elsewhere, and for draws in no group).
                keep = torch.ones_like(f, dtype=torch.bool)
                for j, group in grouped:
                    keep[:, j] = False
                    keep[groups[group][0][::group], j] = True
                parts = [torch.where(keep, x, torch.zeros_like(x)) for x in parts]
        for aggregate, ca, cb in joint or []:
            a = -draws.logr - ca
            b = (draws.tok_b if aggregate == "tok" else torch.expm1(draws.logr)) - cb
            parts.append(torch.stack([a, b, a * a, b * b, a * b], dim=-1))
        if weights:
            w = draws.weight if draws.weight is not None else torch.ones_like(draws.logr)
            parts.append(torch.stack([w, w * w], dim=-1))
        return torch.cat(parts, dim=-1)
    return features


@dataclass
class CaseRun:
    """Everything sampled for one case: per-batch feature sums plus the exact reference."""
    pair: CasePair
    rows: list[Row]
    shifts: list[float]
    sizes: torch.Tensor          # [K] int64, draws per batch
    sums: torch.Tensor           # [K, 3Q + 5J] float64 per-batch feature sums (CPU)
    counts: torch.Tensor         # [K, Q] float64, values per batch of each row (draws; groups for group rows)
    exact: dict[str, tuple[float, float]] = field(default_factory=dict)  # row label → (mean, var)
    seconds: float = 0.0         # this process's sampling time (batches restored from a checkpoint took none)
    joint: list[tuple[str, float, float]] = field(default_factory=list)  # (aggregate, ca, cb) blocks
    drawn: list[list[list[int]]] = field(default_factory=list)  # per rank: [lo, hi) batch ranges it drew
    restored: int = 0            # draws of the batches restored from a checkpoint (not drawn by this process)
    weighted: bool = False       # the sums end with the weight block (ΣW, ΣW² per batch)

    @property
    def draws(self) -> int:
        return int(self.sizes.sum())

    def weight_sums(self) -> tuple[float, float] | None:
        """(ΣW, ΣW²) over every draw of the importance weights (None: the sampler is not weighted)."""
        if not self.weighted:
            return None
        total = self.sums[:, -WEIGHT_FEATURES:].sum(0)
        return float(total[0]), float(total[1])

    def joint_sums(self, aggregate: str) -> torch.Tensor:
        """[K, 5] per-batch sums of the joint (a, b) features of one aggregate."""
        i = [a for a, _, _ in self.joint].index(aggregate)
        start = FEATURES_PER_ESTIMATOR * len(self.rows) + JOINT_FEATURES * i
        return self.sums[:, start:start + JOINT_FEATURES]

    def joint_shift(self, aggregate: str) -> tuple[float, float]:
        _, ca, cb = next(j for j in self.joint if j[0] == aggregate)
        return ca, cb


def as_rows(items, pair: CasePair) -> list[Row]:
    """Rows from registry names, Estimators/PairRows or Rows; a source gets a row on every aggregate
    the pair gives it (:meth:`CasePair.aggregates_for`)."""
    out = []
    for it in items:
        if isinstance(it, Row):
            out.append(it)
            continue
        est = resolve_estimator(it)
        out += [Row(est, a, pair.row_group(a)) for a in pair.aggregates_for(est)]
    return out


def row_counts(rows: list[Row], sizes: list[int], piece: int) -> torch.Tensor:
    """[K, Q] float64: how many values each row gets from each batch (the draws; whole groups within
    each piece for a group row, see kl_bench.core.draws)."""
    # host: counts of the gathered sums
    return torch.tensor([[float(n if r.group == 1 else groups_in(n, r.group, piece)) for r in rows] for n in sizes],
                        dtype=torch.float64).reshape(len(sizes), len(rows))


def _finite_or_zero(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def _report(progress: Callable[..., None] | None, draws: int, restored: bool = False) -> None:
    """Tell ``progress`` of ``draws`` done; draws restored from a checkpoint as ``restored=True``, so that
    a rate counts only the draws of this process."""
    if progress is not None:
        if restored:
            progress(draws, restored=True)
        else:
            progress(draws)


def _joint_blocks(pair: CasePair, joint: bool) -> list[tuple[str, float, float]]:
    """(aggregate, ca, cb) per aggregate: the joint (−log r, r − 1) features shifted by their exact means."""
    if not joint:
        return []
    blocks = []
    for agg in pair.aggregates:
        jm = pair.exact_joint(agg)
        blocks.append((agg, _finite_or_zero(jm.mean_a), _finite_or_zero(jm.mean_b)))
    return blocks


def _check_resume(resume: torch.Tensor, pair: CasePair, rows: list[Row], exact: dict[str, tuple[float, float]],
                  width: int, sizes: list[int]) -> None:
    """Refuse checkpoint sums [k, width] that are not this spec's (other estimators) or are corrupted."""
    if resume.shape[1] != width:
        raise SpecError("checkpoint does not match this spec's estimators; delete it or run without --resume")
    bad = check_resumed_sums(resume, len(rows), [math.isfinite(exact[r.label][0]) for r in rows], sizes,
                             weighted=pair.weights != "none")
    if bad:
        raise SpecError(f"checkpoint of case '{pair.name}' {bad} (corrupted?); delete it or run without --resume")


def run_case(pair: CasePair, rows, *, draws: int, seed: int, batches: int,
             chunk: int, device: torch.device, joint: bool = False, stream: str = "",
             progress: Callable[[int], None] | None = None, resume: torch.Tensor | None = None,
             on_sums: Callable[[torch.Tensor], None] | None = None, ranks: Ranks = SINGLE) -> CaseRun:
    """Sample ``draws`` draws of ``pair`` in batches and accumulate every row's features.

    ``rows``: :class:`Row`s, or registry names / Estimators (expanded over the pair's aggregates).
    ``joint`` adds the (−log r, r − 1) moments per aggregate for the λ curve. ``stream`` names an
    independent random stream (e.g. "pilot"). ``resume``: the [k, P] sums of the first k batches from a
    checkpoint; since batch i depends on (seed, case, i) alone, skipping them gives identical results.
    ``on_sums`` receives the sums of all batches done so far after every chunk (for checkpoints).
    ``ranks``: this process's share of a multi-process run (kl_bench.engine.distributed): each rank draws a slice
    of every round and rank 0 gathers the rows in batch order, so its sums (and ``progress``/``on_sums``
    calls) are those of one process; the other ranks get a CaseRun without sums.
    """
    rows = as_rows(rows, pair)
    exact = {r.label: pair.exact_moments(r.est, r.aggregate) for r in rows}
    shifts = [_finite_or_zero(exact[r.label][0]) for r in rows]
    blocks = _joint_blocks(pair, joint)
    weighted = pair.weights != "none"
    width = len(rows) * FEATURES_PER_ESTIMATOR + JOINT_FEATURES * len(blocks) + WEIGHT_FEATURES * weighted
    sizes = batch_sizes(draws, batches)
    streams = batch_streams(seed, pair.name + (f"/{stream}" if stream else ""), sizes, device)
    run = pair.batch_sums(make_features(rows, shifts, blocks, weighted), tok_rows(rows), device)
    per_chunk = pair.batches_per_chunk(max(sizes), chunk)
    t0 = time.perf_counter()
    out, first = _resumed(resume, pair, rows, exact, width, sizes, progress)
    out = _sum_rounds(run, streams, sizes, first, per_chunk, ranks, progress, on_sums, out)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    sums = torch.cat(out) if out else torch.zeros(0, width, dtype=torch.float64)  # host: the batches' sums, gathered
    return CaseRun(pair, rows, shifts, torch.tensor(sizes), sums, row_counts(rows, sizes, pair.piece_draws(device)),  # host: results
                   exact, time.perf_counter() - t0, blocks, drawn_by_rank(first, len(sizes), per_chunk, ranks.world_size),
                   restored=sum(sizes[:first]), weighted=weighted)


def _resumed(resume: torch.Tensor | None, pair: CasePair, rows: list[Row], exact: dict, width: int, sizes: list[int],
             progress) -> tuple[list[torch.Tensor], int]:
    """([the checkpoint's sums, checked], the batches they hold), or ([], 0) without a checkpoint."""
    if resume is None or not resume.shape[0]:
        return [], 0
    _check_resume(resume, pair, rows, exact, width, sizes)
    first = resume.shape[0]
    _report(progress, sum(sizes[:first]), restored=True)
    return [resume.to(torch.float64)], first


def _sum_rounds(run: BatchSums, streams: list[BatchStream], sizes: list[int], first: int, per_chunk: int, ranks: Ranks,
                progress, on_sums, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """``out`` (the sums of the batches before ``first``), then the sums of the others, drawn round by round;
    every rank draws its slice of a round and rank 0 keeps every batch's row, in batch order."""
    for start, stop, lo, hi in rounds(first, len(sizes), per_chunk, ranks):
        parts = ranks.gather(run(streams[lo:hi]).cpu() if hi > lo else None)
        if parts is None:           # not rank 0: rank 0 keeps the rows
            continue
        out += [p for p in parts if p is not None]
        _report(progress, sum(sizes[start:stop]))
        if on_sums is not None:
            out = [torch.cat(out)]
            on_sums(out[0])
    return out


def small_batch_negative(pair: CasePair, rows: list[Row], *, batch: int, batches: int, seed: int,
                         device: torch.device) -> tuple[dict[str, float], torch.Tensor]:
    """P(mean of ``batch`` draws < 0) per row, simulated on ``batches`` batches of actual draws
    (an independent stream: seeded from (seed, case/small-batch)). Also returns the per-draw values
    [batch·batches, rows] (CPU): an i.i.d. sample that the report keeps as a reservoir."""
    g = batch_generator(seed, f"{pair.name}/small-batch", 0, device)
    draws = pair.sample_draws(batch * batches, g, device, tok_rows(rows))
    values = row_values(draws, rows)
    neg = (values.view(batches, batch, len(rows)).mean(dim=1) < 0).double().mean(dim=0)
    out = {r.label: float(v) for r, v in zip(rows, neg)}
    for j, r in enumerate(rows):
        if r.group > 1:       # the mean of the max(1, batch // B) values of consecutive groups
            per = max(1, batch // r.group)
            v = values[group_starts(draws, r.group), j]
            v = v[:v.shape[0] // per * per].view(-1, per).mean(dim=1)
            out[r.label] = float((v < 0).double().mean()) if v.shape[0] else math.nan
    return out, values.cpu()


@dataclass
class GradientRun:
    """Every gradient item of one case, sampled batch by batch through the same seeding as the sums."""
    items: list[GradItem]
    sizes: np.ndarray         # [K] draws per batch
    total: np.ndarray         # [J, P] Σ over draws of each item's per-draw gradient
    proj: np.ndarray          # [K, J, D] per batch Σ g·u_d
    sq: np.ndarray            # [K, J] per batch Σ |g|²
    proj2: np.ndarray | None  # [K, J, D] per batch Σ (g·u_d)², where the kind measures spreads
    drawn: list[list[list[int]]] = field(default_factory=list)  # per rank: [lo, hi) batch ranges it drew


def add_batches(acc: GradientAccumulator, batches: list[BatchStream],
                progress: Callable[[int], None] | None) -> list[GradBatch]:
    """Add each batch to ``acc`` in order; the batches' sums."""
    parts = []
    for batch in batches:
        parts.append(acc.add(batch))
        _report(progress, batch.size)
    return parts


def run_gradients(pair: CasePair, items: list[GradItem], directions: dict[str, np.ndarray], *, draws: int, seed: int,
                  batches: int, device: torch.device,
                  progress: Callable[[int], None] | None = None, ranks: Ranks = SINGLE) -> GradientRun | None:
    """Per-batch gradient sums of every item; batch i draws from the stream (seed, case/gradients, i).

    ``ranks``: with several processes each rank draws a contiguous block of batches and rank 0 merges
    them (:meth:`GradientAccumulator.merge`) into the very totals one process gets; an accumulator whose
    totals cannot be merged exactly (``splittable`` false) runs the whole pass on rank 0. Returns None on
    the other ranks."""
    oracle = gradient_oracle(pair)
    if oracle is None:
        raise no_gradients(pair)
    sizes = batch_sizes(draws, batches)
    acc = oracle.gradient_accumulator(items, directions, device)
    split = ranks.world_size > 1 and acc.splittable
    if not split and not ranks.root:
        return None
    lo, hi = block(len(sizes), ranks) if split else (0, len(sizes))
    acc.keep_batches = split
    parts = add_batches(acc, batch_streams(seed, f"{pair.name}/gradients", sizes, device)[lo:hi], progress)
    if split:
        parts = _merge_ranks(acc, parts, ranks)
        if parts is None:
            return None
        _report(progress, sum(sizes) - sum(sizes[lo:hi]))
    proj2 = np.stack([b.proj2 for b in parts]) if parts[0].proj2 is not None else None
    return GradientRun(items, np.array(sizes, dtype=np.float64), acc.total(), np.stack([b.proj for b in parts]),
                       np.stack([b.sq for b in parts]), proj2, _gradient_drawn(len(sizes), ranks, split))


def _gradient_drawn(k: int, ranks: Ranks, split: bool) -> list[list[list[int]]]:
    """Per rank, the [lo, hi) ranges of the k batches it drew: a block each on a split pass, else all on rank 0."""
    if split:
        return [[list(block(k, Ranks(r, ranks.world_size)))] for r in range(ranks.world_size)]
    return [[[0, k]]] + [[] for _ in range(ranks.world_size - 1)]


def _merge_ranks(acc: GradientAccumulator, parts: list[GradBatch], ranks: Ranks) -> list[GradBatch] | None:
    """Rank 0: every rank's batch sums in batch order, and ``acc`` merged into the one-process totals;
    None on the other ranks."""
    got = ranks.gather((parts, acc.partial()))
    if got is None:
        return None
    acc.merge([partial for _, partial in got])
    return [b for p, _ in got for b in p]


def check_resumed_sums(sums: torch.Tensor, rows: int, finite: list[bool], sizes: list[int],
                       weighted: bool = False) -> str | None:
    """What is wrong with a checkpoint's per-batch sums [k, 3·rows + 5·J (+ 2)] (kl_bench.engine.monte_carlo's layout:
    per row the centred values, their squares and the count of negative values; per joint block a, b, a²,
    b², ab; with ``weighted``, ΣW and ΣW² last), or None. ``finite``: per row, whether its exact mean is
    finite (only such a row's sums must be); ``sizes``: the draws of each batch. A checkpoint is data on
    disk: anything impossible is refused."""
    k = sums.shape[0]
    if weighted:
        if bool((sums[:, -WEIGHT_FEATURES:] < 0).any()):
            return "holds a negative sum of importance weights"
        sums = sums[:, :-WEIGHT_FEATURES]
    if torch.isnan(sums).any():
        return "holds NaN sums"
    vals, squares, negs = sums[:, :rows], sums[:, rows:2 * rows], sums[:, 2 * rows:3 * rows]
    keep = torch.tensor(finite, dtype=torch.bool)  # host: a checkpoint read from disk
    if not bool(torch.isfinite(torch.cat([vals[:, keep], squares[:, keep]], 1)).all()):
        return "holds infinite sums for an estimator whose exact mean is finite"
    if bool((squares < 0).any()):
        return "holds a negative sum of squares"
    n = torch.tensor(sizes[:k], dtype=torch.float64)[:, None]  # host: a checkpoint read from disk
    if bool(((negs < 0) | (negs > n) | (negs != torch.round(negs))).any()):
        return "holds a count of negative estimates that is not a whole number in [0, the batch's draws]"
    joint = sums[:, 3 * rows:].reshape(k, -1, 5)
    if bool((joint[..., 2:4] < 0).any()):
        return "holds a negative joint sum of squares"
    return None
