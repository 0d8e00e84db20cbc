"""Flat rows under top-p in two passes (kl_bench.audit.stream): a nucleus too large for the candidates.

Top-p without top-k keeps the tokens whose score s is at least τ, the smallest set of most likely tokens
whose mass reaches p. Where the nucleus is small the one-pass candidates hold it (kl_bench.audit.first_pass);
a flat row's nucleus holds tens of thousands of ids (35,000 of 151,936 at logits of standard deviation 2),
which no candidate list holds, and sorting each row's whole score vector costs far more than its matmuls.
For such rows, two passes, each one output-layer forward of the models (three matmuls: z_q with the drawing
pass's z_g, then z_p):

1. :func:`_first` sums the normalisers (q, p and each truncating family's), q's weighted mean of
   d = z_p − z_q (the centre c of the second pass) and, per family, a histogram of the untruncated
   probability mass over score bins of 1/256 nat below an anchor per row (the first tile's largest score
   + 16). Once the normaliser is known, the cumulative mass of the bins brackets τ: every bin before
   ``ja`` is kept for certain, every bin after ``jb`` dropped, whatever rounding the float32 bin sums
   carry (a slack of 10⁻⁴ of mass on either side).
2. :func:`_second` sums, per family, everything over the ids kept for certain in the compute dtype (as
   the one-pass moments: monomials u^i ψ^j with u = d − c, b's score and its spread, and P(f < 0), the
   mass e^{s − lse} scaling every tile alike) and collects the bracket's few hundred tokens (their score
   and u: each tile's top :data:`TAKE` of the scores inside the bracket). Then τ is found exactly among
   them (sorted, the mass before each token: the exact sum above the bracket plus theirs, in float64) and
   their terms are added in float64.

A row whose bracket does not check out (the mass above it already p, or all of it short of p; more
bracket tokens in one tile than :data:`TAKE`; a score past the anchor) is marked ``unknown`` and goes to
the second pass of kl_bench.audit.second_pass, which widens its candidates to the whole row: slower, and
as exact.

Which rows are flat is guessed from the logits of every 37th id (:func:`flat_rows`, one tile's matmul at
V = 151,936): the sample's nucleus, 37 times over, estimates the row's; past twice the candidates
(2,048) the row is flat. Reading the flags is one host synchronisation per call.
"""
from __future__ import annotations

import math

import torch

from .first_pass import poly_columns
from .polymoments import tile_sums
from .stream_plan import Chunk, Family, Plan, Sampled
from .tiling import Scan, chan, logsum, row_max

BINS_PER_NAT = 256      # histogram resolution: two bins hold ~180 ids at logit std 2 (V = 151,936)
HEAD = 16.0             # nats above the first tile's largest score the histogram reaches (bin 0: beyond)
SLACK = 1e-4            # mass either side of p the bracket covers (float32 bin sums err by ≲ 1e-6)
TAKE = 24               # bracket tokens a tile gives per row (~6 at logit std 2; a row past it is widened)


def applies(plan: Plan) -> bool:
    """Two passes serve this call's truncating families: top-p alone (no top-k, no min-p), polynomial
    estimators only, no rollout-engine distances (their |log b − log q| is the widening pass's)."""
    sp = plan.sampler
    return (sp.p is not None and sp.k is None and sp.mp is None and all(p is not None for p in plan.poly)
            and not plan.outputs.against_q and any(f.kind == "cut" for f in plan.families))


