"""Exact per-position values streamed from hidden states and output layers, never an [N, V] tensor.

Positions are taken ``chunk`` at a time and the vocabulary ``tile`` ids at a time; each tile's logits
z = h Wᵀ (+ bias) are made, used and dropped, so memory is O(N + chunk × tile) whatever V is.

**One pass** (one output-layer forward of each model, :func:`stream_values`). Per tile and position it
keeps a few numbers, merged in float64 at the end:
- the log-sum-exps of both models (max and Σ e^{z − max}: nothing overflows);
- for the policy q (and a full-support sampler b), the weighted sums of u^i ψ(u)^j around the tile's own
  weighted mean of d = z_p − z_q, from which :mod:`kl_bench.audit.polymoments` gets, exactly, E[f] and
  Var[f] of every estimator that is a polynomial in r and log r, although log r = d + (lse_q − lse_p)
  needs both normalisers, known only after the last tile; KL = −E_q[log r] is its degree-1 case;
- under a truncating sampler (top-k, top-p, min-p) the top ``candidates`` scores with both models'
  logits there (a streaming k-selection): b's support is among them, so every quantity under b (for any
  estimator, P_b(f < 0), log b) is a finite sum over them once the normalisers are known;
- the weighted mean and spread of b's score (the consistency check's E_b[log b], Var_b[log b]) and the
  sampled token's logits.

**A second pass** (two more forwards) runs only for what one pass cannot give: an estimator that is not a
polynomial (clamped presets, |log r|), P_b(f < 0) of an estimator that changes sign under a sampler that
does not truncate, and rows whose sampler support is not inside the candidates (a top-p nucleus larger
than them, or ties at the threshold): for those rows τ is found by widening the candidate list over the
same tiles (the very same rounded scores) and the values are summed with the normalisers known.

**Devices and dtypes.** Everything is made on the hidden states' device. Tile matmuls run in ``dtype``
(float32 by default, TF32 off unless ``tf32=True``; a bf16/fp16 head is up-cast one tile at a time) and
so do the tile sums; tiles are merged in float64. Only [N] results leave the device, once, when the caller
moves them. float32 carries the logits' own rounding (~1e-7 relative, what the model computes) and each
tile sum of t terms ≲ t·2⁻²⁴ relative; ``dtype=torch.float64`` is exact to rounding (~1e-15, tested
against the dense sums of :func:`kl_bench.audit.exact.position_values`).

Ties at a top-k or top-p boundary: the threshold keeps every token tied with the last kept one, as
transformers' top-k does; its top-p keeps a prefix of an arbitrary sort order. Logits of real models are
continuous, so a tie at the boundary has probability zero.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import SpecError
from ..estimators import resolve_estimator
from .exact import PositionValues
from .polymoments import Basis, degree, finish_family, scratch_needed, tile_sums
from .sampler import Sampler, sampler_scores

COMPUTE_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class Head:
    """An output layer: logits = softcap(multiplier · (h @ weight.T + bias)) · scale. ``weight`` [V, d],
    ``bias`` [V] or None; ``multiplier``: a model's own logit scale (config ``logit_scale``), applied
    first; ``softcap``: Gemma's ``final_logit_softcapping`` c, z ← c·tanh(z / c); ``scale``: 1/T for
    trainers that divide the logits by the sampling temperature (TRL), applied last, as TRL's kernel does.
    A final norm (if the model has one after its body) is applied by the caller to the hidden states."""
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None
    multiplier: float = 1.0

    def __post_init__(self):
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise SpecError(f"the logit soft-cap must be a finite number > 0, got {self.softcap}", key="softcap")
        if not math.isfinite(self.multiplier) or not math.isfinite(self.scale):
            raise SpecError(f"logit scales must be finite, got {self.multiplier} and {self.scale}", key="scale")

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    def logits(self, h: torch.Tensor, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ids [lo, hi) for hidden states ``h`` [n, d] (already in the compute dtype, on the
        head's device): [n, hi − lo], written into ``out`` when given. Only this tile of a 16-bit head is
        up-cast; the bias, cap and scales act in place, elementwise in h's dtype."""
        w = self.weight[lo:hi]
        z = torch.matmul(h, (w if w.dtype == h.dtype else w.to(h.dtype)).T, out=out)
        if self.bias is not None:
            z.add_(self.bias[lo:hi].to(h.dtype))
        if self.multiplier != 1.0:
            z.mul_(self.multiplier)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z if self.scale == 1.0 else z.mul_(self.scale)


