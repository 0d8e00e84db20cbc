"""What a case kind implements, as small protocols, and the registry of kinds (:func:`register_kind`).

A kind is one module or package under ``kl_bench/kinds/``, registered with :func:`register_kind`. Its pair
class implements:

- :class:`CaseParser` (required): its config dataclass from the case's TOML table, and the pair from it;
- :class:`Oracle` (required): the exact value of each target, the exact moments of every row, a caption;
- :class:`DrawSampler` (required): draws x ~ q (or b) and their per-batch feature sums;
- :class:`GradientOracle` (optional): exact gradients and a per-draw gradient accumulator. A kind with a few
  parameters implements :class:`ScoreSampler` and takes the default accumulator
  (kl_bench.kinds.defaults.ScoreGradientOracle);
- :class:`BaselineOracle` (optional): group-baseline rows;
- :class:`kl_bench.kinds.trainable.TrainingOracle` (optional): training trajectories.

:class:`CasePair` is what the engine, the experiment and the results ask of every case: the required three
and the rows a case has. Code outside ``kinds/`` reads a pair through these members only (a test checks
it) and never asks what type a pair is: it asks these protocols (:func:`gradient_oracle`,
:func:`require_gradients`, :func:`baseline_oracle`), and a kind that does not implement an optional one is
refused in one line where it would be needed. The defaults a kind may inherit (the base class
:class:`kl_bench.kinds.defaults.Pair` and the gradient mixins) live in :mod:`kl_bench.kinds.defaults`.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from ..foundation.typed_toml import Table
from ..core.draws import Draws, Row
from ..foundation.errors import SpecError
from ..core.estimators import RowSource
from ..core.modes import ExactGrad, GradBatch, GradItem
from ..foundation.registry import Registry
from ..sampling.mismatch import SamplerSpec
from ..sampling.seeding import BatchStream

# Per-draw features: Draws [n] → [n, P] float64 (see engine.make_features).
Features = Callable[[Draws], torch.Tensor]
# Per-batch sums: k batch streams → [k, P] float64; row i depends on batch i's stream alone.
BatchSums = Callable[[list[BatchStream]], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class CaseConfig:
    """What every case has; a kind's config dataclass adds its own fields (frozen, keyword-only)."""
    name: str
    draws: int | None = None             # overrides [experiment] draws for this case
    sampler: SamplerSpec | None = None
    kind: str = ""                       # the registered kind it was parsed as (set by the spec parser)


@dataclass(frozen=True)
class JointMoments:
    """Moments of a = −log r and b = r − 1 under q: all that cv(λ) = a + λb needs (docs/lambda.md).

    E[cv(λ)] = mean_a + λ·mean_b,  Var[cv(λ)] = var_a + 2λ·cov_ab + λ²·var_b,
    λ* = −cov_ab/var_b = Cov(log r, r)/Var(r) = [KL(p‖q) + KL(q‖p)]/χ²(p‖q).
    """
    mean_a: float
    mean_b: float
    var_a: float
    var_b: float      # χ²(p‖q) when supp p ⊆ supp q; may be +inf
    cov_ab: float

    @property
    def lambda_star(self) -> float:
        if math.isinf(self.var_b):
            return 0.0            # any λ ≠ 0 has infinite variance: k1 is the only finite choice
        return -self.cov_ab / self.var_b if self.var_b > 0 else math.nan

    def mean(self, lam):
        return self.mean_a + lam * self.mean_b

    def var(self, lam):
        """Var[cv(λ)]; +inf for λ ≠ 0 when var_b is infinite. Works on floats and numpy arrays."""
        lam = np.asarray(lam, dtype=np.float64)
        if math.isinf(self.var_a):                # KL(q‖p) = ∞: −log r is infinite on some draw
            out = np.full_like(lam, np.inf)
        elif math.isinf(self.var_b):
            out = np.where(lam == 0, self.var_a, np.inf)
        else:
            out = np.maximum(self.var_a + 2 * lam * self.cov_ab + lam * lam * self.var_b, 0.0)
        return float(out) if out.ndim == 0 else out