def flat_rows(scan: Scan, plan: Plan, chunk: int, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [n] (bool) whose nucleus is likely larger than ``keep`` candidates, the centre c [n] of their
    second pass), on the device, from both models' logits at every s-th id (s = V / tile: one tile's
    matmul of each). s times the ids the sample needs to reach p of its mass estimates the nucleus, ~2×
    over on peaked rows (the sample mostly misses their few heaviest ids: at logit std 4, median 1,550 for
    690, 90th percentile 3,300 for 1,240; at std 2, 36,000 for 36,000); past twice ``keep`` the row is
    flat. A wrong guess costs time, never exactness: a flat row taken for peaked is widened, a peaked one
    taken for flat makes a second pass. The temperature is applied, the penalty and the EOS ban are not.
    c is the sample's q-weighted mean of d = z_p − z_q: any c gives the same sums in exact arithmetic, one
    near q's mean keeps u = d − c small, and so the float32 sums accurate. (The nucleus estimate past 2K is
    the sample's top 2K/s holding less than p of its mass: one top-k, not a sort.)"""
    step = max(1, plan.vocab // min(scan.tile, plan.vocab))
    # host: the sampled ids (a range)
    ids = torch.arange(0, plan.vocab, step, device=scan.hq.device)
    flags, centres = [], []
    for i in range(0, scan.n, chunk):
        zq = scan.heads[0].logits_at(scan.hq[i:i + chunk], ids)
        d = scan.heads[1].logits_at(scan.hp[i:i + chunk], ids) - zq
        q = torch.softmax(zq, dim=-1)
        centres.append((q * d).sum(-1).to(torch.float64))
        score = zq / scan.sampler.temperature
        top = torch.topk(score, min(score.shape[-1], -(-2 * keep // step)), dim=-1).values
        flags.append(torch.logsumexp(top, -1) - torch.logsumexp(score, -1) < math.log(plan.sampler.p))
    return torch.cat(flags), torch.cat(centres)


class _Hist:
    """One family's mass histogram over score bins: bin j holds the ids with (A − s)·R ∈ [j, j + 1)
    (R = :data:`BINS_PER_NAT`, A the anchor; bin 0 also every score above A, the last bin every score
    below the range), as Σ e^{s − A} in the compute dtype."""

    def __init__(self, n: int, plan: Plan, like: torch.Tensor):
        width = HEAD + math.log(plan.vocab / (1 - plan.sampler.p)) + 2     # τ ≥ max − log(V / (1 − p))
        self.bins = int(width * BINS_PER_NAT) + 2
        self.hist = torch.zeros(n, self.bins, dtype=like.dtype, device=like.device)
        self.anchor: torch.Tensor | None = None
        self.bad = torch.zeros(n, dtype=torch.bool, device=like.device)

    def position(self, s: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(A − s)·R [n, t]: both passes compute it by this one operation (the same bits from the same s)."""
        return torch.add(self.anchor * BINS_PER_NAT, s, alpha=-BINS_PER_NAT, out=out)

    def add(self, s: torch.Tensor, w: torch.Tensor, m: torch.Tensor, tmp: torch.Tensor, idx: torch.Tensor) -> None:
        """A tile's scores s, weights w = e^{s − m} and row maxima m [n, 1] (``tmp``, ``idx``: work buffers)."""
        if self.anchor is None:
            self.anchor = m + HEAD
        idx.copy_(self.position(s, out=tmp).clamp_(0, self.bins - 1))       # truncated: the bin index
        shift = m - self.anchor
        self.bad |= shift.squeeze(-1) > 60                      # e^{s − A} could overflow: widened instead
        self.hist.scatter_add_(1, idx, torch.mul(w, torch.exp(shift.clamp(max=60)), out=tmp))

    def bracket(self, lse: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hi, lo [n, 1] in the scores' dtype, ok [n]): τ lies in bins ja..jb, those before kept and those
        after dropped for certain (the bins' masses e^{A − lse}·hist summed in float64, ± :data:`SLACK`), so
        ids with s > hi = A − ja/R are kept and ids with s ≤ lo = A − (jb + 1)/R dropped (a score within
        rounding of a bin's edge may fall on the other side: the second pass checks the bracket on its own
        sums). ``ok``: the bracket is inside the histogram's range."""
        mass = self.hist.to(torch.float64) * torch.exp(self.anchor.squeeze(-1).to(torch.float64) - lse).unsqueeze(-1)
        cum = mass.cumsum(-1)
        ja = (cum < p - SLACK).sum(-1, keepdim=True)
        jb = (cum < p + SLACK).sum(-1, keepdim=True)
        edge = self.anchor.to(torch.float64)
        hi, lo = (edge - ja / BINS_PER_NAT).to(self.hist.dtype), (edge - (jb + 1) / BINS_PER_NAT).to(self.hist.dtype)
        return hi, lo, ((ja >= 1) & (jb <= self.bins - 2)).squeeze(-1) & ~self.bad


class _Work:
    """A pass's tile buffers, made once (views [n, t] for the tile at hand): z_q above z_g, z_p, and
    elementwise work; ``idx``: bin indices."""

    def __init__(self, n: int, tile: int, like: torch.Tensor, extra: int = 2):
        def make(rows):
            return torch.empty(rows * tile, dtype=like.dtype, device=like.device)
        self.zqg, self.zp, self.work = make(2 * n), make(n), [make(n) for _ in range(extra + 4)]
        self.index = torch.empty(n * tile, dtype=torch.long, device=like.device)

    def logits(self, scan: Scan, lo: int, hi: int, policy_only: bool = False) -> tuple[dict, list, torch.Tensor]:
        n, t = scan.n, hi - lo
        z = scan.logits(lo, hi, self.zqg[:2 * n * t].view(2 * n, t), self.zp[:n * t].view(n, t), policy_only)
        return z, [b[:n * t].view(n, t) for b in self.work], self.index[:n * t].view(n, t)


def _needs_delta(plan: Plan, fams: list[Family]) -> bool:
    """P(f < 0) of a sign-changing estimator is summed in the second pass from log r = u + δ, so δ (and
    with it lse_p) is needed before it: the first pass then makes z_p too."""
    return any(plan.sign) and any(plan.spread(f) for f in fams)


def _first(scan: Scan, plan: Plan, fams: list[Family]) -> dict:
    """Pass 1: per tile the policy's (and, where δ is needed early, the reference's) row maxima and
    exp-sums and each family's histogram; merged in float64 into the normalisers and the brackets. Only
    the policy's head runs otherwise (z_q with z_g: two of the three matmuls)."""
    hists = {f.name: _Hist(scan.n, plan, scan.hq) for f in fams}
    with_p = _needs_delta(plan, fams)
    rec: dict[str, list] = {"q": [], "p": [], **{f.name: [] for f in fams}}
    work = _Work(scan.n, min(scan.tile, plan.vocab), scan.hq)
    for lo in range(0, plan.vocab, scan.tile):
        z, (w, tmp, *_), idx = work.logits(scan, lo, min(lo + scan.tile, plan.vocab), policy_only=not with_p)
        s = {f.name: scan.scores(z[f.source], lo) for f in fams}
        mq = row_max(z["zq"])
        torch.sub(z["zq"], mq, out=w).exp_()
        rec["q"].append((mq.squeeze(-1), w.sum(-1)))
        for f in fams:
            if s[f.name] is z["zq"]:                                     # b's scores are z_q: q's weights
                rec[f.name].append(rec["q"][-1])
                hists[f.name].add(s[f.name], w, mq, tmp, idx)
        if with_p:
            mp = row_max(z["zp"])
            rec["p"].append((mp.squeeze(-1), z["zp"].sub_(mp).exp_().sum(-1)))
        for f in fams:
            if s[f.name] is not z["zq"]:
                m = row_max(s[f.name])
                torch.sub(s[f.name], m, out=w).exp_()
                rec[f.name].append((m.squeeze(-1), w.sum(-1)))
                hists[f.name].add(s[f.name], w, m, tmp, idx)
    out = {"lse_q": _lse(rec["q"]), "lse_p": _lse(rec["p"]) if with_p else None, "fam": {}}
    for f in fams:
        lse_f = _lse(rec[f.name])
        hi, lo, ok = hists[f.name].bracket(lse_f, plan.sampler.p)
        out["fam"][f.name] = {"lse": lse_f, "hi": hi, "lo": lo, "ok": ok}
    return out


def _lse(parts: list) -> torch.Tensor:
    """log Σ over tiles of (row max, Σ e^{z − max}) pairs, float64."""
    m, s = (torch.stack(x) for x in zip(*parts))
    return logsum(m, s)


class _Bracket:
    """One family's bracket tokens (score s, u = d − c, and z_q where q's mass there is wanted): each tile
    gives its row's largest :data:`TAKE` scores inside the bracket; a tile with more (its last one taken
    inside) marks the row ``full``."""

    def __init__(self, n: int, like: torch.Tensor, with_zq: bool):
        self.parts: list[tuple] = []
        self.with_zq = with_zq
        self.full = torch.zeros(n, dtype=torch.bool, device=like.device)

    def add(self, x: torch.Tensor, s: torch.Tensor, u: torch.Tensor, zq: torch.Tensor) -> None:
        """``x`` [n, t]: > 0 exactly at the bracket's ids (overwritten), s, u, z_q of the tile."""
        top, idx = torch.topk(x, min(TAKE, x.shape[-1]), dim=-1)
        inside = top > 0
        self.full |= inside[:, -1] & (x.shape[-1] > TAKE)
        got = torch.where(inside, s.gather(-1, idx), torch.full_like(top, -torch.inf))
        self.parts.append((got, u.gather(-1, idx), zq.gather(-1, idx) if self.with_zq else None))

    def sorted(self) -> tuple[torch.Tensor, ...]:
        """(s, u, z_q or None) [n, K] in float64, by descending s (−inf: no token)."""
        s, u, zq = (None if x[0] is None else torch.cat(x, dim=-1) for x in zip(*self.parts))
        s, order = torch.sort(s, dim=-1, descending=True)
        return (s.to(torch.float64), u.gather(-1, order).to(torch.float64),
                None if zq is None else zq.gather(-1, order).to(torch.float64))


def _family_tile(plan: Plan, fam: Family, x: dict, first: dict, acc: dict, scratch: list) -> None:
    """One family's sums over a tile's ids kept for certain (s above its bracket) and its bracket's tokens.
    ``x``: the tile's s, u, ψ, z_q, q's probabilities wq and δ [n, 1]; ``acc``: the family's sums. Masks
    are float 0/1 (a comparison into float and a product: a third of a boolean mask's time on a CPU)."""
    got = first["fam"][fam.name]
    s, u = x["s"][fam.name], x["u"]
    own = s is x["zq"]
    w = x["wq"] if own else torch.sub(s, got["lse"].to(s.dtype).unsqueeze(-1), out=scratch[4]).exp_()
    above = torch.gt(s, got["hi"], out=scratch[5])
    wa = torch.mul(w, above, out=scratch[6])
    total = wa.sum(-1)
    acc["mass"].append(total)
    acc["sums"].append(tile_sums(plan.basis, [wa], u, x["psi"], scratch, [plan.weight_degree(fam)], [total])[0])
    if plan.spread(fam):
        fin = torch.where(wa > 0, s, torch.zeros_like(s)) if x["banned"] else s
        mean = torch.mul(wa, fin, out=scratch[0]).sum(-1) / total.clamp(min=torch.finfo(wa.dtype).tiny)
        acc["spread"].append((total, mean, torch.sub(fin, mean.unsqueeze(-1), out=scratch[0]).square_().mul_(wa).sum(-1)))
        if x["delta"] is not None:                                             # a sign-changing f: P(f < 0)
            lr = torch.add(u, x["delta"], out=scratch[0])                      # log r = u + δ
            acc["neg"].append(torch.stack([torch.where(plan.fns[j](lr) < 0, wa, 0.0).sum(-1) if plan.sign[j]
                                           else torch.zeros_like(total) for j in range(len(plan.fns))], -1))
    if acc["bracket"].with_zq:                                                 # q's mass inside the support
        acc["q_in"].append(torch.mul(x["wq"], above, out=scratch[0]).sum(-1))
    # s − lo > 0 inside the bracket: below it −inf (threshold), above it pushed far below 0
    inside = torch.nn.functional.threshold_(torch.sub(s, got["lo"], out=scratch[4]), 0.0, -torch.inf)
    acc["bracket"].add(inside.sub_(above, alpha=1e30), s, u, x["zq"])


def _second(scan: Scan, plan: Plan, fams: list[Family], first: dict, centre: torch.Tensor) -> Chunk:
    """Pass 2: the sampled tokens' values, the reference's normaliser (unless the first pass made it), q's
    moments about the centre c [n], and per family its sums over the ids kept for certain and its
    bracket's tokens; then τ and every value (:func:`_finish_family`)."""
    dt = scan.hq.dtype
    c = centre.to(dt)
    early = first["lse_p"] is not None
    delta = c.to(torch.float64) + first["lse_q"] - first["lse_p"] if early else None
    work = _Work(scan.n, min(scan.tile, plan.vocab), scan.hq, extra=6)
    rec = {"q": [], "p": [], "tok": []}
    acc = {f.name: {"mass": [], "sums": [], "spread": [], "neg": [], "q_in": [],
                    "bracket": _Bracket(scan.n, scan.hq, f.name == "b" and not _own(scan, f))} for f in fams}
    for lo in range(0, plan.vocab, scan.tile):
        z, buf, _ = work.logits(scan, lo, min(lo + scan.tile, plan.vocab))
        s = {f.name: scan.scores(z[f.source], lo) for f in fams}
        tok = scan.gather(lo, [z["zq"], z["zp"]] + [s[f.name] for f in fams])
        if tok is not None:
            rec["tok"].append(tok)
        u = torch.sub(z["zp"], z["zq"], out=buf[0]).sub_(c.unsqueeze(-1))
        if not early:                                                    # z_p is not needed after u
            mp = row_max(z["zp"])
            rec["p"].append((mp.squeeze(-1), z["zp"].sub_(mp).exp_().sum(-1)))
        x = {"zq": z["zq"], "u": u, "psi": torch.expm1(u, out=buf[1]).sub_(u), "banned": scan.banned, "s": s,
             "wq": torch.sub(z["zq"], first["lse_q"].to(dt).unsqueeze(-1), out=buf[2]).exp_(),
             "delta": None if delta is None else delta.to(dt).unsqueeze(-1)}
        total = x["wq"].sum(-1)
        rec["q"].append(tile_sums(plan.basis, [x["wq"]], u, x["psi"], buf[3:], [plan.weight_degree(None)], [total])[0])
        for f in fams:
            _family_tile(plan, f, x, first, acc[f.name], buf[3:])
    lse_p = first["lse_p"] if early else _lse(rec["p"])
    delta = c.to(torch.float64) + first["lse_q"] - lse_p
    moments = torch.stack(rec["q"]).to(torch.float64).sum(0)
    moments = moments / moments[:, :1]
    mean_q, var_q = poly_columns(plan, moments, delta, plan.var_q())
    out = Chunk(-(delta + moments[:, 1]), first["lse_q"], lse_p, mean_q, var_q,
                _tokens(plan, fams, rec["tok"], scan.n, lse_p), {})
    for f in fams:
        out.fam[f.name] = _finish_family(plan, f, first, acc[f.name], out, delta)
    return out


def _tokens(plan: Plan, fams: list[Family], parts: list, n: int, like: torch.Tensor) -> torch.Tensor:
    """(z_q, z_p, s of each family) at the sampled ids [n, 2 + families], float64 (NaN without ids)."""
    tok = torch.full((n, 2 + len(plan.families)), torch.nan, dtype=torch.float64, device=like.device)
    cols = [0, 1] + [2 + plan.families.index(f) for f in fams]
    for vals, here in parts:
        tok[:, cols] = torch.where(here.unsqueeze(-1), vals.to(torch.float64), tok[:, cols])
    return tok


def _own(scan: Scan, fam: Family) -> bool:
    """The family's scores are z_q itself (scan.scores returns its input: no temperature, penalty or ban)."""
    sp = scan.sampler
    return fam.source == "zq" and sp.temperature == 1.0 and sp.repetition_penalty == 1.0 and not scan.banned


def _monomials(plan: Plan, u: torch.Tensor) -> torch.Tensor:
    """u^i ψ(u)^j [..., K] of every monomial of the basis (float64 u)."""
    psi = torch.expm1(u) - u
    return torch.stack([u ** i * psi ** j for i, j in plan.basis.monomials], dim=-1)


def _threshold(p: float, mass: torch.Tensor, s: torch.Tensor, lse: torch.Tensor):
    """τ among the bracket's sorted scores s [n, K] (float64): a token is kept while the mass before it
    (the mass above the bracket plus the bracket's tokens before it) is below p. Returns (probabilities
    [n, K], kept [n, K], τ [n], ok [n]: the bracket held τ)."""
    prob = torch.exp(s - lse.unsqueeze(-1))                                   # 0 where s = −inf
    before = mass.unsqueeze(-1) + torch.cumsum(prob, -1) - prob
    kept = (before < p) & torch.isfinite(s)
    n = kept.sum(-1)
    tau = s.gather(-1, (n - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ok = (mass < p) & (mass + prob.sum(-1) >= p) & (n >= 1)
    return prob, kept, tau, ok


def _finish_family(plan: Plan, fam: Family, first: dict, acc: dict, out: Chunk, delta: torch.Tensor) -> Sampled:
    """A family's values from its sums over the ids kept for certain and its bracket's tokens (float64)."""
    got = first["fam"][fam.name]
    s, u, zq = acc["bracket"].sorted()
    above = torch.stack(acc["mass"]).to(torch.float64).sum(0)
    prob, kept, tau, ok = _threshold(plan.sampler.p, above, s, got["lse"])
    ok &= got["ok"] & ~acc["bracket"].full
    w = torch.where(kept, prob, torch.zeros_like(prob))
    z = above + w.sum(-1)                                        # b's mass inside its support, untruncated
    mono = _monomials(plan, u)
    sums = torch.stack(acc["sums"]).to(torch.float64).sum(0)
    moments = (torch.nan_to_num(sums, nan=0.0) + (w.unsqueeze(-1) * mono).sum(1)) / z.unsqueeze(-1)
    mean, var = poly_columns(plan, moments, delta, plan.spread(fam))
    nan = torch.full_like(z, torch.nan)
    neg = torch.full_like(mean, torch.nan)
    neg[:, [j for j, sign in enumerate(plan.sign) if not sign]] = 0.0
    log_z = got["lse"] + torch.log(z)
    log_mean, log_var = nan, nan
    if plan.spread(fam):
        log_mean, log_var = _log_b(acc["spread"], w, s, z, log_z)
        lr = u + delta.unsqueeze(-1)
        below = torch.stack([(w * (plan.fns[j](lr) < 0)).sum(-1) for j in range(len(plan.fns))], -1)
        if acc["neg"]:
            # host: which estimators change sign, a constant of the plan
            neg = torch.where(torch.tensor(plan.sign, device=z.device),
                              (torch.stack(acc["neg"]).to(torch.float64).sum(0) + below) / z.unsqueeze(-1), neg)
    q_in = nan if fam.name != "b" else z if zq is None else (    # b = q untruncated: its own mass
        torch.stack(acc["q_in"]).to(torch.float64).sum(0)
        + torch.where(kept, torch.exp(zq - out.lse_q.unsqueeze(-1)), torch.zeros_like(zq)).sum(-1))
    s_tok = out.tok[:, 2 + plan.families.index(fam)]
    tok_log = torch.where(s_tok >= tau, s_tok - log_z, torch.full_like(s_tok, -torch.inf))
    return Sampled(mean, var, neg, (1.0 - q_in).clamp(min=0.0), log_mean, log_var,
                   torch.where(torch.isnan(s_tok), s_tok, tok_log), got["lse"], tau, ~ok, nan, nan, nan, s_tok)


def _log_b(parts: list, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, log_z: torch.Tensor):
    """E_b[log b], Var_b[log b] [n]: the spread of s over the tiles' certain ids and the bracket's kept
    tokens (Chan's combination, all on the probability scale), less log Z_b."""
    total, mean, m2 = (torch.stack(x).to(torch.float64) for x in zip(*parts))
    fin = torch.where(w > 0, s, torch.zeros_like(s))
    wb = w.sum(-1)
    mb = (w * fin).sum(-1) / wb.clamp(min=torch.finfo(torch.float64).tiny)
    m2b = (w * (fin - mb.unsqueeze(-1)).square()).sum(-1)
    scale = torch.zeros(total.shape[0] + 1, total.shape[1], dtype=torch.float64, device=z.device)
    mu, var = chan(scale, torch.cat([total, wb.unsqueeze(0)]), torch.cat([mean, mb.unsqueeze(0)]),
                   torch.cat([m2, m2b.unsqueeze(0)]))
    return mu - log_z, var


def flat_values(scan: Scan, plan: Plan, centre: torch.Tensor) -> Chunk:
    """A chunk of flat rows' values in two passes (the module's docstring), about the centre c [n] of
    :func:`flat_rows`; rows whose bracket does not check out are ``unknown`` in every truncating family,
    for the widening pass."""
    fams = [f for f in plan.families if f.kind == "cut"]
    first = _first(scan, plan, fams)
    out = _second(scan, plan, fams, first, centre)
    bad = torch.stack([out.fam[f.name].unknown for f in fams]).any(0)
    for f in fams:
        out.fam[f.name].unknown = bad                            # one widening pass serves both families
    return out
