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

from ..foundation.errors import SpecError
from ..core.estimators import resolve_estimator
from .exact import PositionValues, SamplerValues
from .polymoments import Basis, degree, finish_family, scratch_needed, tile_sums
from .generation import Sampler, sampler_scores

COMPUTE_DTYPES = (torch.float32, torch.float64)
# Positions per chunk and vocabulary ids per tile, by the hidden states' device type, when the caller names
# none. The work is the same whatever the pieces (chunk × tile elements a buffer, ~12 buffers); the number
# of operations is not: each tile costs ~60 of them, and on a GPU each is about one kernel launch. The
# CPU's 256 × 4,096 keep the buffers in cache (4 MiB each; ~100 MiB in all at V = 151,936). On an H100 they
# left stream_values launch-bound (8,827 launches per 1,024 positions, issue 32); 1,024 × 8,192 make 1,252
# operations there instead of 8,760 (counted on the CPU, benchmarks/launches.py) for ~380 MiB of
# buffers, chosen by that count and that memory inside a trainer's process: not yet timed on a GPU
# (benchmarks/bench_gpu.py --audit-pieces times both).
PIECES = {"cpu": (256, 4096), "cuda": (1024, 8192)}


def pieces(device: torch.device, chunk: int | None = None, tile: int | None = None) -> tuple[int, int]:
    """(chunk, tile): the caller's where given (each ≥ 1), else :data:`PIECES` of ``device``'s type."""
    c, t = PIECES.get(torch.device(device).type, PIECES["cpu"])
    for key, value in (("chunk", chunk), ("tile", tile)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SpecError(f"must be an integer ≥ 1, got {value!r}", key=key)
    return c if chunk is None else chunk, t if tile is None else tile


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


@dataclass(frozen=True)
class _Family:
    """One sampling distribution the audit sums under: ``name`` "b" (the sampler on the scored policy's
    logits) or "g" (on the logits of the pass that drew the tokens); ``kind`` "same" (b = q), "full" (its
    own weights over every id) or "cut" (it truncates: candidates); ``keep``: candidates per row."""
    name: str
    kind: str
    keep: int

    @staticmethod
    def of(name: str, sampler: Sampler, vocab: int, candidates: int) -> "_Family":
        if sampler.truncates:
            # top-k alone needs its k scores and one more (a tie at the k-th shows there); top-p and min-p a list
            only_k = sampler.p is None and sampler.mp is None
            keep = min(vocab, sampler.k + 1 if only_k else max((sampler.k or 0) + 1, candidates))
            return _Family(name, "cut", keep)
        return _Family(name, "same" if sampler.is_identity and name == "b" else "full", 0)

    @property
    def source(self) -> str:
        """Whose logits its scores come from: "zq" (the scored pass) or "zg" (the sampling pass)."""
        return "zg" if self.name == "g" else "zq"


@dataclass(frozen=True)
class _Plan:
    """What one call computes and how. ``poly``: per estimator, its polynomial (None: second pass);
    ``sign``: per estimator, whether it changes sign (P(f < 0) then needs log r itself)."""
    names: tuple[str, ...]
    fns: tuple
    poly: tuple
    sign: tuple[bool, ...]
    basis: Basis
    sampler: Sampler
    families: tuple[_Family, ...]
    vocab: int
    negative: bool = True

    @staticmethod
    def of(estimators: Sequence, sampler: Sampler, vocab: int, candidates: int, negative: bool,
           sampling: bool) -> "_Plan":
        ests = [_function_of_log_r(e) for e in estimators]
        polys = tuple(e.poly for e in ests)
        top = max([1] + [2 * degree(p) for p in polys if p is not None])
        fams = tuple(_Family.of(name, sampler, vocab, candidates) for name in ("b", "g")[:1 + sampling])
        return _Plan(tuple(e.name for e in ests), tuple(e.fn for e in ests), polys,
                     tuple(not e.nonnegative for e in ests), Basis(top), sampler, fams, vocab, negative)

    def take(self, fam: _Family) -> int:
        """Candidates each tile gives: all ``keep`` for top-k alone (the row's top k + 1 are among every
        tile's top k + 1), else at most 128 (a tile holding more of a large nucleus sends its row to
        the second pass, see :class:`_Candidates`)."""
        only_k = self.sampler.p is None and self.sampler.mp is None
        return fam.keep if only_k else min(fam.keep, 128)

    def needs_lse(self, fam: _Family) -> bool:
        """The family's full normaliser is needed: it has full support, or top-p without top-k
        normalises over every id."""
        return fam.kind != "cut" or (self.sampler.p is not None and self.sampler.k is None)

    def second_pass_columns(self, fam: _Family) -> list[int]:
        """Estimators whose values under ``fam`` need a second pass: non-polynomial ones (always: also
        their q moments), sign-changing ones for P(f < 0) under a family that does not truncate."""
        return [j for j, (p, s) in enumerate(zip(self.poly, self.sign))
                if p is None or (s and fam.kind != "cut" and self.negative)]


class _Scan:
    """One position chunk: hidden states in the compute dtype (``hg``: the sampling pass's, or None),
    its sampler inputs, the sampled ids."""

    def __init__(self, hq, hp, hg, heads, sampler, tile, eos_banned, context_ids, ids):
        self.hq, self.hp, self.hg, self.heads, self.sampler, self.tile = hq, hp, hg, heads, sampler, tile
        self.eos_banned, self.context_ids, self.ids = eos_banned, context_ids, ids

    @property
    def n(self) -> int:
        return self.hq.shape[0]

    @property
    def banned(self) -> bool:
        """The EOS ban is on somewhere (scores of −inf at EOS ids)."""
        return self.eos_banned is not None and bool(self.sampler.eos_token_id)

    def rows(self, rows: torch.Tensor) -> "_Scan":
        """The same chunk restricted to ``rows`` (an index tensor)."""
        def pick(x):
            return None if x is None else x[rows]
        return _Scan(self.hq[rows], self.hp[rows], pick(self.hg), self.heads, self.sampler, self.tile,
                     pick(self.eos_banned), pick(self.context_ids), pick(self.ids))

    def tiles(self, policy_only: bool = False):
        """{"lo", "zq", "zp", "zg"} for each vocabulary tile, in the compute dtype (new tensors; z_p absent
        when ``policy_only``, z_g without sampling-pass hidden states)."""
        vocab = self.heads[0].vocab
        for lo in range(0, vocab, self.tile):
            hi = min(lo + self.tile, vocab)
            out = {"lo": lo, "zq": self.heads[0].logits(self.hq, lo, hi)}
            if not policy_only:
                out["zp"] = self.heads[1].logits(self.hp, lo, hi)
            if self.hg is not None:
                out["zg"] = self.heads[0].logits(self.hg, lo, hi)
            yield out

    def scores(self, z: torch.Tensor, lo: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """b's score s of a tile of policy logits (:func:`~.generation.sampler_scores`): z itself without a
        temperature, penalty or EOS ban, z/T into ``out`` with only a temperature, else a new tensor."""
        sp = self.sampler
        plain = sp.repetition_penalty == 1.0 and not self.banned
        if plain and sp.temperature == 1.0:
            return z
        if plain and out is not None:
            return torch.div(z, sp.temperature, out=out)
        return sampler_scores(z, sp, lo=lo, eos_banned=self.eos_banned, context_ids=self.context_ids)

    def gather(self, lo: int, tiles: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
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
    matter: the support (scores ≥ τ) is complete among the candidates whenever τ > dropped."""

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
    NAMES = ("zq", "zp", "zg", "s_b", "s_g", "w", "w_b", "w_g", "u", "psi")

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


def _family_tile(scan: _Scan, fam: _Family, s: torch.Tensor, q: tuple, buf: torch.Tensor, tmp: torch.Tensor,
                 rec: _Tiles, plan: _Plan) -> torch.Tensor | None:
    """A family's per-tile records from its scores s [n, t]: its normaliser, the mean and spread of s
    under it, the q-mass where s = −inf; returns its weights when it needs moments ("full")."""
    f = fam.name
    mq, w, sq, _ = q
    if fam.kind == "same":
        ms, wf, sf = mq, w, sq
    elif plan.needs_lse(fam):
        ms = _row_max(s)
        wf, sf = _exp_sum(s, ms, buf)
    else:
        return None
    rec.put(**{f"{f}_scale": ms.squeeze(-1), f"{f}_sum": sf})
    if fam.kind == "cut":
        return None
    s_fin = torch.where(wf > 0, s, torch.zeros_like(s)) if scan.banned else s
    mean, m2 = _spread(wf, sf, s_fin, tmp)
    rec.put(**{f"{f}_mean": mean, f"{f}_m2": m2})
    if fam.kind == "full":
        zq = q[3]
        rec.put(**{f"{f}_zq": torch.mul(wf, zq, out=tmp).sum(-1) / sf})           # E_b[z_q] of the tile
        # Σ_{b>0} q²/b needs Σ e^{2 z_q − s} over b's support (s = −inf: not in it)
        two = torch.sub(zq, s, out=tmp).add_(zq)
        if scan.banned:
            two = torch.where(torch.isneginf(s), torch.full_like(two, -torch.inf), two)
        m2q = _row_max(two)
        rec.put(**{f"{f}_chi_scale": m2q.squeeze(-1), f"{f}_chi_sum": two.sub_(m2q).exp_().sum(-1)})
    if scan.banned:
        rec.put(**{f"{f}_miss": torch.where(torch.isneginf(s), w, torch.zeros_like(w)).sum(-1)})
    return wf if fam.kind == "full" else None


def _one_tile(scan: _Scan, plan: _Plan, rec: _Tiles, cands: dict, lo: int, bufs: _Buffers) -> None:
    """Fold vocabulary tile [lo, lo + t) into the chunk's records: the models' logits made once, used,
    and overwritten by the next tile."""
    t = min(scan.tile, plan.vocab - lo)
    b, scratch = bufs.views(scan.n, t)
    z = {"zq": scan.heads[0].logits(scan.hq, lo, lo + t, out=b["zq"]),
         "zp": scan.heads[1].logits(scan.hp, lo, lo + t, out=b["zp"])}
    if scan.hg is not None:
        z["zg"] = scan.heads[0].logits(scan.hg, lo, lo + t, out=b["zg"])
    s = {fam.name: z["zq"] if fam.kind == "same" else scan.scores(z[fam.source], lo, out=b[f"s_{fam.name}"])
         for fam in plan.families}
    tok = scan.gather(lo, [z["zq"], z["zp"]] + [s[fam.name] for fam in plan.families])
    if tok is not None:
        rec.put(tok=tok[0], tok_here=tok[1])
    for name, cand in cands.items():
        cand.add(s[name], z["zq"], z["zp"])
    u = torch.sub(z["zp"], z["zq"], out=b["u"])                          # d = z_p − z_q
    mq, mp = _row_max(z["zq"]), _row_max(z["zp"])
    w, sq = _exp_sum(z["zq"], mq, b["w"])
    _, sp = _exp_sum(z["zp"], mp, b["zp"])                              # z_p is not needed any more
    centre = torch.mul(w, u, out=scratch[0]).sum(-1) / sq               # the tile's own q-mean of d
    u.sub_(centre.unsqueeze(-1))
    ps = torch.expm1(u, out=b["psi"]).sub_(u)                           # ψ(u), exact at small |u|
    rec.put(q_scale=mq.squeeze(-1), q_sum=sq, centre=centre, p_scale=mp.squeeze(-1), p_sum=sp)
    full = []
    for fam in plan.families:
        wf = _family_tile(scan, fam, s[fam.name], (mq, w, sq, z["zq"]), b[f"w_{fam.name}"], scratch[0], rec, plan)
        if wf is not None:
            full.append((fam.name, wf))
    sums = tile_sums(plan.basis, [w] + [wf for _, wf in full], u, ps, scratch)
    rec.put(q_sums=sums[0], **{f"{name}_sums": x for (name, _), x in zip(full, sums[1:])})


def _tokens(rec: _Tiles, n: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """(z_q, z_p, s_b[, s_g]) at the sampled ids [n, width], float64 (NaN without ids)."""
    out = torch.full((n, width), torch.nan, dtype=torch.float64, device=like.device)
    if "tok" not in rec:
        return out
    for vals, here in zip(rec.cols["tok"], rec.cols["tok_here"]):
        out = torch.where(here.unsqueeze(-1), vals.to(torch.float64), out)
    return out


# ----------------------------------------------------------------------------- finishing one chunk
@dataclass
class _Sampled:
    """One family's finished values (float64, on the device): SamplerValues' fields, its normaliser
    ``lse`` [n], threshold ``tau`` [n] (−inf: none) and the rows its candidates may not cover."""
    mean: torch.Tensor
    var: torch.Tensor
    neg: torch.Tensor
    miss: torch.Tensor
    log_mean: torch.Tensor
    log_var: torch.Tensor
    tok_log: torch.Tensor
    lse: torch.Tensor
    tau: torch.Tensor
    unknown: torch.Tensor
    kl_q: torch.Tensor
    chi2: torch.Tensor
    gap_abs: torch.Tensor

    def values(self) -> SamplerValues:
        return SamplerValues(self.mean, self.var, self.neg, self.miss, self.log_mean, self.log_var, self.tok_log,
                             self.kl_q, self.chi2, self.gap_abs)


@dataclass
class _Chunk:
    """A chunk's finished values: q's, and one :class:`_Sampled` per family."""
    kl: torch.Tensor
    lse_q: torch.Tensor
    lse_p: torch.Tensor
    mean_q: torch.Tensor
    var_q: torch.Tensor
    tok: torch.Tensor
    fam: dict


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
    """Tiles' (log-scale, Σ w, mean, Σ w (x − mean)²) [T, ...] combined: (mean, variance) (Chan, Golub
    and LeVeque's pairwise update, all tiles at once)."""
    log_w = scale.to(torch.float64) + torch.log(total.to(torch.float64))
    lse = torch.logsumexp(log_w, dim=0)
    share = torch.nan_to_num(torch.exp(log_w - lse))
    mean64 = mean.to(torch.float64)
    mu = (share * mean64).sum(0)
    within = torch.nan_to_num(torch.exp(scale.to(torch.float64) - lse) * m2.to(torch.float64))
    return mu, (within + share * (mean64 - mu).square()).sum(0)


def _finish(scan: _Scan, plan: _Plan, rec: _Tiles, cands: dict) -> _Chunk:
    centres = rec.stacked("centre").to(torch.float64)
    q_scale, q_sums = rec.stacked("q_scale"), rec.stacked("q_sums").to(torch.float64)
    # Σ e^{z − m} of each tile from torch's pairwise sum: the normalisers of q and p are then summed
    # alike, and their rounding cancels in lse_q − lse_p as far as it can.
    q_sums[..., 0] = rec.stacked("q_sum").to(torch.float64)
    lse_q, lse_p = _logsum(q_scale, q_sums[..., 0]), _logsum(rec.stacked("p_scale"), rec.stacked("p_sum"))
    share = torch.exp(q_scale.to(torch.float64) + torch.log(q_sums[..., 0]) - lse_q)
    centre = (share * (centres + q_sums[..., 1] / q_sums[..., 0])).sum(0)           # the exact q-mean of d
    _, mq = finish_family(plan.basis, q_scale, q_sums, centres, centre)
    delta = centre + lse_q - lse_p                                                   # log r = u + δ
    mean_q, var_q = _poly_columns(plan, mq, delta)
    tok = _tokens(rec, scan.n, 2 + len(plan.families), lse_q)
    out = _Chunk(-(delta + mq[:, 1]), lse_q, lse_p, mean_q, var_q, tok, {})
    for i, fam in enumerate(plan.families):
        s_tok = tok[:, 2 + i]
        if fam.kind == "cut":
            out.fam[fam.name] = _finish_cut(plan, fam, cands[fam.name], out, s_tok, rec)
        else:
            out.fam[fam.name] = _finish_full(plan, fam, rec, out, (centres, centre, delta), s_tok)
    return out


def _finish_full(plan: _Plan, fam: _Family, rec: _Tiles, out: _Chunk, centring, s_tok) -> _Sampled:
    """A family with full support: moments from its weights' tile sums (or q's, when it is q)."""
    f = fam.name
    centres, centre, delta = centring
    mean, var = out.mean_q.clone(), out.var_q.clone()
    if fam.kind == "full":
        _, moments = finish_family(plan.basis, rec.stacked(f"{f}_scale"), rec.stacked(f"{f}_sums"), centres, centre)
        mean, var = _poly_columns(plan, moments, delta)
    lse = _logsum(rec.stacked(f"{f}_scale"), rec.stacked(f"{f}_sum"))
    s_mean, s_var = _chan(rec.stacked(f"{f}_scale"), rec.stacked(f"{f}_sum"), rec.stacked(f"{f}_mean"),
                          rec.stacked(f"{f}_m2"))
    neg = torch.full_like(mean, torch.nan)
    neg[:, [j for j, sign in enumerate(plan.sign) if not sign]] = 0.0               # f ≥ 0 for every draw
    miss = torch.exp(_logsum(rec.stacked("q_scale"), rec.stacked(f"{f}_miss")) - out.lse_q) \
        if f"{f}_miss" in rec else torch.zeros_like(lse)
    zero = torch.zeros_like(lse)
    kl_q, chi2, gap = zero, zero, zero                                               # b = q
    if fam.kind == "full":
        share = torch.nan_to_num(torch.exp(rec.stacked(f"{f}_scale").to(torch.float64)
                                           + torch.log(rec.stacked(f"{f}_sum").to(torch.float64)) - lse))
        zq_mean = (share * rec.stacked(f"{f}_zq").to(torch.float64)).sum(0)
        kl_q = (s_mean - lse) - (zq_mean - out.lse_q)                               # E_b[log b] − E_b[log q]
        chi2 = torch.expm1(_logsum(rec.stacked(f"{f}_chi_scale"), rec.stacked(f"{f}_chi_sum")) + lse - 2 * out.lse_q)
        gap = torch.full_like(lse, torch.nan)                                        # |·| needs a second pass
    return _Sampled(mean, var, neg, miss, s_mean - lse, s_var, s_tok - lse, lse, torch.full_like(lse, -torch.inf),
                    torch.zeros_like(lse, dtype=torch.bool), kl_q, chi2, gap)


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


def _under(plan: _Plan, logb: torch.Tensor, keep: torch.Tensor, logr: torch.Tensor):
    """E, Var, P(f < 0) [n, F] and E, Var of log b [n] under b = exp(logb) [n, K] over ``keep``."""
    b = torch.exp(logb)
    f = torch.stack([fn(logr) for fn in plan.fns], dim=-1) if plan.fns else logr.new_zeros(logr.shape + (0,))
    f = torch.where(keep.unsqueeze(-1), f, torch.zeros_like(f))                     # 0·inf would be NaN
    mean = (b.unsqueeze(-1) * f).sum(1)
    var = (b.unsqueeze(-1) * (f - mean.unsqueeze(1)).square()).sum(1)
    neg = (b.unsqueeze(-1) * (f < 0).to(f.dtype)).sum(1)
    lb = torch.where(keep, logb, torch.zeros_like(logb))
    log_mean = (b * lb).sum(-1)
    return mean, var, neg, log_mean, (b * (lb - log_mean.unsqueeze(-1)).square()).sum(-1)


def _finish_cut(plan: _Plan, fam: _Family, cand: _Candidates, out: _Chunk, s_tok: torch.Tensor,
                rec: _Tiles) -> _Sampled:
    """Everything under a truncating family from its candidates (its support is among them; rows where
    it may not be are marked ``unknown`` and redone by the second pass)."""
    s, zq, zp = (x.to(torch.float64) for x in cand.finish())
    f = fam.name
    lse_s = _logsum(rec.stacked(f"{f}_scale"), rec.stacked(f"{f}_sum")) if f"{f}_scale" in rec \
        else torch.zeros_like(out.lse_q)
    tau, unknown = _threshold(plan.sampler, s, lse_s, plan.vocab)
    unknown |= cand.dropped.to(torch.float64) >= tau
    keep = (s >= tau.unsqueeze(-1)) & torch.isfinite(s)
    ls = torch.where(keep, s, torch.full_like(s, -torch.inf))
    lse_b = torch.logsumexp(ls, dim=-1)
    logr = (zp - out.lse_p.unsqueeze(-1)) - (zq - out.lse_q.unsqueeze(-1))
    mean, var, neg, log_mean, log_var = _under(plan, ls - lse_b.unsqueeze(-1), keep, logr)
    lq = zq - out.lse_q.unsqueeze(-1)
    kept_q = torch.where(keep, torch.exp(lq), torch.zeros_like(zq)).sum(-1)
    tok_log = torch.where(s_tok >= tau, s_tok - lse_b, torch.full_like(s_tok, -torch.inf))
    logb = ls - lse_b.unsqueeze(-1)
    b = torch.exp(logb)
    gap = torch.where(keep, logb - lq, torch.zeros_like(lq))
    chi2 = torch.where(keep, torch.exp(2 * lq - logb), torch.zeros_like(lq)).sum(-1) - 1.0
    return _Sampled(mean, var, neg, (1.0 - kept_q).clamp(min=0.0), log_mean, log_var,
                    torch.where(torch.isnan(s_tok), s_tok, tok_log), lse_s, tau, unknown,
                    (b * gap).sum(-1), chi2, (b * gap.abs()).sum(-1))


# ----------------------------------------------------------------------------- the second pass
def _widen(scan: _Scan, plan: _Plan, fam: _Family, lse_s: torch.Tensor) -> torch.Tensor:
    """τ [n] of a family for rows whose support reaches past the candidates (a flat row's nucleus): each
    row's whole score vector, made tile by tile in one pass (O(V) per such row; the very same rounded
    scores as the first pass), and τ from all of it."""
    cand = torch.cat([scan.scores(t[fam.source], t["lo"]) for t in scan.tiles(policy_only=True)], dim=-1)
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


def _second_pass(scan: _Scan, fns, lse_q, lse_p, tau, source: str = "zq"):
    """With the normalisers and the family's threshold τ known, one more pass over the tiles: moments
    under q of ``fns`` and under the family (scores from ``source``'s logits) of (f, 1[f < 0], s), and the
    q-mass outside its support. Returns (q: (mean, var) [n, F]; family: (log Z [n], mean [n, 2F + 1],
    var [n, 2F + 1]); miss [n]). Sums run in float64 (f itself, as the dense path)."""
    under_q, under_b, miss, chi = _Spread(), _Spread(), [], []
    shift = (lse_q - lse_p).unsqueeze(-1)
    for t in scan.tiles():
        s = scan.scores(t[source], t["lo"])
        logr = (t["zp"] - t["zq"]).to(torch.float64) + shift
        f = torch.stack([fn(logr) for fn in fns], dim=-1) if fns else logr.new_zeros(logr.shape + (0,))
        wq = torch.exp(t["zq"].to(torch.float64) - lse_q.unsqueeze(-1))
        under_q.add(torch.zeros_like(lse_q), wq, f)
        inside = s >= tau.unsqueeze(-1).to(s.dtype)
        ms = _row_max(torch.where(inside, s, torch.full_like(s, -torch.inf))).to(torch.float64)
        wb = torch.where(inside, torch.exp(s.to(torch.float64) - ms), torch.zeros_like(wq))
        zq64 = t["zq"].to(torch.float64)
        under_b.add(ms.squeeze(-1), wb, torch.cat([f, (f < 0).to(f.dtype), zq64.unsqueeze(-1),
                                                   s.to(torch.float64).unsqueeze(-1)], -1))
        miss.append(torch.where(inside, torch.zeros_like(wq), wq).sum(-1))
        chi.append(torch.logsumexp(torch.where(inside, 2 * zq64 - s.to(torch.float64), torch.full_like(zq64, -torch.inf)), -1))
    _, mean_q, var_q = under_q.combine()
    log_zb, mean_b, var_b = under_b.combine()
    # columns of b: f [F], 1[f < 0] [F], z_q, s; Σ_{b>0} q²/b = e^{log Z_b − 2 lse_q} Σ e^{2 z_q − s}
    chi2 = torch.expm1(torch.logsumexp(torch.stack(chi), 0) + log_zb[:, 0] - 2 * lse_q)
    return (mean_q, var_q), (log_zb[:, 0], mean_b, var_b, chi2), torch.stack(miss).sum(0)


def _negative_pass(scan: _Scan, plan: _Plan, fam: _Family, out: _Chunk, cols: list[int]) -> None:
    """P(f < 0) [n] of polynomial estimators that change sign, under a family with full support: the
    sign of f(log r) needs log r = d + (lse_q − lse_p), so one more pass, in the compute dtype (f's sign
    at a token is decided by log r to the logits' own rounding)."""
    shift = (out.lse_q - out.lse_p).unsqueeze(-1)
    got = out.fam[fam.name]
    sums = torch.zeros(out.kl.shape[0], len(cols), dtype=torch.float64, device=out.kl.device)
    for t in scan.tiles():
        s = t["zq"] if fam.kind == "same" else scan.scores(t[fam.source], t["lo"])
        wb = torch.exp(s - got.lse.unsqueeze(-1).to(s.dtype))
        logr = (t["zp"] - t["zq"]).add_(shift.to(t["zq"].dtype))
        for i, j in enumerate(cols):
            sums[:, i] += torch.where(plan.fns[j](logr) < 0, wb, torch.zeros_like(wb)).sum(-1).to(torch.float64)
    for i, j in enumerate(cols):
        got.neg[:, j] = sums[:, i]


def _redo_columns(scan: _Scan, plan: _Plan, fam: _Family, out: _Chunk, cols: list[int]) -> None:
    """The second pass for estimators one pass cannot give under ``fam`` (every row): the moments of
    non-polynomial ones (and their q moments), P(f < 0) of polynomial ones that change sign."""
    signs = [j for j in cols if plan.poly[j] is not None]
    if signs:
        _negative_pass(scan, plan, fam, out, signs)
    cols = [j for j in cols if plan.poly[j] is None]
    if not cols:
        return
    got = out.fam[fam.name]
    fns = [plan.fns[j] for j in cols]
    (mean_q, var_q), (_, mean_b, var_b, _), _ = _second_pass(scan, fns, out.lse_q, out.lse_p, got.tau, fam.source)
    nf = len(cols)
    for i, j in enumerate(cols):
        out.mean_q[:, j], out.var_q[:, j] = mean_q[:, i], var_q[:, i]
        if fam.kind == "same":
            got.mean[:, j], got.var[:, j] = mean_q[:, i], var_q[:, i]
        if fam.kind != "cut":
            got.mean[:, j], got.var[:, j], got.neg[:, j] = mean_b[:, i], var_b[:, i], mean_b[:, nf + i]


def _redo_rows(scan: _Scan, plan: _Plan, fam: _Family, out: _Chunk, rows: torch.Tensor) -> None:
    """The second pass for rows whose support the family's candidates may not cover: τ from the whole
    score vector, then everything under the family summed over the tiles."""
    sub, got = scan.rows(rows), out.fam[fam.name]
    tau = _widen(sub, plan, fam, got.lse[rows])
    _, (log_z, mean, var, chi2), miss = _second_pass(sub, list(plan.fns), out.lse_q[rows], out.lse_p[rows], tau,
                                                     fam.source)
    nf = len(plan.fns)
    got.tau[rows] = tau
    got.mean[rows], got.var[rows], got.neg[rows] = mean[:, :nf], var[:, :nf], mean[:, nf:2 * nf]
    got.log_mean[rows], got.log_var[rows] = mean[:, -1] - log_z, var[:, -1]
    got.kl_q[rows] = got.log_mean[rows] - (mean[:, -2] - out.lse_q[rows])
    got.chi2[rows], got.gap_abs[rows] = chi2, torch.nan          # E_b|log b − log q| needs log Z_b in advance
    got.miss[rows] = miss
    s_tok = out.tok[rows, 2 + plan.families.index(fam)]
    tok_log = torch.where(s_tok >= tau, s_tok - log_z, torch.full_like(s_tok, -torch.inf))
    got.tok_log[rows] = torch.where(torch.isnan(s_tok), s_tok, tok_log)


def _spoiled(plan: _Plan, out: _Chunk) -> torch.Tensor:
    """Rows [n] where a one-pass moment is not finite: a float32 tile sum overflowed (u⁴, ψ⁴ at |u| ≳ 20),
    or log r is infinite somewhere (p or q is 0 at an id), which the moments cannot carry."""
    cols = [j for j, p in enumerate(plan.poly) if p is not None]
    parts = [~torch.isfinite(out.kl)]
    for x in [out.mean_q, out.var_q] + [t for f in plan.families if f.kind == "full"
                                         for t in (out.fam[f.name].mean, out.fam[f.name].var)]:
        parts.append(~torch.isfinite(x[:, cols]).all(-1) if cols else torch.zeros_like(parts[0]))
    return torch.stack(parts).any(0)


def _redo_spoiled(scan: _Scan, plan: _Plan, out: _Chunk, rows: torch.Tensor) -> None:
    """Spoiled rows from the second pass, which sums f(log r) itself in float64 (an infinite f where its
    weight is 0 counts 0; where it is not, the value is rightly infinite)."""
    sub = scan.rows(rows)
    fns = list(plan.fns) + [lambda logr: -logr]                      # KL = E_q[−log r]
    nf = len(plan.fns)
    for fam in plan.families:
        got = out.fam[fam.name]
        q, (_, mean, var, _), _ = _second_pass(sub, fns, out.lse_q[rows], out.lse_p[rows], got.tau[rows], fam.source)
        if fam.kind != "cut":
            got.mean[rows], got.var[rows] = mean[:, :nf], var[:, :nf]
            got.neg[rows] = torch.where(torch.isnan(got.neg[rows]), got.neg[rows], mean[:, nf + 1:2 * nf + 1])
    out.kl[rows] = q[0][:, -1]
    out.mean_q[rows], out.var_q[rows] = q[0][:, :nf], q[1][:, :nf]


def _any(mask: torch.Tensor) -> bool:
    """Whether any entry is true: the host synchronisation of a chunk (on a meta tensor, where no value
    exists, False: the shapes are all a meta run checks)."""
    return False if mask.device.type == "meta" else bool(mask.any())


def _chunk_values(scan: _Scan, plan: _Plan, bufs: _Buffers) -> PositionValues:
    rec = _Tiles()
    cands = {f.name: _Candidates(f.keep, plan.take(f), scan.hq) for f in plan.families if f.kind == "cut"}
    for lo in range(0, plan.vocab, scan.tile):
        _one_tile(scan, plan, rec, cands, lo, bufs)
    out = _finish(scan, plan, rec, cands)
    for fam in plan.families:
        cols = plan.second_pass_columns(fam)
        if cols:
            _redo_columns(scan, plan, fam, out, cols)
        if fam.kind == "cut" and _any(out.fam[fam.name].unknown):
            _redo_rows(scan, plan, fam, out, torch.nonzero(out.fam[fam.name].unknown).flatten())
    spoiled = _spoiled(plan, out)
    if _any(spoiled):
        _redo_spoiled(scan, plan, out, torch.nonzero(spoiled).flatten())
    g = out.fam["g"].values() if "g" in out.fam else None
    return PositionValues(plan.names, out.kl, out.mean_q, out.var_q, out.tok[:, 0] - out.lse_q,
                          out.tok[:, 1] - out.lse_p, out.fam["b"].values(), g)


# ----------------------------------------------------------------------------- the public functions
def _empty(names: tuple[str, ...], like: torch.Tensor, sampling: bool) -> PositionValues:
    e = torch.zeros(0, dtype=torch.float64, device=like.device)
    ef = e.view(0, 1).expand(0, len(names))
    sv = SamplerValues(ef, ef, ef, e, e, e, e, e, e, e)
    return PositionValues(names, e, ef, ef, e, e, sv, sv if sampling else None)


@torch.no_grad()
def stream_values(policy_hidden: torch.Tensor, reference_hidden: torch.Tensor, policy_head: Head, reference_head: Head,
                  estimators: Sequence = ("k1", "k3"), sampler: Sampler | None = None, *,
                  ids: torch.Tensor | None = None, eos_banned: torch.Tensor | None = None,
                  context_ids: torch.Tensor | None = None, sampling_hidden: torch.Tensor | None = None,
                  chunk: int | None = None, tile: int | None = None, candidates: int = 1024,
                  dtype: torch.dtype = torch.float32, tf32: bool = False, negative: bool = True) -> PositionValues:
    """:func:`kl_bench.audit.exact.position_values` from hidden states [N, d] (each model's own, any float
    dtype, on the heads' device) and output layers, streamed: the same values, in O(N + chunk × tile)
    memory, as [N] / [N, F] float64 tensors on that device. ``chunk``, ``tile``: positions per chunk and ids
    per tile (None: :data:`PIECES` of the device).

    ``sampling_hidden`` [N, d]: the policy's hidden states in the pass that drew the tokens, when it
    differs from the scored one (its values are ``g``; one more matmul per tile). ``dtype``: the tile
    matmuls' and tile sums' dtype (float32: the model's own rounding, ~1e-7 relative of each logit;
    float64: exact to rounding); the merges are float64 either way. ``candidates``: the scores kept per
    position for a top-p or min-p sampler (a larger support is found by widening). ``negative``: P(f < 0)
    of estimators that change sign (k1, fwd_k1) under a sampler that does not truncate needs a second
    pass (two more forwards); False leaves those entries NaN (not computed)."""
    _check_inputs(policy_hidden, reference_hidden, policy_head, reference_head, dtype)
    if sampling_hidden is not None and sampling_hidden.shape != policy_hidden.shape:
        raise SpecError(f"the sampling pass's hidden states must be {list(policy_hidden.shape)}, got "
                        f"{list(sampling_hidden.shape)}", key="sampling_hidden")
    sampler = sampler or Sampler()
    chunk, tile = pieces(policy_hidden.device, chunk, tile)
    plan = _Plan.of(estimators, sampler, policy_head.vocab, candidates, negative, sampling_hidden is not None)
    n_all, parts = policy_hidden.shape[0], []
    bufs = _Buffers(scratch_needed(plan.basis), min(chunk, n_all), min(tile, plan.vocab),
                    policy_hidden.new_empty(0, dtype=dtype))

    def rows(x, i, dt=None):
        return None if x is None else (x[i:i + chunk] if dt is None else x[i:i + chunk].to(dt))
    with matmul_precision(tf32):
        for i in range(0, n_all, chunk):
            scan = _Scan(rows(policy_hidden, i, dtype), rows(reference_hidden, i, dtype), rows(sampling_hidden, i, dtype),
                         (policy_head, reference_head), sampler, tile, rows(eos_banned, i), rows(context_ids, i),
                         rows(ids, i, torch.long))
            parts.append(_chunk_values(scan, plan, bufs))
    return PositionValues.cat(parts) if parts else _empty(plan.names, policy_hidden, sampling_hidden is not None)


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
              *, chunk: int | None = None, tile: int | None = None, dtype: torch.dtype = torch.float32,
              tf32: bool = False) -> torch.Tensor:
    """KL(q‖p) [N] only (float64, on the hidden states' device), in one pass: E_q[z_q − z_p] − lse_q + lse_p.

    The matmuls write into three buffers of chunk × tile elements made once (no allocation, hence no
    page faults, per tile) and each tile is reduced in place in ``dtype``; the tiles' sums are merged in
    float64. With float32 each tile sum of t terms in (0, 1] carries ≲ log2(t)·2⁻²⁴ relative error
    (pairwise summation), below the float32 logits' own rounding."""
    _check_inputs(policy_hidden, reference_hidden, policy_head, reference_head, dtype)
    n_all, vocab = policy_hidden.shape[0], policy_head.vocab
    device = policy_hidden.device
    chunk, tile = pieces(device, chunk, tile)
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
