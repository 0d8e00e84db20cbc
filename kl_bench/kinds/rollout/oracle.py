"""The rollout kind's exact values, by aggregate (docs/rollouts.md#what-the-program-computes): every one a
moment E[M S^k] of the phased dynamic program (kl_bench.kinds.rollout.dp), combined on the host.

- truth: KL(q‖p) = −E_q[L], KL(p‖q) = E_q[RL] (the float64 tables even where the rows see rounded log r),
  E_q|y| for the rows that are rates per token;
- ``seq``: a polynomial f = Σ c R^s L^k has E f = Σ c E[R^s L^k] and E f² from the squared polynomial
  (under a sampler: E_b[W^j R^s L^k]); other functions of L have no exact value here (NaN);
- ``tok``: Σ_t f(log r_t) is additive along the path (h = f, or h = w·f with token weights; W
  multiplicative with sequence weights);
- ``tok_mean``, ``tok_gm``, ``tok_batch``: the program split by the final length |y|, then exact sums over
  ℓ (and, for the token-mean of B sequences, the FFT convolutions of kl_bench.core.rollout_dp).

A :class:`RolloutOracle` holds its model and the values computed once per case (the moments E_q[R^s L^k]
by s, E_q|y|, the length spectra and factors of the token-mean rows).
"""
from __future__ import annotations

import math

import torch

from ...core import gates, rollout_dp
from ...core.estimators import RowSource, poly_square
from ...core.oracles import context_tv
from ...core.targets import FORWARD, REVERSE, TV
from ..protocols import JointMoments
from . import dp
from .model import RolloutModel


# Variances here are E[X²] − E[X]², each side a float64 sum of the program's terms: a difference within a
# few ulps of E[X²] is rounding, not spread (a row that is one constant, such as the analytic KL of a
# one-step rollout's first bucket, came out with a std of 8e-10 = √(ulps of E[X²]) where its measured std
# is exactly 0, and the gate failed it). Such a variance is 0: the true one is below what the formula
# resolves. Eight ulps: both moments rounded, and the square.
CANCELLATION_ULPS = 8.0


def mean_var(mean: float, second: float) -> tuple[float, float]:
    """(mean, variance) from the first two moments; an infinite second moment is an infinite variance, and one
    within :data:`CANCELLATION_ULPS` of E[X²] (cancellation) is 0."""
    if math.isnan(mean) or math.isnan(second):
        return mean, math.nan             # unknown, as before: not a variance of 0, nor an infinite one
    if not math.isfinite(second):
        return mean, math.inf
    var = second - mean * mean
    return mean, (var if var > CANCELLATION_ULPS * 2.0**-52 * abs(second) else 0.0)


def cumulative_moments(model: RolloutModel, f: torch.Tensor) -> tuple[float, float]:
    """(E_b[S], E_b[S²]) of S = Σ_t ρ_{1:t} f(c_t, x_t), ρ_{1:t} = Π_{s≤t} w_s the prefix's (corrected) weight
    (CTPO's cumulative weights), exactly: a forward pass over the buckets carrying, per bucket, the masses
    E[1], E[ρ], E[ρ²], E[S], E[Sρ], E[S²] of the paths alive there. A step with token weight w and value f maps
    ρ → ρw and S → S + fρw, so Sρ → wSρ + fw²ρ² and S² → S² + 2fw·Sρ + f²w²ρ²: linear in the carried
    masses. ``f`` [C, V]; a rejection mask's per-token factor multiplies each step (its square is itself)."""
    c_n, v = model.log_q.shape
    dev = model.log_q.device
    cont = torch.ones(v, dtype=torch.bool, device=dev)
    if model.eos is not None:
        cont[model.eos] = False
    state = torch.zeros(6, c_n, dtype=torch.float64, device=dev)      # 1, ρ, ρ², S, Sρ, S² per bucket
    state[:3, 0] = 1.0
    ended = torch.zeros(6, dtype=torch.float64, device=dev)
    t = 0
    for lb, steps in model.phases:
        b = lb.exp()
        law = torch.where(b > 0, b * model.keep_table(lb), torch.zeros_like(b))            # [C, V]
        w = torch.where(b > 0, model.token_weight(lb), torch.zeros_like(b))
        h = torch.where(b > 0, f, torch.zeros_like(f))
        for _ in range(steps):
            one, r1, r2, s1, sr, s2 = (x[:, None] for x in state)          # [C, 1] each
            new = torch.stack([one * law, r1 * w * law, r2 * w * w * law, (s1 + h * w * r1) * law,
                               (w * sr + h * w * w * r2) * law, (s2 + 2 * h * w * sr + h * h * w * w * r2) * law])
            t += 1
            last = t == model.length
            ended += new[:, :, ~cont].sum((1, 2)) if not last else new.sum((1, 2))
            state = torch.zeros_like(state)
            if not last:
                state.index_add_(1, model.bucket[cont], new[:, :, cont].sum(1))   # a token's next bucket
    out = ended.tolist()
    return out[3], out[5]


