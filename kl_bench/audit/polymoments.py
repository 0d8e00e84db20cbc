"""Exact moments of polynomial estimators from one pass over the vocabulary (docs/audit.md §2, "One pass
for polynomial estimators": why u and ψ(u) = expm1(u) − u, and not r).

At a position log r = u + δ with u = d − μ (d = z_p − z_q, μ a centre) and δ = μ + lse_q − lse_p known
only after the last tile. Every r^s (log r)^k = e^{sδ} (1 + u + ψ)^s (u + δ)^k is a polynomial in (u, ψ)
whose coefficients depend on δ alone, so E[f] and Var[f] of a polynomial estimator are fixed combinations
of the moments E[u^i ψ^j], summed tile by tile about each tile's own centre and moved to one centre at the
end exactly (:meth:`Basis.recentre`). All polynomial algebra is float64 on the inputs' device; shapes
[..., K] over the K monomials.
"""
from __future__ import annotations

import math

import torch

Poly = dict[tuple[int, int], float]


def _contract(coefficients: torch.Tensor, moments: torch.Tensor) -> torch.Tensor:
    """Σ_k c_k m_k over the last axis, a term with c_k = 0 counting 0 whatever m_k: a moment that
    overflowed (float32 tile sums of u⁴ or ψ⁴ at |u| ≳ 20) then spoils only what needs it, never the KL."""
    return torch.where(coefficients == 0, torch.zeros_like(coefficients), coefficients * moments).sum(-1)


def degree(poly: Poly) -> int:
    """The degree in (u, ψ) of Σ a r^s (log r)^k: max s + k (r is linear in (u, ψ), log r too)."""
    return max((s + k for (s, k), a in poly.items() if a != 0), default=0)


