"""Exact per-position values streamed from hidden states and output layers, never an [N, V] tensor.

Positions are taken ``chunk`` at a time and the vocabulary ``tile`` ids at a time; each tile's logits
z = h Wᵀ (+ bias) are made, used and dropped, so memory is O(N + chunk × tile × F) whatever V is.

Pass 1 (one output-layer forward of each model) runs an online log-sum-exp of the policy's and the
reference's logits and, in the same loop, KL = E_q[z_q − z_p] − lse_q + lse_p, where the expectation is
merged tile by tile (below) with the unnormalised weights exp(z_q): it needs no normaliser in advance.
It also keeps the sampler's running maximum score and top candidates, from which the per-row threshold τ
of b follows (kl_bench.audit.sampler): top-k is the k-th largest score (an exact streaming k-selection);
top-p is found among the top ``candidates`` scores when their mass reaches p, and otherwise (a flat row)
from that one row's full score vector, built tile by tile (O(V) for one row); min-p is an offset from the
maximum.

Pass 2 (only when estimators are asked for, or b ≠ q) remakes the tiles: f(log r) needs log r =
(z_p − lse_p) − (z_q − lse_q), hence both normalisers from pass 1.

Merging tiles: a tile with total weight W_t = Σ exp(logw), weighted mean μ_t and variance V_t joins the
running (W, μ, V) as μ ← a μ + b μ_t, V ← a V + b V_t + a b (μ_t − μ)², with a = W/(W + W_t),
b = W_t/(W + W_t) computed in log space (Chan et al.'s pairwise update). Every quantity stays a centred
float64 mean or variance, so nothing cancels; the result equals the dense sums to rounding (~1e-15).

Ties at a top-k or top-p boundary: the threshold keeps every token tied with the last kept one, as
transformers' top-k does; its top-p keeps a prefix of an arbitrary sort order. Logits of real models are
continuous, so a tie at the boundary has probability zero.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import SpecError
from .exact import PositionValues, estimator_functions
from .sampler import Sampler, sampler_scores


@dataclass(frozen=True)
class Head:
    """An output layer: logits = softcap(h @ weight.T + bias) · scale. ``weight`` [V, d], ``bias`` [V] or
    None; ``softcap``: Gemma's ``final_logit_softcapping`` c, z ← c·tanh(z / c), applied by the model
    before anything the trainer does (None: none); ``scale``: 1/T for trainers that divide the logits by
    the sampling temperature (TRL), applied after the cap as they do. A final norm (if the model has one
    after its body) is applied by the caller to the hidden states."""
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self):
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise SpecError(f"the logit soft-cap must be a finite number > 0, got {self.softcap}", key="softcap")

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    def logits(self, h: torch.Tensor, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ids [lo, hi) for hidden states ``h`` [n, d] (already in the compute dtype): [n, hi − lo],
        written into ``out`` when given (a contiguous [n, hi − lo] buffer: no allocation per tile). The
        bias, cap and scale act in place, elementwise in h's dtype (tanh is accurate to a few ulp)."""
        z = torch.matmul(h, self.weight[lo:hi].to(h.dtype).T, out=out)
        if self.bias is not None:
            z.add_(self.bias[lo:hi].to(h.dtype))
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z if self.scale == 1.0 else z.mul_(self.scale)