def _rows(t: torch.Tensor, c: int) -> torch.Tensor:
    """``t`` [C, V] zeroed outside row ``c``."""
    out = torch.zeros_like(t)
    out[c] = t[c]
    return out


class RolloutOracle:
    """Exact values of one rollout model (module docstring); caches what several rows share."""

    def __init__(self, model: RolloutModel):
        self.model = model
        self._seq: dict[int, list[float]] = {}
        self._mean_length: float | None = None
        self._spectra: rollout_dp.LengthSpectra | None = None
        self._batch_factor: torch.Tensor | None = None
        self._visits: torch.Tensor | None = None

    # ---------------------------------------------------------------- truth
    def true_values(self) -> dict[str, float]:
        return {REVERSE: self.kl(), FORWARD: self.kl_forward(), TV: self.tv()}

    def tv(self) -> float:
        """E_q[Σ_t TV(q(·|c_{t−1}), p(·|c_{t−1}))]: each generated token's context's total variation, summed
        along the path (the float64 tables), as the per-step KLs sum to KL(q‖p) (for TV, this is not the
        total variation of the sequence laws)."""
        m = self.model
        h = context_tv(m.log_q, m.log_p)[:, None].expand_as(m.log_q)
        return dp.to_host(dp.under_q(m, torch.ones_like(h), h, 1))[1]

    def kl(self) -> float:
        m = self.model
        if m.precision is not None:     # the truth is the float64 KL, not the rounded table's
            g = m.log_p - m.log_q
            return -dp.to_host(dp.under_q(m, torch.ones_like(g), g, 1))[1]
        return -self.seq_moments(0)[1]

    def kl_forward(self) -> float:
        m = self.model
        if m.precision is not None:
            g = m.log_p - m.log_q
            return dp.to_host(dp.under_q(m, torch.exp(g), g, 1))[1]
        return self.seq_moments(1)[1]      # E_p[L] = E_q[R L]: q > 0 everywhere

    def gate_rates(self, gate, delta: float):
        """A gate's exact rates (kl_bench.core.gates) on the float64 tables: each bucket weighted by its expected
        visits E_q[#steps in c] (one program per bucket, computed once), the share of sequences with a masked
        token from the program with the per-token factor 1{kept}."""
        m = self.model
        if self._visits is None:
            ones = torch.ones_like(m.log_q)
            self._visits = torch.tensor([dp.to_host(dp.under_q(m, ones, _rows(ones, c), 1))[1]
                                         for c in range(m.buckets)], dtype=torch.float64, device=m.device)
        return gates.gate_rates(m.log_q, m.log_p, self._visits, gate, delta, self._sequence_moments)

    def _sequence_moments(self, keep: torch.Tensor) -> tuple[float, float, float]:
        """(P_q(K), E_q[K·Σ_t k3_t], E_q[K·W]) for the sequence mask K = Π_t keep_t and weight W = Π_t r_t: the
        program with K as its multiplicative factor (times r for W: q·r = p, so E_q[K·W] = P_p(K))."""
        m = self.model
        q = m.log_q.exp()
        k3_t = torch.where(q > 0, torch.expm1(m.log_p - m.log_q) - (m.log_p - m.log_q), torch.zeros_like(q))
        kept, kept_kl = dp.to_host(dp.under_q(m, keep, k3_t, 1))
        r = torch.where(q > 0, torch.exp(m.log_p - m.log_q), torch.zeros_like(q))
        return kept, kept_kl, dp.to_host(dp.under_q(m, keep * r, torch.ones_like(q), 0))[0]

    def mean_length(self) -> float:
        """E_q|y|, exact (computed once: every per-token row's truth divides by it)."""
        if self._mean_length is None:
            ones = torch.ones_like(self.model.logr_table)
            self._mean_length = dp.to_host(dp.under_q(self.model, ones, ones, 1))[1]
        return self._mean_length

    def seq_moments(self, s: int) -> list[float]:
        """E_q[R^s L^k] for k = 0..4 (R = e^L, L the sequence log-ratio); computed once per s."""
        if s not in self._seq:
            g = self.model.logr_table
            m = torch.exp(s * g) if s else torch.ones_like(g)
            self._seq[s] = dp.to_host(dp.under_q(self.model, m, g, 4))
        return self._seq[s]

    def tok_moments(self, h: torch.Tensor) -> list[float]:
        """E_q[S^k], k = 0..2, for the token sum S = Σ_t h(c_{t−1}, x_t), h [C, V]."""
        return dp.to_host(dp.under_q(self.model, torch.ones_like(h), h, 2))

    # ---------------------------------------------------------------- rows, by aggregate
    def seq(self, est: RowSource) -> tuple[float, float]:
        """(mean, variance) of f(L), L the sequence log-ratio: polynomial moments E[R^s L^k] by the program."""
        if est.analytic:
            return self.tok(est)
        if self.model.has_sampler:
            return self._sampler_seq(est)
        if est.poly is None:
            return math.nan, math.nan          # |L|: no exact rollout oracle
        return mean_var(self._poly_mean(est.poly), self._poly_mean(poly_square(est.poly)))

    def tok(self, est: RowSource) -> tuple[float, float]:
        """(mean, variance) of the token sum Σ_t f(log r_t): additive along the path."""
        if self.model.has_sampler:
            return self._sampler_tok(est)
        m = self.tok_moments(self.model.tok_values(est))
        return mean_var(m[1], m[2])

    def tok_mean(self, est: RowSource) -> tuple[float, float]:
        """(mean, variance) of Σ_t f / |y| (times W with sequence weights), exact by splitting the program on
        the final length |y|."""
        model = self.model
        f = model.tok_values(est)
        ones = torch.ones_like(f)
        lengths = torch.arange(1, model.length + 1, dtype=torch.float64, device=f.device)
        on_sums, wt = model.weighting.on_sums, model.token_weight
        m1 = dp.by_length(model, lambda lb: wt(lb) if on_sums else ones, lambda lb: f, 1)[:, 1]
        m2 = dp.by_length(model, lambda lb: wt(lb) ** 2 if on_sums else ones, lambda lb: f, 2)[:, 2]
        return mean_var(dp.to_host((m1 / lengths).sum()), dp.to_host((m2 / lengths**2).sum()))

    def tok_gm(self, est: RowSource) -> tuple[float, float]:
        """(mean, variance) of Σ_t f · W^{1/|y|}: W^{1/ℓ} = Π_t w_t^{1/ℓ} is multiplicative once ℓ is fixed,
        so one program per final length."""
        model = self.model
        f, lw = model.tok_values(est), model.token_log_weight
        mean = second = 0.0
        for ell in range(1, model.length + 1):
            # w^{1/ℓ} as exp(log w / ℓ): finite whenever the geometric mean is
            mean += dp.to_host(dp.by_length(model, lambda lb: torch.exp(lw(lb) / ell), lambda lb: f, 1)[ell - 1, 1])
            second += dp.to_host(dp.by_length(model, lambda lb: torch.exp(2 * lw(lb) / ell), lambda lb: f, 2)[ell - 1, 2])
        return mean_var(mean, second)

    def tok_batch(self, est: RowSource) -> tuple[float, float]:
        """(mean, variance) of one token-mean value Σ_i Σ_t f / Σ_i |y_i| over B sequences. Draws are
        unweighted (refused otherwise): b's length split."""
        f = self.model.tok_values(est)
        ones = torch.ones_like(f)
        lengths = dp.by_length(self.model, lambda lb: ones, lambda lb: f, 2)
        if self._spectra is None:      # the lengths' part: the same for every row of the case
            self._spectra = rollout_dp.length_spectra(lengths[:, 0], self.model.token_mean_batch)
        return rollout_dp.token_mean_moments(lengths, self.model.token_mean_batch, self._spectra)

    def batch_length_factor(self) -> torch.Tensor:
        """γ_B(ℓ) = B·E[1/(ℓ + L′)] [T] of the tok_batch rows (L′ the other B − 1 lengths of a group,
        :func:`kl_bench.core.rollout_dp.inverse_total_length`): one FFT correlation, computed once per case."""
        if self._batch_factor is None:
            self._batch_factor = rollout_dp.inverse_total_length(dp.length_law(self.model), self.model.token_mean_batch)
        return self._batch_factor

    def inverse_length(self) -> torch.Tensor:
        """1/ℓ for ℓ = 1..T, [T]: the factor of the per-sequence token mean."""
        return 1.0 / torch.arange(1, self.model.length + 1, dtype=torch.float64, device=self.model.device)

    # ---------------------------------------------------------------- the λ curve and the tails
    def joint_seq(self) -> JointMoments:
        """Moments of (−L, R − 1) under q."""
        m0, m1 = self.seq_moments(0), self.seq_moments(1)
        er2 = self.seq_moments(2)[0]
        var_b = math.inf if not math.isfinite(er2) else er2 - 1.0
        # Cov(−L, R − 1) = −E[R L] + E[L]·E[R], with E[R] = 1.
        return JointMoments(-m0[1], 0.0, m0[2] - m0[1] ** 2, var_b, -m1[1] + m0[1])

    def joint_tok(self) -> JointMoments:
        """Moments of (−L, Σ_t (r_t − 1)) under q."""
        m0, g = self.seq_moments(0), self.model.logr_table
        mean_a, var_a = -m0[1], m0[2] - m0[1] ** 2
        b = torch.expm1(g)
        mb = self.tok_moments(b)
        mab = self.tok_moments(b - g)       # a + b = Σ_t k3(r_t): Cov by polarisation
        var_b = mb[2] - mb[1] ** 2
        var_ab = mab[2] - mab[1] ** 2
        return JointMoments(mean_a, mb[1], var_a, var_b, 0.5 * (var_ab - var_a - var_b))

    def kurtosis_proxy(self, est: RowSource) -> float:
        """E[R^{4s}] / E[R^{2s}]² for a seq row whose polynomial holds R^s (it dominates the tail), both exact
        by the program (inf beyond float64); NaN without such a term or under a sampler."""
        if est.poly is None or self.model.has_sampler:
            return math.nan
        s_max = max((s for (s, _), c in est.poly.items() if c != 0), default=0)
        if s_max == 0:
            return math.nan
        num, den = self.seq_moments(4 * s_max)[0], self.seq_moments(2 * s_max)[0]
        return num / den**2 if math.isfinite(num) and math.isfinite(den) and den > 0 else math.inf

    # ---------------------------------------------------------------- helpers
    def _poly_mean(self, poly) -> float:
        total = 0.0
        for (s, k), c in poly.items():
            if c == 0:
                continue
            if k > 4:
                return math.nan
            v = self.seq_moments(s)[k]
            if math.isinf(v) or math.isnan(v):
                return math.inf       # E[R^s ...] beyond float64 range: practically infinite
            total += c * v
        return total

    def _sampler_tok(self, est: RowSource) -> tuple[float, float]:
        """(E_b[v], Var_b[v]) of a tok row under the sampler, by the phased program."""
        model = self.model
        ones, wt, f = torch.ones_like(model.logr_table), model.token_weight, model.tok_values(est)
        if model.weighting.cumulative:            # Σ_t ρ_{1:t} f_t: neither additive nor a product
            return mean_var(*cumulative_moments(model, f))
        if model.weighting.per_token:             # Σ_t w_t f_t: additive
            mom = dp.b_moments(model, lambda lb: ones, lambda lb: wt(lb) * f, 2)
            return mean_var(mom[1], mom[2])
        if model.weighting.on_sums:               # W · Σ_t f_t: weight multiplicative, sum additive
            m1 = dp.b_moments(model, lambda lb: wt(lb), lambda lb: f, 1)[1]
            m2 = dp.b_moments(model, lambda lb: wt(lb) ** 2, lambda lb: f, 2)[2]
            return mean_var(m1, m2)
        mom = dp.b_moments(model, lambda lb: ones, lambda lb: f, 2)
        return mean_var(mom[1], mom[2])

    def _sampler_seq(self, est: RowSource) -> tuple[float, float]:
        """(E_b[v], Var_b[v]) of a seq row (a polynomial in R and L) under the sampler."""
        if est.poly is None:
            return math.nan, math.nan
        return mean_var(self._sampler_poly(est.poly, 1), self._sampler_poly(poly_square(est.poly), 2))

    def _sampler_poly(self, poly, power: int) -> float:
        """E_b[W^power Σ c R^s L^k] (W = 1 without weights)."""
        model = self.model
        g, ones, weighted, wt = model.logr_table, torch.ones_like(model.logr_table), model.weighting.weighted, \
            model.token_weight
        total = 0.0
        for (s_, k), c in poly.items():
            if c == 0:
                continue
            v = dp.b_moments(model, lambda lb, s_=s_: (wt(lb) ** power if weighted else ones) * torch.exp(s_ * g),
                             lambda lb: g, k)[k]
            if not math.isfinite(v):
                return math.inf
            total += c * v
        return total
