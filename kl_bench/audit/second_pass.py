"""The second streaming pass of the audit (two more forwards), run only for what one pass cannot give:
non-polynomial estimators, P(f < 0) of sign-changing ones under a full-support sampler, rows whose
sampler support is not inside the candidates (τ found by widening), and rows a float32 tile sum spoiled."""
from __future__ import annotations

import torch

from .stream_plan import Chunk, Family, Plan
from .tiling import Scan, chan, logsum, row_max, threshold


def _widen(scan: Scan, plan: Plan, fams: list[Family], lse_s: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(τ [n], log Z_b [n]) of each family for rows whose support reaches past the candidates (a flat
    row's nucleus): each row's whole score vector, made tile by tile in one pass shared by the families
    (O(V) per such row; the very same rounded scores as the first pass), τ from all of it, and
    log Σ_{s ≥ τ} e^s. The scores are sorted in their own dtype (the order and the values are those of
    their exact float64 images, at half the bytes)."""
    parts: list[list[torch.Tensor]] = [[] for _ in fams]
    for t in scan.tiles(policy_only=True):
        for fam, kept in zip(fams, parts):
            kept.append(scan.scores(t[fam.source], t["lo"]))
    out = []
    for kept, lse in zip(parts, lse_s):
        cand = torch.sort(torch.cat(kept, dim=-1), dim=-1, descending=True).values.to(torch.float64)
        tau = threshold(plan.sampler, cand, lse, plan.vocab)[0]
        out.append((tau, torch.logsumexp(torch.where(cand >= tau.unsqueeze(-1), cand, torch.full_like(cand, -torch.inf)),
                                         -1)))
    return out


class _Spread:
    """Per-tile (log-scale, Σ w, weighted mean, Σ w (x − mean)²) of columns x [n, t, C], combined over
    tiles by :func:`chan` (float64) at the end."""

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
        mu, var = chan(scale, total, mean, m2)
        return logsum(scale, total), mu, var


def _second_pass(scan: Scan, fns, lse_q, lse_p, fams: list[tuple], with_q: bool = True):
    """With the normalisers and each family's threshold τ known, one more pass over the tiles, shared by
    the families ``fams`` (source, τ [n], log Z_b [n] or None): moments under q of ``fns`` (when
    ``with_q``) and under each family (scores from ``source``'s logits) of (f, 1[f < 0], z_q, s), and the
    q-mass outside its support. With the family's normaliser log Z_b known in advance, one more column
    last: |log b − log q| = |s − log Z_b − z_q + lse_q|. Returns (q: (mean, var) [n, F] or None; per
    family ((log Z [n], mean [n, 2F + 2 (+1)], var likewise, χ² [n]), miss [n])). Sums run in float64 (f
    itself, as the dense path); each family's sums are those a pass of its own would make."""
    under_q, per = _Spread(), [(_Spread(), [], []) for _ in fams]
    shift = (lse_q - lse_p).unsqueeze(-1)
    for t in scan.tiles():
        logr = (t["zp"] - t["zq"]).to(torch.float64) + shift
        f = torch.stack([fn(logr) for fn in fns], dim=-1) if fns else logr.new_zeros(logr.shape + (0,))
        zq64 = t["zq"].to(torch.float64)
        wq = torch.exp(zq64 - lse_q.unsqueeze(-1))
        if with_q:
            under_q.add(torch.zeros_like(lse_q), wq, f)
        below = (f < 0).to(f.dtype)
        for (source, tau, log_zb), (under_b, miss, chi) in zip(fams, per):
            s = scan.scores(t[source], t["lo"])
            inside = s >= tau.unsqueeze(-1).to(s.dtype)
            ms = row_max(torch.where(inside, s, torch.full_like(s, -torch.inf))).to(torch.float64)
            s64 = s.to(torch.float64)
            wb = torch.where(inside, torch.exp(s64 - ms), torch.zeros_like(wq))
            cols = [f, below, zq64.unsqueeze(-1), s64.unsqueeze(-1)]
            if log_zb is not None:
                cols.append((s64 - (log_zb - lse_q).unsqueeze(-1) - zq64).abs().unsqueeze(-1))
            under_b.add(ms.squeeze(-1), wb, torch.cat(cols, -1))
            miss.append(torch.where(inside, torch.zeros_like(wq), wq).sum(-1))
            chi.append(torch.logsumexp(torch.where(inside, 2 * zq64 - s64, torch.full_like(zq64, -torch.inf)), -1))
    out = []
    for under_b, miss, chi in per:
        log_zb, mean_b, var_b = under_b.combine()
        # columns of b: f [F], 1[f < 0] [F], z_q, s; Σ_{b>0} q²/b = e^{log Z_b − 2 lse_q} Σ e^{2 z_q − s}
        chi2 = torch.expm1(torch.logsumexp(torch.stack(chi), 0) + log_zb[:, 0] - 2 * lse_q)
        out.append(((log_zb[:, 0], mean_b, var_b, chi2), torch.stack(miss).sum(0)))
    return (under_q.combine()[1:] if with_q else None), out


def negative_pass(scan: Scan, plan: Plan, out: Chunk, wanted: list[tuple[Family, list[int]]]) -> None:
    """P(f < 0) [n] of polynomial estimators that change sign, under each family with full support in
    ``wanted`` (family, its columns): the sign of f(log r) needs log r = d + (lse_q − lse_p), so one more
    pass, in the compute dtype (f's sign at a token is decided by log r to the logits' own rounding). The
    families share the pass: each tile's logits, log r and signs are made once, and each family sums its
    own weights over them (the same tile values and operations as a pass of its own, so the same sums)."""
    shift = (out.lse_q - out.lse_p).unsqueeze(-1)
    sums = [torch.zeros(out.kl.shape[0], len(cols), dtype=torch.float64, device=out.kl.device) for _, cols in wanted]
    for t in scan.tiles():
        logr = (t["zp"] - t["zq"]).add_(shift.to(t["zq"].dtype))
        # 1[f < 0] as a float 0/1 (a comparison into float and a product: a third of a boolean where's time)
        signs = {j: torch.lt(plan.fns[j](logr), 0, out=torch.empty_like(logr))
                 for j in sorted({j for _, cols in wanted for j in cols})}
        for (fam, cols), acc in zip(wanted, sums):
            s = t["zq"] if fam.kind == "same" else scan.scores(t[fam.source], t["lo"])
            wb = torch.sub(s, out.fam[fam.name].lse.unsqueeze(-1).to(s.dtype)).exp_()
            for i, j in enumerate(cols):
                acc[:, i] += torch.mul(signs[j], wb).sum(-1).to(torch.float64)
    for (fam, cols), acc in zip(wanted, sums):
        for i, j in enumerate(cols):
            out.fam[fam.name].neg[:, j] = acc[:, i]


def redo_columns(scan: Scan, plan: Plan, fam: Family, out: Chunk, cols: list[int]) -> None:
    """The second pass for the moments of non-polynomial estimators (and their q moments) under ``fam``
    (every row); P(f < 0) of polynomial ones that change sign is :func:`negative_pass`'s."""
    cols = [j for j in cols if plan.poly[j] is None]
    if not cols:
        return
    got = out.fam[fam.name]
    fns = [plan.fns[j] for j in cols]
    (mean_q, var_q), [((_, mean_b, var_b, _), _)] = _second_pass(scan, fns, out.lse_q, out.lse_p,
                                                                [(fam.source, got.tau, None)])
    nf = len(cols)
    for i, j in enumerate(cols):
        out.mean_q[:, j], out.var_q[:, j] = mean_q[:, i], var_q[:, i]
        if fam.kind == "same":
            got.mean[:, j], got.var[:, j] = mean_q[:, i], var_q[:, i]
        if fam.kind != "cut":
            got.mean[:, j], got.var[:, j], got.neg[:, j] = mean_b[:, i], var_b[:, i], mean_b[:, nf + i]


def redo_rows(scan: Scan, plan: Plan, out: Chunk, fams: list[Family], unknown: list[torch.Tensor],
              rows: torch.Tensor) -> None:
    """The second pass for ``rows`` (an index tensor), where the support of one of ``fams`` may reach past
    its candidates (``unknown`` [n] of each): τ from the whole score vector, then everything under the
    family summed over the tiles. The families share both passes over these rows (the widening pass makes
    z_q and z_g once, the summing pass z_q, z_p and z_g once); each family's values are written on its own."""
    sub = scan.rows(rows)
    widened = _widen(sub, plan, fams, [out.fam[f.name].lse[rows] for f in fams])
    _, res = _second_pass(sub, list(plan.fns), out.lse_q[rows], out.lse_p[rows],
                          [(f.source, tau, zb) for f, (tau, zb) in zip(fams, widened)], with_q=False)
    for fam, mine, (tau, _), (sums, miss) in zip(fams, unknown, widened, res):
        _write_rows(plan, fam, out, rows, mine[rows], tau, sums, miss)


def _write_rows(plan: Plan, fam: Family, out: Chunk, rows: torch.Tensor, keep: torch.Tensor, tau: torch.Tensor,
                sums: tuple, miss: torch.Tensor) -> None:
    """A family's second-pass values on those of ``rows`` where ``keep`` (its own rows among the union's:
    blended, not selected, which would read ``keep`` back to the host): its threshold, sums (log Z, mean,
    var, χ²) and miss."""
    got = out.fam[fam.name]
    log_z, mean, var, chi2 = sums
    nf = len(plan.fns)
    zq, s, gap = 2 * nf, 2 * nf + 1, 2 * nf + 2                  # the columns after f and 1[f < 0]
    s_tok = out.tok[rows, 2 + plan.families.index(fam)]
    tok_log = torch.where(s_tok >= tau, s_tok - log_z, torch.full_like(s_tok, -torch.inf))
    log_mean = mean[:, s] - log_z
    new = {"tau": tau, "mean": mean[:, :nf], "var": var[:, :nf], "neg": mean[:, nf:2 * nf], "log_mean": log_mean,
           "log_var": var[:, s], "kl_q": log_mean - (mean[:, zq] - out.lse_q[rows]),
           # E_b|log b − log q|: the widening pass gave log Z_b before this one (a top-p nucleus past the candidates)
           "chi2": chi2, "gap_abs": mean[:, gap], "miss": miss,
           "tok_log": torch.where(torch.isnan(s_tok), s_tok, tok_log)}
    for name, value in new.items():
        field = getattr(got, name)
        mine = keep.view(-1, *([1] * (value.dim() - 1)))
        field[rows] = torch.where(mine, value.to(field.dtype), field[rows])


def spoiled(plan: Plan, out: Chunk) -> torch.Tensor:
    """Rows [n] where a one-pass moment is not finite: a float32 tile sum overflowed (u⁴, ψ⁴ at |u| ≳ 20),
    or log r is infinite somewhere (p or q is 0 at an id), which the moments cannot carry. Variances that
    were not wanted (NaN: not computed) are not looked at."""
    cols = [j for j, p in enumerate(plan.poly) if p is not None]
    parts = [~torch.isfinite(out.kl)]
    checked = [out.mean_q] + ([out.var_q] if plan.var_q() else [])
    for f in plan.families:
        if f.kind == "full":
            checked += [out.fam[f.name].mean] + ([out.fam[f.name].var] if plan.spread(f) else [])
    for x in checked:
        parts.append(~torch.isfinite(x[:, cols]).all(-1) if cols else torch.zeros_like(parts[0]))
    return torch.stack(parts).any(0)


def redo_spoiled(scan: Scan, plan: Plan, out: Chunk, rows: torch.Tensor) -> None:
    """Spoiled rows from the second pass, which sums f(log r) itself in float64 (an infinite f where its
    weight is 0 counts 0; where it is not, the value is rightly infinite)."""
    sub = scan.rows(rows)
    fns = list(plan.fns) + [lambda logr: -logr]                      # KL = E_q[−log r]
    nf = len(plan.fns)
    q, res = _second_pass(sub, fns, out.lse_q[rows], out.lse_p[rows],
                          [(fam.source, out.fam[fam.name].tau[rows], None) for fam in plan.families])
    for fam, ((_, mean, var, _), _) in zip(plan.families, res):
        got = out.fam[fam.name]
        if fam.kind != "cut":
            got.mean[rows], got.var[rows] = mean[:, :nf], var[:, :nf]
            got.neg[rows] = torch.where(torch.isnan(got.neg[rows]), got.neg[rows], mean[:, nf + 1:2 * nf + 1])
    out.kl[rows] = q[0][:, -1]
    out.mean_q[rows], out.var_q[rows] = q[0][:, :nf], q[1][:, :nf]