class _Moments:
    """Running (log W, μ [n, F], V [n, F]) of values under unnormalised log-weights, merged tile by tile."""

    def __init__(self, n: int, f: int):
        self.logw = torch.full((n,), -torch.inf, dtype=torch.float64)
        self.mean = torch.zeros(n, f, dtype=torch.float64)
        self.var = torch.zeros(n, f, dtype=torch.float64)

    def add(self, logw: torch.Tensor, values: torch.Tensor) -> None:
        """``logw`` [n, t] (−inf: weight 0), ``values`` [n, t, F]."""
        lw_t = torch.logsumexp(logw, dim=-1)
        empty = torch.isneginf(lw_t)
        w = torch.exp(logw - torch.where(empty, 0.0, lw_t).unsqueeze(-1)).unsqueeze(-1)
        v = torch.where(w > 0, values, torch.zeros_like(values))        # 0·inf would be NaN
        mu_t = (w * v).sum(dim=1)
        var_t = (w * (v - mu_t.unsqueeze(1)).square()).sum(dim=1)
        total = torch.logaddexp(self.logw, lw_t)
        none = torch.isneginf(total)
        safe = torch.where(none, 0.0, total)
        a = torch.where(none, 0.0, torch.exp(self.logw - safe)).unsqueeze(-1)
        b = torch.where(none | empty, 0.0, torch.exp(lw_t - safe)).unsqueeze(-1)
        delta = mu_t - self.mean
        self.mean = a * self.mean + b * mu_t
        self.var = a * self.var + b * var_t + a * b * delta.square()
        self.logw = total


