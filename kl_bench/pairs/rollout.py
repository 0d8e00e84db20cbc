"""Rollouts: sequences from two autoregressive token models over a vocabulary of size V.

The next-token logits depend on the previous token only through its bucket c = bucket(x) ∈ {0..C−1};
generation starts in bucket 0 and stops after T tokens or at the EOS token (which is included).
Sequence-level rows ("seq") apply an estimator to L = Σ_t log r_t (R = e^L); token-level rows
("tok") sum the per-token estimator over the generated tokens, as GRPO/PPO code does; ``full`` sums
the analytic per-step KL(q(·|c) ‖ p(·|c)) along the path. Exact values: kl_bench.rollout_dp.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from .. import rollout_dp
from ..alias import AliasTable, build_alias
from ..draws import Draws, Row
from ..errors import SpecError
from ..estimators import Estimator, poly_square
from ..logits import read_logits_file, resolve_pair_logits
from ..spec import RolloutCase
from .base import BatchSums, Features, JointMoments, Pair


def read_bucket_map(path, vocab: int, buckets: int) -> torch.Tensor:
    """An int array [V] with values in [0, C) from .npy or .pt."""
    t = read_logits_file(path)          # same loader: checks existence, format and readability
    if t.shape[0] != 1 or t.shape[1] != vocab:
        raise SpecError(f"bucket map must have shape [{vocab}], got {list(t.shape[1:]) if t.shape[0] == 1 else list(t.shape)}")
    t = t[0]
    if not torch.equal(t, t.round()):
        raise SpecError("bucket map must hold integers")
    if t.min() < 0 or t.max() >= buckets:
        raise SpecError(f"bucket map values must lie in [0, {buckets}), got [{int(t.min())}, {int(t.max())}]")
    return t.long()


class RolloutPair(Pair):
    kind = "rollout"
    aggregates = ("seq", "tok")

    def __init__(self, name: str, log_q: torch.Tensor, log_p: torch.Tensor, bucket: torch.Tensor,
                 length: int, eos: int | None, label: str = ""):
        """``log_q``, ``log_p``: normalised float64 [C, V]; ``bucket``: int64 [V] in [0, C)."""
        self.name, self.label = name, label
        self.log_q, self.log_p = log_q.to(torch.float64), log_p.to(torch.float64)
        self.bucket, self.length, self.eos = bucket.long(), int(length), eos
        self.buckets, self.vocab = self.log_q.shape
        self._g = self.log_p - self.log_q                          # log r(c, x), [C, V]
        q = self.log_q.exp()
        self._kl_ctx = (q * (self.log_q - self.log_p)).sum(-1)      # KL(q(·|c) ‖ p(·|c)), [C]
        self._alias: AliasTable | None = None      # built on first sampling (exact runs need none)

    def _alias_table(self) -> AliasTable:
        # Per-bucket alias tables, flattened to [C·V] so that a step is two gathers per rollout.
        if self._alias is None:
            q = self.log_q.exp()
            tables = [build_alias(q[c].numpy()) for c in range(self.buckets)]
            self._alias = AliasTable(torch.cat([t.prob for t in tables]), torch.cat([t.alias for t in tables]))
        return self._alias

    @classmethod
    def from_case(cls, case: RolloutCase) -> "RolloutPair":
        lq, lp = resolve_pair_logits(case.q, case.p, case.vocab, contexts=case.buckets)
        for side, t in (("q", lq), ("p", lp)):
            if t.shape != (case.buckets, case.vocab):
                raise SpecError(f"rollout logits must have shape [C, V] = [{case.buckets}, {case.vocab}], "
                                f"got {list(t.shape)}", key=side)
            if not torch.isfinite(t).all():
                raise SpecError("rollout logits must be finite (zero probabilities are not supported "
                                "for rollouts)", key=side)
        if case.bucket_of == "mod":
            bucket = torch.arange(case.vocab) % case.buckets
        else:
            try:
                bucket = read_bucket_map(case.bucket_of, case.vocab, case.buckets)
            except SpecError as e:
                raise e.located(key="bucket_of.file") from None
        from .categorical import _describe_sources
        return cls(case.name, lq, lp, bucket, case.length, case.eos, label=_describe_sources(case))

    # ------------------------------------------------------------------ exact
    def _dp(self, m: torch.Tensor, h: torch.Tensor, kmax: int) -> list[float]:
        a, e = rollout_dp.moment_matrices(self.log_q.exp(), m, h, self.bucket, self.buckets, self.eos, kmax)
        return rollout_dp.propagate(a, e, self.length)

    @functools.cache
    def seq_moments(self, s: int) -> list[float]:
        """E_q[R^s L^k] for k = 0..4 (R = e^L, L the sequence log-ratio)."""
        m = torch.exp(s * self._g) if s else torch.ones_like(self._g)
        return self._dp(m, self._g, 4)

    def _tok_values(self, est: Estimator) -> torch.Tensor:
        """Per-step value of a token-level row, [C, V]."""
        if est.name == "full":
            return self._kl_ctx[:, None].expand_as(self._g)
        return est.fn(self._g)

    def tok_moments(self, h: torch.Tensor) -> list[float]:
        """E[S^k], k = 0..2, for the token sum S = Σ_t h(c_{t−1}, x_t)."""
        return self._dp(torch.ones_like(h), h, 2)

    def kl(self) -> float:
        return -self.seq_moments(0)[1]

    def kl_forward(self) -> float:
        return self.seq_moments(1)[1]      # E_p[L] = E_q[R L]: q > 0 everywhere

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

    def exact_moments(self, est: Estimator, aggregate: str = "seq") -> tuple[float, float]:
        if aggregate == "tok" or est.name == "full":
            m = self.tok_moments(self._tok_values(est))
            return m[1], max(m[2] - m[1] ** 2, 0.0)
        if est.poly is None:
            return math.nan, math.nan          # |L|: no exact rollout oracle
        mean, second = self._poly_mean(est.poly), self._poly_mean(poly_square(est.poly))
        return mean, (math.inf if math.isinf(second) else max(second - mean * mean, 0.0))

    def kurtosis_proxy(self, est: Estimator, aggregate: str = "seq") -> float:
        # Sequence-level estimators with an R^s term are dominated by it in the tail:
        # E[R^{4s}] / E[R^{2s}]² (both exact by the DP; inf when beyond float64).
        if aggregate != "seq" or est.poly is None:
            return math.nan
        s_max = max((s for (s, _), c in est.poly.items() if c != 0), default=0)
        if s_max == 0:
            return math.nan
        num, den = self.seq_moments(4 * s_max)[0], self.seq_moments(2 * s_max)[0]
        return num / den**2 if math.isfinite(num) and math.isfinite(den) and den > 0 else math.inf

    def exact_joint(self, aggregate: str = "seq") -> JointMoments:
        m0, m1 = self.seq_moments(0), self.seq_moments(1)
        mean_a, var_a = -m0[1], m0[2] - m0[1] ** 2
        if aggregate == "seq":
            er2 = self.seq_moments(2)[0]
            var_b = math.inf if not math.isfinite(er2) else er2 - 1.0
            # Cov(−L, R − 1) = −E[R L] + E[L]·E[R], with E[R] = 1.
            return JointMoments(mean_a, 0.0, var_a, var_b, -m1[1] + m0[1])
        b = torch.expm1(self._g)
        mb = self.tok_moments(b)
        mab = self.tok_moments(b - self._g)       # a + b = Σ_t k3(r_t): Cov by polarisation
        var_b = mb[2] - mb[1] ** 2
        var_ab = mab[2] - mab[1] ** 2
        return JointMoments(mean_a, mb[1], var_a, var_b, 0.5 * (var_ab - var_a - var_b))

    # ------------------------------------------------------------------ sampling
    def sample_draws(self, n: int, generator: torch.Generator, device: torch.device,
                     tok_rows: list[Row] = ()) -> Draws:
        """``n`` rollouts of at most T steps; never materialises [n, V]."""
        return self._simulate([n], [generator], device, tok_rows)

    def _simulate(self, sizes: list[int], gens: list[torch.Generator], device: torch.device,
                  tok_rows: list[Row] = ()) -> Draws:
        """Rollouts for several batches at once: batch i's uniforms come from its own generator, every
        other operation runs on one long vector (per-op overhead dominates on short vectors)."""
        table = self._alias_table()
        prob, alias = table.prob.to(device), table.alias.to(device)
        g_flat, kl_ctx, bucket = self._g.reshape(-1).to(device), self._kl_ctx.to(device), self.bucket.to(device)
        v, n = self.vocab, sum(sizes)
        c = torch.zeros(n, dtype=torch.int64, device=device)
        alive = torch.ones(n, dtype=torch.float64, device=device)
        logr = torch.zeros(n, dtype=torch.float64, device=device)
        full = torch.zeros_like(logr)
        tok_b = torch.zeros_like(logr)
        tok = torch.zeros(n, len(tok_rows), dtype=torch.float64, device=device)
        for _ in range(self.length):
            u = torch.cat([torch.rand(k, dtype=torch.float64, generator=g, device=device)
                           for k, g in zip(sizes, gens)]) * v
            j = u.long().clamp_(max=v - 1)
            base = c * v
            x = torch.where(u - j < prob[base + j], j, alias[base + j])
            g = g_flat[base + x]
            kl_c = kl_ctx[c]
            logr += alive * g
            full += alive * kl_c
            tok_b += alive * torch.expm1(g)
            if tok_rows:
                tok += alive[:, None] * torch.stack(
                    [kl_c if r.est.name == "full" else r.est.fn(g) for r in tok_rows], dim=-1)
            if self.eos is not None:
                alive = alive * (x != self.eos)
            c = bucket[x]
        return Draws(logr, full, tok, tok_b)

    def batch_sums(self, features: Features, tok_rows, device: torch.device) -> BatchSums:
        def run(sizes: list[int], gens: list[torch.Generator]) -> torch.Tensor:
            f = features(self._simulate(sizes, gens, device, tok_rows))
            # Contiguous per-batch reductions (no scatter-add): deterministic on CUDA too.
            return torch.stack([part.sum(0) for part in torch.split(f, sizes)])
        return run

    def batches_per_chunk(self, batch_size: int, chunk_draws: int) -> int:
        # ~ (10 + tok rows) float64 values per rollout stay alive across the T steps.
        return max(1, chunk_draws // max(1, batch_size * 4))

    def describe(self) -> str:
        eos = f", eos={self.eos}" if self.eos is not None else ""
        return (f"rollout V={self.vocab}, C={self.buckets}, T={self.length}{eos}"
                + (f": {self.label}" if self.label else ""))


def brute_force_sequences(pair: RolloutPair):
    """Every sequence with its q-probability and per-step (bucket, token) path: tiny V and T only."""
    q = pair.log_q.exp().numpy()
    out = []

    def rec(c: int, prob: float, path: list[tuple[int, int]]):
        if len(path) == pair.length:
            out.append((prob, path))
            return
        for x in range(pair.vocab):
            step = path + [(c, x)]
            if pair.eos is not None and x == pair.eos:
                out.append((prob * q[c, x], step))
            else:
                rec(int(pair.bucket[x]), prob * q[c, x], step)
    rec(0, 1.0, [])
    return out


__all__ = ["RolloutPair", "brute_force_sequences", "read_bucket_map", "np"]
