"""The defaults a kind may inherit: :class:`Pair`, the base of a kind's pair class (the shared members of
:class:`kl_bench.kinds.protocols.CasePair`: row aggregates, run.json metadata, piece-by-piece batch sums), and
the gradient mixins (:class:`GradientDefaults`; :class:`ScoreGradientOracle` with its accumulator
:class:`ScoreGradients` for a kind with few parameters). The protocols themselves are in
:mod:`kl_bench.kinds.protocols`."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import torch

from ..foundation.typed_toml import Table
from ..core.draws import Draws, Row
from ..foundation.errors import SpecError
from ..core.estimators import RowSource
from ..core.modes import GradBatch, GradItem
from ..sampling.seeding import BatchStream, piece_draws
from ..core.targets import FORWARD, REVERSE, TARGETS

from .protocols import BatchSums, CaseConfig, Features, GradientAccumulator, JointMoments, ScoreSampler


class Pair(ABC):
    """The base of a kind's pair class: the defaults of :class:`CasePair` (a kind adds
    :class:`GradientOracle` with :class:`GradientDefaults` where it has one)."""
    name: str
    kind: ClassVar[str] = ""
    aggregates: tuple[str, ...] = ("",)   # rollouts: ("seq", "tok")
    has_sampler: bool = False             # draws come from b ≠ q (see SamplerSpec)
    sampler_label: str = ""
    support_miss: float = 0.0             # mass of q (per context/step, worst case) that b never draws
    weights: str = "none"
    expensive_draws: ClassVar[bool] = False  # a draw costs model forward passes: keep side simulations small
    supplies_logq: ClassVar[bool] = False    # hands the estimators log q(x) of each draw (Estimator.needs_logq)

    # ---------------------------------------------------------------- spec → pair
    @classmethod
    @abstractmethod
    def parse(cls, t: Table, common: dict[str, Any], spec_dir: Path) -> CaseConfig:
        """See :meth:`CaseParser.parse`."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: CaseConfig) -> "Pair":
        """See :meth:`CaseParser.from_config`."""

    def validate(self, sources: list[RowSource]) -> None:
        """Refuse (SpecError) estimators this pair has no exact oracle for, before any sampling (a kind that
        overrides this calls it too)."""
        if not self.supplies_logq:
            for s in sources:
                if s.needs_logq:
                    raise SpecError(f"estimator '{s.name}' is a function of the sampled token's probabilities q(x), "
                                    f"p(x), which a {self.kind} case does not have", case=self.name, key="estimators")

    def adapt(self, source: RowSource) -> RowSource:
        """The estimator as this case evaluates it (e.g. in a lower precision, kl_bench.core.precision);
        unchanged by default."""
        return source

    def metadata(self) -> dict[str, Any]:
        """This case in run.json (``length`` set where rows grow with a sequence length)."""
        return {"kind": self.kind, "description": self.describe(), "label": "", "length": None}

    # ---------------------------------------------------------------- truth
    @abstractmethod
    def true_values(self) -> dict[str, float]:
        """See :meth:`Oracle.true_values`."""

    def true_value(self, target: str, aggregate: str = "") -> float:
        """The exact target of a row on ``aggregate`` (rollouts: per generated token for rows divided by
        lengths)."""
        values = self.true_values()
        if target not in values:
            known = ", ".join(values)
            raise SpecError(f"estimator target '{TARGETS[target].name}' has no exact value on a {self.kind} case "
                            f"(it has: {known})", case=self.name)
        return values[target]

    def gate_rates(self, gate, delta: float):
        """A gate's exact rates at ``delta`` (:class:`kl_bench.core.gates.GateRates`) on a kind with a vocabulary
        whose tables it sums over; the others refuse."""
        raise SpecError(f"a {self.kind} case has no exact gate rates (gates need the vocabulary's tables: "
                        "categorical and rollout cases)", case=self.name, key="experiment.gates")

    def kl(self) -> float:
        """Exact KL(q‖p) (the reverse KL that trainers penalise); may be +inf."""
        return self.true_value(REVERSE)

    def kl_forward(self) -> float:
        """Exact KL(p‖q); may be +inf."""
        return self.true_value(FORWARD)

    def aggregates_for(self, source: RowSource) -> tuple[str, ...]:
        """The aggregates on which ``source`` gets a row (rollouts: token-only sources are not on seq)."""
        return self.aggregates

    def row_group(self, aggregate: str) -> int:
        """Draws per value of a row on ``aggregate``: 1 (per draw) unless the kind aggregates groups of draws
        (rollouts' "tok_batch": B sequences per trainer batch)."""
        return 1

    @abstractmethod
    def exact_moments(self, est: RowSource, aggregate: str = "") -> tuple[float, float]:
        """See :meth:`Oracle.exact_moments`."""

    @abstractmethod
    def exact_joint(self, aggregate: str = "") -> JointMoments:
        """See :meth:`Oracle.exact_joint`."""

    def fourth_moment_finite(self, est: RowSource, aggregate: str = "") -> bool:
        """Whether E_q[f⁴] < ∞. Without it a measured variance converges slowly, is usually too low,
        and batch-means errors of variances (and of λ*) are unreliable."""
        return True

    def kurtosis_proxy(self, est: RowSource, aggregate: str = "") -> float:
        """An exact scale for E[f⁴]/E[f²]² where it can be huge though finite, else NaN. When it
        exceeds the number of draws, a measured variance cannot be trusted."""
        return math.nan

    def exact_prob_negative(self, fn: Callable[[torch.Tensor], torch.Tensor], aggregate: str = "") -> float:
        """Exact P_q(f(log r) < 0), or NaN where no exact method exists."""
        return math.nan

    def reference_row(self) -> str | None:
        """Where no exact value exists (``true_values`` NaN, e.g. sampled continuations of real models):
        the label of the row whose measured mean is the best unbiased reference (``"tok:full"``, the
        Rao–Blackwellised per-step KL). The summary then reports ``ref_kl`` ± ``ref_se`` and each row's
        ``z_ref`` against it, labelled as Monte Carlo, never exact. None: the exact values are the reference."""
        return None

    def reference_comparison(self, est: RowSource, aggregate: str) -> tuple[float, float, float, float] | None:
        """(ref_kl, ref_se, ref_diff, ref_diff_se) of a row where the reference's noise is not the run's
        (logged data: the difference is the log's own, its SE that of the log's sequences, not of
        resampling them; ref_diff NaN for rows of another target); None: from the run's batch means."""
        return None

    @abstractmethod
    def describe(self) -> str:
        """See :meth:`Oracle.describe`."""

    # ---------------------------------------------------------------- sampling
    def piece_draws(self, device: torch.device) -> int:
        """Draws per piece (kl_bench.sampling.seeding): fixed by the device type and the case, never by ``chunk``.
        A kind whose draws are large (many dimensions, long sequences) makes its pieces smaller."""
        return piece_draws(device)

    def batch_sums(self, features: Features, tok_rows: list[Row], device: torch.device) -> BatchSums:
        """Return a function that draws each batch from its own stream, x ~ q (or b), and sums the per-draw
        features over the batch; row i of its [k, P] result depends on batch i's stream alone.

        The default draws each batch piece by piece with :meth:`sample_draws` and adds the piece sums in
        piece order: memory is one piece, and the bytes do not depend on how batches are grouped."""
        piece = self.piece_draws(device)

        def run(batches: list[BatchStream]) -> torch.Tensor:
            out = []
            for batch in batches:
                total = None
                for m, g in batch.pieces(piece):
                    # One reduction per piece (not a scatter-add): deterministic on CUDA too.
                    s = features(self.sample_draws(m, g, device, tok_rows)).sum(0)
                    total = s if total is None else total + s
                out.append(total)
            return torch.stack(out)
        return run

    def batches_per_chunk(self, batch_size: int, chunk_draws: int) -> int:
        """How many batches to hand :meth:`batch_sums` at once (a batch larger than a piece is drawn in
        pieces, so this only groups small batches between progress updates and checkpoints)."""
        return max(1, chunk_draws // max(1, batch_size))

    @abstractmethod
    def sample_draws(self, n: int, generator: torch.Generator, device: torch.device,
                     tok_rows: list[Row] = ()) -> Draws:
        """See :meth:`DrawSampler.sample_draws`."""



class GradientDefaults:
    """Mixin for a :class:`GradientOracle`: the defaults a kind overrides where they do not hold."""
    # loss_is_nemo rows under a sampler: NeMo-RL's output clamp sees w·f, w = q/b (its
    # use_on_policy_kl_approximation), so the pair must apply the weight inside the clamp's test
    clamp_sees_weight: ClassVar[bool] = False
    exports_gradient_vectors: ClassVar[bool] = False  # gradients.npz holds its exact gradient vectors (categoricals)

    def gradient_fourth_moment_finite(self, item: GradItem) -> bool:
        """E|c s|⁴ < ∞ (else a measured gradient variance cannot be tested against its exact value)."""
        return True

    @property
    def gradient_aggregates(self) -> tuple[str, ...]:
        """The aggregates that get gradient rows (each also in the estimator's ``aggregates_for``)."""
        return self.aggregates

    def gradient_pair_rows(self, sources: list[RowSource]) -> list[GradItem]:
        """Gradient rows of pair-supplied rows (``full``): none by default."""
        return []

    def gradient_excludes(self, mode: str, aggregate: str) -> bool:
        """Whether a (mode, aggregate) gets no gradient row on this pair (e.g. a form the case's sampler
        corrections do not define)."""
        return False

    def gradient_self(self, item: GradItem) -> np.ndarray | None:
        """∇θ E_q[row value] (the ``self`` target); None: the kind has none."""
        return None

    def gradient_ukl(self) -> np.ndarray | None:
        """∇θ UKL(q_S‖p) (the ``ukl`` target); None: the kind has none."""
        return None

    def require_gradients(self) -> None:
        """Refuse, in one line, a case without the two references every gradient row is compared with (a kind
        adds its own refusals and calls this)."""
        missing = [t for t in (REVERSE, FORWARD) if t not in self.true_values()]
        if missing:
            raise SpecError(f"gradient rows compare with ∇{' and ∇'.join(missing)}, which a {self.kind} case has "
                            "no exact value of: set gradients = false or drop this case", case=self.name)


class ScoreGradientOracle(GradientDefaults):
    """Mixin for a kind that implements :class:`ScoreSampler` (few parameters): the default accumulator
    :class:`ScoreGradients`; the kind adds its exact gradients (``gradient_references``, ``gradient_exact``)."""

    def gradient_accumulator(self, items: list[GradItem], directions: dict[str, np.ndarray],
                             device: torch.device) -> GradientAccumulator:
        """Per-draw gradients c(log r)·(w)·s from :meth:`ScoreSampler.sample_scores`, batch by batch."""
        return ScoreGradients(self, items, directions, device)


class ScoreGradients(GradientAccumulator):
    """The default accumulator: explicit per-draw gradients g = c(log r)·w·s [m, P], one piece of m draws at a time
    (memory O(m·P))."""

    def __init__(self, pair: ScoreSampler, items: list[GradItem], directions: dict[str, np.ndarray], device: torch.device):
        self.pair, self.items, self.device = pair, items, device
        self.u = np.stack(list(directions.values())).T                  # [P, D]
        self._total = np.zeros((len(items), pair.gradient_params))
        self._sums: list[np.ndarray] = []      # per-batch Σ g on a split pass, to merge ranks in batch order

    splittable = True

    def add(self, batch: BatchStream) -> GradBatch:
        proj, sq = np.zeros((len(self.items), self.u.shape[1])), np.zeros(len(self.items))
        gsum = np.zeros((len(self.items), self.pair.gradient_params))
        for m, generator in batch.pieces(self.pair.piece_draws(self.device)):     # memory: one piece
            logr, weight, s = self.pair.sample_scores(m, generator, self.device)
            for j, item in enumerate(self.items):
                gj = (item.coef(logr) if weight is None else item.coef(logr) * weight)[:, None] * s
                gsum[j] += gj.sum(0).cpu().numpy()
                sq[j] += float((gj * gj).sum())
        self._total += gsum
        if self.keep_batches:
            self._sums.append(gsum)
        for j in range(len(self.items)):
            proj[j] = gsum[j] @ self.u
        return GradBatch(proj, sq)

    def total(self) -> np.ndarray:
        return self._total

    def partial(self) -> list[np.ndarray]:
        return self._sums

    def merge(self, partials: list[list[np.ndarray]]) -> None:
        # Float sums depend on their order: add the batch sums from zero in batch order, as one process does.
        self._sums = [g for part in partials for g in part]
        self._total = np.zeros_like(self._total)
        for g in self._sums:
            self._total += g


