"""The first streaming pass of the audit (one output-layer forward of each model): per vocabulary tile
the normalisers, the polynomial tile sums and a truncating sampler's candidates are kept, then merged in
float64 into a chunk's values (:func:`first_pass`); what it cannot give is left to
:mod:`kl_bench.audit.second_pass`."""
from __future__ import annotations

import torch

from . import fused
from .polymoments import finish_family, tile_sums
from .stream_plan import Chunk, Family, Plan, Sampled
from .tiling import Scan, chan, logsum, row_max, threshold


class _Candidates:
    """The largest scores of each row, with z_q and z_p at those ids: each tile gives its top ``take``,
    and one selection at the end keeps the top ``k`` of them (descending). A tile may hold more of the
    row's top ``k`` than it gave; ``dropped`` [n], the largest score a tile left out, says where that can
    matter: the support (scores ≥ τ) is complete among the candidates whenever τ > dropped."""

    def __init__(self, k: int, take: int, like: torch.Tensor):
        self.k, self.take = k, take
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.dropped = torch.full((like.shape[0],), -torch.inf, dtype=like.dtype, device=like.device)

    def add(self, s: torch.Tensor, zq: torch.Tensor, zp: torch.Tensor) -> tuple:
        """Take the tile's top ``take`` of s [n, t]; returns (ids, z_q there, z_p there) for :meth:`add_at`."""
        take = min(self.take, s.shape[-1])
        top, idx = torch.topk(s, take, dim=-1)
        got = (idx, zq.gather(-1, idx), zp.gather(-1, idx))
        self.parts.append((top,) + got[1:])
        if take < s.shape[-1]:
            # the largest score this tile left out is at most its last one kept (ties included)
            self.dropped = torch.maximum(self.dropped, top[:, -1])
        return got

    def add_at(self, s: torch.Tensor, taken: tuple) -> None:
        """Take the ids another family took (``taken``: its :meth:`add`'s return) with this family's scores s:
        one top-k selection a tile for both families (the drawing pass's scores are the scored policy's up
        to its mismatch, so their tops are nearly the same ids). The largest of this family's scores left
        out is read off the tile (−inf written at the ids taken, on a copy), so the support is complete
        among the candidates whenever τ exceeds it, as for :meth:`add`."""
        idx, zq, zp = taken
        self.parts.append((s.gather(-1, idx), zq, zp))
        if idx.shape[-1] < s.shape[-1]:
            left = s.scatter(-1, idx, -torch.inf)
            self.dropped = torch.maximum(self.dropped, left.amax(dim=-1))

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


