"""The rollout kind's sampler: paths of a :class:`~kl_bench.kinds.rollout.model.RolloutModel` drawn step by
step, and what the estimators see of them (kl_bench.core.draws.Draws): L = Σ_t log r_t, the analytic Σ_t KL(c_t),
Σ_t (r_t − 1), the token rows' sums, the importance weights and the rejection mask's verdict.

Each step draws every path's token from b's alias table of its bucket (kl_bench.sampling.alias.pick: one uniform,
two gathers), accumulates the per-path sums (float64: in step order on the CPU, once per block of steps in
a fixed order on a GPU, kl_bench.sampling.seeding.STEP_BLOCKS) and moves the path to its token's bucket;
a path that drew EOS stays alive = 0 (its later steps add nothing). Batch i's uniforms come from its own
generator, for a block of steps at once on a GPU (seeding.UNIFORM_STEPS); every other operation runs on
one long vector (per-op overhead dominates on short vectors),
and every operation is per path, so a path's values do not depend on its neighbours. Tensors are made on
the sampling ``device`` (the generators' device); the model's tables are made there once
(RolloutModel.sampling_tables).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...sampling.alias import pick
from ...core.draws import Draws, Row
from ...core.rejection import SequenceMask
from ...sampling.seeding import BatchStream, piece_draws, step_block, uniform_steps
from ..protocols import BatchSums, Features
from .model import RolloutModel


@dataclass
class Paths:
    """Recorded paths [n, T]: ``keys`` c·V + x (the bucket a step's token was drawn from, and the token;
    int64), ``alive`` 1.0 where the step belongs to the sequence, ``weights`` each step's corrected q/b
    (None without weights), ``keep`` the rejection mask's 0/1 per path [n] (None without a mask)."""
    keys: torch.Tensor
    alive: torch.Tensor
    weights: torch.Tensor | None
    keep: torch.Tensor | None


@dataclass
class _Walk:
    """The per-path state and sums of a batch of paths along the steps, all [n] (tok: [n, rows])."""
    c: torch.Tensor
    alive: torch.Tensor
    logr: torch.Tensor
    full: torch.Tensor
    tok_b: torch.Tensor
    tok: torch.Tensor
    weight: torch.Tensor | None
    log_weight: torch.Tensor | None

    @classmethod
    def start(cls, n: int, rows: int, weighted: bool, device: torch.device) -> "_Walk":
        f64 = torch.float64
        return cls(torch.zeros(n, dtype=torch.int64, device=device), torch.ones(n, dtype=f64, device=device),
                   *(torch.zeros(n, dtype=f64, device=device) for _ in range(3)),
                   torch.zeros(n, rows, dtype=f64, device=device),
                   torch.ones(n, dtype=f64, device=device) if weighted else None,
                   torch.zeros(n, dtype=f64, device=device) if weighted else None)


