"""The rollout model: every table the rollout kind computes with, frozen (docs/rollouts.md#model).

Two autoregressive token models q and p over V tokens whose next-token law depends on the previous token
only through its bucket c = bucket(x) ∈ {0..C−1}; generation starts in bucket 0 and stops after T tokens
or at EOS (which is included). A sampler b draws the tokens in phases (EOS suppressed for the first
``min_length`` steps, then b itself); each token's importance weight q/b is corrected (cap, floor, mask;
the PPO clip changes gradients only) and a rejection mask may drop whole sequences. The other parts of the
kind (``dp``, ``oracle``, ``sampler``, ``gradients``, ``baselines``) read this object and nothing else, and
so does kl_bench.training.

Tables are float64 [C, V] (the bucket map int64 [V]) on one device, the device of log q: every table
derived here is made there. :meth:`RolloutModel.build` is tensor algebra only (it runs on ``meta``
tensors); :meth:`RolloutModel.validate` checks values (host reads of small results).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from ...sampling.alias import AliasTable, build_alias_rows
from ...sampling.seeding import device_key
from ...foundation.errors import SpecError
from ...core.precision import Precision, rounded_logr
from ...core.rejection import Rejection
from ...core.weights import WeightCorrection


@dataclass(frozen=True)
class Weighting:
    """What a sampler's ``weights`` option does to the rows (docs/rollouts.md#sampler-weights), one entry of
    :data:`WEIGHTINGS`: nothing in the kind branches on the option's name."""
    name: str
    weighted: bool = False          # tokens carry w_t = q/b, and seq rows are multiplied by W = Π_t w_t
    per_token: bool = False         # tok rows are Σ_t w_t f_t: each token's term carries its own weight
    on_sums: bool = False           # tok rows are multiplied by W (the sequence's weight on the token sum)
    geometric: bool = False         # tok_gm rows: the token sum times W^{1/|y|} (TRL's sequence weight)
    gradients: bool = True          # gradient rows are defined
    baselines: bool = False         # group baselines model it (W·(F − b)·S)
    per_sequence_mean: bool = True  # tok_mean rows have a length-aware oracle
    token_mean_batch: bool = False  # tok_batch rows have an exact oracle (unweighted draws only)
    cumulative: bool = False        # tok rows are Σ_t ρ_{1:t} f_t: each token carries its prefix's weight (CTPO)


WEIGHTINGS: dict[str, Weighting] = {w.name: w for w in (
    Weighting("none", baselines=True, token_mean_batch=True),
    Weighting("token", weighted=True, per_token=True, per_sequence_mean=False),
    Weighting("sequence", weighted=True, on_sums=True, baselines=True),
    Weighting("geometric", weighted=True, on_sums=True, geometric=True, gradients=False),
    # CTPO (arXiv 2605.07331): token t weighted by the prefix product ρ_{1:t} = Π_{s≤t} w_s, unbiased per token.
    Weighting("cumulative", weighted=True, per_token=True, cumulative=True, per_sequence_mean=False, gradients=False),
)}


class Phase(NamedTuple):
    """``steps`` consecutive steps whose tokens are drawn from b = exp(``log_b``) [C, V]."""
    log_b: torch.Tensor
    steps: int


@dataclass(frozen=True, eq=False)
class SamplingTables:
    """What a step of the sampler reads, on one device (made there once per model and device: a rollout
    run calls the sampler once per chunk, a gradient pass once per piece, and copying [C·V] tables from
    the host each time cost more than the sampling on a GPU, issue 33)."""
    alias: tuple[AliasTable, ...]              # per phase, the sampler's per-bucket alias tables [C·V]
    logr: torch.Tensor                         # log r(c, x) flattened [C·V]
    kl_ctx: torch.Tensor                       # KL(q(·|c) ‖ p(·|c)) [C]
    bucket: torch.Tensor                       # the bucket after each token [V]
    logw: tuple[torch.Tensor, ...] | None      # per phase, log q/b flattened [C·V] (None: no weights)
    logq: torch.Tensor                         # log q(x|c) flattened [C·V] (Estimator.needs_logq rows)


