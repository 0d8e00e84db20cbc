"""Case kind ``categorical``: categoricals over a vocabulary, one context ([V]) or B contexts ([B, V]).

A draw picks a context uniformly, then a token x ~ q_b. Every per-draw statistic is a function of the
(context, token) id, so every per-batch sum is a linear function of the batch's count vector over the
ids, and that vector is exactly Multinomial(n, w) (w: the sampling mixture). A batch therefore never
materialises per-draw values. Its count vector comes one of two ways (``sampling``):
- ``counts``: drawn directly as conditional binomials, O(ids) per batch whatever n (every sum is then a
  "draw-equivalent": identical in distribution to drawing each token): on the CPU by numpy's sequential
  multinomial on the host, on other devices by kl_bench.sampling.multinomial's binary tree on the device, a chunk's
  batches in one call (:data:`COUNTS_ON_HOST`);
- ``tokens``: each token drawn with an alias table, piece by piece (kl_bench.sampling.seeding.token_piece_draws),
  and counted;
- ``auto`` (default): counts for a batch with at least as many draws as ids, tokens below that.
The sums are then one fixed-shape product of the count vector with a per-id feature table.
Exact moments are float64 sums over the vocabulary (docs/exact.md); gradients take θ = q's logits
[B, V] (docs/gradients.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...core import oracles as exact
from ...sampling.alias import build_alias, sample_alias
from ...foundation.typed_toml import Table, positive
from ...core.draws import Draws
from ...foundation.errors import SpecError
from ...core.estimators import RowSource
from ...core.precision import Precision, in_precision, parse_precision, rounded_logr
from ...core.modes import derivative
from ...sampling.logits import (LogitsSource, check_table_size, describe_sources, has_vocab_of_its_own, parse_pair_sources,
                      resolve_pair_source_logits)
from ...sampling.mismatch import CORRECTION_KEYS, LOGIT_KEYS, WEIGHT_KEYS
from ...sampling.multinomial import MultinomialTree, batches_per_call, call_bytes, draw_counts
from ...sampling.seeding import BatchStream, device_key, piece_draws, token_piece_draws
from ...core.targets import FORWARD, REVERSE
from ...core.weights import WeightCorrection
from ..trainable import Reward, check_trainable
from .training import CategoricalProblem
from ..protocols import (BaselineExact, BatchSums, CaseConfig, ExactGrad, Features, GradBatch, GradientAccumulator,
                         GradItem, JointMoments, register_kind)
from ..defaults import GradientDefaults, Pair

SAMPLING = ("auto", "counts", "tokens")
# Device types whose count vectors numpy draws on the host: the CPU, where its sequential conditional
# binomials in C are ~10× faster than kl_bench.sampling.multinomial's torch tree (benchmarks/bench_vocab50k.py,
# both in the same run). Elsewhere the tree draws them on the device: no host round trip, one call for
# a chunk's batches.
COUNTS_ON_HOST = {"cpu"}


@dataclass(frozen=True, kw_only=True)
class CategoricalCase(CaseConfig):
    vocab: int | None
    q: LogitsSource
    p: LogitsSource
    sampling: str = "auto"     # how a batch's count vector is drawn (module docstring)
    precision: Precision | None = None   # log-probs as a trainer rounds them (kl_bench.core.precision)


@register_kind("categorical", description="categoricals over a vocabulary, [V] or [B, V] logits; exact sums",
               sampler_keys=(*LOGIT_KEYS, "behavior", *WEIGHT_KEYS, *CORRECTION_KEYS))
class CategoricalPair(GradientDefaults, Pair):
    clamp_sees_weight = True
    train_aggregates: tuple[str, ...] = ()     # kl_bench.kinds.trainable: a draw is one token

    def training_problem(self, reward: Reward, beta: float) -> CategoricalProblem:
        """θ0 = log q [B, V] trained towards p under the reward table [B, V] (kl_bench.kinds.trainable)."""
        check_trainable(self.name, self.has_sampler, self.precision, self.log_q, self.log_p)
        return CategoricalProblem(self.name, self.log_q.clone(), self.log_p, reward.table(tuple(self.log_q.shape)), beta)

    def __init__(self, name: str, log_q: torch.Tensor, log_p: torch.Tensor, label: str = "",
                 log_b: torch.Tensor | None = None, weights: str = "none", weight_cap: float | None = None,
                 sampler_label: str = "", sampling: str = "auto", precision: Precision | None = None,
                 logits: tuple[torch.Tensor, torch.Tensor] | None = None,
                 correction: WeightCorrection | None = None):
        """``log_q``, ``log_p``: normalised float64 log-probabilities [B, V]. ``log_b``: a sampler b ≠ q
        that draws the tokens while the estimators keep using q's and p's log-probs; ``weights``
        ("token") multiplies every estimate by q/b, capped at ``weight_cap``. ``sampling``: how a
        batch's count vector is drawn (module docstring). ``precision``: the estimators see log r as a
        trainer computes it in lower precision (kl_bench.core.precision) from ``logits``, (q's, p's) as the
        source holds them [B, V] (None: the log-probs are what is given). ``correction``: further bounds,
        masks and the PPO clip of the weight (kl_bench.core.weights; its cap replaces ``weight_cap``)."""
        self.name = name
        self.sampling = sampling
        self.log_q, self.log_p = log_q.to(torch.float64), log_p.to(torch.float64)
        self.label = label
        self.log_b = None if log_b is None else log_b.to(torch.float64)
        self.sampler_label = sampler_label
        self.has_sampler, self.weights = self.log_b is not None, weights
        sample = self.log_q if self.log_b is None else self.log_b
        if self.log_b is not None and bool(((self.log_b > -torch.inf) & (self.log_q == -torch.inf)).any()):
            raise SpecError("the sampler draws tokens that q gives probability 0", key="sampler")
        # Draws come from the mixture (1/B) b(x|context) over the flattened (context, token) ids; ids
        # that b never draws are dropped so that a −inf log-ratio never meets a zero count (0·inf = NaN).
        w = (sample.exp() / sample.shape[0]).reshape(-1)
        self._support = torch.nonzero(w > 0).squeeze(1)
        self._logr = (self.log_p - self.log_q).reshape(-1)[self._support]
        self.precision = precision
        if precision is not None:       # a fixed function of (context, token): exact sums stay exact
            self._rounded = precision.rounding_input(logits, self.log_q, self.log_p)
            self._logr = rounded_logr(*self._rounded, precision).reshape(-1)[self._support]
        self._alias = build_alias(w[self._support].numpy())
        # The multinomial's probabilities, renormalised in float64 (numpy checks that they sum to 1).
        pw = w[self._support].numpy()
        self._pvals = pw / pw.sum()
        self._tree: tuple[torch.device, MultinomialTree] | None = None   # the same probabilities as a tree, on a device
        # Importance weights q/b of the drawn ids (a cap bounds the variance at the price of bias).
        self._is_weight = self._raw_weight = None
        self.correction = correction if correction is not None else WeightCorrection(cap=weight_cap)
        if self.log_b is not None and weights == "token":
            self._raw_weight = torch.exp((self.log_q - self.log_b).reshape(-1)[self._support])
            self._is_weight = self.correction.detached(self._raw_weight)
        # Mass of q that b never draws: an unweighted estimate is biased, a weighted one misses it. "Never" as
        # the sampler draws: where b's probability is 0 in float64 (log b = −inf, or below −745 as a
        # temperature near 0 makes it: such a token is left out of the draws' support above).
        self.support_miss = 0.0 if self.log_b is None else float(
            (self.log_q.exp() * (self.log_b.exp() == 0)).sum(-1).mean())
        # The `full` estimator: each (context, token) entry carries its context's analytic KL.
        kl_ctx = torch.where(self.log_q.exp() > 0, self.log_q.exp() * (self.log_q - self.log_p),
                             torch.zeros_like(self.log_q)).sum(-1)
        self._full = kl_ctx[:, None].expand_as(self.log_q).reshape(-1)[self._support]

    @classmethod
    def parse(cls, t: Table, common: dict[str, Any], spec_dir: Path) -> CategoricalCase:
        vocab = t.get("vocab", "int", None, positive)
        sampling = t.get("sampling", "str", "auto")
        if sampling not in SAMPLING:
            raise t.error(f"must be one of {', '.join(SAMPLING)}, got {sampling!r}", key="sampling")
        precision = parse_precision(t)          # before the sources, which finish the table
        q, p = parse_pair_sources(t, spec_dir)
        if vocab is None and not (has_vocab_of_its_own(q) or has_vocab_of_its_own(p)):
            raise t.error("missing required key (needed unless logits come from a file or a tensor)", key="vocab")
        check_table_size(t, vocab, q, p)
        return CategoricalCase(vocab=vocab, q=q, p=p, sampling=sampling, precision=precision, **common)

    @classmethod
    def from_config(cls, case: CategoricalCase) -> "CategoricalPair":
        zq, zp = resolve_pair_source_logits(case.q, case.p, case.vocab)
        lq, lp = torch.log_softmax(zq, -1), torch.log_softmax(zp, -1)
        sp = case.sampler
        label = describe_sources(case.q, case.p)
        if sp is None:
            return cls(case.name, lq, lp, label=label, sampling=case.sampling, precision=case.precision,
                       logits=(zq, zp))
        return cls(case.name, lq, lp, label=label, log_b=sp.logprobs(lq, lp), weights=sp.weights,
                   weight_cap=sp.weight_cap, sampler_label=sp.describe(), sampling=case.sampling,
                   precision=case.precision, logits=(zq, zp), correction=WeightCorrection.of(sp))

    def adapt(self, source: RowSource) -> RowSource:
        return source if self.precision is None else in_precision(source, self.precision)

    def metadata(self) -> dict[str, Any]:
        meta = {**super().metadata(), "label": self.label, "sampling": self.sampling}
        return meta if self.precision is None else {**meta, "precision": self.precision.metadata(self._rounded)}

    @property
    def support_ids(self) -> torch.Tensor:
        """Flattened (context·V + token) ids that the sampler can draw, int64 [M]."""
        return self._support

    @property
    def support_logr(self) -> torch.Tensor:
        """log r of every id in :attr:`support_ids`, float64 [M]."""
        return self._logr

    @property
    def contexts(self) -> int:
        return int(self.log_q.shape[0])

    @property
    def vocab(self) -> int:
        return int(self.log_q.shape[1])

    def true_values(self) -> dict[str, float]:
        return {REVERSE: self.kl(), FORWARD: self.kl_forward()}

    def kl(self) -> float:
        return exact.categorical_kl(self.log_q, self.log_p)

    def kl_forward(self) -> float:
        return exact.categorical_kl(self.log_p, self.log_q)

    def _values(self, est: RowSource) -> torch.Tensor:
        """Per-entry values of ``est`` (importance-weighted when asked) on the drawn ids, [M]."""
        v = self._full if est.analytic else est.fn(self._logr)
        return v if self._is_weight is None else v * self._is_weight

    def exact_moments(self, est: RowSource, aggregate: str = "") -> tuple[float, float]:
        return exact.weighted_moments(self._weights(), self._values(est))

    def kurtosis_proxy(self, est: RowSource, aggregate: str = "") -> float:
        """E_b[v⁴]/E_b[v²]² of the row's value v, exactly (sums over the drawn ids, scaled by the largest |v|
        so that neither sum overflows): beyond the draws, the draws have not met the few tokens that make
        E[v²] (IS weights q/b of 1e50 where a cold sampler leaves b tiny but not 0), and the measured std
        is far too low. NaN for a row of zeros."""
        v, w = self._values(est).abs(), self._weights()
        top = float(v.max()) if v.numel() else 0.0
        if not (top > 0 and math.isfinite(top)):
            return math.nan
        x = v / top
        second = float((w * x * x).sum())
        return float((w * x**4).sum()) / second / second if second > 0 else math.inf

    def _weights(self) -> torch.Tensor:
        """The sampling distribution (b, or q) over the drawn (context, token) ids, [M]."""
        sample = self.log_q if self.log_b is None else self.log_b
        return (sample.exp() / self.contexts).reshape(-1)[self._support]

    def exact_joint(self, aggregate: str = "") -> JointMoments:
        w, logr = self._weights(), self._logr
        a, b = -logr, torch.expm1(logr)
        if torch.isinf(a).any():                      # p(x) = 0 < q(x): KL(q‖p) = ∞
            return JointMoments(math.inf, float((w * b).sum()), math.inf, math.nan, math.nan)
        ma, mb = float((w * a).sum()), float((w * b).sum())
        # Second passes around the means: no E[x²] − E[x]² cancellation.
        return JointMoments(ma, mb, float((w * (a - ma) ** 2).sum()), float((w * (b - mb) ** 2).sum()),
                            float((w * (a - ma) * (b - mb)).sum()))

    def exact_prob_negative(self, fn, aggregate: str = "") -> float:
        v = fn(self._logr) if self._is_weight is None else fn(self._logr) * self._is_weight
        return float((self._weights() * (v < 0)).sum())

    def sample_draws(self, n, generator, device, tok_rows=()) -> Draws:
        ids = self.sample_ids(n, generator, device)
        return Draws(self._logr.to(device)[ids], self._full.to(device)[ids],
                     weight=None if self._is_weight is None else self._is_weight.to(device)[ids])

    def describe(self) -> str:
        ctx = f", {self.contexts} contexts" if self.contexts > 1 else ""
        return (f"categorical V={self.vocab}{ctx}" + (f": {self.label}" if self.label else "")
                + (f"; {self.sampler_label}" if self.sampler_label else "")
                + (f"; {self.precision.describe()}" if self.precision is not None else ""))

    def sample_ids(self, n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """Indices into the support of q for ``n`` draws; int64 [n]."""
        return sample_alias(self._alias_on(device), n, generator)

    def sample_slots(self, sizes: list[int], gens: list[torch.Generator], device: torch.device,
                     dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """The alias slots 2j + (1 if the coin sends column j to its alias) of sum(``sizes``) draws, piece i
        drawn from ``gens[i]`` as :meth:`sample_ids` draws it (the same uniforms, so the same tokens), ``dtype``
        (int64, or int32 where 2M < 2^31) [sum(sizes)] on ``device``: :meth:`_token_counts` counts them.

        Memory traffic is what this costs on a GPU (one pass of each operation over the draws): int32 column
        indices move half the bytes of int64 through the clamp, the gather, the coin's subtraction and the
        histogram, and 2j + tails is one kernel (torch.add with alpha = 2, written over j)."""
        table, m = self._alias_on(device), self._alias.size
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

    def _alias_on(self, device: torch.device):
        if self._alias.prob.device != device_key(device):
            self._alias = self._alias.to(device)
        return self._alias

    def uses_counts(self, n: int) -> bool:
        """Whether a batch of ``n`` draws gets its count vector from the multinomial (module docstring).
        Depends on n alone, so the choice (and the bytes) never depend on how batches are grouped."""
        return self.sampling == "counts" or (self.sampling == "auto" and n >= self._logr.shape[0])

    def batches_per_chunk(self, batch_size: int, chunk_draws: int) -> int:
        """Batches handed over at once: by draws for token batches (Pair's rule), by memory for count vectors,
        which cost O(ids) whatever their draws, so that a device draws many in one call."""
        per = super().batches_per_chunk(batch_size, chunk_draws)
        return max(per, batches_per_call(self._logr.shape[0])) if self.uses_counts(batch_size) else per

    def piece_draws(self, device: torch.device) -> int:
        return token_piece_draws(device)

    def _tree_on(self, device: torch.device) -> MultinomialTree:
        if self._tree is None or self._tree[0] != device_key(device):
            self._tree = device_key(device), MultinomialTree.of(torch.from_numpy(self._pvals).to(device))
        return self._tree[1]

    def count_vectors(self, batches: list[BatchStream], device: torch.device) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """Each batch's draws as counts over the drawn ids: (None, counts [M]) dense, or (ids [m], counts [m])
        sparse (sorted ids with a nonzero count) when the batch is far smaller than the support. Counts are
        float64 holding exact integers (n ≤ 2^53), on ``device``; each batch's depend on its stream alone."""
        drawn = self._multinomial_counts([b for b in batches if self.uses_counts(b.size)], device)
        tokens = [b for b in batches if b.index not in drawn]
        dense = [b for b in tokens if 8 * b.size >= self._logr.shape[0]]
        drawn.update(zip((b.index for b in dense), self._token_counts(dense, device)))
        return [(None, drawn[b.index]) if b.index in drawn else self._sparse_token_counts(b, device) for b in batches]

    def _multinomial_counts(self, multi: list[BatchStream], device: torch.device) -> dict[int, torch.Tensor]:
        """The count vectors [M] (float64) of the batches drawn as multinomials, by batch index."""
        drawn: dict[int, torch.Tensor] = {}
        if multi and device.type not in COUNTS_ON_HOST:
            # The tree on the device, up to batches_per_call batches per call (within the device's budget),
            # each from its own generator.
            per = batches_per_call(self._logr.shape[0], call_bytes(device))
            for i in range(0, len(multi), per):
                group = multi[i:i + per]
                counts = draw_counts(self._tree_on(device), [b.size for b in group],
                                     [b.counts_generator() for b in group]).to(torch.float64)
                drawn.update((b.index, c) for b, c in zip(group, counts))
        else:
            for b in multi:
                # Conditional binomials in C: O(M) per batch, whatever n (a draw-equivalent of n tokens).
                counts = torch.from_numpy(b.numpy_generator().multinomial(b.size, self._pvals))
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

    def _token_counts(self, batches: list[BatchStream], device: torch.device) -> list[torch.Tensor]:
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
        table, m, piece = self._alias_on(device), self._logr.shape[0], self.piece_draws(device)
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
        table = features(Draws(self._logr.to(device), self._full.to(device),
                               weight=None if self._is_weight is None else self._is_weight.to(device)))  # [M, P]
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

    # ---------------------------------------------------------------- gradients
    @property
    def gradient_params(self) -> int:
        return self.contexts * self.vocab

    def _ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(context index, token index) of every drawn (context, token) id."""
        return self._support // self.vocab, self._support % self.vocab

    def gradient_references(self) -> dict[str, np.ndarray]:
        """∇θ KL(q‖p) and ∇θ KL(p‖q) for θ = q's logits, averaged over contexts: rows (1/B) q⊙(log q −
        log p − KL) and (1/B)(q − p)."""
        q, lq, lp = self.log_q.exp(), self.log_q, self.log_p
        b = self.contexts
        kl = (q * (lq - lp)).sum(-1, keepdim=True)
        return {REVERSE: (q * (lq - lp - kl) / b).reshape(-1).numpy(),
                FORWARD: ((q - lp.exp()) / b).reshape(-1).numpy()}

    def coefficient_table(self, item: GradItem) -> torch.Tensor:
        """c(log r) on every drawn id [M], times the detached q/b of a weighted sampler. NeMo-RL's order
        (loss_is_nemo) under a weighted sampler is its use_on_policy_kl_approximation: w = q/b enters
        before the output clamp, so the clamp's test sees w·f (kl_bench.core.presets.WeightedClamp)."""
        if self._is_weight is None:
            return item.coef(self._logr)
        if item.mode == "loss_is_nemo":
            return item.est.weighted.coefficient(self._logr, self._is_weight)
        if self.correction.clips(item.mode):        # the PPO surrogate (kl_bench.core.weights)
            return self.correction.coefficient(item.est, item.mode, self._logr, self._raw_weight)
        return item.coef(self._logr) * self._is_weight

    def gradient_exact(self, item: GradItem, directions: dict[str, np.ndarray]) -> ExactGrad:
        """E[c s] for s = e_x − q_b (in row b), under the mixture (1/B) b_b(x) (b = q without a sampler)."""
        return self.exact_gradient_of_table(self.coefficient_table(item), directions)

    # θ = q's logits [B, V], flattened row by row: the exact vectors go to gradients.npz (B·V float64 each).
    exports_gradient_vectors = True

    def gradient_self(self, item: GradItem) -> np.ndarray | None:
        """∇θ E_q[f(log r)] = E_q[(f − f′)(log r)·s] (the score rule; ∇ log r = −s), whatever the sampler:
        rows (1/B)(q⊙c − q⟨q, c⟩) over q's support, with log r as the estimators see it. Under a sampler
        with rounded log-probs (the rounded table covers b's ids only) there is none."""
        if self.precision is not None and self.has_sampler:
            return None
        q = self.log_q.exp()
        if self.precision is None:
            ctx, tok = torch.nonzero(q > 0, as_tuple=True)
            logr = self.log_p[ctx, tok] - self.log_q[ctx, tok]
        else:
            (ctx, tok), logr = self._ids(), self._logr
        d = derivative(item.est, "self")
        c = torch.zeros_like(q)
        c[ctx, tok] = item.est.fn(logr) - d(logr)
        qc = q * torch.where(q > 0, c, torch.zeros_like(c))
        return ((qc - q * qc.sum(-1, keepdim=True)) / self.contexts).reshape(-1).numpy()

    def gradient_ukl(self) -> np.ndarray | None:
        """∇θ Σ_{x∈S} [q log(q/p) − q + p], S = b's support (q's without a sampler): with ∂q_x/∂z_j =
        q_x(δ_xj − q_j) the +1 and −1 of the derivative cancel, leaving rows (1/B)(q⊙g·1_S − q Σ_S q g),
        g = log q − log p. It is ∇KL(q‖p) when S holds all of q's mass (Σ_x ∇q_x = 0); a truncating
        sampler (top-k, top-p) leaves out the mass outside S, and the rows that see only S follow this."""
        q = self.log_q.exp()
        inside = q > 0 if self.log_b is None else self.log_b > -torch.inf
        g = torch.where(inside, self.log_q - self.log_p, torch.zeros_like(q))
        qg = q * g
        out = ((qg - q * qg.sum(-1, keepdim=True)) / self.contexts).reshape(-1).numpy()
        return out if np.isfinite(out).all() else None

    def exact_gradient_of_table(self, c_table: torch.Tensor, directions: dict[str, np.ndarray]) -> ExactGrad:
        """E[c s] for per-id coefficients ``c_table`` [M] (sums over the vocabulary)."""
        b, v = self.contexts, self.vocab
        q = self.log_q.exp()
        w = self._weights()
        ctx, tok = self._ids()
        cw = torch.zeros(b, v, dtype=torch.float64)  # host: the pair's exact tables live on the host
        cw[ctx, tok] = w * c_table                            # (1/B) b_b(x) c(x)
        mean = cw - q * cw.sum(-1, keepdim=True)              # row b: (1/B)(b⊙c − q Σ b c)
        s_norm2 = 1 - 2 * q[ctx, tok] + (q * q).sum(-1)[ctx]  # |e_x − q_b|²
        second = float((w * c_table**2 * s_norm2).sum())
        proj_var = {}
        for name, u in directions.items():
            ut = torch.as_tensor(u, dtype=torch.float64).reshape(b, v)  # host: the pair's exact tables live on the host
            su = ut[ctx, tok] - (q * ut).sum(-1)[ctx]        # s·u for each id
            m1 = float((w * c_table * su).sum())
            proj_var[name] = float((w * (c_table * su - m1) ** 2).sum())
        return ExactGrad(mean.reshape(-1).numpy(), second, proj_var)

    def gradient_accumulator(self, items, directions, device) -> GradientAccumulator:
        return _CategoricalGradients(self, items, directions, device)

    # ---------------------------------------------------------------- group baselines (kl_bench.experiment.group_baselines)
    baseline_aggregates = ("",)

    def baseline_check(self) -> None:
        if self.correction.clips("reward"):
            raise SpecError("group baselines with the PPO clip are not modelled (the clip's branch depends on the "
                            "centred advantage): drop clip_low/clip_high/dual_clip or the baseline_groups",
                            key="sampler", case=self.name)

    def _baseline_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per drawn id: ρ (ones without token weights), |s|², the context and token indices."""
        q = self.log_q.exp()
        ctx, tok = self._ids()
        rho = self._is_weight if self._is_weight is not None else torch.ones_like(self._logr)
        return rho, 1 - 2 * q[ctx, tok] + (q * q).sum(-1)[ctx], ctx, tok, q

    def baseline_exact(self, est, aggregate: str) -> BaselineExact:
        """Sums over the drawn ids under the draw mixture w = (1/B)·b: every moment is exact."""
        w, logr = self._weights(), self._logr
        rho, s2, _, _, _ = self._baseline_tables()
        f = est.fn(logr)
        phi = rho**2 * s2
        mu = float((w * f).sum())
        return BaselineExact(self.exact_gradient_of_table(rho * f, {}).mean,
                             self.exact_gradient_of_table(rho, {}).mean, mu, float((w * (f - mu) ** 2).sum()),
                             (float((w * f**2 * phi).sum()), float((w * f * phi).sum()), float((w * phi).sum())))

    def baseline_draws(self, est, aggregate: str, u: np.ndarray, device: torch.device):
        rho, s2, ctx, tok, q = self._baseline_tables()
        ut = torch.as_tensor(u, dtype=torch.float64).reshape(q.shape)  # host: the pair's exact tables live on the host
        tables = (est.fn(self._logr), rho, ut[ctx, tok] - (q * ut).sum(-1)[ctx], s2)     # F, ρ, s·u, |s|² per id

        def draw(n: int, gen: torch.Generator):
            ids = self.sample_ids(n, gen, device).cpu()
            return tuple(t[ids] for t in tables)
        return draw

    def baseline_piece(self, device: torch.device) -> int:
        return piece_draws(device)


class _CategoricalGradients(GradientAccumulator):
    """Every per-draw quantity is a table over the drawn (context, token) ids, so a batch is one
    bincount and one matrix product; the total gradient follows from the total counts."""

    def __init__(self, pair: CategoricalPair, items: list[GradItem], directions: dict[str, np.ndarray], device):
        self.pair, self.device, self.nj = pair, device, len(items)
        q = pair.log_q.exp()
        ctx, tok = pair._ids()
        self.c_tab = torch.stack([pair.coefficient_table(it) for it in items])          # [J, M]
        # host: gradient tables on the host (issue 33: counts cross per batch)
        su = torch.stack([torch.as_tensor(u, dtype=torch.float64).reshape(q.shape)[ctx, tok]
                          - (q * torch.as_tensor(u, dtype=torch.float64).reshape(q.shape)).sum(-1)[ctx]  # host: gradient tables on the host
                          for u in directions.values()])                                # [D, M]
        s_norm2 = 1 - 2 * q[ctx, tok] + (q * q).sum(-1)[ctx]
        self.nd = su.shape[0]
        self.table = torch.cat([(self.c_tab[:, None, :] * su[None]).reshape(-1, self.c_tab.shape[1]),
                                self.c_tab**2 * s_norm2])
        self.counts = torch.zeros(self.c_tab.shape[1], dtype=torch.float64)  # host: total counts, gathered on the host

    def add(self, batch: BatchStream) -> GradBatch:
        ids, counts = self.pair.batch_counts(batch, self.device)
        ids, counts = (None if ids is None else ids.cpu()), counts.cpu()
        # Fixed shapes per batch (as in batch_sums): the bytes never depend on the grouping.
        out = (self.table @ counts if ids is None else self.table[:, ids] @ counts).numpy()
        if ids is None:
            self.counts += counts
        else:
            self.counts.index_add_(0, ids, counts)
        return GradBatch(out[: self.nd * self.nj].reshape(self.nj, self.nd), out[self.nd * self.nj:])

    # Counts are whole numbers (exact in float64 below 2^53), so any grouping of batches sums them exactly.
    splittable = True

    def partial(self) -> torch.Tensor:
        return self.counts

    def merge(self, partials: list[torch.Tensor]) -> None:
        self.counts = torch.zeros_like(self.counts)
        for c in partials:
            self.counts += c

    def total(self) -> np.ndarray:
        p = self.pair
        q = p.log_q.exp()
        ctx, tok = p._ids()
        total = np.zeros((self.nj, p.contexts * p.vocab))
        for j in range(self.nj):
            cw = torch.zeros(p.contexts, p.vocab, dtype=torch.float64)  # host: the pair's exact tables live on the host
            cw[ctx, tok] = self.counts * self.c_tab[j]
            total[j] = (cw - q * cw.sum(-1, keepdim=True)).reshape(-1).numpy()
        return total