# ----------------------------------------------------------------------------- gradients
class GradientAccumulator(ABC):
    """Accumulates the per-draw gradients of every item, one batch at a time (the engine seeds them)."""

    @abstractmethod
    def add(self, batch: BatchStream) -> GradBatch:
        """Draw the batch (piece by piece, or its counts) and return the batch's sums."""

    @abstractmethod
    def total(self) -> np.ndarray:
        """[J, P]: Σ over every draw so far of each item's per-draw gradient."""

    # Several processes (kl_bench.engine.distributed): each rank adds a block of batches, then rank 0 merges the
    # ranks' partial totals. Only an accumulator whose merged total is bit for bit the one-process total
    # (exact integer counts, or per-batch sums added in batch order) says so; the others run on rank 0.
    splittable: ClassVar[bool] = False
    keep_batches: bool = False      # set by the engine on a split pass: keep what merge needs per batch

    def partial(self) -> Any:
        """This rank's share of the totals (picklable), for :meth:`merge`."""
        raise NotImplementedError

    def merge(self, partials: list[Any]) -> None:
        """Rank 0: every rank's :meth:`partial`, in rank order (contiguous blocks of batches), into the
        totals one process adding every batch in order would hold."""
        raise NotImplementedError


@runtime_checkable
class CaseParser(Protocol):
    """Spec → config → pair (class methods of a kind's pair class)."""

    @classmethod
    def parse(cls, t: Table, common: dict[str, Any], spec_dir: Path) -> CaseConfig:
        """The kind's config from its case table ``t`` (finish ``t``: unknown keys are errors);
        ``common``: name, draws and sampler, already parsed, to pass on to the config."""

    @classmethod
    def from_config(cls, config: CaseConfig) -> "CasePair":
        """Build the pair (may read files); input errors are SpecErrors naming the key."""


@runtime_checkable
class Oracle(Protocol):
    """The exact truth of a pair: targets, per-row moments, the joint moments of the λ curve."""

    def true_values(self) -> dict[str, float]:
        """Exact value of every target this pair supports (kl_bench.core.targets); may be +inf."""

    def exact_moments(self, est: RowSource, aggregate: str = "") -> tuple[float, float]:
        """(E_q[f], Var_q[f]) per draw, exactly; NaN where unknown, +inf where divergent."""

    def exact_joint(self, aggregate: str = "") -> JointMoments:
        """Exact moments of (−log r, r − 1) under q (rollouts: of (−L, R − 1) with "seq" and of
        (−L, Σ_t (r_t − 1)) with "tok")."""

    def describe(self) -> str:
        """One line describing q and p, for captions and tables."""


@runtime_checkable
class DrawSampler(Protocol):
    """Draws x ~ q (or a behaviour b ≠ q), seeded by the engine's streams."""

    def sample_draws(self, n: int, generator: torch.Generator, device: torch.device,
                     tok_rows: list[Row] = ()) -> Draws:
        """``n`` explicit draws (for small-batch simulations and tests)."""

    def piece_draws(self, device: torch.device) -> int:
        """Draws per piece (kl_bench.sampling.seeding)."""

    def batch_sums(self, features: Features, tok_rows: list[Row], device: torch.device) -> BatchSums:
        """Per-batch sums of the per-draw features, each batch drawn from its own stream."""

    def batches_per_chunk(self, batch_size: int, chunk_draws: int) -> int:
        """How many batches to hand :meth:`batch_sums` at once."""


@runtime_checkable
class GradientOracle(Protocol):
    """Optional (docs/gradients.md): exact gradients ∇θ of q's parameters and their Monte Carlo estimate
    (:class:`GradientDefaults` holds the defaults of the members a kind need not write)."""
    clamp_sees_weight: bool            # loss_is_nemo rows under a sampler: the pair applies w inside the clamp
    exports_gradient_vectors: bool     # gradients.npz holds its exact gradient vectors

    @property
    def gradient_params(self) -> int:
        """Number of parameters θ of q that gradients are taken with respect to."""

    def gradient_references(self) -> dict[str, np.ndarray]:
        """{target: ∇θ of its exact value} [P] for every target."""

    def gradient_exact(self, item: GradItem, directions: dict[str, np.ndarray]) -> ExactGrad | None:
        """The exact expected per-draw gradient of ``item`` (and its second moments where exact), or
        None where no exact value exists. ``directions``: unit vectors for projected variances."""

    def gradient_accumulator(self, items: list[GradItem], directions: dict[str, np.ndarray],
                             device: torch.device) -> GradientAccumulator:
        """Per-draw gradients of every item, batch by batch."""

    def gradient_fourth_moment_finite(self, item: GradItem) -> bool:
        """E|c s|⁴ < ∞ (else a measured gradient variance cannot be tested against its exact value)."""

    def gradient_self(self, item: GradItem) -> np.ndarray | None:
        """∇θ E_q[v] [P], v the row's value (the estimator on the item's aggregate): the ``self`` target,
        what the row's value would follow used as an objective; None where the kind has no exact value."""

    def gradient_ukl(self) -> np.ndarray | None:
        """∇θ UKL(q_S‖p) [P], the unnormalised KL Σ_{x∈S} q log(q/p) − q + p over S, what the sampler can
        draw (docs/gradients.md#targets-reverse-forward-self-ukl): the ``ukl`` target; None where the kind
        has none (it equals ∇KL(q‖p) wherever S holds all of q's mass)."""

    @property
    def gradient_aggregates(self) -> tuple[str, ...]:
        """The aggregates that get gradient rows (each also in the estimator's ``aggregates_for``)."""

    def gradient_pair_rows(self, sources: list[RowSource]) -> list[GradItem]:
        """Gradient rows of pair-supplied rows in ``sources`` (rollouts: the Rao–Blackwellised gradient of
        ``full``); [] where the kind has none."""

    def gradient_excludes(self, mode: str, aggregate: str) -> bool:
        """Whether a (mode, aggregate) gets no gradient row on this pair (e.g. a form the case's sampler
        corrections do not define)."""

    def require_gradients(self) -> None:
        """Refuse (SpecError, one line) a gradient pass this case's options do not support."""