@dataclass(frozen=True, eq=False)
class RolloutModel:
    """The tables of one rollout case (module docstring); built by :meth:`build`.

    ``logr_table`` is log r(c, x) as the estimators see it (rounded where ``precision`` is set; the truth
    stays the float64 KL), ``kl_ctx`` [C] the per-bucket KL(q(·|c) ‖ p(·|c)). ``phases``: the sampler's
    phases in order (one phase of b = q without a sampler). ``correction``: a floor or mask of q/b (None for
    the cap alone, computed as ``weight_cap``); ``clip``: the PPO clip (gradients only). ``rounded``: what
    the precision rounds, (q side, p side)."""
    log_q: torch.Tensor
    log_p: torch.Tensor
    bucket: torch.Tensor
    length: int
    eos: int | None
    logr_table: torch.Tensor
    kl_ctx: torch.Tensor
    phases: tuple[Phase, ...]
    has_sampler: bool = False
    weighting: Weighting = WEIGHTINGS["none"]
    weight_cap: float | None = None
    correction: WeightCorrection | None = None
    clip: WeightCorrection | None = None
    rejection: Rejection | None = None
    min_length: int = 0
    per_sequence_mean: bool = False
    token_mean_batch: int | None = None
    precision: Precision | None = None
    rounded: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(cls, log_q: torch.Tensor, log_p: torch.Tensor, bucket: torch.Tensor, length: int, eos: int | None, *,
              log_b: torch.Tensor | None = None, min_length: int = 0, weights: str = "none",
              weight_cap: float | None = None, precision: Precision | None = None, per_sequence_mean: bool = False,
              token_mean_batch: int | None = None, logits: tuple[torch.Tensor, torch.Tensor] | None = None,
              correction: WeightCorrection | None = None, rejection: Rejection | None = None) -> "RolloutModel":
        """The model of q, p (normalised [C, V]) and ``bucket`` [V] in [0, C) (see
        :class:`kl_bench.kinds.rollout.RolloutPair` for the sampler options). ``logits``: (q's, p's) bucket
        logits as the source holds them, for ``precision`` (kl_bench.core.precision)."""
        weighting = WEIGHTINGS[weights]
        clip = _ppo_clip(correction, weighting)
        _check_length_rows(per_sequence_mean, token_mean_batch, weighting, rejection)
        min_length = int(min_length) if eos is not None else 0
        log_q, log_p = log_q.to(torch.float64), log_p.to(torch.float64)
        logr_table, rounded = log_p - log_q, None                     # log r(c, x), [C, V]
        if precision is not None:   # a fixed function of (bucket, token): the dynamic program stays exact
            rounded = precision.rounding_input(logits, log_q, log_p)
            logr_table = rounded_logr(*rounded, precision)
        q = log_q.exp()
        kl_ctx = (q * (log_q - log_p)).sum(-1)                        # KL(q(·|c) ‖ p(·|c)), [C]
        has_sampler = log_b is not None or min_length > 0 or weighting.weighted or rejection is not None
        phases = _phases(log_q if log_b is None else log_b.to(torch.float64), eos, int(length), min_length)
        return cls(log_q, log_p, bucket.long(), int(length), eos, logr_table, kl_ctx, phases, has_sampler, weighting,
                   weight_cap, _floor_or_mask(correction), clip, rejection, min_length, per_sequence_mean,
                   token_mean_batch, precision, rounded)

    def validate(self) -> "RolloutModel":
        """Refuse (SpecError) a sampler that draws tokens q never does, in any phase; the model itself."""
        if any(bool(((lb > -torch.inf) & (self.log_q == -torch.inf)).any()) for lb, _ in self.phases):
            raise SpecError("the sampler draws tokens that q gives probability 0", key="sampler")
        return self

    @property
    def buckets(self) -> int:
        return self.log_q.shape[0]

    @property
    def vocab(self) -> int:
        return self.log_q.shape[1]

    @property
    def device(self) -> torch.device:
        return self.log_q.device

    @cached_property
    def support_miss(self) -> float:
        """The largest per-step, per-bucket mass of q that b never draws (EOS suppression counts): a bias
        source of every weighted row. "Never" as the alias tables draw: b's probability 0 in float64 (log b =
        −inf, or below −745 under a temperature near 0)."""
        q = self.log_q.exp()
        return max(float((q * (lb.exp() == 0)).sum(-1).max()) for lb, _ in self.phases)

    @property
    def exact_under_rejection(self) -> bool:
        """False where a rejection mask does not factorise over tokens: no exact values or gradients."""
        return self.rejection is None or self.rejection.factorises

    @cached_property
    def phase_of(self) -> list[int]:
        """The phase of each step t = 0..T−1."""
        return [i for i, (_, steps) in enumerate(self.phases) for _ in range(steps)]

    @cached_property
    def alias_tables(self) -> tuple[AliasTable, ...]:
        """Per phase, b's per-bucket alias tables flattened to [C·V] (a step is two gathers per rollout);
        built on first sampling (exact runs need none)."""
        return tuple(build_alias_rows(lb.exp()) for lb, _ in self.phases)

    @cached_property
    def _tables_by_device(self) -> dict[torch.device, SamplingTables]:
        return {}

    def sampling_tables(self, device: torch.device) -> SamplingTables:
        """The sampler's tables on ``device`` (:class:`SamplingTables`), made there on first use."""
        key = device_key(device)                           # one copy for "cuda" and "cuda:N" alike
        if key not in self._tables_by_device:
            logw = tuple((self.log_q - lb).reshape(-1).to(key) for lb, _ in self.phases) \
                if self.weighting.weighted else None
            self._tables_by_device[key] = SamplingTables(tuple(t.to(key) for t in self.alias_tables),
                                                         self.logr_table.reshape(-1).to(key), self.kl_ctx.to(key),
                                                         self.bucket.to(key), logw, self.log_q.reshape(-1).to(key))
        return self._tables_by_device[key]

    # ---------------------------------------------------------------- importance weights (docs/weights.md)
    def capped(self, w: torch.Tensor) -> torch.Tensor:
        """A token's weight q/b with the case's cap (and floor and mask, kl_bench.core.weights) applied."""
        if self.correction is not None:
            return self.correction.detached(w)
        return w.clamp(max=self.weight_cap) if self.weight_cap is not None else w

    def capped_log(self, lw: torch.Tensor) -> torch.Tensor:
        """log of a token's corrected weight from log(q/b): the cap in log space (no overflow); with a
        floor or mask, the log of the corrected weight (−inf where masked: the token or sequence drops)."""
        if self.correction is not None:
            return torch.log(self.correction.detached(torch.exp(lw)))
        return lw.clamp(max=math.log(self.weight_cap)) if self.weight_cap is not None else lw

    def token_weight(self, lb: torch.Tensor) -> torch.Tensor:
        """[C, V] corrected q/b in the phase of log b ``lb``. The cap applies to each token's q/b; a sequence
        weight is the product of capped token weights, so it stays multiplicative (exact by the program)."""
        return self.capped(torch.exp(self.log_q - lb))

    def token_log_weight(self, lb: torch.Tensor) -> torch.Tensor:
        """log of :meth:`token_weight`: log(q/b), capped at log(weight_cap)."""
        return self.capped_log(self.log_q - lb)

    def sequence_weight(self, lb: torch.Tensor) -> torch.Tensor:
        """The per-step factor of W = Π_t w_t that multiplies sequence terms: the token weight where the
        draws are weighted, else 1."""
        return self.token_weight(lb) if self.weighting.weighted else torch.ones_like(lb)

    def keep_table(self, lb: torch.Tensor) -> torch.Tensor:
        """[C, V] float64 0/1: the per-token factor of the rejection mask in the phase of log b ``lb`` (1
        without one). The mask is its product over a sequence's tokens where it factorises (seq_max
        criteria); the sum and mean criteria are not in it, and their rows have no exact value."""
        if self.rejection is None:
            return torch.ones_like(lb)
        return self.rejection.token_keep(self.log_q - lb)

    def tok_values(self, est) -> torch.Tensor:
        """Per-step value [C, V] of a token-level row: the estimator of log r(c, x), or KL(c) for ``full``."""
        if est.analytic:
            return self.kl_ctx[:, None].expand_as(self.logr_table)
        return est.on(self.logr_table, self.log_q)


