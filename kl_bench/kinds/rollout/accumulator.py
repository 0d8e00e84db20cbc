"""Monte Carlo gradients of the rollout kind: every row's per-draw gradient Σ_t a_t s_t summed over recorded
paths (kl_bench.kinds.rollout.sampler.paths), with its projections on unit directions and its squared norm.

A row's per-step weights a_t [n, T] come from its token form (kl_bench.kinds.rollout.gradients.TOKEN_FORMS:
a per-(bucket, token) coefficient, and a term from the path's own f's), its importance weights (a token's
w_t, or the sequence's W on every term) and its aggregate (÷|y| for a per-sequence mean, one gradient per
group of B paths for the token-mean of a trainer batch). Sequence rows have a_t = W·c(L) on every step.

|g|² = |Σ_t a_t s_t|² needs no scatter: paths sorted by (bucket, token) key make equal keys and equal
buckets contiguous, so the double sums are prefix sums within runs (:class:`SortedPaths`; deterministic on
CUDA too). Totals Σ_draws g are float sums in draw order on the host: index_add_ on CUDA adds in no fixed
order (the per-piece keys and weights are the only large transfer of the kind).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ...core.aggregates import AGGREGATES, groups_in
from ...foundation.errors import SpecError
from ...core.modes import GradItem
from ...sampling.seeding import BatchStream, piece_draws
from ..protocols import GradBatch, GradientAccumulator
from .gradients import TOKEN_FORMS, local_tables, rb_direct
from .model import RolloutModel
from .sampler import paths

HOST = torch.device("cpu")


def _run_start(ids: torch.Tensor) -> torch.Tensor:
    """For rows of sorted ids [n, T]: the index where each element's run of equal ids starts."""
    i = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return torch.where(new, i, torch.zeros_like(i)).cummax(1).values