class Basis:
    """The monomials u^i ψ^j with i + j ≤ ``degree``, in a fixed order, and their algebra.

    A polynomial is a tensor [..., K] of its coefficients; a moment vector is a tensor [..., K] of
    E[u^i ψ^j] (entry 0 is E[1]). Products are truncated at ``degree`` (every product formed here has
    degree ≤ ``degree``, so nothing is dropped)."""

    def __init__(self, degree: int):
        self.degree = degree
        self.monomials = [(i, j) for total in range(degree + 1) for i in range(total, -1, -1) for j in [total - i]]
        self.index = {m: k for k, m in enumerate(self.monomials)}
        pairs = [(a, b, self.index[(i1 + i2, j1 + j2)])
                 for a, (i1, j1) in enumerate(self.monomials) for b, (i2, j2) in enumerate(self.monomials)
                 if i1 + i2 + j1 + j2 <= degree]
        # host: an index table, moved to each device once (_on); [3, P] on the CPU; moved on use
        self._pairs = torch.tensor(pairs, dtype=torch.long).T

    @property
    def size(self) -> int:
        return len(self.monomials)

    def _on(self, device) -> torch.Tensor:
        cache = self.__dict__.setdefault("_pairs_on", {})
        key = str(device)
        if key not in cache:
            cache[key] = self._pairs.to(device)
        return cache[key]

    def mul(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The product of two polynomials [..., K] (broadcast), truncated at the degree."""
        a, b, k = self._on(x.device)
        terms = x[..., a] * y[..., b]
        out = torch.zeros(terms.shape[:-1] + (self.size,), dtype=terms.dtype, device=terms.device)
        return out.index_add_(-1, k, terms)

    def linear(self, const: torch.Tensor, u: torch.Tensor | float, psi: torch.Tensor | float) -> torch.Tensor:
        """const + u·u + psi·ψ as a polynomial [..., K] (broadcast over the coefficients' shapes)."""
        device = next((x.device for x in (const, u, psi) if isinstance(x, torch.Tensor)), None)
        const = torch.as_tensor(const, dtype=torch.float64, device=device)
        shape = torch.broadcast_shapes(const.shape, torch.as_tensor(u, device=device).shape,
                                       torch.as_tensor(psi, device=device).shape)
        out = torch.zeros(shape + (self.size,), dtype=torch.float64, device=const.device)
        out[..., self.index[(0, 0)]] = const
        if self.degree >= 1:
            out[..., self.index[(1, 0)]] = u
            out[..., self.index[(0, 1)]] = psi
        return out

    def power_table(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[x⁰, x¹, ..., x^degree] for a polynomial x [..., K]."""
        one = torch.zeros_like(x)
        one[..., 0] = 1.0
        out = [one]
        for _ in range(self.degree):
            out.append(self.mul(out[-1], x))
        return out

    def recentre(self, moments: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Moments about the centre μ [..., K] → moments about μ + Δ (``delta`` [...]): E[u'^i ψ(u')^j] with
        u' = u − Δ, ψ(u') = e^{−Δ} ψ + expm1(−Δ) u + ψ(−Δ), every monomial expanded exactly in (u, ψ)."""
        if self.degree == 0:
            return moments
        em1 = torch.expm1(-delta)
        shift_u = self.linear(-delta, 1.0, 0.0)
        shift_psi = self.linear(em1 + delta, em1, em1 + 1.0)          # ψ(−Δ) = expm1(−Δ) + Δ
        up, pp = self.power_table(shift_u), self.power_table(shift_psi)
        rows = torch.stack([self.mul(up[i], pp[j]) for i, j in self.monomials], dim=-2)      # [..., K, K]
        return _contract(rows, moments.unsqueeze(-2))

    def estimator(self, poly: Poly, delta: torch.Tensor) -> torch.Tensor:
        """f = Σ a r^s (log r)^k as a polynomial in (u, ψ) [..., K], with log r = u + δ (``delta`` [...])."""
        r = self.linear(torch.exp(delta), torch.exp(delta), torch.exp(delta))     # e^δ (1 + u + ψ)
        logr = self.linear(delta, 1.0, 0.0)
        rp, lp = self.power_table(r), self.power_table(logr)
        out = torch.zeros(delta.shape + (self.size,), dtype=torch.float64, device=delta.device)
        for (s, k), a in poly.items():
            if a:
                out = out + a * self.mul(rp[s], lp[k])
        return out

    def mean_and_var(self, f: torch.Tensor, moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """E[f] and Var[f] = E[(f − E f)²] from a polynomial f [..., K] and normalised moments [..., K]."""
        mean = _contract(f, moments)
        g = f.clone()
        g[..., 0] = g[..., 0] - mean
        var = _contract(self.mul(g, g), moments)
        return mean, var.clamp(min=0.0)


def tile_sums(basis: Basis, weights: list[torch.Tensor], u: torch.Tensor, psi_u: torch.Tensor,
              scratch: list[torch.Tensor], degrees: list[int] | None = None,
              totals: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """Σ_v w(v) u(v)^i ψ(v)^j [n, K] for every monomial and each weight vector in ``weights`` (each [n, t]),
    from the tile's u and ψ(u) [n, t], in their dtype (torch's pairwise row sums).

    ``degrees``: per weight, the highest degree i + j summed (None: the basis degree); the monomials above
    it are NaN (not computed: a mean needs degree f, only a variance 2·degree f). ``totals``: per weight,
    Σ w where the caller has summed it already (the same row sum of the same tensor: the same bits).
    ``scratch``: at least :func:`scratch_needed` buffers of the tiles' shape, overwritten (no allocation
    of tile size: a fresh CPU tensor of a few MB costs more in page faults than the arithmetic on it; None
    entries make new tensors, which torch.compile fuses away: kl_bench.audit.fused).
    Each monomial is one product and one row sum: w·u^i is built by multiplying by u in turn, and each
    w·u^i·ψ^j from w·u^i·ψ^(j−1) (at most D = 4 products, 1 ulp each)."""
    degrees = [basis.degree] * len(weights) if degrees is None else degrees
    totals = [None] * len(weights) if totals is None else totals
    return [_weight_sums(basis, w, u, psi_u, scratch, deg, total) for w, deg, total in zip(weights, degrees, totals)]


def _weight_sums(basis: Basis, w: torch.Tensor, u: torch.Tensor, psi_u: torch.Tensor, scratch: list[torch.Tensor],
                 deg: int, total: torch.Tensor | None) -> torch.Tensor:
    """One weight's monomial sums [n, K] up to degree ``deg`` (NaN above it); ``scratch``: work buffers."""
    ping, pong, c_ping, c_pong = scratch[:4]
    row = {(0, 0): w.sum(-1) if total is None else total}
    a = w
    for i in range(deg + 1):
        if i:
            a = torch.mul(a, u, out=pong if a is ping else ping)                     # w·u^i
            row[(i, 0)] = a.sum(-1)
        c = a
        for j in range(1, deg + 1 - i):
            c = torch.mul(c, psi_u, out=c_pong if c is c_ping else c_ping)           # w·u^i·ψ^j
            row[(i, j)] = c.sum(-1)
    nan = torch.full_like(row[(0, 0)], torch.nan) if len(row) < basis.size else None
    return torch.stack([row.get(m, nan) for m in basis.monomials], dim=-1)


def scratch_needed(basis: Basis) -> int:
    """The scratch buffers :func:`tile_sums` needs (four: two for w·u^i, two for its ψ^j chain)."""
    return 4


def finish_family(basis: Basis, log_scale: torch.Tensor, sums: torch.Tensor, centres: torch.Tensor,
                  centre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One weight family's tiles combined: (log Σ w, normalised moments [n, K] about ``centre`` [n]).

    ``log_scale`` [T, n]: each tile's log factor (its weights were exp(a − log_scale)); ``sums`` [T, n, K]:
    its monomial sums about its own centre ``centres`` [T, n]."""
    sums = sums.to(torch.float64)
    log_w = log_scale.to(torch.float64) + torch.log(sums[..., 0])      # log Σ w of each tile
    total = torch.logsumexp(log_w, dim=0)
    share = torch.exp(log_w - total)                                    # each tile's share of the weight
    share = torch.where(torch.isnan(share), torch.zeros_like(share), share)   # empty tiles (Σ w = 0)
    norm = sums / sums[..., :1].clamp(min=torch.finfo(torch.float64).tiny)
    moved = basis.recentre(norm, centre.unsqueeze(0) - centres.to(torch.float64))
    return total, (share.unsqueeze(-1) * moved).sum(0)


def psi(u: torch.Tensor) -> torch.Tensor:
    """ψ(u) = e^u − 1 − u, ≥ 0, from expm1 (no cancellation at small |u|)."""
    return torch.expm1(u) - u


LOG_TINY = math.log(torch.finfo(torch.float64).tiny)