@dataclass(frozen=True)
class BaselineExact:
    """Exact pieces of a reward-mode row ρ·(F − b)·s with a group baseline b (kl_bench.experiment.group_baselines), x ~ b
    (the sampler; q without one), F the row's value, ρ its importance weight (1 without one):
    ``rho_f_s`` = E[ρ F s] [P], ``rho_s`` = E[ρ s] [P], ``mu`` = E[F], ``var`` = Var F, and ``phi`` =
    (E[F² φ], E[F φ], E[φ]) for φ = ρ²|s|² (None where the kind has no exact second moments)."""
    rho_f_s: np.ndarray
    rho_s: np.ndarray
    mu: float
    var: float = math.nan
    phi: tuple[float, float, float] | None = None


# Draws for baseline rows: (n, generator) → (F [n], ρ [n], s·u [n], |s|² [n]) for n draws in order.
BaselineDraws = Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


@runtime_checkable
class BaselineOracle(Protocol):
    """Optional (docs/weights.md#group-baselines-reward-mode): group-baseline rows of an estimator in the
    reward, one per aggregate in :attr:`baseline_aggregates`."""

    @property
    def baseline_aggregates(self) -> tuple[str, ...]:
        """The aggregates with baseline rows (categoricals: ""; rollouts: seq and tok)."""

    def baseline_check(self) -> None:
        """Refuse (SpecError, one line) a case whose sampler options baselines do not model."""

    def baseline_exact(self, est, aggregate: str) -> BaselineExact | None:
        """The exact pieces of the row, or None where the kind has no exact expected gradient for it."""

    def baseline_draws(self, est, aggregate: str, u: np.ndarray, device: torch.device) -> BaselineDraws:
        """Per-draw F, ρ, s·u (u [P] a unit direction) and |s|², for the Monte Carlo rows."""

    def baseline_piece(self, device: torch.device) -> int:
        """Draws per piece (groups never straddle pieces, so G may not exceed it)."""


def baseline_oracle(pair: Any) -> BaselineOracle | None:
    """The pair as a baseline oracle, or None where its kind has none."""
    return pair if isinstance(pair, BaselineOracle) else None