def _run_prefix(vals: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums of ``vals`` [n, T] within runs (``start`` from :func:`_run_start`)."""
    cs = vals.cumsum(1)
    return cs - F.pad(cs, (1, 0)).gather(1, start)


@dataclass
class SortedPaths:
    """A batch of paths sorted by key per row, so that equal (bucket, token) keys and equal buckets are
    contiguous; |g|² then needs prefix sums only (no scatter: deterministic on CUDA too)."""
    order: torch.Tensor       # [n, T] permutation
    key_start: torch.Tensor   # run starts of equal keys
    bucket_start: torch.Tensor
    qx: torch.Tensor          # q(x_t | c_{t−1}), sorted
    qq: torch.Tensor          # |q(·|c_{t−1})|², sorted

    @classmethod
    def of(cls, keys: torch.Tensor, q_flat: torch.Tensor, qq: torch.Tensor, vocab: int) -> "SortedPaths":
        order = torch.argsort(keys, dim=1, stable=True)
        ks = keys.gather(1, order)
        cb = torch.div(ks, vocab, rounding_mode="floor")
        return cls(order, _run_start(ks), _run_start(cb), q_flat[ks], qq[cb])

    def sq_norm(self, w: torch.Tensor) -> torch.Tensor:
        """|Σ_t w_t s_t|² per draw, [n], for per-step weights w [n, T] (0 on steps after the end).

        = Σ_keys W² − 2 Σ_c A_c B_c + Σ_c A_c² |q_c|², with W the weight summed per (bucket, token),
        A_c = Σ_{t in c} w_t and B_c = Σ_{t in c} w_t q(x_t|c). Each double sum over a run is
        Σ_i a_i (2·prefix_i − a_i), or Σ_i (a_i·prefix_b,i + b_i·prefix_a,i − a_i b_i) for two sequences."""
        ws = w.gather(1, self.order)
        wq = ws * self.qx
        pa, pb = _run_prefix(ws, self.bucket_start), _run_prefix(wq, self.bucket_start)
        same_key = ws * (2 * _run_prefix(ws, self.key_start) - ws)
        cross = ws * pb + wq * pa - ws * wq
        diag = self.qq * ws * (2 * pa - ws)
        return (same_key - 2 * cross + diag).sum(1)


def _divides_by_length(aggregate: str) -> bool:
    """Each sequence's terms are divided by its own length |y| (the per-sequence token mean)."""
    agg = AGGREGATES[aggregate]
    return agg.per_token and not agg.grouped


class RolloutGradients(GradientAccumulator):
    """Per-batch sums of every row's per-draw gradient, its projections and squared norm, from recorded
    paths; totals accumulate on the host with index_add_ (module docstring). ``case``: the case's name, for
    errors."""

    def __init__(self, model: RolloutModel, items: list[GradItem], directions: list[np.ndarray], device,
                 case: str | None = None):
        self.model, self.items, self.device, self.case = model, items, device, case
        c_, v = model.buckets, model.vocab
        q = self.q = model.log_q.exp()
        self.q_flat, self.g_flat = q.reshape(-1).to(device), model.logr_table.reshape(-1).to(device)
        self.qq = (q * q).sum(-1).to(device)
        # Projections g·u = Σ_t w_t (u(c, x_t) − ⟨q_c, u_c⟩): one additive table per direction.
        us = [torch.as_tensor(u, device=q.device).reshape(c_, v) for u in directions]
        self.hu = torch.stack([(u - (q * u).sum(-1, keepdim=True)).reshape(-1) for u in us]).to(device)
        self._local_rows(model, items, device)
        self.dense = _DenseTerm.of(model, self.hu, device) if any(TOKEN_FORMS[it.token].dense for it in items) \
            else None
        self.w_total = torch.zeros(c_ * v, len(self.per_draw), dtype=torch.float64, device=HOST)
        self.counts = torch.zeros(c_ * v, dtype=torch.float64, device=HOST)
        # Draws per piece: [m, T] recorded steps stay within 2^21 entries (fixed per case: same bytes for
        # any chunk).
        self.piece = max(1, min(piece_draws(device), 2**21 // max(1, model.length)))

    def _local_rows(self, model: RolloutModel, items: list[GradItem], device) -> None:
        """The tables of the token rows: a per-(bucket, token) coefficient c(c, x) where the form has one, and
        per sampler phase with token weights (and the PPO clip) for the local rows; ``local``: the rows whose
        totals follow from the (bucket, token) counts alone (local tok rows, no per-draw factor: no importance
        weights, no rejection mask)."""
        forms = {j: TOKEN_FORMS[it.token] for j, it in enumerate(items) if AGGREGATES[it.aggregate].token}
        per_step = [j for j, form in forms.items() if form.per_step]
        self.local = self._count_rows(model, items, per_step)
        self.per_draw = [j for j in range(len(items)) if j not in self.local]
        self.tables = {j: form.local(items[j], self.g_flat) for j, form in forms.items() if form.local is not None}
        self.phase_tables = self._phase_tables(model, items, per_step, device)
        self.phase_of = torch.tensor(model.phase_of, device=device)

    @staticmethod
    def _count_rows(model: RolloutModel, items: list[GradItem], per_step: list[int]) -> list[int]:
        """The rows of ``per_step`` whose totals follow from the (bucket, token) counts alone: no importance
        weights, no rejection mask, no length factor."""
        if model.weighting.weighted or model.rejection is not None:
            return []
        return [j for j in per_step if not AGGREGATES[items[j].aggregate].length]

    @staticmethod
    def _phase_tables(model: RolloutModel, items: list[GradItem], rows: list[int], device) -> dict[int, torch.Tensor]:
        """Per row of ``rows``, its coefficient per sampler phase [phases, C·V] with token weights (and the PPO
        clip) in it; none without token weights."""
        if not model.weighting.per_token:
            return {}
        return {j: torch.stack([t.reshape(-1) for t in local_tables(model, items[j])]).to(device) for j in rows}

    def add(self, batch: BatchStream) -> GradBatch:
        nj, nd = len(self.items), self.hu.shape[0]
        proj, proj2, sq = np.zeros((nj, nd)), np.zeros((nj, nd)), np.zeros(nj)
        for m, generator in batch.pieces(self.piece):
            p = paths(self.model, m, generator, self.device)
            w_cols = self._piece(p, batch.size, proj, proj2, sq)
            flat_keys = p.keys.reshape(-1).cpu()
            self.counts.index_add_(0, flat_keys, p.alive.reshape(-1).cpu())
            if w_cols:
                self.w_total.index_add_(0, flat_keys, torch.stack(w_cols, -1).reshape(-1, len(w_cols)).cpu())
        return GradBatch(proj, sq, proj2)

    def _piece(self, p, size: int, proj: np.ndarray, proj2: np.ndarray, sq: np.ndarray) -> list[torch.Tensor]:
        """Add one piece's projections and squared norms into ``proj``, ``proj2``, ``sq``; the per-step weights
        [m, T] of the rows whose totals need them."""
        keys, alive, model = p.keys, p.alive, self.model
        # Importance weights: per token w_t (weights = "token") or W = Π_t w_t on every term.
        tok_w = p.weights * alive if model.weighting.per_token else alive
        seq_w = torch.where(alive > 0, p.weights, torch.ones_like(alive)).prod(1, keepdim=True) \
            if model.weighting.weighted else 1.0
        logr_t = self.g_flat[keys] * alive
        big_l = logr_t.sum(1)
        units = {1: (keys, SortedPaths.of(keys, self.q_flat, self.qq, model.vocab), self.hu[:, keys], None, 1.0)}
        w_cols = []
        for j, it in enumerate(self.items):
            w = seq_w * it.coef(big_l)[:, None] * alive if not AGGREGATES[it.aggregate].token else \
                self._token_weights(it, j, keys, alive, logr_t, tok_w, seq_w)
            w = _masked(w, p.keep)
            b = model.token_mean_batch if AGGREGATES[it.aggregate].grouped else 1
            if b not in units:
                units[b] = self._groups(keys, alive, b, size)
            _, srt, hs, per_member, factor = units[b]
            if per_member is not None:   # one gradient per group: Σ_i Σ_t w s / Σ_i |y_i|
                n = per_member.shape[0]
                w = torch.cat([factor * w[:n] / per_member[:, None], torch.zeros_like(w[n:])])
                uw = w[:n].reshape(n // b, -1) / factor
            else:
                uw = w
            if j not in self.local:
                w_cols.append(w)
            pj = (uw[None] * hs).sum(2)                          # [D, units]
            norm2 = srt.sq_norm(uw)
            if TOKEN_FORMS[it.token].dense:                      # + W·Σ_c n_c ∇KL(c): projections and |g|²
                pj, norm2 = self.dense.add(keys, alive, seq_w, uw, pj, norm2, model.vocab)
            proj[j] += factor * pj.sum(1).cpu().numpy()
            proj2[j] += factor * (pj * pj).sum(1).cpu().numpy()
            sq[j] += factor * float(norm2.sum())
        return w_cols

    def _groups(self, keys: torch.Tensor, alive: torch.Tensor, b: int, size: int):
        """The units of a tok_batch row in a piece: its whole groups of B = ``b`` consecutive paths as
        (keys [G, B·T], their SortedPaths, projections [D, G, B·T], Σ|y| of each member's group [G·B],
        factor). Each group's gradient is one value; ``factor`` = draws / groups of the batch makes the
        batch's sums those of the group mean times its draws (the engine divides by draws), so the draws
        that fall in no whole group (the end of a piece) leave no bias."""
        groups = groups_in(size, b, self.piece)
        if groups == 0:
            raise SpecError(f"batches of {size} rollouts hold no whole group of token_mean_batch = {b}: raise "
                            "the draws or lower the batches", case=self.case, key="token_mean_batch")
        g = keys.shape[0] // b
        kg = keys[:g * b].reshape(g, -1)
        per_member = alive[:g * b].sum(1).view(g, b).sum(1).repeat_interleave(b)
        return kg, SortedPaths.of(kg, self.q_flat, self.qq, self.model.vocab), self.hu[:, kg], per_member, size / groups

    def _token_weights(self, it: GradItem, j: int, keys, alive, logr_t, tok_w, seq_w) -> torch.Tensor:
        """Per-step weights w [m, T] of a token row, its per-draw gradient being Σ_t w_t s_t: the form's
        per-(bucket, token) coefficient on each step times its token weight (or the phase's table, where
        token weights and the clip are in it) plus its term from the path's f's; a sequence weight W on all;
        times 1/|y| for a per-sequence mean."""
        form = TOKEN_FORMS[it.token]
        if form.dense:                      # the Rao–Blackwellised row: each step's reward Σ_{t'>t} KL(c_{t'−1})
            kl_t = self.dense.kl_ctx[torch.div(keys, self.model.vocab, rounding_mode="floor")] * alive
            return seq_w * (kl_t.flip(1).cumsum(1).flip(1) - kl_t)
        outer = seq_w if self.model.weighting.on_sums else 1.0
        w = torch.zeros_like(alive)
        if j in self.phase_tables:          # Σ_t a_phase(t)(x_t) s_t: the weight is in the table
            w = w + self.phase_tables[j][self.phase_of[None, :keys.shape[1]], keys] * alive
        elif j in self.tables:
            w = w + self.tables[j][keys] * tok_w
        if form.path is not None:
            w = w + form.path(it, logr_t, alive, tok_w)
        w = outer * w
        if _divides_by_length(it.aggregate):
            w = w / alive.sum(1, keepdim=True)
        return w

    def total(self) -> np.ndarray:
        total = np.zeros((len(self.items), self.model.buckets * self.model.vocab))
        q = self.q.to(HOST)
        for col, j in enumerate(self.per_draw):
            total[j] = _grad_from_weights(self.w_total[:, col], q)
            if TOKEN_FORMS[self.items[j].token].dense:      # Σ_draws W Σ_c n_c ∇KL(c) = Σ_c visits_c ∇KL(c)
                visits = self.dense.visits.to(HOST)[:, None]
                total[j] += (visits * self.dense.direct.to(HOST)).reshape(-1).numpy()
        for j in self.local:
            total[j] = _grad_from_weights(self.counts * self.tables[j].to(HOST), q)
        return total


@dataclass
class _DenseTerm:
    """The Rao–Blackwellised row's dense part B = Σ_c n_c ∇KL(c) (n_c: the path's visits to bucket c;
    kl_bench.kinds.rollout.gradients.rb_direct) beside its sparse part A = Σ_t a_t s_t: B·u from the per-bucket
    tables ``du`` [D, C]; |A + B|² = |A|² + 2 Σ_t a_t n_{c_t} (s_t·∇KL(c_t)) + Σ_c n_c² |∇KL(c)|² (rows of
    different buckets are orthogonal), with s(c, x)·∇KL(c) = ∇KL(c)[x] − ⟨q_c, ∇KL(c)⟩ in ``sd`` [C·V]."""
    direct: torch.Tensor      # ∇KL(c) [C, V]
    kl_ctx: torch.Tensor      # KL(c) [C]
    du: torch.Tensor          # [D, C]
    sd: torch.Tensor          # [C·V]
    norm2: torch.Tensor       # |∇KL(c)|² [C]
    visits: torch.Tensor      # Σ over the paths added of W·n_c [C] (the direct part's total), on the device

    @classmethod
    def of(cls, model: RolloutModel, hu: torch.Tensor, device) -> "_DenseTerm":
        d = rb_direct(model)
        q = model.log_q.exp()
        c_, v = d.shape
        du = (hu.to(d.device).reshape(-1, c_, v) * d).sum(-1)     # Σ_x ∇KL(c)[x]·(u − ⟨q_c, u_c⟩) = ∇KL(c)·u_c
        sd = (d - (q * d).sum(-1, keepdim=True)).reshape(-1)
        return cls(d.to(device), model.kl_ctx.to(device), du.to(device), sd.to(device), (d * d).sum(-1).to(device),
                   torch.zeros(c_, dtype=torch.float64, device=device))

    def add(self, keys: torch.Tensor, alive: torch.Tensor, seq_w: torch.Tensor | float, w: torch.Tensor,
            pj: torch.Tensor, norm2: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(projections [D, n], |g|² [n]) of the paths with W·B added to their sparse part (``pj``, ``norm2`` of
        the per-step weights ``w`` [n, T], W in them already); ``seq_w``: each path's W [n, 1] (1.0: none).
        Visits are whole numbers: their scatter-add is exact in any order (then times W)."""
        buckets = torch.div(keys, vocab, rounding_mode="floor")
        n = torch.zeros(keys.shape[0], self.norm2.shape[0], dtype=torch.float64, device=keys.device)
        n.scatter_add_(1, buckets, alive)
        n = n * seq_w
        self.visits += n.sum(0)                 # on the device: read once, by the total
        cross = (w * n.gather(1, buckets) * self.sd[keys]).sum(1)
        return pj + self.du @ n.T, norm2 + 2 * cross + (n * n) @ self.norm2


def _masked(w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Per-step weights [m, T] of a row with a rejected sequence's every step zeroed (``keep`` [m] 0/1; None:
    no mask); 0, never 0·inf."""
    return w if keep is None else torch.where(keep[:, None] > 0, w, torch.zeros_like(w))


def _grad_from_weights(w: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    """Σ_steps w (e_x − q_c) from W(c, x) = Σ w over the steps that drew x from bucket c."""
    wm = w.reshape(q.shape)
    return (wm - wm.sum(-1, keepdim=True) * q).reshape(-1).numpy()