def _phases(late: torch.Tensor, eos: int | None, length: int, min_length: int) -> tuple[Phase, ...]:
    """The sampler's phases: [(log b [C, V], steps)], EOS suppressed (renormalised) in the first
    min(min_length, T) steps."""
    phases = []
    if min_length:
        early = late.clone()
        early[:, eos] = -torch.inf
        phases.append(Phase(torch.log_softmax(early, -1), min(min_length, length)))
    if length > min_length:
        phases.append(Phase(late, length - min_length))
    return tuple(phases)


def _floor_or_mask(correction: WeightCorrection | None) -> WeightCorrection | None:
    """The correction when it floors or masks q/b; None for the cap alone (computed as before, so that
    its bytes do not move)."""
    if correction is None or (correction.floor is None and correction.mask is None):
        return None
    return correction


def _check_length_rows(per_sequence_mean: bool, token_mean_batch: int | None, weighting: Weighting,
                       rejection: Rejection | None) -> None:
    """Rows divided by lengths have exact oracles under these weights only, and none under a rejection
    mask (a rejected sequence's tokens would leave the denominator: a ratio, not a mean of draws)."""
    if rejection is not None and (per_sequence_mean or token_mean_batch is not None):
        raise SpecError(f"{'per_sequence_mean' if per_sequence_mean else 'token_mean_batch'} cannot be combined "
                        "with a rejection mask (a rejected sequence would leave the lengths' denominator): drop one",
                        key="sampler.reject")
    if per_sequence_mean and not weighting.per_sequence_mean:
        raise SpecError("per_sequence_mean needs weights = \"none\", \"sequence\" or \"geometric\" (a token-weighted "
                        "sum over |y| has no length-aware oracle here)", key="per_sequence_mean")
    if token_mean_batch is not None and not weighting.token_mean_batch:
        raise SpecError("token_mean_batch needs unweighted draws (weights = \"none\"): a weighted token-mean "
                        "has no exact oracle here", key="token_mean_batch")