@contextlib.contextmanager
def matmul_precision(tf32: bool = False):
    """float32 matmuls at full float32 precision unless ``tf32``: TF32 on CUDA (and bf16 passes on some
    CPUs under "medium") round the logits to ~1e-3 relative. The previous global setting is restored."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _check_inputs(policy_hidden, reference_hidden, policy_head: Head, reference_head: Head, dtype) -> None:
    if policy_head.vocab != reference_head.vocab:
        raise SpecError(f"policy and reference vocabularies differ: {policy_head.vocab} and {reference_head.vocab}")
    if policy_hidden.shape[0] != reference_hidden.shape[0]:
        raise SpecError(f"policy and reference hidden states cover {policy_hidden.shape[0]} and "
                        f"{reference_hidden.shape[0]} positions")
    if dtype not in COMPUTE_DTYPES:      # the tile sums run in dtype: 16-bit ones would round them
        raise SpecError(f"the audit computes in float32 or float64, not {dtype}", key="dtype")
    devices = {t.device for t in (policy_hidden, reference_hidden, policy_head.weight, reference_head.weight)}
    if len(devices) > 1:
        raise SpecError("hidden states and output layers must be on one device, got "
                        + ", ".join(sorted(str(d) for d in devices)), key="device")


# ----------------------------------------------------------------------------- the plan of one call
def _function_of_log_r(item):
    est = resolve_estimator(item)
    if est.analytic:
        raise SpecError(f"'{est.name}' is not a function of log r: the exact KL is always reported")
    return est


def _candidates_kept(sampler: Sampler, vocab: int, candidates: int) -> int:
    """Scores kept per row under a truncating b: top-k alone needs its k and one more (a tie at the k-th
    shows there); top-p and min-p a list of ``candidates``."""
    if sampler.p is None and sampler.mp is None:
        return min(vocab, sampler.k + 1)
    return min(vocab, max((sampler.k or 0) + 1, candidates))


@dataclass(frozen=True)
class _Plan:
    """What one call computes and how. ``poly``: per estimator, its polynomial (None: second pass);
    ``sign``: per estimator, whether P_b(f < 0) is unknown without a second pass; ``b``: "q" (b = q),
    "full" (b has its own weights over every id) or "cut" (b truncates: candidates)."""
    names: tuple[str, ...]
    fns: tuple
    poly: tuple
    sign: tuple[bool, ...]
    basis: Basis
    sampler: Sampler
    b: str
    keep: int
    vocab: int
    negative: bool = True

    @staticmethod
    def of(estimators: Sequence, sampler: Sampler, vocab: int, candidates: int, negative: bool = True) -> "_Plan":
        ests = [_function_of_log_r(e) for e in estimators]
        polys = tuple(e.poly for e in ests)
        top = max([1] + [2 * degree(p) for p in polys if p is not None])
        b = "cut" if sampler.truncates else "q" if sampler.is_identity else "full"
        return _Plan(tuple(e.name for e in ests), tuple(e.fn for e in ests), polys,
                     tuple(not e.nonnegative for e in ests), Basis(top), sampler, b,
                     _candidates_kept(sampler, vocab, candidates) if b == "cut" else 0, vocab, negative)

    @property
    def needs_lse_s(self) -> bool:
        """b's full normaliser is needed: top-p without top-k normalises over every id."""
        return self.b != "cut" or (self.sampler.p is not None and self.sampler.k is None)

    @property
    def take(self) -> int:
        """Candidates each tile gives: all ``keep`` for top-k alone (the row's top k + 1 are among every
        tile's top k + 1), else at most 128 (a tile holding more of a large nucleus sends its row to
        the second pass, see :class:`_Candidates`)."""
        only_k = self.sampler.p is None and self.sampler.mp is None
        return self.keep if only_k else min(self.keep, 128)

    def second_pass_columns(self) -> list[int]:
        """Estimators whose values need the second pass over every row."""
        return [j for j, (p, s) in enumerate(zip(self.poly, self.sign))
                if p is None or (s and self.b != "cut" and self.negative)]