class Buffers:
    """Tile-sized work buffers of one call, made once on the device in the compute dtype (a fresh CPU
    tensor of a few MB costs more in page faults than the arithmetic on it): views [n, t] of flat
    storage, for the tile at hand. ``zqg`` holds z_q above the drawing pass's z_g (one matmul, [2n, t])."""
    NAMES = ("zqg", "zp", "s_b", "s_g", "w", "w_b", "w_g", "u", "psi")

    def __init__(self, extra: int, chunk: int, tile: int, like: torch.Tensor):
        self.flat = [torch.empty(chunk * tile * (2 if name == "zqg" else 1), dtype=like.dtype, device=like.device)
                     for name in self.NAMES + (None,) * extra]

    def views(self, n: int, t: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        v = [b[:n * t * (2 if i == 0 else 1)].view(-1, t) for i, b in enumerate(self.flat)]
        return dict(zip(self.NAMES, v)), v[len(self.NAMES):]


# The work buffers of the fused path: none (every ``out=`` below then makes a new tensor, which torch.compile
# fuses away); the eager path writes into Buffers' views instead.
_UNBUFFERED = dict.fromkeys(Buffers.NAMES)


def _exp_sum(z: torch.Tensor, m: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e^{z − m} written into ``out`` (None: a new tensor), its row sums [n])."""
    w = torch.sub(z, m, out=out).exp_()
    return w, w.sum(dim=-1)


def _spread(w: torch.Tensor, total: torch.Tensor, x: torch.Tensor, tmp: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted mean [n] and Σ w (x − mean)² [n] of a finite x [n, t] (``tmp`` overwritten)."""
    mean = torch.mul(w, x, out=tmp).sum(-1) / total.clamp(min=torch.finfo(w.dtype).tiny)
    return mean, torch.sub(x, mean.unsqueeze(-1), out=tmp).square_().mul_(w).sum(-1)


def _family_tile(fam: Family, s: torch.Tensor, q: tuple, buf: torch.Tensor | None, tmp: torch.Tensor | None,
                 plan: Plan, banned: bool) -> tuple[dict, torch.Tensor | None]:
    """A family's per-tile records from its scores s [n, t]: its normaliser, the mean and
    spread of s under it (where wanted), the q-mass where s = −inf; and its weights when it needs moments
    ("full"). ``q``: (m_q, q's weights, their sum, z_q, whether s is z_q itself)."""
    f = fam.name
    mq, w, sq, zq, own = q
    if fam.kind == "same" or own:
        ms, wf, sf = mq, w, sq                  # its scores are z_q itself: q's own weights, not made twice
    elif plan.needs_lse(fam):
        ms = row_max(s)
        wf, sf = _exp_sum(s, ms, buf)
    else:
        return {}, None
    rec = {f"{f}_scale": ms.squeeze(-1), f"{f}_sum": sf}
    if fam.kind == "cut":
        return rec, None
    against = fam.kind == "full" and plan.outputs.against_q
    if plan.spread(fam) or against:             # E_b[s] is also KL(b‖q)'s first term
        s_fin = torch.where(wf > 0, s, torch.zeros_like(s)) if banned else s
        rec[f"{f}_mean"], rec[f"{f}_m2"] = _spread(wf, sf, s_fin, tmp)
    if against:
        rec[f"{f}_zq"] = torch.mul(wf, zq, out=tmp).sum(-1) / sf                   # E_b[z_q] of the tile
        # Σ_{b>0} q²/b needs Σ e^{2 z_q − s} over b's support (s = −inf: not in it)
        two = torch.sub(zq, s, out=tmp).add_(zq)
        if banned:
            two = torch.where(torch.isneginf(s), torch.full_like(two, -torch.inf), two)
        m2q = row_max(two)
        rec[f"{f}_chi_scale"], rec[f"{f}_chi_sum"] = m2q.squeeze(-1), two.sub_(m2q).exp_().sum(-1)
    if banned:
        rec[f"{f}_miss"] = torch.where(torch.isneginf(s), w, torch.zeros_like(w)).sum(-1)
    return rec, wf if fam.kind == "full" else None


def _elementwise(plan: Plan, z: dict, s: dict, own: dict, b: dict, scratch: list, banned: bool) -> dict:
    """A tile's records from its logits ``z`` and scores ``s`` [n, t] (``b``, ``scratch``: the work buffers, or
    None each: new tensors, as the fused path wants them):
    normalisers, the q-centre of d, the families' records and every weight's monomial sums."""
    u = torch.sub(z["zp"], z["zq"], out=b["u"])                          # d = z_p − z_q
    mq, mp = row_max(z["zq"]), row_max(z["zp"])
    w, sq = _exp_sum(z["zq"], mq, b["w"])
    _, sp = _exp_sum(z["zp"], mp, b["zp"])                              # z_p's buffer: z_p is not needed any more
    centre = torch.mul(w, u, out=scratch[0]).sum(-1) / sq               # the tile's own q-mean of d
    u.sub_(centre.unsqueeze(-1))
    ps = torch.expm1(u, out=b["psi"]).sub_(u)                           # ψ(u), exact at small |u|
    rec = {"q_scale": mq.squeeze(-1), "q_sum": sq, "centre": centre, "p_scale": mp.squeeze(-1), "p_sum": sp}
    weights, degrees, totals, names = [w], [plan.weight_degree(None)], [sq], []
    for fam in plan.families:
        got, wf = _family_tile(fam, s[fam.name], (mq, w, sq, z["zq"], own[fam.name]),
                               b[f"w_{fam.name}"], scratch[0], plan, banned)
        rec.update(got)
        if wf is not None:
            weights.append(wf)
            degrees.append(plan.weight_degree(fam))
            totals.append(got[f"{fam.name}_sum"])
            names.append(fam.name)
    sums = tile_sums(plan.basis, weights, u, ps, scratch, degrees, totals)
    rec["q_sums"] = sums[0]
    rec.update({f"{name}_sums": x for name, x in zip(names, sums[1:])})
    return rec


def _one_tile(scan: Scan, plan: Plan, rec: _Tiles, cands: dict, lo: int, bufs: Buffers) -> None:
    """Fold vocabulary tile [lo, lo + t) into the chunk's records: the models' logits made once, used,
    and overwritten by the next tile."""
    t = min(scan.tile, plan.vocab - lo)
    b, scratch = bufs.views(scan.n, t)
    z = scan.logits(lo, lo + t, b["zqg"], b["zp"])
    s = {fam.name: z["zq"] if fam.kind == "same" else scan.scores(z[fam.source], lo, out=b[f"s_{fam.name}"])
         for fam in plan.families}
    tok = scan.gather(lo, [z["zq"], z["zp"]] + [s[fam.name] for fam in plan.families])
    if tok is not None:
        rec.put(tok=tok[0], tok_here=tok[1])
    taken = None
    for name, cand in cands.items():
        if taken is None:
            taken = cand.add(s[name], z["zq"], z["zp"])
        else:                                   # the drawing pass's family takes the scored family's ids
            cand.add_at(s[name], taken)
    own = {name: x is z["zq"] for name, x in s.items()}
    eager = (plan, z, s, own, b, scratch, scan.banned)
    # Compiled without work buffers: the intermediates stay in registers and cache, unwritten. A dimension
    # of 1 would specialise the compiled graph (a new compile mid-run) for a piece that costs nothing.
    if plan.fused and scan.n > 1 and t > 1:
        rec.put(**fused.call(_elementwise, (plan, z, s, own, _UNBUFFERED, [None] * len(scratch), scan.banned), eager))
    else:
        rec.put(**_elementwise(*eager))


def _tokens(rec: _Tiles, n: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """(z_q, z_p, s_b[, s_g]) at the sampled ids [n, width], float64 (NaN without ids)."""
    out = torch.full((n, width), torch.nan, dtype=torch.float64, device=like.device)
    if "tok" not in rec:
        return out
    for vals, here in zip(rec.cols["tok"], rec.cols["tok_here"]):
        out = torch.where(here.unsqueeze(-1), vals.to(torch.float64), out)
    return out


# ----------------------------------------------------------------------------- finishing one chunk
def poly_columns(plan: Plan, moments: torch.Tensor, delta: torch.Tensor, var: bool = True):
    """E[f], Var[f] [n, F] of the polynomial estimators from normalised moments (NaN for the others, and
    for Var where ``var`` is false: its moments of degree 2·degree f were not summed)."""
    mean = torch.full((delta.shape[0], len(plan.names)), torch.nan, dtype=torch.float64, device=delta.device)
    out_var = mean.clone()
    for j, poly in enumerate(plan.poly):
        if poly is not None:
            mean[:, j], v = plan.basis.mean_and_var(plan.basis.estimator(poly, delta), moments)
            if var:
                out_var[:, j] = v
    return mean, out_var



def _finish(scan: Scan, plan: Plan, rec: _Tiles, cands: dict) -> Chunk:
    centres = rec.stacked("centre").to(torch.float64)
    q_scale, q_sums = rec.stacked("q_scale"), rec.stacked("q_sums").to(torch.float64)
    # Σ e^{z − m} of each tile from torch's pairwise sum: the normalisers of q and p are then summed
    # alike, and their rounding cancels in lse_q − lse_p as far as it can.
    q_sums[..., 0] = rec.stacked("q_sum").to(torch.float64)
    lse_q, lse_p = logsum(q_scale, q_sums[..., 0]), logsum(rec.stacked("p_scale"), rec.stacked("p_sum"))
    share = torch.exp(q_scale.to(torch.float64) + torch.log(q_sums[..., 0]) - lse_q)
    centre = (share * (centres + q_sums[..., 1] / q_sums[..., 0])).sum(0)           # the exact q-mean of d
    _, mq = finish_family(plan.basis, q_scale, q_sums, centres, centre)
    delta = centre + lse_q - lse_p                                                   # log r = u + δ
    mean_q, var_q = poly_columns(plan, mq, delta, plan.var_q())
    tok = _tokens(rec, scan.n, 2 + len(plan.families), lse_q)
    out = Chunk(-(delta + mq[:, 1]), lse_q, lse_p, mean_q, var_q, tok, {})
    for i, fam in enumerate(plan.families):
        s_tok = tok[:, 2 + i]
        if fam.kind == "cut":
            out.fam[fam.name] = _finish_cut(plan, fam, cands[fam.name], out, s_tok, rec)
        else:
            out.fam[fam.name] = _finish_full(plan, fam, rec, out, (centres, centre, delta), s_tok)
    return out


def _finish_full(plan: Plan, fam: Family, rec: _Tiles, out: Chunk, centring, s_tok) -> Sampled:
    """A family with full support: moments from its weights' tile sums (or q's, when it is q); what is not
    wanted (Plan.outputs) is NaN."""
    f = fam.name
    centres, centre, delta = centring
    mean, var = out.mean_q.clone(), out.var_q.clone()
    if fam.kind == "full":
        _, moments = finish_family(plan.basis, rec.stacked(f"{f}_scale"), rec.stacked(f"{f}_sums"), centres, centre)
        mean, var = poly_columns(plan, moments, delta, plan.spread(fam))
    lse = logsum(rec.stacked(f"{f}_scale"), rec.stacked(f"{f}_sum"))
    nan = torch.full_like(lse, torch.nan)
    s_mean, s_var = nan, nan
    if f"{f}_mean" in rec:
        s_mean, s_var = chan(rec.stacked(f"{f}_scale"), rec.stacked(f"{f}_sum"), rec.stacked(f"{f}_mean"),
                              rec.stacked(f"{f}_m2"))
    neg = torch.full_like(mean, torch.nan)
    neg[:, [j for j, sign in enumerate(plan.sign) if not sign]] = 0.0               # f ≥ 0 for every draw
    miss = torch.exp(logsum(rec.stacked("q_scale"), rec.stacked(f"{f}_miss")) - out.lse_q) \
        if f"{f}_miss" in rec else torch.zeros_like(lse)
    zero = torch.zeros_like(lse)
    kl_q, chi2, gap = zero, zero, zero                                               # b = q
    if fam.kind == "full":
        kl_q, chi2, gap = nan, nan, nan                                              # not wanted, or below
    if f"{f}_zq" in rec:
        share = torch.nan_to_num(torch.exp(rec.stacked(f"{f}_scale").to(torch.float64)
                                           + torch.log(rec.stacked(f"{f}_sum").to(torch.float64)) - lse))
        zq_mean = (share * rec.stacked(f"{f}_zq").to(torch.float64)).sum(0)
        kl_q = (s_mean - lse) - (zq_mean - out.lse_q)                               # E_b[log b] − E_b[log q]
        chi2 = torch.expm1(logsum(rec.stacked(f"{f}_chi_scale"), rec.stacked(f"{f}_chi_sum")) + lse - 2 * out.lse_q)
        # E_b|log b − log q| needs a second pass: NaN
    if not plan.spread(fam):
        s_mean, s_var = nan, nan                    # E_b[s] was made for KL(b‖q) alone
    return Sampled(mean, var, neg, miss, s_mean - lse, s_var, s_tok - lse, lse, torch.full_like(lse, -torch.inf),
                    torch.zeros_like(lse, dtype=torch.bool), kl_q, chi2, gap, s_tok.to(torch.float64))



def _under(plan: Plan, logb: torch.Tensor, keep: torch.Tensor, logr: torch.Tensor):
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


def _finish_cut(plan: Plan, fam: Family, cand: _Candidates, out: Chunk, s_tok: torch.Tensor,
                rec: _Tiles) -> Sampled:
    """Everything under a truncating family from its candidates (its support is among them; rows where
    it may not be are marked ``unknown`` and redone by the second pass)."""
    s, zq, zp = (x.to(torch.float64) for x in cand.finish())
    f = fam.name
    lse_s = logsum(rec.stacked(f"{f}_scale"), rec.stacked(f"{f}_sum")) if f"{f}_scale" in rec \
        else torch.zeros_like(out.lse_q)
    tau, unknown = threshold(plan.sampler, s, lse_s, plan.vocab)
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
    return Sampled(mean, var, neg, (1.0 - kept_q).clamp(min=0.0), log_mean, log_var,
                    torch.where(torch.isnan(s_tok), s_tok, tok_log), lse_s, tau, unknown,
                    (b * gap).sum(-1), chi2, (b * gap.abs()).sum(-1), s_tok.to(torch.float64))



def first_pass(scan: Scan, plan: Plan, bufs: Buffers) -> Chunk:
    """The chunk's values from one pass over the vocabulary tiles (rows a truncating family's candidates
    may not cover are marked ``unknown``)."""
    rec = _Tiles()
    cands = {f.name: _Candidates(f.keep, plan.take(f), scan.hq) for f in plan.families if f.kind == "cut"}
    for lo in range(0, plan.vocab, scan.tile):
        _one_tile(scan, plan, rec, cands, lo, bufs)
    return _finish(scan, plan, rec, cands)
