"""``CategoricalPair``: the categorical kind's parts composed behind the protocols (kl_bench.kinds.protocols):
the frozen tables (:mod:`.model`), the exact truth (:mod:`.oracle`), the draws (:mod:`.sampler`), the
gradients (:mod:`.gradients`), the group baselines (:mod:`.group_baselines`) and training (:mod:`.training`).
It holds no maths of its own."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...core.draws import Draws
from ...core.estimators import RowSource
from ...core.precision import Precision, in_precision
from ...core.weights import WeightCorrection
from ...foundation.errors import SpecError
from ...foundation.typed_toml import Table
from ...sampling.logits import describe_sources, resolve_pair_source_logits
from ...sampling.mismatch import CORRECTION_KEYS, LOGIT_KEYS, WEIGHT_KEYS
from ...sampling.seeding import piece_draws
from ..defaults import GradientDefaults, Pair
from ..protocols import (BaselineExact, BatchSums, ExactGrad, Features, GradientAccumulator, GradItem, JointMoments,
                         register_kind)
from ..trainable import Reward, check_trainable
from . import config, gradients, group_baselines, oracle
from .config import CategoricalCase
from .model import CategoricalModel
from .sampler import CategoricalSampler
from .training import CategoricalProblem


@register_kind("categorical", description="categoricals over a vocabulary, [V] or [B, V] logits; exact sums",
               sampler_keys=(*LOGIT_KEYS, "behavior", *WEIGHT_KEYS, *CORRECTION_KEYS))
class CategoricalPair(GradientDefaults, Pair):
    # NeMo-RL's clamp order under a weighted sampler takes w inside the clamp (kl_bench.core.modes.Mode.weighted)
    clamp_sees_weight = True
    supplies_logq = True
    # θ = q's logits [B, V], flattened row by row: the exact vectors go to gradients.npz (B·V float64 each).
    exports_gradient_vectors = True
    baseline_aggregates = ("",)
    train_aggregates: tuple[str, ...] = ()     # kl_bench.kinds.trainable: a draw is one token

    def __init__(self, name: str, log_q: torch.Tensor, log_p: torch.Tensor, label: str = "",
                 log_b: torch.Tensor | None = None, weights: str = "none", weight_cap: float | None = None,
                 sampler_label: str = "", sampling: str = "auto", precision: Precision | None = None,
                 logits: tuple[torch.Tensor, torch.Tensor] | None = None,
                 correction: WeightCorrection | None = None):
        """``log_q``, ``log_p``: normalised float64 log-probabilities [B, V]. ``log_b``: a sampler b ≠ q
        that draws the tokens while the estimators keep using q's and p's log-probs; ``weights``
        ("token") multiplies every estimate by q/b, capped at ``weight_cap``. ``sampling``: how a
        batch's count vector is drawn (the kind's docstring). ``precision``: the estimators see log r as a
        trainer computes it in lower precision (kl_bench.core.precision) from ``logits``, (q's, p's) as the
        source holds them [B, V] (None: the log-probs are what is given). ``correction``: further bounds,
        masks and the PPO clip of the weight (kl_bench.core.weights; its cap replaces ``weight_cap``)."""
        self.name, self.label, self.sampler_label = name, label, sampler_label
        correction = correction if correction is not None else WeightCorrection(cap=weight_cap)
        self.model = CategoricalModel.build(log_q, log_p, log_b, weights, correction, precision, logits)
        self.sampler = CategoricalSampler(self.model, sampling)
        self.has_sampler, self.weights = log_b is not None, weights
        self.support_miss = self.model.support_miss

    # ---------------------------------------------------------------- spec → pair
    @classmethod
    def parse(cls, t: Table, common: dict[str, Any], spec_dir: Path) -> CategoricalCase:
        return config.parse(t, common, spec_dir)

    @classmethod
    def from_config(cls, case: CategoricalCase) -> "CategoricalPair":
        zq, zp = resolve_pair_source_logits(case.q, case.p, case.vocab)
        lq, lp = torch.log_softmax(zq, -1), torch.log_softmax(zp, -1)
        sp = case.sampler
        label = describe_sources(case.q, case.p)
        if sp is None:
            return cls(case.name, lq, lp, label=label, sampling=case.sampling, precision=case.precision,
                       logits=(zq, zp))
        return cls(case.name, lq, lp, label=label, log_b=sp.logprobs(lq, lp), weights=sp.weights,
                   weight_cap=sp.weight_cap, sampler_label=sp.describe(), sampling=case.sampling,
                   precision=case.precision, logits=(zq, zp), correction=WeightCorrection.of(sp))

    def adapt(self, source: RowSource) -> RowSource:
        return source if self.model.precision is None else in_precision(source, self.model.precision)

    def metadata(self) -> dict[str, Any]:
        meta = {**super().metadata(), "label": self.label, "sampling": self.sampler.sampling}
        m = self.model
        return meta if m.precision is None else {**meta, "precision": m.precision.metadata(m.rounded)}

    def describe(self) -> str:
        m = self.model
        ctx = f", {m.contexts} contexts" if m.contexts > 1 else ""
        return (f"categorical V={m.vocab}{ctx}" + (f": {self.label}" if self.label else "")
                + (f"; {self.sampler_label}" if self.sampler_label else "")
                + (f"; {m.precision.describe()}" if m.precision is not None else ""))

    # ---------------------------------------------------------------- truth (.oracle)
    def true_values(self) -> dict[str, float]:
        return oracle.true_values(self.model)

    def gate_rates(self, gate, delta: float):
        return oracle.gate_rates(self.model, gate, delta)

    def exact_moments(self, est: RowSource, aggregate: str = "") -> tuple[float, float]:
        return oracle.exact_moments(self.model, est)

    def kurtosis_proxy(self, est: RowSource, aggregate: str = "") -> float:
        return oracle.kurtosis_proxy(self.model, est)

    def exact_joint(self, aggregate: str = "") -> JointMoments:
        return oracle.exact_joint(self.model)

    def exact_prob_negative(self, fn, aggregate: str = "") -> float:
        return oracle.exact_prob_negative(self.model, fn)

    # ---------------------------------------------------------------- draws (.sampler)
    def sample_draws(self, n, generator, device, tok_rows=()) -> Draws:
        return self.sampler.sample_draws(n, generator, device, tok_rows)

    def piece_draws(self, device: torch.device) -> int:
        return self.sampler.piece_draws(device)

    def batches_per_chunk(self, batch_size: int, chunk_draws: int) -> int:
        return self.sampler.batches_per_chunk(batch_size, super().batches_per_chunk(batch_size, chunk_draws))

    def batch_sums(self, features: Features, tok_rows, device: torch.device) -> BatchSums:
        return self.sampler.batch_sums(features, tok_rows, device)

    # ---------------------------------------------------------------- gradients (.gradients)
    @property
    def gradient_params(self) -> int:
        return self.model.contexts * self.model.vocab

    def gradient_references(self) -> dict[str, np.ndarray]:
        return gradients.gradient_references(self.model)

    def gradient_exact(self, item: GradItem, directions: dict[str, np.ndarray]) -> ExactGrad:
        return gradients.gradient_exact(self.model, item, directions)

    def gradient_self(self, item: GradItem) -> np.ndarray | None:
        return gradients.gradient_self(self.model, item)

    def gradient_ukl(self) -> np.ndarray | None:
        return gradients.gradient_ukl(self.model)

    def gradient_accumulator(self, items, directions, device) -> GradientAccumulator:
        return gradients.CategoricalGradients(self.sampler, items, directions, device)

    # ---------------------------------------------------------------- group baselines (.group_baselines)
    def baseline_check(self) -> None:
        if self.model.correction.clips("reward"):
            raise SpecError("group baselines with the PPO clip are not modelled (the clip's branch depends on the "
                            "centred advantage): drop clip_low/clip_high/dual_clip or the baseline_groups",
                            key="sampler", case=self.name)

    def baseline_exact(self, est, aggregate: str) -> BaselineExact:
        return group_baselines.baseline_exact(self.model, est)

    def baseline_draws(self, est, aggregate: str, u: np.ndarray, device: torch.device):
        return group_baselines.baseline_draws(self.sampler, est, u, device)

    def baseline_piece(self, device: torch.device) -> int:
        return piece_draws(device)

    # ---------------------------------------------------------------- training (.training)
    def training_problem(self, reward: Reward, beta: float) -> CategoricalProblem:
        """θ0 = log q [B, V] trained towards p under the reward table [B, V] (kl_bench.kinds.trainable)."""
        m = self.model
        check_trainable(self.name, self.has_sampler, m.precision, m.log_q, m.log_p)
        return CategoricalProblem(self.name, m.log_q.clone(), m.log_p, reward.table(tuple(m.log_q.shape)), beta)