class _Scan:
    """One position chunk: hidden states in the compute dtype, its sampler inputs, the sampled ids."""

    def __init__(self, hq, hp, heads, sampler, tile, eos_banned, context_ids, ids):
        self.hq, self.hp, self.heads, self.sampler, self.tile = hq, hp, heads, sampler, tile
        self.eos_banned, self.context_ids, self.ids = eos_banned, context_ids, ids

    @property
    def n(self) -> int:
        return self.hq.shape[0]

    def rows(self, rows: torch.Tensor) -> "_Scan":
        """The same chunk restricted to ``rows`` (an index tensor)."""
        def pick(x):
            return None if x is None else x[rows]
        return _Scan(self.hq[rows], self.hp[rows], self.heads, self.sampler, self.tile, pick(self.eos_banned),
                     pick(self.context_ids), pick(self.ids))

    def tiles(self, policy_only: bool = False):
        """(lo, z_q, z_p) for each vocabulary tile, in the compute dtype (z_p None when ``policy_only``)."""
        vocab = self.heads[0].vocab
        for lo in range(0, vocab, self.tile):
            hi = min(lo + self.tile, vocab)
            zq = self.heads[0].logits(self.hq, lo, hi)
            yield lo, zq, None if policy_only else self.heads[1].logits(self.hp, lo, hi)

    def scores(self, zq: torch.Tensor, lo: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """b's score s of a tile of policy logits (:func:`~.sampler.sampler_scores`): z_q itself without a
        temperature, penalty or EOS ban, z_q/T into ``out`` with only a temperature, else a new tensor."""
        sp = self.sampler
        plain = sp.repetition_penalty == 1.0 and not (self.eos_banned is not None and sp.eos_token_id)
        if plain and sp.temperature == 1.0:
            return zq
        if plain and out is not None:
            return torch.div(zq, sp.temperature, out=out)
        return sampler_scores(zq, sp, lo=lo, eos_banned=self.eos_banned, context_ids=self.context_ids)

    def gather(self, lo: int, *tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The tiles' values at the sampled ids [n, len(tiles)] and where the id lies in this tile [n]."""
        if self.ids is None:
            return None
        j = self.ids - lo
        here = (j >= 0) & (j < tiles[0].shape[-1])
        jj = torch.where(here, j, 0).unsqueeze(-1)
        return torch.cat([t.gather(-1, jj) for t in tiles], dim=-1), here


# ----------------------------------------------------------------------------- the one pass
class _Candidates:
    """The largest scores of each row, with z_q and z_p at those ids: each tile gives its top ``take``,
    and one selection at the end keeps the top ``k`` of them (descending). A tile may hold more of the
    row's top ``k`` than it gave; ``dropped`` [n], the largest score a tile left out, says where that can
    matter: b's support (scores ≥ τ) is complete among the candidates whenever τ > dropped."""

    def __init__(self, k: int, take: int, like: torch.Tensor):
        self.k, self.take = k, take
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.dropped = torch.full((like.shape[0],), -torch.inf, dtype=like.dtype, device=like.device)

    def add(self, s: torch.Tensor, zq: torch.Tensor, zp: torch.Tensor) -> None:
        take = min(self.take, s.shape[-1])
        top, idx = torch.topk(s, take, dim=-1)
        self.parts.append((top, zq.gather(-1, idx), zp.gather(-1, idx)))
        if take < s.shape[-1]:
            # the largest score this tile left out is at most its last one kept (ties included)
            self.dropped = torch.maximum(self.dropped, top[:, -1])

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, zq, zp = (torch.cat(x, dim=-1) for x in zip(*self.parts))
        top, j = torch.topk(s, min(self.k, s.shape[-1]), dim=-1)
        return top, zq.gather(-1, j), zp.gather(-1, j)


class _Tiles:
    """Per-tile records of one chunk (lists of [n] or [n, K] tensors, stacked to [T, ...] at the end)."""

    def __init__(self):
        self.cols: dict[str, list[torch.Tensor]] = {}

    def put(self, **values: torch.Tensor) -> None:
        for key, v in values.items():
            self.cols.setdefault(key, []).append(v)

    def stacked(self, key: str) -> torch.Tensor:
        return torch.stack(self.cols[key])

    def __contains__(self, key: str) -> bool:
        return key in self.cols


class _Buffers:
    """Tile-sized work buffers of one call, made once on the device in the compute dtype (a fresh CPU
    tensor of a few MB costs more in page faults than the arithmetic on it): views [n, t] of flat
    storage, for the tile at hand."""
    NAMES = ("zq", "zp", "s", "w", "wb", "u", "psi")

    def __init__(self, extra: int, chunk: int, tile: int, like: torch.Tensor):
        self.flat = [torch.empty(chunk * tile, dtype=like.dtype, device=like.device)
                     for _ in range(len(self.NAMES) + extra)]

    def views(self, n: int, t: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        v = [b[:n * t].view(n, t) for b in self.flat]
        return dict(zip(self.NAMES, v)), v[len(self.NAMES):]


def _row_max(z: torch.Tensor) -> torch.Tensor:
    """Row maxima [n, 1]; 0 for a row of −inf (its weights are then all 0, not NaN)."""
    m = z.amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _exp_sum(z: torch.Tensor, m: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e^{z − m} written into ``out``, its row sums [n])."""
    w = torch.sub(z, m, out=out).exp_()
    return w, w.sum(dim=-1)


def _spread(w: torch.Tensor, total: torch.Tensor, x: torch.Tensor, tmp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean [n] and Σ w (x − mean)² [n] of a finite x [n, t] (``tmp`` overwritten)."""
    mean = torch.mul(w, x, out=tmp).sum(-1) / total.clamp(min=torch.finfo(w.dtype).tiny)
    return mean, torch.sub(x, mean.unsqueeze(-1), out=tmp).square_().mul_(w).sum(-1)


def _one_tile(scan: _Scan, plan: _Plan, rec: _Tiles, cand: _Candidates | None, lo: int, bufs: _Buffers) -> None:
    """Fold vocabulary tile [lo, lo + t) into the chunk's records: both models' logits made once, used,
    and overwritten by the next tile."""
    t = min(scan.tile, plan.vocab - lo)
    b, scratch = bufs.views(scan.n, t)
    zq = scan.heads[0].logits(scan.hq, lo, lo + t, out=b["zq"])
    zp = scan.heads[1].logits(scan.hp, lo, lo + t, out=b["zp"])
    s = zq if plan.b == "q" else scan.scores(zq, lo, out=b["s"])
    tok = scan.gather(lo, zq, zp, s)
    if tok is not None:
        rec.put(tok=tok[0], tok_here=tok[1])
    if cand is not None:
        cand.add(s, zq, zp)
    u = torch.sub(zp, zq, out=b["u"])                                  # d = z_p − z_q
    mq, mp = _row_max(zq), _row_max(zp)
    w, sq = _exp_sum(zq, mq, b["w"])
    _, sp = _exp_sum(zp, mp, b["zp"])                                   # z_p is not needed any more
    centre = torch.mul(w, u, out=scratch[0]).sum(-1) / sq               # the tile's own q-mean of d
    u.sub_(centre.unsqueeze(-1))
    ps = torch.expm1(u, out=b["psi"]).sub_(u)                           # ψ(u), exact at small |u|
    rec.put(q_scale=mq.squeeze(-1), q_sum=sq, centre=centre, p_scale=mp.squeeze(-1), p_sum=sp)
    weights = [w]
    if plan.b != "q" and (plan.b == "full" or plan.needs_lse_s):
        ms = _row_max(s)
        wb, sb = _exp_sum(s, ms, b["wb"])
        weights += [wb] if plan.b == "full" else []
        rec.put(s_scale=ms.squeeze(-1), s_sum=sb)
    elif plan.b == "q":
        ms, wb, sb = mq, w, sq
        rec.put(s_scale=ms.squeeze(-1), s_sum=sb)
    sums = tile_sums(plan.basis, weights, u, ps, scratch)
    rec.put(q_sums=sums[0], **({"b_sums": sums[1]} if plan.b == "full" else {}))
    if plan.b != "cut":
        banned = scan.eos_banned is not None and bool(plan.sampler.eos_token_id)
        s_fin = torch.where(wb > 0, s, torch.zeros_like(s)) if banned else s
        s_mean, s_m2 = _spread(wb, sb, s_fin, scratch[0])
        rec.put(s_mean=s_mean, s_m2=s_m2)
        if banned:
            rec.put(miss=torch.where(torch.isneginf(s), w, torch.zeros_like(w)).sum(-1))


def _tokens(rec: _Tiles, n: int, like: torch.Tensor) -> torch.Tensor:
    """(z_q, z_p, s) at the sampled ids [n, 3], float64 (NaN without ids)."""
    out = torch.full((n, 3), torch.nan, dtype=torch.float64, device=like.device)
    if "tok" not in rec:
        return out
    for vals, here in zip(rec.cols["tok"], rec.cols["tok_here"]):
        out = torch.where(here.unsqueeze(-1), vals.to(torch.float64), out)
    return out


# ----------------------------------------------------------------------------- finishing one chunk
@dataclass
class _Chunk:
    """A chunk's finished values (float64 tensors on the device) before assembly into PositionValues.
    ``tau`` [n]: b's threshold (−inf: none); ``unknown`` [n]: rows whose b support the candidates may
    not cover (finished by the second pass)."""
    kl: torch.Tensor
    lse_q: torch.Tensor
    lse_p: torch.Tensor
    lse_s: torch.Tensor
    mean_q: torch.Tensor
    var_q: torch.Tensor
    mean_b: torch.Tensor
    var_b: torch.Tensor
    neg_b: torch.Tensor
    miss: torch.Tensor
    logb_mean: torch.Tensor
    logb_var: torch.Tensor
    tok: torch.Tensor
    tok_logb: torch.Tensor
    tau: torch.Tensor
    unknown: torch.Tensor


def _poly_columns(plan: _Plan, moments: torch.Tensor, delta: torch.Tensor):
    """E[f], Var[f] [n, F] of the polynomial estimators from normalised moments (NaN for the others)."""
    mean = torch.full((delta.shape[0], len(plan.names)), torch.nan, dtype=torch.float64, device=delta.device)
    var = mean.clone()
    for j, poly in enumerate(plan.poly):
        if poly is not None:
            mean[:, j], var[:, j] = plan.basis.mean_and_var(plan.basis.estimator(poly, delta), moments)
    return mean, var


def _logsum(scale: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """log Σ_t e^{scale_t} total_t over tiles [T, n] → [n], float64."""
    return torch.logsumexp(scale.to(torch.float64) + torch.log(total.to(torch.float64)), dim=0)


def _chan(scale, total, mean, m2) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles' (log-scale, Σ w, mean, Σ w (x − mean)²) [T, n] combined: (mean, variance) [n] (Chan, Golub
    and LeVeque's pairwise update, all tiles at once)."""
    log_w = scale.to(torch.float64) + torch.log(total.to(torch.float64))
    lse = torch.logsumexp(log_w, dim=0)
    share = torch.nan_to_num(torch.exp(log_w - lse))
    mean64 = mean.to(torch.float64)
    mu = (share * mean64).sum(0)
    within = torch.nan_to_num(torch.exp(scale.to(torch.float64) - lse) * m2.to(torch.float64))
    return mu, (within + share * (mean64 - mu).square()).sum(0)


def _finish(scan: _Scan, plan: _Plan, rec: _Tiles, cand: _Candidates | None) -> _Chunk:
    centres = rec.stacked("centre").to(torch.float64)
    q_scale, q_sums = rec.stacked("q_scale"), rec.stacked("q_sums").to(torch.float64)
    # Σ e^{z − m} of each tile from torch's pairwise sum (the matmul's sums are coarser): the normalisers
    # of q and p are then summed alike, and their rounding cancels in lse_q − lse_p as far as it can.
    q_sums[..., 0] = rec.stacked("q_sum").to(torch.float64)
    lse_q, lse_p = _logsum(q_scale, q_sums[..., 0]), _logsum(rec.stacked("p_scale"), rec.stacked("p_sum"))
    share = torch.exp(q_scale.to(torch.float64) + torch.log(q_sums[..., 0]) - lse_q)
    centre = (share * (centres + q_sums[..., 1] / q_sums[..., 0])).sum(0)           # the exact q-mean of d
    _, mq = finish_family(plan.basis, q_scale, q_sums, centres, centre)
    delta = centre + lse_q - lse_p                                                   # log r = u + δ
    mean_q, var_q = _poly_columns(plan, mq, delta)
    tok = _tokens(rec, scan.n, lse_q)
    zero = torch.zeros_like(lse_q)
    lse_s = _logsum(rec.stacked("s_scale"), rec.stacked("s_sum")) if "s_scale" in rec else torch.zeros_like(lse_q)
    out = _Chunk(-(delta + mq[:, 1]), lse_q, lse_p, lse_s,
                 mean_q, var_q, mean_q.clone(), var_q.clone(), torch.full_like(mean_q, torch.nan), zero, zero, zero,
                 tok, tok[:, 0] - lse_q, torch.full_like(zero, -torch.inf), torch.zeros_like(zero, dtype=torch.bool))
    if plan.b == "cut":
        _finish_cut(plan, cand, out)
        return out
    if plan.b == "full":
        _, mb = finish_family(plan.basis, rec.stacked("s_scale"), rec.stacked("b_sums"), centres, centre)
        out.mean_b, out.var_b = _poly_columns(plan, mb, delta)
    s_mean, out.logb_var = _chan(rec.stacked("s_scale"), rec.stacked("s_sum"), rec.stacked("s_mean"),
                                 rec.stacked("s_m2"))
    out.logb_mean, out.tok_logb = s_mean - out.lse_s, tok[:, 2] - out.lse_s
    for j, sign in enumerate(plan.sign):
        if not sign:
            out.neg_b[:, j] = 0.0                                                    # f ≥ 0 for every draw
    if "miss" in rec:
        out.miss = torch.exp(_logsum(q_scale, rec.stacked("miss")) - lse_q)
    return out


def _top_p_threshold(cand: torch.Tensor, norm: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """τ of top-p from the sorted (descending) candidate scores [n, K] and the log-normaliser [n] of the
    distribution top-p acts on; and the rows [n] where the candidates' mass is below p (τ unknown)."""
    probs = torch.exp(cand - norm.unsqueeze(-1))
    cum = torch.cumsum(probs, dim=-1)
    keep = (cum - probs) < p                               # the mass of the more likely tokens is below p
    count = keep.sum(dim=-1).clamp(min=1)
    tau = cand.gather(-1, (count - 1).unsqueeze(-1)).squeeze(-1)
    return tau, cum[:, -1] < p


def _threshold(sp: Sampler, cand: torch.Tensor, lse_s: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """τ [n] of a truncating b from sorted candidate scores [n, K], and the rows [n] where b's support may
    reach beyond the candidates: a nucleus larger than them, or the last candidate still ≥ τ (a tie at
    the k-th score, or a min-p/top-p set as large as the list) while ids remain outside it."""
    tau = torch.full(cand.shape[:1], -torch.inf, dtype=cand.dtype, device=cand.device)
    unknown = torch.zeros(cand.shape[:1], dtype=torch.bool, device=cand.device)
    if sp.k is not None and sp.k < vocab:
        tau = torch.maximum(tau, cand[:, sp.k - 1])
    if sp.p is not None:
        top = cand[:, :sp.k] if sp.k is not None else cand
        norm = torch.logsumexp(top, dim=-1) if sp.k is not None else lse_s
        tau_p, short = _top_p_threshold(top, norm, sp.p)
        tau = torch.maximum(tau, tau_p)
        if sp.k is None:
            unknown |= short
    if sp.mp is not None:
        tau = torch.maximum(tau, cand[:, 0] + math.log(sp.mp))
    if cand.shape[-1] < vocab:
        unknown |= cand[:, -1] >= tau
    return tau, unknown


def _under_b(plan: _Plan, logb: torch.Tensor, keep: torch.Tensor, logr: torch.Tensor, out: _Chunk) -> None:
    """Moments under b = exp(logb) [n, K] over the ``keep`` entries, of every estimator of ``logr``."""
    b = torch.exp(logb)
    f = torch.stack([fn(logr) for fn in plan.fns], dim=-1) if plan.fns else logr.new_zeros(logr.shape + (0,))
    f = torch.where(keep.unsqueeze(-1), f, torch.zeros_like(f))                     # 0·inf would be NaN
    out.mean_b = (b.unsqueeze(-1) * f).sum(1)
    out.var_b = (b.unsqueeze(-1) * (f - out.mean_b.unsqueeze(1)).square()).sum(1)
    out.neg_b = (b.unsqueeze(-1) * (f < 0).to(f.dtype)).sum(1)
    lb = torch.where(keep, logb, torch.zeros_like(logb))
    out.logb_mean = (b * lb).sum(-1)
    out.logb_var = (b * (lb - out.logb_mean.unsqueeze(-1)).square()).sum(-1)


def _finish_cut(plan: _Plan, cand: _Candidates, out: _Chunk) -> None:
    """Everything under a truncating b from the candidates (b's support is among them; rows where it may
    not be are marked ``unknown`` and redone by the second pass)."""
    s, zq, zp = (x.to(torch.float64) for x in cand.finish())
    out.tau, out.unknown = _threshold(plan.sampler, s, out.lse_s, plan.vocab)
    out.unknown |= cand.dropped.to(torch.float64) >= out.tau
    keep = (s >= out.tau.unsqueeze(-1)) & torch.isfinite(s)
    ls = torch.where(keep, s, torch.full_like(s, -torch.inf))
    lse_b = torch.logsumexp(ls, dim=-1)
    logr = (zp - out.lse_p.unsqueeze(-1)) - (zq - out.lse_q.unsqueeze(-1))
    _under_b(plan, ls - lse_b.unsqueeze(-1), keep, logr, out)
    kept_q = torch.where(keep, torch.exp(zq - out.lse_q.unsqueeze(-1)), torch.zeros_like(zq)).sum(-1)
    out.miss = (1.0 - kept_q).clamp(min=0.0)
    s_tok = out.tok[:, 2]
    tok_logb = torch.where(s_tok >= out.tau, s_tok - lse_b, torch.full_like(s_tok, -torch.inf))
    out.tok_logb = torch.where(torch.isnan(s_tok), s_tok, tok_logb)


# ----------------------------------------------------------------------------- the second pass
def _widen(scan: _Scan, plan: _Plan, lse_s: torch.Tensor) -> torch.Tensor:
    """τ [n] of b for rows whose support reaches past the candidates (a flat row's nucleus): each row's
    whole score vector, made tile by tile in one policy-only pass (O(V) per such row; the very same
    rounded scores as the first pass), and τ from all of it."""
    cand = torch.cat([scan.scores(zq, lo) for lo, zq, _ in scan.tiles(policy_only=True)], dim=-1)
    cand = torch.sort(cand.to(torch.float64), dim=-1, descending=True).values
    return _threshold(plan.sampler, cand, lse_s, plan.vocab)[0]


class _Spread:
    """Per-tile (log-scale, Σ w, weighted mean, Σ w (x − mean)²) of columns x [n, t, C], combined over
    tiles by :func:`_chan` (float64) at the end."""

    def __init__(self):
        self.parts: list[tuple[torch.Tensor, ...]] = []

    def add(self, scale: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> None:
        """``scale`` [n], weights ``w`` [n, t] (0 where excluded), columns ``x`` [n, t, C]."""
        total = w.sum(-1)
        x = torch.where((w > 0).unsqueeze(-1), x, torch.zeros_like(x))      # 0·inf would be NaN
        mean = (w.unsqueeze(-1) * x).sum(1) / total.clamp(min=torch.finfo(w.dtype).tiny).unsqueeze(-1)
        m2 = (w.unsqueeze(-1) * (x - mean.unsqueeze(1)).square()).sum(1)
        self.parts.append((scale.unsqueeze(-1).expand_as(mean), total.unsqueeze(-1).expand_as(mean), mean, m2))

    def combine(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log Σ w [n, C], mean [n, C], variance [n, C])."""
        scale, total, mean, m2 = (torch.stack(x) for x in zip(*self.parts))
        mu, var = _chan(scale, total, mean, m2)
        return _logsum(scale, total), mu, var


def _second_pass(scan: _Scan, fns, lse_q, lse_p, tau):
    """With the normalisers and b's threshold τ known, one more pass over the tiles: moments under q of
    ``fns`` and under b of (f, 1[f < 0], s), and the q-mass outside b's support. Returns
    (q: (mean, var) [n, F]; b: (log Z_b [n], mean [n, 2F + 1], var [n, 2F + 1]); miss [n])."""
    under_q, under_b, miss = _Spread(), _Spread(), []
    shift = (lse_q - lse_p).unsqueeze(-1)
    for lo, zq, zp in scan.tiles():
        s = scan.scores(zq, lo)
        logr = (zp - zq).to(torch.float64) + shift           # float64: f's arguments as the dense path
        f = torch.stack([fn(logr) for fn in fns], dim=-1) if fns else logr.new_zeros(logr.shape + (0,))
        wq = torch.exp(zq.to(torch.float64) - lse_q.unsqueeze(-1))
        under_q.add(torch.zeros_like(lse_q), wq, f)
        inside = s >= tau.unsqueeze(-1).to(s.dtype)
        ms = _row_max(torch.where(inside, s, torch.full_like(s, -torch.inf))).to(torch.float64)
        wb = torch.where(inside, torch.exp(s.to(torch.float64) - ms), torch.zeros_like(wq))
        under_b.add(ms.squeeze(-1), wb, torch.cat([f, (f < 0).to(f.dtype), s.to(torch.float64).unsqueeze(-1)], -1))
        miss.append(torch.where(inside, torch.zeros_like(wq), wq).sum(-1))
    _, mean_q, var_q = under_q.combine()
    log_zb, mean_b, var_b = under_b.combine()
    return (mean_q, var_q), (log_zb[:, 0], mean_b, var_b), torch.stack(miss).sum(0)


def _negative_pass(scan: _Scan, plan: _Plan, out: _Chunk, cols: list[int]) -> None:
    """P_b(f < 0) [n] of polynomial estimators that change sign, under a b with full support: the sign of
    f(log r) needs log r = d + (lse_q − lse_p), so one more pass, in the compute dtype (f's sign at a
    token is decided by log r to the logits' own rounding)."""
    shift = (out.lse_q - out.lse_p).unsqueeze(-1)
    lse_b = (out.lse_q if plan.b == "q" else out.lse_s).unsqueeze(-1)
    sums = torch.zeros(out.kl.shape[0], len(cols), dtype=torch.float64, device=out.kl.device)
    for lo, zq, zp in scan.tiles():
        s = zq if plan.b == "q" else scan.scores(zq, lo)
        wb = torch.exp(s - lse_b.to(s.dtype))
        logr = (zp - zq).add_(shift.to(zq.dtype))
        for i, j in enumerate(cols):
            sums[:, i] += torch.where(plan.fns[j](logr) < 0, wb, torch.zeros_like(wb)).sum(-1).to(torch.float64)
    for i, j in enumerate(cols):
        out.neg_b[:, j] = sums[:, i]


def _redo_columns(scan: _Scan, plan: _Plan, out: _Chunk, cols: list[int]) -> None:
    """The second pass for estimators one pass cannot give (every row): the moments of non-polynomial
    ones, and P_b(f < 0) of polynomial ones that change sign."""
    signs = [j for j in cols if plan.poly[j] is not None]
    if signs:
        _negative_pass(scan, plan, out, signs)
    cols = [j for j in cols if plan.poly[j] is None]
    if not cols:
        return
    fns = [plan.fns[j] for j in cols]
    tau = out.tau if plan.b == "cut" else torch.full_like(out.kl, -torch.inf)
    (mean_q, var_q), (_, mean_b, var_b), _ = _second_pass(scan, fns, out.lse_q, out.lse_p, tau)
    nf = len(cols)
    for i, j in enumerate(cols):
        out.mean_q[:, j], out.var_q[:, j] = mean_q[:, i], var_q[:, i]
        if plan.b != "cut":
            out.mean_b[:, j], out.var_b[:, j], out.neg_b[:, j] = mean_b[:, i], var_b[:, i], mean_b[:, nf + i]


def _redo_rows(scan: _Scan, plan: _Plan, out: _Chunk, rows: torch.Tensor) -> None:
    """The second pass for rows whose sampler support the candidates may not cover: τ from the whole
    score vector, then everything under b summed over the tiles."""
    sub = scan.rows(rows)
    tau = _widen(sub, plan, out.lse_s[rows])
    _, (log_zb, mean_b, var_b), miss = _second_pass(sub, list(plan.fns), out.lse_q[rows], out.lse_p[rows], tau)
    nf = len(plan.fns)
    out.tau[rows] = tau
    out.mean_b[rows], out.var_b[rows], out.neg_b[rows] = mean_b[:, :nf], var_b[:, :nf], mean_b[:, nf:2 * nf]
    out.logb_mean[rows], out.logb_var[rows] = mean_b[:, -1] - log_zb, var_b[:, -1]
    out.miss[rows] = miss
    s_tok = out.tok[rows, 2]
    tok_logb = torch.where(s_tok >= tau, s_tok - log_zb, torch.full_like(s_tok, -torch.inf))
    out.tok_logb[rows] = torch.where(torch.isnan(s_tok), s_tok, tok_logb)


def _spoiled(plan: _Plan, out: _Chunk) -> torch.Tensor:
    """Rows [n] where a one-pass moment is not finite: a float32 tile sum overflowed (u⁴, ψ⁴ at |u| ≳ 20),
    or log r is infinite somewhere (p or q is 0 at an id), which the moments cannot carry."""
    cols = [j for j, p in enumerate(plan.poly) if p is not None]
    parts = [~torch.isfinite(out.kl)]
    for x in (out.mean_q, out.var_q) + ((out.mean_b, out.var_b) if plan.b == "full" else ()):
        parts.append(~torch.isfinite(x[:, cols]).all(-1) if cols else torch.zeros_like(parts[0]))
    return torch.stack(parts).any(0)


def _redo_spoiled(scan: _Scan, plan: _Plan, out: _Chunk, rows: torch.Tensor) -> None:
    """Spoiled rows from the second pass, which sums f(log r) itself in float64 (an infinite f where its
    weight is 0 counts 0; where it is not, the value is rightly infinite)."""
    sub = scan.rows(rows)
    fns = list(plan.fns) + [lambda logr: -logr]                      # KL = E_q[−log r]
    tau = out.tau[rows] if plan.b == "cut" else torch.full_like(out.kl[rows], -torch.inf)
    (mean_q, var_q), (_, mean_b, var_b), _ = _second_pass(sub, fns, out.lse_q[rows], out.lse_p[rows], tau)
    nf = len(plan.fns)
    out.kl[rows] = mean_q[:, -1]
    out.mean_q[rows], out.var_q[rows] = mean_q[:, :nf], var_q[:, :nf]
    if plan.b != "cut":
        out.mean_b[rows], out.var_b[rows] = mean_b[:, :nf], var_b[:, :nf]
        out.neg_b[rows] = torch.where(torch.isnan(out.neg_b[rows]), out.neg_b[rows], mean_b[:, nf + 1:2 * nf + 1])


def _any(mask: torch.Tensor) -> bool:
    """Whether any entry is true: the one host synchronisation of a chunk (on a meta tensor, where no
    value exists, False: the shapes are all a meta run checks)."""
    return False if mask.device.type == "meta" else bool(mask.any())


def _chunk_values(scan: _Scan, plan: _Plan, bufs: _Buffers) -> PositionValues:
    rec = _Tiles()
    cand = _Candidates(plan.keep, plan.take, scan.hq) if plan.b == "cut" else None
    for lo in range(0, plan.vocab, scan.tile):
        _one_tile(scan, plan, rec, cand, lo, bufs)
    out = _finish(scan, plan, rec, cand)
    cols = plan.second_pass_columns()
    if cols:
        _redo_columns(scan, plan, out, cols)
    if plan.b == "cut" and _any(out.unknown):
        _redo_rows(scan, plan, out, torch.nonzero(out.unknown).flatten())
    spoiled = _spoiled(plan, out)
    if _any(spoiled):
        _redo_spoiled(scan, plan, out, torch.nonzero(spoiled).flatten())
    tok = out.tok
    return PositionValues(plan.names, out.kl, out.mean_q, out.var_q, out.mean_b, out.var_b, out.neg_b, out.miss,
                          out.logb_mean, out.logb_var, tok[:, 0] - out.lse_q, tok[:, 1] - out.lse_p, out.tok_logb)


# ----------------------------------------------------------------------------- the public functions
def _empty(names: tuple[str, ...], like: torch.Tensor) -> PositionValues:
    empty = torch.zeros(0, dtype=torch.float64, device=like.device)
    return PositionValues(names, empty, *(empty.view(0, 1).expand(0, len(names)),) * 5, empty, empty, empty,
                          empty, empty, empty)


@torch.no_grad()
def stream_values(policy_hidden: torch.Tensor, reference_hidden: torch.Tensor, policy_head: Head, reference_head: Head,
                  estimators: Sequence = ("k1", "k3"), sampler: Sampler | None = None, *,
                  ids: torch.Tensor | None = None, eos_banned: torch.Tensor | None = None,
                  context_ids: torch.Tensor | None = None, chunk: int = 256, tile: int = 4096,
                  candidates: int = 1024, dtype: torch.dtype = torch.float32, tf32: bool = False,
                  negative: bool = True) -> PositionValues:
    """:func:`kl_bench.audit.exact.position_values` from hidden states [N, d] (each model's own, any float
    dtype, on the heads' device) and output layers, streamed: the same values, in O(N + chunk × tile)
    memory, as [N] / [N, F] float64 tensors on that device.

    ``dtype``: the tile matmuls' and tile sums' dtype (float32: the model's own rounding, ~1e-7 relative
    of each logit; float64: exact to rounding); the merges are float64 either way. ``candidates``: the
    scores kept per position for a top-p or min-p sampler (a larger support is found by widening).
    ``negative``: P_b(f < 0) of estimators that change sign (k1, fwd_k1) under a sampler that does not
    truncate needs a second pass (two more forwards); False leaves those entries NaN (not computed)."""
    _check_inputs(policy_hidden, reference_hidden, policy_head, reference_head, dtype)
    sampler = sampler or Sampler()
    plan = _Plan.of(estimators, sampler, policy_head.vocab, candidates, negative)
    parts = []
    n_all = policy_hidden.shape[0]
    bufs = _Buffers(scratch_needed(plan.basis), min(chunk, n_all), min(tile, plan.vocab),
                    policy_hidden.new_empty(0, dtype=dtype))
    with matmul_precision(tf32):
        for i in range(0, n_all, chunk):
            j = i + chunk
            scan = _Scan(policy_hidden[i:j].to(dtype), reference_hidden[i:j].to(dtype), (policy_head, reference_head),
                         sampler, tile, None if eos_banned is None else eos_banned[i:j],
                         None if context_ids is None else context_ids[i:j],
                         None if ids is None else ids[i:j].to(torch.long))
            parts.append(_chunk_values(scan, plan, bufs))
    return PositionValues.cat(parts) if parts else _empty(plan.names, policy_hidden)


def _kl_tile(zq: torch.Tensor, zp: torch.Tensor, diff: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One tile's (m_q, S_q, A, m_p, S_p) [n] for KL = A/S_q − lse_q + lse_p, in place on the three
    [n, t] buffers (overwritten): S = Σ e^{z − m}, A = Σ e^{z_q − m_q}(z_q − z_p); six elementwise passes
    and four row reductions, no allocation of tile size."""
    torch.sub(zq, zp, out=diff)                            # z_q − z_p, before z_q is overwritten
    mq, mp = zq.amax(dim=-1, keepdim=True), zp.amax(dim=-1, keepdim=True)
    eq, ep = zq.sub_(mq).exp_(), zp.sub_(mp).exp_()      # e^{z − m_t} ∈ (0, 1]
    return mq.squeeze(-1), eq.sum(dim=-1), diff.mul_(eq).sum(dim=-1), mp.squeeze(-1), ep.sum(dim=-1)


@torch.no_grad()
def stream_kl(policy_hidden: torch.Tensor, reference_hidden: torch.Tensor, policy_head: Head, reference_head: Head,
              *, chunk: int = 256, tile: int = 4096, dtype: torch.dtype = torch.float32,
              tf32: bool = False) -> torch.Tensor:
    """KL(q‖p) [N] only (float64, on the hidden states' device), in one pass: E_q[z_q − z_p] − lse_q + lse_p.

    The matmuls write into three buffers of chunk × tile elements made once (no allocation, hence no
    page faults, per tile) and each tile is reduced in place in ``dtype``; the tiles' sums are merged in
    float64. With float32 each tile sum of t terms in (0, 1] carries ≲ log2(t)·2⁻²⁴ relative error
    (pairwise summation), below the float32 logits' own rounding."""
    _check_inputs(policy_hidden, reference_hidden, policy_head, reference_head, dtype)
    n_all, vocab = policy_hidden.shape[0], policy_head.vocab
    device = policy_hidden.device
    size = min(chunk, n_all) * min(tile, vocab)
    flat = [torch.empty(size, dtype=dtype, device=device) for _ in range(3)]
    out = []
    with matmul_precision(tf32):
        for i in range(0, n_all, chunk):
            hq, hp = policy_hidden[i:i + chunk].to(dtype), reference_hidden[i:i + chunk].to(dtype)
            n = hq.shape[0]
            parts = []
            for lo in range(0, vocab, tile):
                hi = min(lo + tile, vocab)
                zq, zp, diff = (b[:n * (hi - lo)].view(n, hi - lo) for b in flat)
                parts.append(_kl_tile(policy_head.logits(hq, lo, hi, out=zq), reference_head.logits(hp, lo, hi, out=zp),
                                      diff))
            mq, sq, a, mp, sp = (torch.stack(x).to(torch.float64) for x in zip(*parts))
            lse_q, lse_p = torch.logsumexp(mq + torch.log(sq), 0), torch.logsumexp(mp + torch.log(sp), 0)
            out.append((torch.exp(mq - lse_q) * a).sum(0) - lse_q + lse_p)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64, device=device)
