"""Case kind ``rollout``: sequences from two autoregressive token models over a vocabulary of size V.

The next-token logits depend on the previous token only through its bucket c = bucket(x) ∈ {0..C−1};
generation starts in bucket 0 and stops after T tokens or at the EOS token (which is included).
Sequence-level rows ("seq") apply an estimator to L = Σ_t log r_t (R = e^L); token-level rows
("tok") sum the per-token estimator over the generated tokens, as GRPO/PPO code does; ``full`` sums
the analytic per-step KL(q(·|c) ‖ p(·|c)) along the path. Exact values: kl_bench.rollout_dp
(docs/rollouts.md); gradient oracles: kl_bench.pairs.rollout.gradients (docs/gradients.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ... import rollout_dp
from ...alias import AliasTable, build_alias
from ...config import MAX_LENGTH, Table, at_most, positive
from ...draws import AGGREGATES, Draws, Row
from ...errors import SpecError
from ...estimators import RowSource, poly_square
from ...modes import MODES
from ...precision import Precision, in_precision, parse_precision, rounded_logr
from ...logits import (LogitsSource, check_table_size, describe_sources, parse_pair_sources, read_logits_file,
                       resolve_pair_source_logits)
from ...rejection import Rejection, SequenceMask
from ...samplers import CORRECTION_KEYS, LOGIT_KEYS, WEIGHT_KEYS
from ...seeding import BatchStream
from ...targets import FORWARD, REVERSE
from ...weights import WeightCorrection
from ..base import (BaselineExact, BatchSums, CaseConfig, ExactGrad, Features, GradientAccumulator, GradientDefaults, GradItem,
                    JointMoments, Pair, register_kind)
from . import gradients as grad


MAX_TOKEN_MEAN_BATCH = 4096        # B of tok_batch rows (groups never span batches or pieces: see kl_bench.draws)
MAX_TOKEN_MEAN_TOKENS = 2**22      # B × T: the size of the FFT behind the exact moments


@dataclass(frozen=True, kw_only=True)
class RolloutCase(CaseConfig):
    """Two autoregressive token models whose next-token logits depend on the previous token only
    through its bucket: q and p are [C, V] logits."""
    vocab: int
    buckets: int
    bucket_of: str | Path       # "mod" (x mod C) or a .npy/.pt file with an int array [V]
    length: int                 # T, the maximum number of generated tokens
    eos: int | None
    q: LogitsSource
    p: LogitsSource
    eos_prob: float | None = None   # sets q(eos|c) = p(eos|c) = eos_prob in every bucket
    precision: Precision | None = None   # log-probs as a trainer rounds them (kl_bench.precision)
    per_sequence_mean: bool = False      # also tok_mean rows: Σ_t f / |y| per sequence
    token_mean_batch: int | None = None  # also tok_batch rows: Σ f / Σ |y| over batches of B sequences


def read_bucket_map(path, vocab: int, buckets: int) -> torch.Tensor:
    """An int array [V] with values in [0, C) from .npy or .pt."""
    t = read_logits_file(path)          # same loader: checks existence, format and readability
    if t.shape[0] != 1 or t.shape[1] != vocab:
        raise SpecError(f"{path}: bucket map must have shape [{vocab}], got {list(t.shape[1:]) if t.shape[0] == 1 else list(t.shape)}")
    t = t[0]
    if not torch.equal(t, t.round()):
        raise SpecError(f"{path}: bucket map must hold integers")
    if t.min() < 0 or t.max() >= buckets:
        raise SpecError(f"{path}: bucket map values must lie in [0, {buckets}), got [{int(t.min())}, {int(t.max())}]")
    return t.long()


def _floor_or_mask(correction: WeightCorrection | None) -> WeightCorrection | None:
    """The correction when it floors or masks q/b; None for the cap alone (computed as before, so that
    its bytes do not move)."""
    if correction is None or (correction.floor is None and correction.mask is None):
        return None
    return correction


def _check_length_rows(per_sequence_mean: bool, token_mean_batch: int | None, weights: str,
                       rejection: Rejection | None) -> None:
    """Rows divided by lengths have exact oracles under these weights only, and none under a rejection
    mask (a rejected sequence's tokens would leave the denominator: a ratio, not a mean of draws)."""
    if rejection is not None and (per_sequence_mean or token_mean_batch is not None):
        raise SpecError(f"{'per_sequence_mean' if per_sequence_mean else 'token_mean_batch'} cannot be combined "
                        "with a rejection mask (a rejected sequence would leave the lengths' denominator): drop one",
                        key="sampler.reject")
    if per_sequence_mean and weights == "token":
        raise SpecError("per_sequence_mean needs weights = \"none\", \"sequence\" or \"geometric\" (a token-weighted "
                        "sum over |y| has no length-aware oracle here)", key="per_sequence_mean")
    if token_mean_batch is not None and weights != "none":
        raise SpecError("token_mean_batch needs unweighted draws (weights = \"none\"): a weighted token-mean "
                        "has no exact oracle here", key="token_mean_batch")


def _ppo_clip(correction: WeightCorrection | None, weights: str) -> WeightCorrection | None:
    """The correction when it holds the PPO clip (it changes gradients only, kl_bench.weights: of the
    per-token local rows, exactly); None otherwise. The clip is per token: weights = "token"."""
    if correction is None or (correction.clip is None and correction.dual is None):
        return None
    if weights != "token":
        raise SpecError("the PPO clip (clip_low, clip_high, dual_clip) clips each token's ratio: it needs "
                        "weights = \"token\"", key="sampler.weights")
    return correction


@register_kind("rollout", description="T-token rollouts of two bucketed autoregressive models, [C, V] logits; "
               "exact dynamic programming",
               sampler_keys=(*LOGIT_KEYS, "min_length", "behavior", *WEIGHT_KEYS, *CORRECTION_KEYS, "reject"),
               weight_kinds=("token", "sequence", "geometric"))
class RolloutPair(GradientDefaults, Pair):
    aggregates = ("seq", "tok")

    def __init__(self, name: str, log_q: torch.Tensor, log_p: torch.Tensor, bucket: torch.Tensor,
                 length: int, eos: int | None, label: str = "", log_b: torch.Tensor | None = None,
                 min_length: int = 0, weights: str = "none", weight_cap: float | None = None,
                 sampler_label: str = "", precision: Precision | None = None, per_sequence_mean: bool = False,
                 token_mean_batch: int | None = None, logits: tuple[torch.Tensor, torch.Tensor] | None = None,
                 correction: WeightCorrection | None = None, rejection: Rejection | None = None):
        """``log_q``, ``log_p``: normalised float64 [C, V]; ``bucket``: int64 [V] in [0, C).
        ``precision``: every row sees the per-token log r as a trainer rounds it (kl_bench.precision);
        the truth stays the float64 KL.

        A sampler: tokens drawn from ``log_b`` [C, V] (b = q when None) with EOS suppressed for the
        first ``min_length`` tokens, while the estimators use q's and p's log-probs. ``weights``:
        "token" multiplies each token's term by q/b and sequence-level rows by the product of those;
        "sequence" multiplies every row by W = Π_t q/b; "geometric" does too and adds tok_gm rows, the
        token sum times W^{1/|y|} (TRL's sequence-level weight). ``weight_cap`` caps each token's q/b.
        ``per_sequence_mean``: tok_mean rows (Σ_t f / |y|) besides the token sums. ``token_mean_batch`` = B:
        tok_batch rows, the "token-mean" of B consecutive sequences (Σ_i Σ_t f / Σ_i |y_i|), one value per B.
        ``correction``: a lower bound and a mask of each token's q/b (kl_bench.weights; weights = "token").
        ``rejection``: a sequence-level rejection mask on the tokens' q/b (kl_bench.rejection): a rejected
        sequence's rows are 0, on every aggregate and under any ``weights``."""
        self.name, self.label = name, label
        self.sampler_label, self.weights, self.weight_cap = sampler_label, weights, weight_cap
        self.correction = _floor_or_mask(correction)
        self.clip = _ppo_clip(correction, weights)
        self.min_length = int(min_length) if eos is not None else 0
        self.log_q, self.log_p = log_q.to(torch.float64), log_p.to(torch.float64)
        self.bucket, self.length, self.eos = bucket.long(), int(length), eos
        self.buckets, self.vocab = self.log_q.shape
        self.logr_table = self.log_p - self.log_q                          # log r(c, x), [C, V]
        self.precision = precision
        self.per_sequence_mean, self.token_mean_batch = per_sequence_mean, token_mean_batch
        self.rejection = rejection
        _check_length_rows(per_sequence_mean, token_mean_batch, weights, rejection)
        self._length_spectra: rollout_dp.LengthSpectra | None = None
        self._mean_length: float | None = None
        if precision is not None:   # a fixed function of (bucket, token): the dynamic program stays exact
            # ``logits``: (q's, p's) bucket logits [C, V] as the source holds them (kl_bench.precision)
            self._rounded = precision.rounding_input(logits, self.log_q, self.log_p)
            self.logr_table = rounded_logr(*self._rounded, precision)
        q = self.log_q.exp()
        self.kl_ctx = (q * (self.log_q - self.log_p)).sum(-1)      # KL(q(·|c) ‖ p(·|c)), [C]
        self._alias: AliasTable | None = None      # built on first sampling (exact runs need none)
        # The sampler's phases: [(log b [C, V], steps)], EOS suppressed (renormalised) in the first.
        self.has_sampler = log_b is not None or self.min_length > 0 or weights != "none" or rejection is not None
        late = self.log_q if log_b is None else log_b.to(torch.float64)
        self.phases: list[tuple[torch.Tensor, int]] = []
        if self.min_length:
            early = late.clone()
            early[:, eos] = -torch.inf
            self.phases.append((torch.log_softmax(early, -1), min(self.min_length, self.length)))
        if self.length > self.min_length:
            self.phases.append((late, self.length - self.min_length))
        if bool(((late > -torch.inf) & (self.log_q == -torch.inf)).any()):
            raise SpecError("the sampler draws tokens that q gives probability 0", key="sampler")
        # Largest per-step mass of q that b never draws (EOS suppression counts): a bias source.
        self.support_miss = max(float((q * (lb == -torch.inf)).sum(-1).max()) for lb, _ in self.phases)
        self._phase_alias: list[AliasTable] | None = None
        self._seq_cache: dict[int, list[float]] = {}
        self._batch_factor: torch.Tensor | None = None     # γ_B of the tok_batch rows, once per pair

    def alias_table(self) -> AliasTable:
        # Per-bucket alias tables, flattened to [C·V] so that a step is two gathers per rollout.
        if self._alias is None:
            q = self.log_q.exp()
            tables = [build_alias(q[c].numpy()) for c in range(self.buckets)]
            self._alias = AliasTable(torch.cat([t.prob for t in tables]), torch.cat([t.alias for t in tables]))
        return self._alias

    @classmethod
    def parse(cls, t: Table, common: dict[str, Any], spec_dir: Path) -> RolloutCase:
        vocab = t.get("vocab", "int", check=positive)
        buckets = t.get("buckets", "int", check=positive)
        if buckets > vocab:
            raise t.error(f"must be ≤ vocab ({vocab}), got {buckets}", key="buckets")
        bucket_of: str | Path = "mod"
        if t.has("bucket_of"):
            raw = t.data["bucket_of"]
            if isinstance(raw, dict):
                sub = t.sub("bucket_of")
                bucket_of = spec_dir / sub.get("file", "str")
                sub.finish()
            else:
                bucket_of = t.get("bucket_of", "str", check=lambda v: None if v == "mod" else
                                  f"must be \"mod\" or {{file = \"...\"}}, got '{v}'")
        length = t.get("length", "int", check=lambda v: f"must be ≥ 1, got {v}" if v < 1 else
                       at_most(MAX_LENGTH, "2^20: every rollout and every exact moment takes T sequential steps")(v))
        eos = t.get("eos", "int", None, lambda v: None if 0 <= v < vocab else
                    f"must be a token id in [0, {vocab}), got {v}")
        eos_prob = t.get("eos_prob", "float", None, lambda v: None if 0 < v < 1 else f"must lie in (0, 1), got {v}")
        if eos_prob is not None and eos is None:
            raise t.error("needs an eos token", key="eos_prob")
        precision = parse_precision(t)          # before the sources, which finish the table
        per_sequence_mean = t.bool("per_sequence_mean", False)

        def batch_ok(b: int) -> str | None:
            if not 1 <= b <= MAX_TOKEN_MEAN_BATCH:
                return f"must lie in [1, {MAX_TOKEN_MEAN_BATCH}], got {b}"
            if b * length > MAX_TOKEN_MEAN_TOKENS:
                return (f"times length must be ≤ 2^22 (the exact moments convolve B length distributions), "
                        f"got {b} × {length}")
            return None
        token_mean_batch = t.get("token_mean_batch", "int", None, batch_ok)
        q, p = parse_pair_sources(t, spec_dir)
        check_table_size(t, vocab, q, p, contexts=buckets, what="buckets")
        return RolloutCase(vocab=vocab, buckets=buckets, bucket_of=bucket_of, length=length, eos=eos, q=q, p=p,
                           eos_prob=eos_prob, precision=precision,
                           per_sequence_mean=per_sequence_mean, token_mean_batch=token_mean_batch, **common)

    def metadata(self) -> dict[str, Any]:
        # `length`: the report plots std/true against it across cases of one family (`label`).
        meta = {**super().metadata(), "label": self.label, "length": self.length}
        return meta if self.precision is None else {**meta, "precision": self.precision.metadata(self._rounded)}

    def aggregates_for(self, source: RowSource) -> tuple[str, ...]:
        # In the table's order: seq and tok (a function of L other than a polynomial in R and L has no
        # exact sequence-level oracle, and trainers apply such functions per token: tok rows only), then
        # the aggregates the case switches on (per_sequence_mean, token_mean_batch, geometric weights).
        return tuple(name for name, a in AGGREGATES.items()
                     if (name in self.aggregates if a.enabled is None else a.enabled(self)) and a.applies(source))

    @property
    def gradient_aggregates(self) -> tuple[str, ...]:
        # seq and tok, and the per-sequence token mean where the case has it (GRPO's 1/|y|: exact by the
        # forward–backward program with a factor of the final length, kl_bench.pairs.rollout.gradients).
        # The token-mean over B sequences too (local forms only, kl_bench.gradients.gradient_items).
        return self.aggregates + (("tok_mean",) if self.per_sequence_mean else ()) \
            + (("tok_batch",) if self.token_mean_batch is not None else ())

    def row_group(self, aggregate: str) -> int:
        return self.token_mean_batch if AGGREGATES[aggregate].grouped else 1

    @classmethod
    def from_config(cls, case: RolloutCase) -> "RolloutPair":
        zq, zp = resolve_pair_source_logits(case.q, case.p, case.vocab, contexts=case.buckets)
        lq, lp = torch.log_softmax(zq, -1), torch.log_softmax(zp, -1)
        if case.eos_prob is not None:
            # the source's per-row offset (its log-normaliser) kept on the EOS-adjusted log-probs
            zq, zp = (_set_eos_prob(t.log_softmax(-1), case.eos, case.eos_prob) + t.logsumexp(-1, keepdim=True)
                      for t in (zq, zp))
            lq, lp = (_set_eos_prob(t, case.eos, case.eos_prob) for t in (lq, lp))
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
        sp = case.sampler
        label = describe_sources(case.q, case.p)
        if sp is None:
            return cls(case.name, lq, lp, bucket, case.length, case.eos, label=label, precision=case.precision,
                       per_sequence_mean=case.per_sequence_mean, token_mean_batch=case.token_mean_batch,
                       logits=(zq, zp))
        if sp.min_length and case.eos is None:
            raise SpecError("min_length needs an eos token", key="sampler.min_length")
        return cls(case.name, lq, lp, bucket, case.length, case.eos, label=label,
                   log_b=sp.logprobs(lq, lp) if sp.reshapes else None, min_length=sp.min_length,
                   weights=sp.weights, weight_cap=sp.weight_cap, sampler_label=sp.describe(),
                   precision=case.precision, per_sequence_mean=case.per_sequence_mean,
                   token_mean_batch=case.token_mean_batch, logits=(zq, zp), correction=WeightCorrection.of(sp),
                   rejection=sp.reject)

    def adapt(self, source: RowSource) -> RowSource:
        return source if self.precision is None else in_precision(source, self.precision)

    def require_gradients(self) -> None:
        if self.weights == "geometric":
            raise SpecError("gradient rows are not available with geometric sequence weights: set gradients = false",
                            key="sampler.weights", case=self.name)
        if self.precision is not None:
            raise SpecError("gradient rows are not available with rounded log-probs on rollouts: set gradients = "
                            "false or drop precision", key="precision", case=self.name)
        super().require_gradients()

    # ------------------------------------------------------------------ exact
    def _dp(self, m: torch.Tensor, h: torch.Tensor, kmax: int) -> list[float]:
        """E_q[M S^k] (no sampler involved): the truth."""
        a, e = rollout_dp.moment_matrices(self.log_q.exp(), m, h, self.bucket, self.buckets, self.eos, kmax)
        return rollout_dp.propagate(a, e, self.length)

    def _phase_matrices(self, m_fn, h_fn, kmax: int) -> list:
        """Per sampler phase, the DP's moment matrices and step count; ``m_fn``/``h_fn`` map a phase's
        log b to tables."""
        phases = []
        for lb, steps in self.phases:
            b = lb.exp()
            # Where b never draws, weights are irrelevant (and may be inf): zero them, never 0·inf. The
            # rejection mask's per-token factor multiplies M (a sub-stochastic b: paths through a rejected
            # token contribute 0; its square is itself, so second moments take it once too).
            m = torch.where(b > 0, m_fn(lb) * self.keep_table(lb), torch.zeros_like(b))
            h = torch.where(b > 0, h_fn(lb), torch.zeros_like(b))
            a, e = rollout_dp.moment_matrices(b, m, h, self.bucket, self.buckets, self.eos, kmax)
            phases.append((a, e, steps))
        return phases

    def b_moments(self, m_fn, h_fn, kmax: int) -> list[float]:
        """E_b[M S^k], k = 0..kmax, under the sampler's phases (``m_fn``/``h_fn`` map a phase's log b to the
        tables of M and S; zeroed where b never draws)."""
        return rollout_dp.propagate_phases(self._phase_matrices(m_fn, h_fn, kmax))

    def keep_table(self, lb: torch.Tensor) -> torch.Tensor:
        """[C, V] float64 0/1: the per-token factor of the rejection mask in the phase of log b ``lb`` (1
        without one). The mask is its product over a sequence's tokens where it factorises (seq_max
        criteria); the sum and mean criteria are not in it, and their rows have no exact value."""
        if self.rejection is None:
            return torch.ones_like(lb)
        return self.rejection.token_keep(self.log_q - lb)

    @property
    def exact_under_rejection(self) -> bool:
        """False where a rejection mask does not factorise over tokens: no exact values or gradients."""
        return self.rejection is None or self.rejection.factorises

    def token_weight(self, lb: torch.Tensor) -> torch.Tensor:
        # The cap applies to each token's q/b; a sequence weight is the product of capped token
        # weights, so it stays multiplicative (and exact by the DP).
        return self._capped(torch.exp(self.log_q - lb))

    def token_log_weight(self, lb: torch.Tensor) -> torch.Tensor:
        """log of :meth:`token_weight`: log(q/b), capped at log(weight_cap)."""
        return self._capped_log(self.log_q - lb)

    def _capped_log(self, lw: torch.Tensor) -> torch.Tensor:
        """log of a token's corrected weight from log(q/b): the cap in log space (no overflow); with a
        floor or mask, the log of the corrected weight (−inf where masked: the token or sequence drops)."""
        if self.correction is not None:
            return torch.log(self.correction.detached(torch.exp(lw)))
        return lw.clamp(max=math.log(self.weight_cap)) if self.weight_cap is not None else lw

    def seq_moments(self, s: int) -> list[float]:
        """E_q[R^s L^k] for k = 0..4 (R = e^L, L the sequence log-ratio); cached on the pair."""
        if s not in self._seq_cache:
            m = torch.exp(s * self.logr_table) if s else torch.ones_like(self.logr_table)
            self._seq_cache[s] = self._dp(m, self.logr_table, 4)
        return self._seq_cache[s]

    def _tok_values(self, est: RowSource) -> torch.Tensor:
        """Per-step value of a token-level row, [C, V]."""
        if est.analytic:
            return self.kl_ctx[:, None].expand_as(self.logr_table)
        return est.fn(self.logr_table)

    def tok_moments(self, h: torch.Tensor) -> list[float]:
        """E[S^k], k = 0..2, for the token sum S = Σ_t h(c_{t−1}, x_t)."""
        return self._dp(torch.ones_like(h), h, 2)

    def true_values(self) -> dict[str, float]:
        return {REVERSE: self.kl(), FORWARD: self.kl_forward()}

    def true_value(self, target: str, aggregate: str = "") -> float:
        # Rows divided by lengths estimate a rate per generated token: compare them with the target over
        # E_q|y| (what the token-mean of an unbiased per-token estimator converges to, draws from q).
        value = super().true_value(target)
        return value / self.mean_length() if AGGREGATES[aggregate].per_token else value

    def mean_length(self) -> float:
        """E_q|y|, exact (computed once: every per-token row's truth divides by it)."""
        if self._mean_length is None:
            ones = torch.ones_like(self.logr_table)
            self._mean_length = self._dp(ones, ones, 1)[1]
        return self._mean_length

    def kl(self) -> float:
        if self.precision is not None:     # the truth is the float64 KL, not the rounded table's
            g = self.log_p - self.log_q
            return -self._dp(torch.ones_like(g), g, 1)[1]
        return -self.seq_moments(0)[1]

    def kl_forward(self) -> float:
        if self.precision is not None:
            g = self.log_p - self.log_q
            return self._dp(torch.exp(g), g, 1)[1]
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

    def exact_moments(self, est: RowSource, aggregate: str = "seq") -> tuple[float, float]:
        # Each aggregate's exact hook (kl_bench.draws.AGGREGATES) calls one of the exact_* methods below.
        if not self.exact_under_rejection:
            return math.nan, math.nan           # a sum or mean over the tokens: Monte Carlo only
        return AGGREGATES[aggregate].exact(self, est)

    def exact_seq(self, est: RowSource) -> tuple[float, float]:
        """(mean, variance) of f(L), L the sequence log-ratio: polynomial moments E[R^s L^k] by the DP."""
        if est.analytic:
            return self.exact_tok(est)
        if self.has_sampler:
            return self._sampler_seq_moments(est)
        if est.poly is None:
            return math.nan, math.nan          # |L|: no exact rollout oracle
        mean, second = self._poly_mean(est.poly), self._poly_mean(poly_square(est.poly))
        return mean, (math.inf if math.isinf(second) else max(second - mean * mean, 0.0))

    def exact_tok(self, est: RowSource) -> tuple[float, float]:
        """(mean, variance) of the token sum Σ_t f(log r_t): additive along the path."""
        if self.has_sampler:
            return self._sampler_tok_moments(est)
        m = self.tok_moments(self._tok_values(est))
        return m[1], max(m[2] - m[1] ** 2, 0.0)

    def exact_tok_batch(self, est: RowSource) -> tuple[float, float]:
        """(mean, variance) of one token-mean value Σ_i Σ_t f / Σ_i |y_i| over B sequences. Draws are
        unweighted (refused otherwise): b's length split."""
        f = self._tok_values(est)
        ones = torch.ones_like(f)
        by_length = self._length_dp(lambda lb: ones, lambda lb: f, 2)
        if self._length_spectra is None:      # the lengths' part: the same for every row of the case
            self._length_spectra = rollout_dp.length_spectra(by_length[:, 0], self.token_mean_batch)
        return rollout_dp.token_mean_moments(by_length, self.token_mean_batch, self._length_spectra)

    def kurtosis_proxy(self, est: RowSource, aggregate: str = "seq") -> float:
        # Sequence-level estimators with an R^s term are dominated by it in the tail:
        # E[R^{4s}] / E[R^{2s}]² (both exact by the DP; inf when beyond float64).
        if aggregate != "seq" or est.poly is None or self.has_sampler:
            return math.nan
        s_max = max((s for (s, _), c in est.poly.items() if c != 0), default=0)
        if s_max == 0:
            return math.nan
        num, den = self.seq_moments(4 * s_max)[0], self.seq_moments(2 * s_max)[0]
        return num / den**2 if math.isfinite(num) and math.isfinite(den) and den > 0 else math.inf

    def _sampler_tok_moments(self, est: RowSource) -> tuple[float, float]:
        """(E_b[v], Var_b[v]) of a tok row under the sampler, by the phased dynamic program."""
        ones = torch.ones_like(self.logr_table)
        wt = self.token_weight
        f = self._tok_values(est)
        if self.weights == "token":             # Σ_t w_t f_t: additive
            mom = self.b_moments(lambda lb: ones, lambda lb: wt(lb) * f, 2)
            return mom[1], max(mom[2] - mom[1] ** 2, 0.0)
        if self.weights in ("sequence", "geometric"):   # W · Σ_t f_t: weight multiplicative, sum additive
            m1 = self.b_moments(lambda lb: wt(lb), lambda lb: f, 1)[1]
            m2 = self.b_moments(lambda lb: wt(lb) ** 2, lambda lb: f, 2)[2]
            return _mean_var(m1, m2)
        mom = self.b_moments(lambda lb: ones, lambda lb: f, 2)
        return mom[1], max(mom[2] - mom[1] ** 2, 0.0)

    def _sampler_seq_moments(self, est: RowSource) -> tuple[float, float]:
        """(E_b[v], Var_b[v]) of a seq row (a polynomial in R and L) under the sampler."""
        if est.poly is None:
            return math.nan, math.nan
        ones = torch.ones_like(self.logr_table)
        weighted = self.weights != "none"
        wt = self.token_weight

        def moment(poly, power):   # E_b[W^power Σ c R^s L^k]
            total = 0.0
            for (s_, k), c in poly.items():
                if c == 0:
                    continue
                v = self.b_moments(lambda lb, s_=s_: (wt(lb) ** power if weighted else ones) * torch.exp(s_ * self.logr_table),
                               lambda lb: self.logr_table, k)[k]
                if not math.isfinite(v):
                    return math.inf
                total += c * v
            return total
        mean = moment(est.poly, 1)
        second = moment(poly_square(est.poly), 2)
        return mean, (math.inf if math.isinf(second) else max(second - mean * mean, 0.0))

    def _length_dp(self, m_fn, h_fn, kmax: int) -> torch.Tensor:
        """[T, kmax+1]: E_b[M S^k ; |y| = ℓ] for ℓ = 1..T under the sampler's phases (b = q without one)."""
        return rollout_dp.propagate_by_length(self._phase_matrices(m_fn, h_fn, kmax))

    def length_law(self) -> torch.Tensor:
        """P_b(|y| = ℓ) for ℓ = 1..T, [T], under the sampler's phases (b = q without one)."""
        return self._length_dp(torch.ones_like, torch.ones_like, 0)[:, 0]

    def batch_length_factor(self) -> torch.Tensor:
        """γ_B(ℓ) = B·E[1/(ℓ + L′)] [T] of the tok_batch rows (L′ the other B − 1 lengths of a group,
        :func:`kl_bench.rollout_dp.inverse_total_length`): one FFT correlation, computed once per pair."""
        if self._batch_factor is None:
            self._batch_factor = rollout_dp.inverse_total_length(self.length_law(), self.token_mean_batch)
        return self._batch_factor

    def exact_tok_mean(self, est: RowSource) -> tuple[float, float]:
        """(mean, variance) of Σ_t f / |y| (times W with sequence weights), exact by splitting the dynamic
        program on the final length |y|."""
        f = self._tok_values(est)
        ones = torch.ones_like(f)
        lengths = torch.arange(1, self.length + 1, dtype=torch.float64)
        seq_w = self.weights in ("sequence", "geometric")
        m1 = self._length_dp(lambda lb: self.token_weight(lb) if seq_w else ones, lambda lb: f, 1)[:, 1]
        m2 = self._length_dp(lambda lb: self.token_weight(lb) ** 2 if seq_w else ones, lambda lb: f, 2)[:, 2]
        return _mean_var(float((m1 / lengths).sum()), float((m2 / lengths**2).sum()))

    def exact_tok_gm(self, est: RowSource) -> tuple[float, float]:
        """(mean, variance) of Σ_t f · W^{1/|y|}: W^{1/ℓ} = Π_t w_t^{1/ℓ} is multiplicative once ℓ is fixed,
        so one program per final length."""
        f = self._tok_values(est)
        mean = second = 0.0
        for ell in range(1, self.length + 1):
            # w^{1/ℓ} as exp(log w / ℓ): finite whenever the geometric mean is
            mean += float(self._length_dp(lambda lb: torch.exp(self.token_log_weight(lb) / ell), lambda lb: f,
                                          1)[ell - 1, 1])
            second += float(self._length_dp(lambda lb: torch.exp(2 * self.token_log_weight(lb) / ell),
                                            lambda lb: f, 2)[ell - 1, 2])
        return _mean_var(mean, second)

    def token_mean_limit(self, est: RowSource) -> float:
        """E[Σ_t f] / E[|y|]: what "token-mean" aggregation (Σ over a batch's tokens / their number)
        converges to as the batch grows (its finite-batch ratio bias is O(1/n)); draws from q or an
        unweighted sampler."""
        if self.weights != "none":
            return math.nan
        f = self._tok_values(est)
        ones = torch.ones_like(f)
        num = self.b_moments(lambda lb: ones, lambda lb: f, 1)[1]
        den = self.b_moments(lambda lb: ones, lambda lb: ones, 1)[1]
        return num / den

    def exact_joint(self, aggregate: str = "seq") -> JointMoments:
        m0, m1 = self.seq_moments(0), self.seq_moments(1)
        mean_a, var_a = -m0[1], m0[2] - m0[1] ** 2
        if aggregate == "seq":
            er2 = self.seq_moments(2)[0]
            var_b = math.inf if not math.isfinite(er2) else er2 - 1.0
            # Cov(−L, R − 1) = −E[R L] + E[L]·E[R], with E[R] = 1.
            return JointMoments(mean_a, 0.0, var_a, var_b, -m1[1] + m0[1])
        b = torch.expm1(self.logr_table)
        mb = self.tok_moments(b)
        mab = self.tok_moments(b - self.logr_table)       # a + b = Σ_t k3(r_t): Cov by polarisation
        var_b = mb[2] - mb[1] ** 2
        var_ab = mab[2] - mab[1] ** 2
        return JointMoments(mean_a, mb[1], var_a, var_b, 0.5 * (var_ab - var_a - var_b))

    # ------------------------------------------------------------------ sampling
    def sample_draws(self, n: int, generator: torch.Generator, device: torch.device,
                     tok_rows: list[Row] = ()) -> Draws:
        """``n`` rollouts of at most T steps; never materialises [n, V]."""
        return self.simulate([n], [generator], device, tok_rows)

    def simulate(self, sizes: list[int], gens: list[torch.Generator], device: torch.device,
                  tok_rows: list[Row] = (), record: list | None = None) -> Draws:
        """Rollouts for several batches at once: batch i's uniforms come from its own generator, every
        other operation runs on one long vector (per-op overhead dominates on short vectors).

        ``record``: when a list, each step appends (key, alive, w) of shape [n]: key = c·V + x (the
        bucket the token was drawn from and the token), alive = 1.0 where the step belongs to the
        sequence, w the token's (capped) weight q/b (None without weights)."""
        tables, logw, phase_of = self._sampler_tables(device)
        g_flat, kl_ctx, bucket = self.logr_table.reshape(-1).to(device), self.kl_ctx.to(device), self.bucket.to(device)
        v, n = self.vocab, sum(sizes)
        weight = torch.ones(n, dtype=torch.float64, device=device) if logw is not None else None
        log_weight = torch.zeros(n, dtype=torch.float64, device=device) if logw is not None else None
        c = torch.zeros(n, dtype=torch.int64, device=device)
        alive = torch.ones(n, dtype=torch.float64, device=device)
        logr, full, tok_b = (torch.zeros(n, dtype=torch.float64, device=device) for _ in range(3))
        tok = torch.zeros(n, len(tok_rows), dtype=torch.float64, device=device)
        # The rejection mask's statistics of the raw log q/b, per sequence (kl_bench.rejection).
        mask = SequenceMask(self.rejection, self.log_q, [lb for lb, _ in self.phases], n, device)
        for t in range(self.length):
            prob, alias = tables[phase_of[t]]
            u = torch.cat([torch.rand(k, dtype=torch.float64, generator=g, device=device)
                           for k, g in zip(sizes, gens)]) * v
            j = u.long().clamp_(max=v - 1)
            base = c * v
            x = torch.where(u - j < prob[base + j], j, alias[base + j])
            g, kl_c = g_flat[base + x], kl_ctx[c]
            logr += alive * g
            full += alive * kl_c
            tok_b += alive * torch.expm1(g)
            w_t = None if logw is None else self._capped(torch.exp(logw[phase_of[t]][base + x]))
            if w_t is not None:                     # q/b of this token, for sequences still alive
                weight = weight * torch.where(alive > 0, w_t, torch.ones_like(w_t))
                lw_t = self._capped_log(logw[phase_of[t]][base + x])
                log_weight += torch.where(alive > 0, lw_t, torch.zeros_like(lw_t))   # Σ log w: no overflow
            mask.add(phase_of[t], base + x, alive)
            if record is not None:
                record.append((base + x, alive, w_t))
            if tok_rows:
                vals = torch.stack([kl_c if r.est.analytic else r.est.fn(g) for r in tok_rows], dim=-1)
                tok += (alive * w_t if self.weights == "token" else alive)[:, None] * vals
            if self.eos is not None:
                alive = alive * (x != self.eos)
            c = bucket[x]
        return Draws(logr, full, tok, tok_b, weight=weight, tok_weighted=self.weights == "token",
                     log_weight=log_weight, keep=mask.keep())

    def _sampler_tables(self, device: torch.device):
        """Per phase the flattened alias tables [(prob, alias)] of b, per phase log(q/b) [C·V] (None
        without weights), and the phase of each step t."""
        if self._phase_alias is None:
            self._phase_alias = [self.alias_table()] if not self.has_sampler else [
                _flat_alias(lb) for lb, _ in self.phases]
        tables = [(t.prob.to(device), t.alias.to(device)) for t in self._phase_alias]
        logw = [(self.log_q - lb).reshape(-1).to(device) for lb, _ in self.phases] if self.weights != "none" else None
        phase_of = [i for i, (_, steps) in enumerate(self.phases) for _ in range(steps)] if self.has_sampler \
            else [0] * self.length
        return tables, logw, phase_of

    def _capped(self, w: torch.Tensor) -> torch.Tensor:
        """A token's weight q/b with the case's cap (and floor and mask, kl_bench.weights) applied."""
        if self.correction is not None:
            return self.correction.detached(w)
        return w.clamp(max=self.weight_cap) if self.weight_cap is not None else w

    def batch_sums(self, features: Features, tok_rows, device: torch.device) -> BatchSums:
        piece = self.piece_draws(device)

        def run(batches: list[BatchStream]) -> torch.Tensor:
            totals: list[torch.Tensor | None] = [None] * len(batches)
            group: list[tuple[int, int, torch.Generator]] = []      # (batch position, draws, generator)

            def flush():
                # Pieces of several small batches share one simulation (per-op overhead dominates on
                # short vectors); every operation is per path, so a piece's sum does not depend on its
                # neighbours. Contiguous per-piece reductions (no scatter-add): deterministic on CUDA.
                sizes = [m for _, m, _ in group]
                draws = self.simulate(sizes, [g for _, _, g in group], device, tok_rows)
                draws.segments = sizes        # token-mean groups stay within a piece
                f = features(draws)
                for (k, _, _), part in zip(group, torch.split(f, sizes)):
                    s = part.sum(0)
                    totals[k] = s if totals[k] is None else totals[k] + s
                group.clear()

            for k, batch in enumerate(batches):
                for m, g in batch.pieces(piece):
                    if group and sum(x for _, x, _ in group) + m > piece:
                        flush()
                    group.append((k, m, g))
            flush()
            return torch.stack(totals)
        return run

    def batches_per_chunk(self, batch_size: int, chunk_draws: int) -> int:
        # ~ (10 + tok rows) float64 values per rollout stay alive across the T steps.
        return max(1, chunk_draws // max(1, batch_size * 4))

    # ---------------------------------------------------------------- gradients (θ = q's bucket logits)
    @property
    def gradient_params(self) -> int:
        return self.buckets * self.vocab

    def gradient_references(self) -> dict[str, np.ndarray]:
        rev, fwd = grad.reference(self)
        return {REVERSE: rev, FORWARD: fwd}

    def gradient_exact(self, item: GradItem, directions: dict[str, np.ndarray]) -> ExactGrad | None:
        mean = grad.exact_mean(self, item)
        return None if mean is None else ExactGrad(mean, math.nan, {})

    def gradient_excludes(self, mode: str, aggregate: str) -> bool:
        # Under the PPO clip, a token's branch depends on its own ratio and cost only in the local forms;
        # a score-function row's cost is the whole sequence's (and a seq row has no per-token ratio):
        # those rows are left out rather than given a form no trainer computes (docs/weights.md).
        return self.clip is not None and self.clip.clips(mode) and (
            not AGGREGATES[aggregate].token or MODES[mode].token != "local")

    def gradient_self(self, item: GradItem) -> np.ndarray | None:
        return grad.self_gradient(self, item)

    def gradient_ukl(self) -> np.ndarray | None:
        return grad.ukl(self)

    def gradient_accumulator(self, items, directions, device) -> GradientAccumulator:
        return grad.RolloutGradients(self, items, list(directions.values()), device)

    # ---------------------------------------------------------------- group baselines (kl_bench.baselines)
    baseline_aggregates = ("seq", "tok")

    def baseline_check(self) -> None:
        """A rollout's baseline rows centre the sequence's value F and multiply by its sequence weight W:
        token weights (each token's ratio inside F) and the PPO clip are not modelled."""
        if self.weights not in ("none", "sequence"):
            raise SpecError(f"group baselines on rollouts need weights = \"none\" or \"sequence\", not "
                            f"\"{self.weights}\" (only the sequence's product weight W is modelled: W·(F − b)·S)",
                            key="sampler.weights", case=self.name)
        if self.precision is not None:
            raise SpecError("group baselines on rollouts are not available with rounded log-probs: drop precision "
                            "or baseline_groups", key="precision", case=self.name)
        if self.rejection is not None:
            raise SpecError("group baselines on rollouts with a rejection mask (reject) are not modelled: drop "
                            "reject or baseline_groups", key="sampler.reject", case=self.name)

    def baseline_exact(self, est, aggregate: str) -> BaselineExact | None:
        """Exact expected gradient (second moments are measured: |S|² couples the steps, see the module
        docstring of kl_bench.pairs.rollout.gradients)."""
        out = grad.baseline_exact(self, est, aggregate)
        return None if out is None else BaselineExact(*out)

    def baseline_draws(self, est, aggregate: str, u: np.ndarray, device: torch.device):
        return grad.baseline_draws(self, est, aggregate, u, device)

    def baseline_piece(self, device: torch.device) -> int:
        # [n, T] recorded steps stay within 2^21 entries, as in the gradient pass.
        return max(1, min(self.piece_draws(device), 2**21 // max(1, self.length)))

    def describe(self) -> str:
        eos = f", eos={self.eos}" if self.eos is not None else ""
        return (f"rollout V={self.vocab}, C={self.buckets}, T={self.length}{eos}"
                + (f": {self.label}" if self.label else "")
                + (f"; {self.sampler_label}" if self.sampler_label else "")
                + (f"; {self.precision.describe()}" if self.precision is not None else ""))


def _mean_var(mean: float, second: float) -> tuple[float, float]:
    """(mean, variance) from the first two moments; an infinite second moment is an infinite variance."""
    if not math.isfinite(second):
        return mean, math.inf
    return mean, max(second - mean * mean, 0.0)


def _flat_alias(log_b: torch.Tensor) -> AliasTable:
    """Per-bucket alias tables of b [C, V], flattened to [C·V]."""
    b = log_b.exp()
    tables = [build_alias(b[c].numpy()) for c in range(b.shape[0])]
    return AliasTable(torch.cat([t.prob for t in tables]), torch.cat([t.alias for t in tables]))


def _set_eos_prob(log_probs: torch.Tensor, eos: int, prob: float) -> torch.Tensor:
    """Give EOS probability ``prob`` in every bucket, rescaling the other tokens to 1 − prob."""
    others = log_probs.clone()
    others[:, eos] = -torch.inf
    out = torch.log_softmax(others, -1) + math.log1p(-prob)
    out[:, eos] = math.log(prob)
    return out


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


__all__ = ["RolloutCase", "RolloutPair", "brute_force_sequences", "read_bucket_map"]
