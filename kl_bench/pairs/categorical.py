"""Categorical pairs over a vocabulary, one context ([V]) or B contexts ([B, V]).

A draw picks a context uniformly, then a token x ~ q_b. Every per-draw statistic is a function of the
(context, token) id, so a batch never materialises per-draw values: tokens are drawn with an alias
table, counted with ``bincount`` and every feature sum is one matrix product with a per-token table.
"""
from __future__ import annotations

import math

import torch

from .. import exact
from ..alias import build_alias, sample_alias
from ..draws import Draws
from ..estimators import Estimator
from ..errors import SpecError
from ..logits import resolve_pair_logits, sampler_for
from ..spec import CategoricalCase
from .base import BatchSums, Features, JointMoments, Pair

# Largest [batches, M] count matrix per chunk (float64 entries): 2^22 × 8 B = 32 MiB.
_COUNT_CELLS = 1 << 22


class CategoricalPair(Pair):
    kind = "categorical"

    def __init__(self, name: str, log_q: torch.Tensor, log_p: torch.Tensor, label: str = "",
                 log_b: torch.Tensor | None = None, weights: str = "none", weight_cap: float | None = None,
                 sampler_label: str = ""):
        """``log_q``, ``log_p``: normalised float64 log-probabilities [B, V]. ``log_b``: a sampler b ≠ q
        that draws the tokens while the estimators keep using q's and p's log-probs; ``weights``
        ("token") multiplies every estimate by q/b, capped at ``weight_cap``."""
        self.name = name
        self.log_q, self.log_p = log_q.to(torch.float64), log_p.to(torch.float64)
        self.label = label
        self.log_b = None if log_b is None else log_b.to(torch.float64)
        self.sampler_label = sampler_label
        self.has_sampler, self.weights = self.log_b is not None, weights
        sample = self.log_q if self.log_b is None else self.log_b
        if self.log_b is not None and bool(((self.log_b > -torch.inf) & (self.log_q == -torch.inf)).any()):
            raise SpecError("the sampler draws tokens that q gives probability 0", key="sampler")
        # Draws come from the mixture (1/B) b(x|context) over the flattened (context, token) ids; ids
        # that b never draws are dropped so that a −inf log-ratio never meets a zero count (0·inf = NaN).
        w = (sample.exp() / sample.shape[0]).reshape(-1)
        self._support = torch.nonzero(w > 0).squeeze(1)
        self._logr = (self.log_p - self.log_q).reshape(-1)[self._support]
        self._alias = build_alias(w[self._support].numpy())
        # Importance weights q/b of the drawn ids (a cap bounds the variance at the price of bias).
        self._is_weight = None
        if self.log_b is not None and weights == "token":
            iw = torch.exp((self.log_q - self.log_b).reshape(-1)[self._support])
            self._is_weight = iw.clamp(max=weight_cap) if weight_cap is not None else iw
        # Mass of q that b never draws: an unweighted estimate is biased, a weighted one misses it.
        self.support_miss = 0.0 if self.log_b is None else float(
            (self.log_q.exp() * (self.log_b == -torch.inf)).sum(-1).mean())
        # The `full` estimator: each (context, token) entry carries its context's analytic KL.
        kl_ctx = torch.where(self.log_q.exp() > 0, self.log_q.exp() * (self.log_q - self.log_p),
                             torch.zeros_like(self.log_q)).sum(-1)
        self._full = kl_ctx[:, None].expand_as(self.log_q).reshape(-1)[self._support]

    @classmethod
    def from_case(cls, case: CategoricalCase) -> "CategoricalPair":
        lq, lp = resolve_pair_logits(case.q, case.p, case.vocab)
        sp = case.sampler
        if sp is None:
            return cls(case.name, lq, lp, label=_describe_sources(case))
        return cls(case.name, lq, lp, label=_describe_sources(case), log_b=sampler_for(sp, lq, lp),
                   weights=sp.weights, weight_cap=sp.weight_cap, sampler_label=sp.describe())

    @property
    def contexts(self) -> int:
        return int(self.log_q.shape[0])

    @property
    def vocab(self) -> int:
        return int(self.log_q.shape[1])

    def kl(self) -> float:
        return exact.categorical_kl(self.log_q, self.log_p)

    def kl_forward(self) -> float:
        return exact.categorical_kl(self.log_p, self.log_q)

    def _values(self, est: Estimator) -> torch.Tensor:
        """Per-entry values of ``est`` (importance-weighted when asked) on the drawn ids, [M]."""
        v = self._full if est.name == "full" else est.fn(self._logr)
        return v if self._is_weight is None else v * self._is_weight

    def exact_moments(self, est: Estimator, aggregate: str = "") -> tuple[float, float]:
        return exact.weighted_moments(self._weights(), self._values(est))

    def _weights(self) -> torch.Tensor:
        """The sampling distribution (b, or q) over the drawn (context, token) ids, [M]."""
        sample = self.log_q if self.log_b is None else self.log_b
        return (sample.exp() / self.contexts).reshape(-1)[self._support]

    def exact_joint(self, aggregate: str = "") -> JointMoments:
        w, logr = self._weights(), self._logr
        a, b = -logr, torch.expm1(logr)
        if torch.isinf(a).any():                      # p(x) = 0 < q(x): KL(q‖p) = ∞
            return JointMoments(math.inf, float((w * b).sum()), math.inf, math.nan, math.nan)
        ma, mb = float((w * a).sum()), float((w * b).sum())
        # Second passes around the means: no E[x²] − E[x]² cancellation.
        return JointMoments(ma, mb, float((w * (a - ma) ** 2).sum()), float((w * (b - mb) ** 2).sum()),
                            float((w * (a - ma) * (b - mb)).sum()))

    def exact_prob_negative(self, fn, aggregate: str = "") -> float:
        v = fn(self._logr) if self._is_weight is None else fn(self._logr) * self._is_weight
        return float((self._weights() * (v < 0)).sum())

    def sample_draws(self, n, generator, device, tok_rows=()) -> Draws:
        ids = self.sample_ids(n, generator, device)
        return Draws(self._logr.to(device)[ids], self._full.to(device)[ids],
                     weight=None if self._is_weight is None else self._is_weight.to(device)[ids])

    def describe(self) -> str:
        ctx = f", {self.contexts} contexts" if self.contexts > 1 else ""
        return (f"categorical V={self.vocab}{ctx}" + (f": {self.label}" if self.label else "")
                + (f"; {self.sampler_label}" if self.sampler_label else ""))

    def sample_ids(self, n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
        """Indices into the support of q for ``n`` draws; int64 [n]."""
        return sample_alias(self._alias_on(device), n, generator)

    def _alias_on(self, device: torch.device):
        if self._alias.prob.device != device:
            self._alias = self._alias.to(device)
        return self._alias

    def batch_sums(self, features: Features, tok_rows, device: torch.device) -> BatchSums:
        table = features(Draws(self._logr.to(device), self._full.to(device),
                               weight=None if self._is_weight is None else self._is_weight.to(device)))  # [M, P]
        m = table.shape[0]
        # ±inf features (k1 where p(x) = 0) are summed separately: a zero count times inf is NaN.
        pos, neg = torch.isposinf(table), torch.isneginf(table)
        finite = torch.where(pos | neg, torch.zeros_like(table), table)
        has_inf = bool(pos.any() or neg.any())

        def run(sizes: list[int], gens: list[torch.Generator]) -> torch.Tensor:
            ids = torch.cat([self.sample_ids(n, g, device) + i * m for i, (n, g) in enumerate(zip(sizes, gens))])
            counts = torch.bincount(ids, minlength=len(sizes) * m).view(len(sizes), m).to(torch.float64)
            out = counts @ finite
            if has_inf:
                out = out + torch.where(counts @ pos.double() > 0, torch.inf, 0.0)
                out = out + torch.where(counts @ neg.double() > 0, -torch.inf, 0.0)
            return out
        return run

    def batches_per_chunk(self, batch_size: int, chunk_draws: int) -> int:
        return max(1, min(chunk_draws // max(1, batch_size), _COUNT_CELLS // self._logr.shape[0]))


def _describe_sources(case: CategoricalCase) -> str:
    from ..spec import DerivedLogits, FileLogits, ZipfLogits

    def one(src) -> str:
        if isinstance(src, ZipfLogits):
            return f"zipf(s={src.exponent:g})"
        if isinstance(src, FileLogits):
            return f"file {src.path.name}"
        if isinstance(src, DerivedLogits):
            bits = [src.source]
            if src.temperature != 1.0:
                bits.append(f"/T={src.temperature:g}")
            if src.noise > 0:
                bits.append(f"+N(0,{src.noise:g}²)")
            return "".join(bits)
        return "?"
    return f"q = {one(case.q)}, p = {one(case.p)}"
