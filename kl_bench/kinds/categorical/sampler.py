"""Draws of a categorical case: tokens from an alias table, or each batch's count vector over the drawn
(context, token) ids (the kind's docstring says which, ``sampling``), and the per-batch feature sums as one
product of a count vector with a per-id table. The only state is the alias table and the multinomial tree
on the device last used (caches: the draws depend on the seeds alone)."""
from __future__ import annotations

import torch

from ...core.draws import Draws
from ...sampling.alias import build_alias, sample_alias
from ...sampling.multinomial import MultinomialTree, batches_per_call, call_bytes, draw_counts
from ...sampling.seeding import BatchStream, device_key, token_piece_draws
from ..protocols import BatchSums, Features
from .model import CategoricalModel

SAMPLING = ("auto", "counts", "tokens")
# Device types whose count vectors numpy draws on the host: the CPU, where its sequential conditional
# binomials in C are ~10× faster than kl_bench.sampling.multinomial's torch tree (benchmarks/bench_vocab50k.py,
# both in the same run). Elsewhere the tree draws them on the device: no host round trip, one call for
# a chunk's batches.
COUNTS_ON_HOST = {"cpu"}


class CategoricalSampler:
    """Draws from the sampling mixture (1/B) b(x|context) of ``model``; ``sampling``: "auto", "counts" or
    "tokens" (how a batch's count vector is drawn)."""

    def __init__(self, model: CategoricalModel, sampling: str = "auto"):
        self.model, self.sampling = model, sampling
        self._alias = build_alias(model.weights().numpy())
        self._tree: tuple[torch.device, MultinomialTree] | None = None   # the same probabilities as a tree, on a device

    def sample_draws(self, n, generator, device, tok_rows=()) -> Draws:
        ids = self.sample_ids(n, generator, device)
        return Draws(self.model.logr.to(device)[ids], self.model.full.to(device)[ids],
                     weight=None if self.model.is_weight is None else self.model.is_weight.to(device)[ids],
                     logq=self.model.logq.to(device)[ids])

    def sample_ids(self, n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """Indices into the support of q for ``n`` draws; int64 [n]."""
        return sample_alias(self.alias_on(device), n, generator)

    def sample_slots(self, sizes: list[int], gens: list[torch.Generator], device: torch.device,
                     dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """The alias slots 2j + (1 if the coin sends column j to its alias) of sum(``sizes``) draws, piece i
        drawn from ``gens[i]`` as :meth:`sample_ids` draws it (the same uniforms, so the same tokens), ``dtype``
        (int64, or int32 where 2M < 2^31) [sum(sizes)] on ``device``: :meth:`token_counts` counts them.

        Memory traffic is what this costs on a GPU (one pass of each operation over the draws): int32 column
        indices move half the bytes of int64 through the clamp, the gather, the coin's subtraction and the
        histogram, and 2j + tails is one kernel (torch.add with alpha = 2, written over j)."""
        table, m = self.alias_on(device), self._alias.size
        u = torch.empty(sum(sizes), dtype=torch.float64, device=device)
        at = 0
        for k, g in zip(sizes, gens):
            torch.rand(k, dtype=torch.float64, generator=g, device=device, out=u[at:at + k])
            at += k
        u.mul_(m)                                            # as sample_alias: u·M, column and coin in one
        j = u.to(dtype).clamp_(max=m - 1)                    # truncation toward 0, as .long(): u ≥ 0
        # index_select takes int32 indices as they are (prob[j] would convert them to int64 first: a hidden
        # kernel and 12 more bytes a draw). kl_bench.sampling.alias.pick keeps j where coin < prob.
        tails = torch.ge(u.sub_(j), table.prob.index_select(0, j))
        return torch.add(tails, j, alpha=2, out=j)

    def alias_on(self, device: torch.device):
        if self._alias.prob.device != device_key(device):
            self._alias = self._alias.to(device)
        return self._alias

    def uses_counts(self, n: int) -> bool:
        """Whether a batch of ``n`` draws gets its count vector from the multinomial (module docstring).
        Depends on n alone, so the choice (and the bytes) never depend on how batches are grouped."""
        return self.sampling == "counts" or (self.sampling == "auto" and n >= self.model.logr.shape[0])

    def batches_per_chunk(self, batch_size: int, per_draws: int) -> int:
        """Batches handed over at once: ``per_draws`` (by draws, the default rule) for token batches, by memory
        for count vectors, which cost O(ids) whatever their draws, so that a device draws many in one call."""
        return max(per_draws, batches_per_call(self.model.logr.shape[0])) if self.uses_counts(batch_size) else per_draws

    def piece_draws(self, device: torch.device) -> int:
        return token_piece_draws(device)

    def tree_on(self, device: torch.device) -> MultinomialTree:
        if self._tree is None or self._tree[0] != device_key(device):
            self._tree = device_key(device), MultinomialTree.of(torch.from_numpy(self.model.pvals).to(device))
        return self._tree[1]

    def count_vectors(self, batches: list[BatchStream], device: torch.device) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """Each batch's draws as counts over the drawn ids: (None, counts [M]) dense, or (ids [m], counts [m])
        sparse (sorted ids with a nonzero count) when the batch is far smaller than the support. Counts are
        float64 holding exact integers (n ≤ 2^53), on ``device``; each batch's depend on its stream alone."""
        drawn = self._multinomial_counts([b for b in batches if self.uses_counts(b.size)], device)
        tokens = [b for b in batches if b.index not in drawn]
        dense = [b for b in tokens if 8 * b.size >= self.model.logr.shape[0]]
        drawn.update(zip((b.index for b in dense), self.token_counts(dense, device)))
        return [(None, drawn[b.index]) if b.index in drawn else self._sparse_token_counts(b, device) for b in batches]

    def _multinomial_counts(self, multi: list[BatchStream], device: torch.device) -> dict[int, torch.Tensor]:
        """The count vectors [M] (float64) of the batches drawn as multinomials, by batch index."""
        drawn: dict[int, torch.Tensor] = {}
        if multi and device.type not in COUNTS_ON_HOST:
            # The tree on the device, up to batches_per_call batches per call (within the device's budget),
            # each from its own generator.
            per = batches_per_call(self.model.logr.shape[0], call_bytes(device))
            for i in range(0, len(multi), per):
                group = multi[i:i + per]
                counts = draw_counts(self.tree_on(device), [b.size for b in group],
                                     [b.counts_generator() for b in group]).to(torch.float64)
                drawn.update((b.index, c) for b, c in zip(group, counts))
        else:
            for b in multi:
                # Conditional binomials in C: O(M) per batch, whatever n (a draw-equivalent of n tokens).
                counts = torch.from_numpy(b.numpy_generator().multinomial(b.size, self.model.pvals))
                drawn[b.index] = counts.to(device=device, dtype=torch.float64)
        return drawn

    def batch_counts(self, batch: BatchStream, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One batch's :meth:`count_vectors`."""
        return self.count_vectors([batch], device)[0]

    def _sparse_token_counts(self, batch: BatchStream, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Far fewer draws than ids: the batch's tokens sorted (O(n log n)) rather than counted over all M ids."""
        ids = torch.cat([self.sample_ids(k, g, device) for k, g in batch.pieces(self.piece_draws(device))])
        uniq, cnt = torch.unique(ids, sorted=True, return_counts=True)
        return uniq, cnt.to(torch.float64)

    def token_counts(self, batches: list[BatchStream], device: torch.device) -> list[torch.Tensor]:
        """Each batch's token counts [M] (float64 holding integers), its tokens drawn one by one from the alias
        table, piece by piece, exactly as :meth:`sample_ids` draws them.

        Two things make this fast on a GPU (issue 33) without changing a count:
        - Counted by alias slot, not by token: a draw lands in column j = ⌊u·M⌋ (uniform) and keeps j
          (heads) or takes alias[j] (tails); counting the 2M slots (j, heads/tails) and folding the tails
          onto their aliases afterwards gives the same integers, but the histogram's bins are hit about
          uniformly. Counting tokens sends a Zipf law's head token a large share of all the atomic adds,
          and that contention was 60% of the device's time (benchmarks/README.md, GPU table).
        - Pieces of several small batches are counted together, up to a piece's worth of draws a round
          (one histogram over [batches in the round, 2M] bins), instead of a dozen kernels per batch.
        Each piece keeps its own generator and size, so the counts, integers, depend on (seed, batch) alone.
        """
        if not batches:
            return []
        table, m, piece = self.alias_on(device), self.model.logr.shape[0], self.piece_draws(device)
        pieces = {b.index: list(b.pieces(piece)) for b in batches}
        left = {i: len(p) for i, p in pieces.items()}         # pieces of each batch not yet counted
        slots: dict[int, torch.Tensor] = {}                      # batch → its slot counts [2M] so far
        done: dict[int, torch.Tensor] = {}                       # batch → its token counts [M], float64
        pending: list[tuple[int, int, torch.Generator]] = []     # (batch, draws, generator) of this round
        held = 0                                                 # draws in ``pending``

        def flush() -> None:
            rows: dict[int, int] = {}                            # the round's batches, in order: their pieces
            for i, _, _ in pending:
                rows[i] = rows.get(i, 0) + 1
            row = {i: r for r, i in enumerate(rows)}
            bins = len(rows) * 2 * m
            kind = torch.int32 if bins < 2 ** 31 else torch.int64   # int32 wherever the bins fit (sample_slots)
            slot = self.sample_slots([k for _, k, _ in pending], [g for _, _, g in pending], device, kind)
            if len(rows) > 1:                                    # each batch its own 2M bins
                offset = torch.tensor([row[i] * 2 * m for i, _, _ in pending], dtype=kind, device=device)
                sizes = torch.tensor([k for _, k, _ in pending], dtype=torch.int64, device=device)
                slot.add_(offset.repeat_interleave(sizes, output_size=slot.numel()))  # output_size: no host sync
            hist = torch.bincount(slot, minlength=bins).view(len(rows), 2 * m)
            for i in rows:
                # A copy, not a view: a view would keep the round's whole [batches, 2M] histogram alive.
                slots[i] = hist[row[i]].clone() if i not in slots else slots[i] + hist[row[i]]
                left[i] -= rows[i]
                if not left[i]:                                  # counted: folded to [M] now, its slots freed
                    heads, tails = slots.pop(i).view(m, 2).unbind(1)
                    done[i] = heads.index_add(0, table.alias, tails).to(torch.float64)  # integers: any order
            pending.clear()
        for b in batches:
            for k, g in pieces[b.index]:
                if pending and held + k > piece:
                    flush()
                    held = 0
                pending.append((b.index, k, g))
                held += k
        flush()
        return [done[b.index] for b in batches]

    def batch_sums(self, features: Features, tok_rows, device: torch.device) -> BatchSums:
        table = features(Draws(self.model.logr.to(device), self.model.full.to(device),
                               weight=None if self.model.is_weight is None else self.model.is_weight.to(device),
                               logq=self.model.logq.to(device)))  # [M, P]
        # ±inf features (k1 where p(x) = 0) are summed separately: a zero count times inf is NaN.
        pos, neg = torch.isposinf(table), torch.isneginf(table)
        finite = torch.where(pos | neg, torch.zeros_like(table), table)
        has_inf = bool(pos.any() or neg.any())
        finite_t = finite.T.contiguous()                                  # [P, M] for matrix-vector products

        def dot(ids: torch.Tensor | None, counts: torch.Tensor, tab: torch.Tensor, tab_t: torch.Tensor):
            # One product per batch with a shape fixed by the batch alone: a BLAS call over several
            # batches' rows takes other paths with other roundings, so grouping would change the bytes.
            return torch.mv(tab_t, counts) if ids is None else (counts[:, None] * tab[ids]).sum(0)

        def run(batches: list[BatchStream]) -> torch.Tensor:
            out = []
            for ids, counts in self.count_vectors(batches, device):
                s = dot(ids, counts, finite, finite_t)
                if has_inf:
                    hit = counts @ (pos if ids is None else pos[ids]).double()    # draws on +inf entries
                    low = counts @ (neg if ids is None else neg[ids]).double()
                    s = s + torch.where(hit > 0, torch.inf, 0.0) + torch.where(low > 0, -torch.inf, 0.0)
                out.append(s)
            return torch.stack(out)
        return run