@runtime_checkable
class ScoreSampler(Protocol):
    """Draws with their per-draw score features, for :class:`ScoreGradients` (kinds with few parameters)."""

    @property
    def gradient_params(self) -> int:
        """P, the length of a score."""

    def piece_draws(self, device: torch.device) -> int:
        """Draws per piece (kl_bench.sampling.seeding)."""

    def sample_scores(self, n: int, generator: torch.Generator,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``n`` draws as (log r [n], importance weight q/b [n] or None, score ∇θ log q(x) [n, P])."""


def gradient_oracle(pair: Any) -> GradientOracle | None:
    """The pair as a gradient oracle, or None where its kind has none."""
    return pair if isinstance(pair, GradientOracle) else None


@runtime_checkable
class CasePair(Oracle, DrawSampler, Protocol):
    """What the engine, the experiment and the results ask of a case's pair (:class:`Pair` holds the
    defaults): its name and kind, the rows it has, its truth (:class:`Oracle` and the analyses' hooks), its
    draws (:class:`DrawSampler`) and what its sampler is."""
    name: str
    kind: str
    aggregates: tuple[str, ...]        # rollouts: ("seq", "tok"): the aggregates of the λ curve
    has_sampler: bool                  # draws come from b ≠ q (see SamplerSpec)
    sampler_label: str
    support_miss: float                # mass of q (per context/step, worst case) that b never draws
    weights: str                       # the sampler's importance weights ("none" without)
    expensive_draws: bool              # a draw costs model forward passes: keep side simulations small
    supplies_logq: bool                # hands the estimators log q(x) of each draw (Estimator.needs_logq)

    def metadata(self) -> dict[str, Any]:
        """This case in run.json."""

    def validate(self, sources: list[RowSource]) -> None:
        """Refuse (SpecError) estimators this pair has no exact oracle for, before any sampling."""

    def adapt(self, source: RowSource) -> RowSource:
        """The estimator as this case evaluates it."""

    def aggregates_for(self, source: RowSource) -> tuple[str, ...]:
        """The aggregates on which ``source`` gets a row."""

    def row_group(self, aggregate: str) -> int:
        """Draws per value of a row on ``aggregate``."""

    def true_value(self, target: str, aggregate: str = "") -> float:
        """The exact target of a row on ``aggregate``."""

    def kl(self) -> float:
        """Exact KL(q‖p)."""

    def kl_forward(self) -> float:
        """Exact KL(p‖q)."""

    def fourth_moment_finite(self, est: RowSource, aggregate: str = "") -> bool:
        """Whether E_q[f⁴] < ∞."""

    def kurtosis_proxy(self, est: RowSource, aggregate: str = "") -> float:
        """An exact scale for E[f⁴]/E[f²]², else NaN."""

    def exact_prob_negative(self, fn: Callable[[torch.Tensor], torch.Tensor], aggregate: str = "") -> float:
        """Exact P_q(f(log r) < 0), or NaN."""

    def reference_row(self) -> str | None:
        """The Monte Carlo reference row where no exact value exists; None otherwise."""

    def gate_rates(self, gate: Any, delta: float) -> Any:
        """A gate's exact rates at ``delta`` (kl_bench.core.gates.GateRates); SpecError where the kind has none."""

    def reference_comparison(self, est: RowSource, aggregate: str) -> tuple[float, float, float] | None:
        """(ref_kl, ref_se, z_ref) where the reference's noise is not the run's; None otherwise."""


@runtime_checkable
class GradientCase(CasePair, GradientOracle, Protocol):
    """A case whose kind has gradient oracles: what the gradient rows ask (kl_bench.experiment.gradient_rows)."""


def no_gradients(pair: Any) -> SpecError:
    """The one-line refusal of a gradient pass on a kind without :class:`GradientOracle`."""
    return SpecError(f"case kind '{pair.kind}' has no gradient oracles: set gradients = false or drop "
                     "this case", case=pair.name)


def require_gradients(pair: Any) -> GradientOracle:
    """The pair as a gradient oracle, or a one-line refusal: a kind without gradient oracles, or a case whose
    options the kind's gradients do not support (:meth:`GradientOracle.require_gradients`)."""
    oracle = gradient_oracle(pair)
    if oracle is None:
        raise no_gradients(pair)
    oracle.require_gradients()
    return oracle


@dataclass(frozen=True)
class CaseKind:
    name: str
    pair: type                        # the pair class (kl_bench.kinds.defaults.Pair, usually)
    description: str
    sampler_keys: tuple[str, ...]     # the sampler keys this kind implements (others are refused)
    weight_kinds: tuple[str, ...]     # the importance-weight modes it implements besides "none"


CASE_KINDS: Registry[CaseKind] = Registry("case kind")


def register_kind(name: str, *, description: str, sampler_keys: tuple[str, ...] = (),
                  weight_kinds: tuple[str, ...] = ("token",)):
    """Class decorator: register a pair class (a :class:`kl_bench.kinds.defaults.Pair` subclass, usually) as case
    kind ``name``.

    The class implements :class:`CaseParser` (its config dataclass subclasses :class:`CaseConfig`),
    :class:`Oracle` and :class:`DrawSampler`, and :class:`GradientOracle` where it has gradients."""
    def deco(cls: type) -> type:
        cls.kind = name
        CASE_KINDS.add(name, CaseKind(name, cls, description, tuple(sampler_keys), tuple(weight_kinds)))
        return cls
    return deco