def _ppo_clip(correction: WeightCorrection | None, weighting: Weighting) -> WeightCorrection | None:
    """The correction when it holds the PPO clip (it changes gradients only, kl_bench.core.weights: of the
    per-token local rows, exactly); None otherwise. The clip is per token: weights = "token"."""
    if correction is None or (correction.clip is None and correction.dual is None):
        return None
    if not weighting.per_token or weighting.cumulative:
        raise SpecError("the PPO clip (clip_low, clip_high, dual_clip) clips each token's ratio: it needs "
                        "weights = \"token\"", key="sampler.weights")
    return correction


def brute_force_sequences(model: RolloutModel) -> list[tuple[float, list[tuple[int, int]]]]:
    """Every sequence with its q-probability and per-step (bucket, token) path: tiny V and T only."""
    q = model.log_q.exp().cpu().numpy()
    bucket = model.bucket.tolist()
    out = []

    def rec(c: int, prob: float, path: list[tuple[int, int]]):
        if len(path) == model.length:
            out.append((prob, path))
            return
        for x in range(model.vocab):
            step = path + [(c, x)]
            if model.eos is not None and x == model.eos:
                out.append((prob * q[c, x], step))
            else:
                rec(bucket[x], prob * q[c, x], step)
    rec(0, 1.0, [])
    return out