@dataclass
class _Block:
    """Up to B steps' per-path values, [B, n] each, added to the walk's sums once a block
    (kl_bench.sampling.seeding.STEP_BLOCKS): ``g`` log r of the drawn tokens, ``kl`` the analytic KL of
    their contexts, ``alive`` 1.0 where the step belongs to the sequence, ``factor`` a token row's weight
    (alive·w_t under token weights, else ``alive`` itself); ``terms`` [B, 3 + rows, n] the terms of every
    sum (L, the analytic KL, Σ (r − 1), then the token rows), summed over the steps in place; ``used`` rows
    filled. Memory: B·(7 + rows) float64 values a path and an estimator's temporaries (B = 8, n = 2^20 paths,
    six rows: 1.2 GiB peak, measured on the CPU, against 0.34 GiB step by step)."""
    g: torch.Tensor
    kl: torch.Tensor
    alive: torch.Tensor
    factor: torch.Tensor
    terms: torch.Tensor
    lq: torch.Tensor | None = None   # log q of the drawn tokens, where a row needs it (Estimator.needs_logq)
    used: int = 0

    @classmethod
    def of(cls, steps: int, n: int, rows: int, per_token: bool, device: torch.device,
           logq: bool = False) -> "_Block":
        g, kl, alive = (torch.empty(steps, n, dtype=torch.float64, device=device) for _ in range(3))
        terms = torch.empty(steps, 3 + rows, n, dtype=torch.float64, device=device)
        return cls(g, kl, alive, torch.empty_like(alive) if per_token else alive, terms,
                   torch.empty_like(g) if logq else None)

    def fill(self, on, key: torch.Tensor, walk: "_Walk", w: torch.Tensor | None) -> None:
        """Record one step: the drawn tokens' log r (and log q where a row needs it) from the tables ``on``
        (kl_bench.kinds.rollout.model.SamplingTables) at ``key`` = c·V + x, their contexts' KL, who is alive, and
        a token row's weight ``w`` (its own w_t, or its prefix's product ρ_{1:t}) where tokens are weighted."""
        j = self.used
        torch.index_select(on.logr, 0, key, out=self.g[j])
        if self.lq is not None:
            torch.index_select(on.logq, 0, key, out=self.lq[j])
        torch.index_select(on.kl_ctx, 0, walk.c, out=self.kl[j])
        self.alive[j].copy_(walk.alive)
        if self.factor is not self.alive:
            torch.mul(walk.alive, w, out=self.factor[j])
        self.used += 1

    def add_to(self, walk: _Walk, tok_rows: list[Row]) -> None:
        """Add the filled rows' terms to ``walk``'s sums, and empty the block."""
        m = self.used
        g, kl, alive, factor, terms = (x if m == x.shape[0] else x[:m]
                                       for x in (self.g, self.kl, self.alive, self.factor, self.terms))
        lq = None if self.lq is None else self.lq[:m]
        torch.mul(alive, g, out=terms[:, 0])
        torch.mul(alive, kl, out=terms[:, 1])
        torch.mul(alive, torch.expm1(g), out=terms[:, 2])
        for j, r in enumerate(tok_rows):
            torch.mul(factor, kl if r.est.analytic else r.est.on(g, lq), out=terms[:, 3 + j])
        s = _steps_sum(terms)
        walk.logr += s[0]
        walk.full += s[1]
        walk.tok_b += s[2]
        if tok_rows:
            walk.tok += s[3:].T
        self.used = 0