def _top_p_threshold(cand: torch.Tensor, norm: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """τ of top-p from the sorted (descending) candidate scores [n, K] and the log-normaliser [n] of the
    distribution top-p acts on; and the rows [n] where the candidates' mass is below p (τ unknown)."""
    probs = torch.exp(cand - norm.unsqueeze(-1))
    cum = torch.cumsum(probs, dim=-1)
    keep = (cum - probs) < p                               # the mass of the more likely tokens is below p
    count = keep.sum(dim=-1).clamp(min=1)
    tau = cand.gather(-1, (count - 1).unsqueeze(-1)).squeeze(-1)
    return tau, cum[:, -1] < p


class _Scan:
    """What one position chunk needs: hidden states in the compute dtype, its sampler inputs, the ids."""

    def __init__(self, hq, hp, heads, sampler, tile, eos_banned, context_ids, ids):
        self.hq, self.hp, self.heads, self.sampler, self.tile = hq, hp, heads, sampler, tile
        self.eos_banned, self.context_ids, self.ids = eos_banned, context_ids, ids

    def tiles(self, policy_only: bool = False, scores: bool = True):
        """(lo, z_q, z_p, s) for each vocabulary tile (z_p None when ``policy_only``, s None unless
        ``scores``)."""
        vocab = self.heads[0].vocab
        for lo in range(0, vocab, self.tile):
            hi = min(lo + self.tile, vocab)
            zq = self.heads[0].logits(self.hq, lo, hi).to(torch.float64)
            zp = None if policy_only else self.heads[1].logits(self.hp, lo, hi).to(torch.float64)
            s = sampler_scores(zq, self.sampler, lo=lo, eos_banned=self.eos_banned,
                               context_ids=self.context_ids) if scores else None
            yield lo, zq, zp, s


def _pass1(scan: _Scan, candidates: int, sampler: bool = True):
    """Online log-sum-exps of both models (and of the sampler's scores unless ``sampler`` is False), the
    merged E_q[z_q − z_p], the running maximum score and the top ``candidates`` scores."""
    n = scan.hq.shape[0]
    lse_q = torch.full((n,), -torch.inf, dtype=torch.float64)
    lse_p, lse_s, s_max = lse_q.clone(), lse_q.clone(), lse_q.clone()
    diff = _Moments(n, 1)
    cand = torch.full((n, 0), -torch.inf, dtype=torch.float64)
    for _, zq, zp, s in scan.tiles(scores=sampler):
        lse_q = torch.logaddexp(lse_q, torch.logsumexp(zq, dim=-1))
        lse_p = torch.logaddexp(lse_p, torch.logsumexp(zp, dim=-1))
        diff.add(zq, (zq - zp).unsqueeze(-1))
        if not sampler:
            continue
        lse_s = torch.logaddexp(lse_s, torch.logsumexp(s, dim=-1))
        s_max = torch.maximum(s_max, s.max(dim=-1).values)
        if candidates:
            both = torch.cat([cand, s], dim=-1)
            cand = torch.topk(both, min(candidates, both.shape[-1]), dim=-1).values
    return lse_q, lse_p, lse_s, s_max, diff.mean.squeeze(-1), cand


def _candidates(scan: _Scan, k: int, rows: torch.Tensor) -> torch.Tensor:
    """The k largest scores [len(rows), k] (descending) of the chunk's ``rows``."""
    cand = torch.full((rows.numel(), 0), -torch.inf, dtype=torch.float64)
    for _, _, _, s in scan.tiles(policy_only=True):
        both = torch.cat([cand, s[rows]], dim=-1)
        cand = torch.topk(both, min(k, both.shape[-1]), dim=-1).values
    return cand


def _thresholds(scan: _Scan, lse_s, s_max, cand) -> torch.Tensor:
    """τ [n] of b (−inf: no truncation)."""
    sp, vocab = scan.sampler, scan.heads[0].vocab
    tau = torch.full_like(lse_s, -torch.inf)
    if sp.k is not None and sp.k < vocab:
        tau = torch.maximum(tau, cand[:, sp.k - 1])
    if sp.p is not None:
        top = cand[:, :sp.k] if sp.k is not None else cand
        norm = torch.logsumexp(top, dim=-1) if sp.k is not None else lse_s
        tau_p, short = _top_p_threshold(top, norm, sp.p)
        rows, k = torch.nonzero(short).flatten(), cand.shape[-1]
        while sp.k is None and rows.numel() and k < vocab:
            # Flat rows: the nucleus is larger than the candidates. Widen the candidate list (×4) for
            # those rows only, by another pass over the same tiles (same matmul shapes, hence the very
            # same rounded scores that pass 2 compares with τ).
            k = min(4 * k, vocab)
            top = _candidates(scan, k, rows)
            tau_p[rows], short = _top_p_threshold(top, lse_s[rows], sp.p)
            rows = rows[short]
        tau = torch.maximum(tau, tau_p)
    if sp.mp is not None:
        tau = torch.maximum(tau, s_max + math.log(sp.mp))
    return tau


def _pass2(scan: _Scan, fns, lse_q, lse_p, tau):
    n, nf = scan.hq.shape[0], len(fns)
    under_q, under_b = _Moments(n, nf), _Moments(n, 2 * nf + 1)
    lse_miss = torch.full((n,), -torch.inf, dtype=torch.float64)
    tok = torch.full((n, 3), torch.nan, dtype=torch.float64)        # z_q, z_p, s of the sampled token
    for lo, zq, zp, s in scan.tiles():
        lq, lp = zq - lse_q.unsqueeze(-1), zp - lse_p.unsqueeze(-1)
        logr = lp - lq
        f = torch.stack([fn(logr) for fn in fns], dim=-1) if fns else logr.new_zeros(logr.shape + (0,))
        under_q.add(zq, f)
        inside = s >= tau.unsqueeze(-1)
        under_b.add(torch.where(inside, s, -torch.inf), torch.cat([f, (f < 0).to(f.dtype), s.unsqueeze(-1)], dim=-1))
        lse_miss = torch.logaddexp(lse_miss, torch.logsumexp(torch.where(inside, -torch.inf, zq), dim=-1))
        if scan.ids is not None:
            j = scan.ids - lo
            here = (j >= 0) & (j < s.shape[-1])
            jj = torch.where(here, j, 0).unsqueeze(-1)
            got = torch.stack([zq.gather(-1, jj), zp.gather(-1, jj), s.gather(-1, jj)], dim=-1).squeeze(1)
            tok = torch.where(here.unsqueeze(-1), got, tok)
    return under_q, under_b, lse_miss, tok


def _chunk_values(scan: _Scan, fns, names, candidates: int) -> PositionValues:
    sp = scan.sampler
    need_cand = max(sp.k or 0, candidates if sp.p is not None and sp.k is None else 0)
    lse_q, lse_p, lse_s, s_max, diff, cand = _pass1(scan, need_cand)
    kl = diff - lse_q + lse_p
    tau = _thresholds(scan, lse_s, s_max, cand)
    moments_q, b, lse_miss, tok = _pass2(scan, fns, lse_q, lse_p, tau)
    nf = len(fns)
    logzb = b.logw
    s_tok = tok[:, 2]
    logb_tok = torch.where(s_tok >= tau, s_tok - logzb, torch.full_like(s_tok, -torch.inf))
    logb_tok = torch.where(torch.isnan(s_tok), s_tok, logb_tok)
    return PositionValues(names, kl, moments_q.mean, moments_q.var, b.mean[:, :nf], b.var[:, :nf], b.mean[:, nf:2 * nf],
                          torch.exp(lse_miss - lse_q), b.mean[:, -1] - logzb, b.var[:, -1],
                          tok[:, 0] - lse_q, tok[:, 1] - lse_p, logb_tok)


class _LogSumExp:
    """Running log Σ exp(z) per row and, optionally, A = Σ exp(z)·y, in float64, merged from each tile's
    (max m_t, S_t = Σ e^{z − m_t}, A_t = Σ e^{z − m_t}·y): S ← S·e^{M − M'} + S_t·e^{m_t − M'} with
    M' = max(M, m_t), A likewise. Every weight is ≤ 1, so nothing overflows whatever the logits."""

    def __init__(self, n: int):
        self.m = torch.full((n,), -torch.inf, dtype=torch.float64)
        self.s = torch.zeros(n, dtype=torch.float64)
        self.a = torch.zeros(n, dtype=torch.float64)

    def add(self, m_t: torch.Tensor, s_t: torch.Tensor, a_t: torch.Tensor | None = None) -> None:
        m_t = m_t.to(torch.float64)
        new = torch.maximum(self.m, m_t)
        old_w, new_w = torch.exp(self.m - new), torch.exp(m_t - new)
        self.s = self.s * old_w + s_t.to(torch.float64) * new_w
        if a_t is not None:
            self.a = self.a * old_w + a_t.to(torch.float64) * new_w
        self.m = new

    @property
    def lse(self) -> torch.Tensor:
        return self.m + torch.log(self.s)

    @property
    def mean(self) -> torch.Tensor:
        return self.a / self.s


def _kl_tile(zq: torch.Tensor, zp: torch.Tensor, diff: torch.Tensor, q: _LogSumExp, p: _LogSumExp) -> None:
    """Fold one tile of logits into the running sums, in place on the three [n, t] buffers (they are
    overwritten): six elementwise passes and four row reductions, no allocation of tile size.
    The exps and the tile sums run in the logits' dtype: in float64 they are exact to rounding; in
    float32 each tile sum of ≤ t terms in [0, 1] carries a relative error ≲ log2(t)·2⁻²⁴ (pairwise
    summation), below the float32 logits' own rounding, and the tiles are merged in float64."""
    torch.sub(zq, zp, out=diff)                            # z_q − z_p, before z_q is overwritten
    mq, mp = zq.amax(dim=-1, keepdim=True), zp.amax(dim=-1, keepdim=True)
    eq, ep = zq.sub_(mq).exp_(), zp.sub_(mp).exp_()      # e^{z − m_t} ∈ (0, 1]
    q.add(mq.squeeze(-1), eq.sum(dim=-1), diff.mul_(eq).sum(dim=-1))
    p.add(mp.squeeze(-1), ep.sum(dim=-1))


@torch.no_grad()
def stream_kl(policy_hidden: torch.Tensor, reference_hidden: torch.Tensor, policy_head: Head, reference_head: Head,
              *, chunk: int = 256, tile: int = 4096, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """KL(q‖p) [N] only, in one pass (one output-layer forward of each model), as
    E_q[z_q − z_p] − lse_q + lse_p with two running log-sum-exps (the first carrying E_q[z_q − z_p]).

    The matmuls write into three buffers of chunk × tile elements made once (no allocation, hence no
    page faults, per tile) and each tile is reduced in place (:func:`_kl_tile`), in ``dtype``; only the
    per-tile sums are merged in float64. With float64 the values equal :func:`stream_values`' to rounding
    (~1e-15); with float32 they carry the float32 logits' rounding (~1e-7 relative of each logit; 2–3e-6
    absolute measured at V = 151,936, benchmarks/README.md), as the model's own log-probs do."""
    if policy_head.vocab != reference_head.vocab:
        raise SpecError(f"policy and reference vocabularies differ: {policy_head.vocab} and {reference_head.vocab}")
    if dtype not in (torch.float32, torch.float64):      # the tile sums run in dtype: 16-bit ones would round them
        raise SpecError(f"stream_kl computes in float32 or float64, not {dtype}", key="dtype")
    n_all, vocab = policy_hidden.shape[0], policy_head.vocab
    size = min(chunk, n_all) * min(tile, vocab)
    flat = [torch.empty(size, dtype=dtype) for _ in range(3)]
    out = []
    for i in range(0, n_all, chunk):
        hq, hp = policy_hidden[i:i + chunk].to(dtype), reference_hidden[i:i + chunk].to(dtype)
        n = hq.shape[0]
        q, p = _LogSumExp(n), _LogSumExp(n)
        for lo in range(0, vocab, tile):
            hi = min(lo + tile, vocab)
            zq, zp, diff = (b[:n * (hi - lo)].view(n, hi - lo) for b in flat)
            _kl_tile(policy_head.logits(hq, lo, hi, out=zq), reference_head.logits(hp, lo, hi, out=zp), diff, q, p)
        out.append(q.mean - q.lse + p.lse)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


@torch.no_grad()
def stream_values(policy_hidden: torch.Tensor, reference_hidden: torch.Tensor, policy_head: Head, reference_head: Head,
                  estimators: Sequence = ("k1", "k3"), sampler: Sampler | None = None, *,
                  ids: torch.Tensor | None = None, eos_banned: torch.Tensor | None = None,
                  context_ids: torch.Tensor | None = None, chunk: int = 256, tile: int = 8192,
                  candidates: int = 1024, dtype: torch.dtype = torch.float64) -> PositionValues:
    """:func:`kl_bench.audit.exact.position_values` from hidden states [N, d] (each model's own) and
    output layers, streamed: the same values to rounding, in O(N + chunk × tile) memory.

    ``dtype``: the dtype of the logits' matmul (float64: exact to rounding; float32 is faster and rounds
    each logit to ~1e-7 relative, as the model itself does); all accumulation is float64."""
    if policy_head.vocab != reference_head.vocab:
        raise SpecError(f"policy and reference vocabularies differ: {policy_head.vocab} and {reference_head.vocab}")
    if policy_hidden.shape[0] != reference_hidden.shape[0]:
        raise SpecError(f"policy and reference hidden states cover {policy_hidden.shape[0]} and "
                        f"{reference_hidden.shape[0]} positions")
    names, fns = estimator_functions(estimators)
    sampler = sampler or Sampler()
    parts = []
    for i in range(0, policy_hidden.shape[0], chunk):
        j = i + chunk
        scan = _Scan(policy_hidden[i:j].to(dtype), reference_hidden[i:j].to(dtype), (policy_head, reference_head),
                     sampler, tile, None if eos_banned is None else eos_banned[i:j],
                     None if context_ids is None else context_ids[i:j], None if ids is None else ids[i:j].to(torch.long))
        parts.append(_chunk_values(scan, fns, names, candidates))
    if not parts:
        empty = torch.zeros(0, dtype=torch.float64)
        return PositionValues(names, empty, *(empty.view(0, 1).expand(0, len(names)),) * 5, empty, empty, empty,
                              empty, empty, empty)
    return PositionValues.cat(parts)