def _steps_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ over the leading (step) dimension of ``x`` [m, ...] (contiguous; overwritten) in a fixed pairwise
    order that depends on m alone: rows i and i + ⌊m/2⌋ added in place, and again (elementwise adds: no
    reduction kernel, whose order may follow the tensor's width, reaches the bytes). m = 1 is x[0] itself,
    the per-step sums' own bytes."""
    m = x.shape[0]
    while m > 1:
        half = m // 2
        x[:half] += x[half:2 * half]
        if m % 2:                                       # the odd row moves up to stay in the running
            x[half] = x[m - 1]
        m = half + m % 2
    return x[0]


def simulate(model: RolloutModel, sizes: list[int], gens: list[torch.Generator], device: torch.device,
             tok_rows: list[Row] = (), record: list | None = None, sums: bool = True) -> Draws:
    """Rollouts for several batches at once (``sizes[i]`` paths from ``gens[i]``), never materialising [n, V].

    ``record``: when a list, each step appends (key, alive, w) of shape [n]: key = c·V + x (the bucket the
    token was drawn from and the token), alive = 1.0 where the step belongs to the sequence, w the token's
    (corrected) weight q/b (None without weights). ``sums`` False: the per-path sums are not formed (the
    Draws' L, KL and token sums stay 0; its weights and mask are made), for a caller that wants the
    recorded paths only (:func:`paths`)."""
    on = model.sampling_tables(device)
    tables, logw, bucket = on.alias, on.logw, on.bucket
    weighted = model.weighting.weighted
    n = sum(sizes)
    walk = _Walk.start(n, len(tok_rows), weighted, device)
    block = _block_for(model, n, tok_rows, device) if sums else None
    # The rejection mask's statistics of the raw log q/b, per sequence (kl_bench.core.rejection).
    mask = SequenceMask(model.rejection, model.log_q, [lb for lb, _ in model.phases], n, device)
    steps = uniform_steps(device)
    for t in range(model.length):
        phase = model.phase_of[t]
        if t % steps == 0:
            uniforms = _uniforms(sizes, gens, min(steps, model.length - t), device)
        u = torch.mul(uniforms[:, t % steps], model.vocab)
        base = walk.c * model.vocab
        x = pick(tables[phase], u, model.vocab, base)
        key = base + x
        w_t = _weigh(model, walk, None if logw is None else logw[phase][key])
        if sums:
            block.fill(on, key, walk, walk.weight if model.weighting.cumulative else w_t)
            if block.used == block.g.shape[0] or t == model.length - 1:
                block.add_to(walk, tok_rows)
        mask.add(phase, key, walk.alive)
        if record is not None:
            record.append((key, walk.alive, w_t))
        if model.eos is not None:
            walk.alive = walk.alive * (x != model.eos)
        walk.c = bucket[x]
    return Draws(walk.logr, walk.full, walk.tok, walk.tok_b, weight=walk.weight, tok_weighted=model.weighting.per_token,
                 log_weight=walk.log_weight, keep=mask.keep())


def _block_for(model: RolloutModel, n: int, tok_rows: list[Row], device: torch.device) -> _Block:
    """The block of steps :func:`simulate` fills for ``n`` paths: per-token weights where the weighting has them,
    log q where a token row's estimator needs it."""
    w = model.weighting
    return _Block.of(min(step_block(device), model.length), n, len(tok_rows), w.weighted and w.per_token, device,
                     any(r.est.needs_logq for r in tok_rows))


def _uniforms(sizes: list[int], gens: list[torch.Generator], steps: int, device: torch.device) -> torch.Tensor:
    """Uniforms [n, ``steps``] float64 for the next ``steps`` steps of every path: batch i's rows (its
    ``sizes[i]`` paths, contiguous) in one call of its generator ``gens[i]``, path-major, so that they depend
    on the batch alone. One step at a time (steps = 1, the CPU) they are the generator's stream in order, as
    one call a step drew them."""
    u = torch.empty(sum(sizes), steps, dtype=torch.float64, device=device)
    at = 0
    for k, g in zip(sizes, gens):
        torch.rand(k, steps, dtype=torch.float64, generator=g, device=device, out=u[at:at + k])
        at += k
    return u


def _weigh(model: RolloutModel, walk: _Walk, logw_t: torch.Tensor | None) -> torch.Tensor | None:
    """Multiply the walk's sequence weights by the drawn tokens' (``logw_t`` = their log q/b [n]; None
    without weights, which is returned) for sequences still alive; the tokens' corrected weights."""
    if logw_t is None:
        return None
    w_t = model.capped(torch.exp(logw_t))
    alive = walk.alive
    walk.weight = walk.weight * torch.where(alive > 0, w_t, torch.ones_like(w_t))
    lw_t = model.capped_log(logw_t)
    walk.log_weight += torch.where(alive > 0, lw_t, torch.zeros_like(lw_t))   # Σ log w: no overflow
    return w_t


def paths(model: RolloutModel, n: int, generator: torch.Generator, device: torch.device) -> Paths:
    """``n`` recorded paths from one generator (the draws of :func:`simulate` with the same generator)."""
    rec: list = []
    keep = simulate(model, [n], [generator], device, record=rec, sums=False).keep
    weights = torch.stack([r[2] for r in rec], 1) if model.weighting.weighted else None
    return Paths(torch.stack([r[0] for r in rec], 1), torch.stack([r[1] for r in rec], 1), weights, keep)


def batch_sums(model: RolloutModel, features: Features, tok_rows: list[Row], device: torch.device) -> BatchSums:
    """Per-batch sums of the per-draw features (kl_bench.kinds.protocols.DrawSampler.batch_sums), each batch drawn
    piece by piece from its own stream."""
    piece = piece_draws(device)

    def run(batches: list[BatchStream]) -> torch.Tensor:
        totals: list[torch.Tensor | None] = [None] * len(batches)
        group: list[tuple[int, int, torch.Generator]] = []      # (batch position, draws, generator)

        def flush():
            # Pieces of several small batches share one simulation (per-op overhead dominates on short
            # vectors); every operation is per path, so a piece's sum does not depend on its neighbours.
            # Contiguous per-piece reductions (no scatter-add): deterministic on CUDA.
            sizes = [m for _, m, _ in group]
            draws = simulate(model, sizes, [g for _, _, g in group], device, tok_rows)
            draws.segments = sizes        # token-mean groups stay within a piece
            f = features(draws)
            for (k, _, _), part in zip(group, torch.split(f, sizes)):
                s = part.sum(0)
                totals[k] = s if totals[k] is None else totals[k] + s
            group.clear()

        for k, batch in enumerate(batches):
            for m, g in batch.pieces(piece):
                if group and sum(x for _, x, _ in group) + m > piece:
                    flush()
                group.append((k, m, g))
        flush()
        return torch.stack(totals)
    return run


__all__ = ["Paths", "batch_sums", "paths", "simulate"]
