"""``GaussianPair``: the Gaussian kind's parts composed behind the protocols (kl_bench.kinds.protocols): the
frozen parameters (:mod:`.model`), the exact truth (:mod:`.oracle`), the draws (:mod:`.sampler`) and the
gradients (:mod:`.gradients`). It holds no maths of its own."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...core import oracles as exact
from ...core.draws import Draws
from ...core.estimators import RowSource
from ...foundation.errors import SpecError
from ...foundation.typed_toml import Table
from ...sampling.mismatch import WEIGHT_KEYS
from ..defaults import Pair, ScoreGradientOracle
from ..protocols import ExactGrad, GradItem, JointMoments, register_kind
from . import config, gradients, oracle, sampler
from .config import GaussianCase
from .model import GaussianModel


@register_kind("gaussian", description="diagonal Gaussians q = N(μq, σq²), p = N(μp, σp²); closed forms",
               sampler_keys=("std_scale", *WEIGHT_KEYS))
class GaussianPair(ScoreGradientOracle, Pair):

    def __init__(self, name: str, mq, sq, mp, sp, std_scale: float = 1.0, weights: str = "none",
                 weight_cap: float | None = None, sampler_label: str = ""):
        """``std_scale`` ≠ 1 draws from b = N(μq, (std_scale·σq)²) while the estimators keep using q's
        and p's densities; ``weights`` = "token" multiplies by q/b (capped at ``weight_cap``)."""
        self.name, self.weights, self.sampler_label = name, weights, sampler_label
        self.model = GaussianModel.build(mq, sq, mp, sp, std_scale, weights, weight_cap)
        self.has_sampler = self.model.has_sampler

    @property
    def params(self) -> exact.GaussianPairParams:
        return self.model.params

    @property
    def sampler_params(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean [D], std [D]) of the sampler b (b = q without one)."""
        return self.model.sampler_params

    @property
    def dim(self) -> int:
        return self.model.dim

    # ---------------------------------------------------------------- spec → pair (.config)
    @classmethod
    def parse(cls, t: Table, common: dict[str, Any], spec_dir: Path) -> GaussianCase:
        return config.parse(t, common, spec_dir)

    @classmethod
    def from_config(cls, case: GaussianCase) -> "GaussianPair":
        sp = case.sampler
        if sp is None:
            return cls(case.name, case.q.mean, case.q.std, case.p.mean, case.p.std)
        return cls(case.name, case.q.mean, case.q.std, case.p.mean, case.p.std, std_scale=sp.std_scale,
                   weights=sp.weights, weight_cap=sp.weight_cap, sampler_label=sp.describe())

    def validate(self, sources: list[RowSource]) -> None:
        super().validate(sources)
        what = oracle.unsupported(self.model, sources)
        if what:
            raise SpecError(f"no exact oracle for {', '.join(what)} on a {self.dim}-dimensional Gaussian "
                            "(quadrature is 1-D only): use a 1-D case or drop them", case=self.name)

    def describe(self) -> str:
        g = self.params

        def fmt(m, s):
            if self.dim == 1:
                return f"N({m[0]:g}, {s[0]:g}²)"
            return f"N([{', '.join(f'{x:g}' for x in m)}], diag[{', '.join(f'{x:g}' for x in s)}]²)"
        return f"q = {fmt(g.mq, g.sq)}, p = {fmt(g.mp, g.sp)}" + (f"; {self.sampler_label}" if self.sampler_label else "")

    # ---------------------------------------------------------------- truth (.oracle)
    def true_values(self) -> dict[str, float]:
        return oracle.true_values(self.model)

    def kl(self) -> float:
        return oracle.kl(self.model)

    def kl_forward(self) -> float:
        return oracle.kl_forward(self.model)

    def exact_moments(self, est: RowSource, aggregate: str = "") -> tuple[float, float]:
        return oracle.exact_moments(self.model, est)

    def exact_joint(self, aggregate: str = "") -> JointMoments:
        return oracle.exact_joint(self.model)

    def fourth_moment_finite(self, est: RowSource, aggregate: str = "") -> bool:
        return oracle.fourth_finite(self.model, est.poly)

    def kurtosis_proxy(self, est: RowSource, aggregate: str = "") -> float:
        return oracle.kurtosis_proxy(self.model, est)

    # ---------------------------------------------------------------- draws (.sampler)
    def sample(self, n: int, generator: torch.Generator, device: torch.device):
        """(log r [n], weight q/b [n] or None, q's standard score [n, D]) for n draws x ~ b: every draw of the
        pair, for the rows and the gradients alike, comes through here (one place to test or patch)."""
        return sampler.sample(self.model, n, generator, device)

    def sample_draws(self, n, generator, device, tok_rows=()) -> Draws:
        logr, weight, _ = self.sample(n, generator, device)
        return Draws(logr, torch.full_like(logr, self.kl()), weight=weight)

    def piece_draws(self, device: torch.device) -> int:
        return sampler.piece_draws(self.model, super().piece_draws(device))

    def batches_per_chunk(self, batch_size: int, chunk_draws: int) -> int:
        return sampler.batches_per_chunk(self.model, batch_size, chunk_draws)

    # ---------------------------------------------------------------- gradients (.gradients)
    @property
    def gradient_params(self) -> int:
        return 2 * self.dim

    def gradient_references(self) -> dict[str, np.ndarray]:
        return gradients.gradient_references(self.model)

    def gradient_exact(self, item: GradItem, directions: dict[str, np.ndarray]) -> ExactGrad | None:
        return gradients.gradient_exact(self.model, item, directions)

    def gradient_self(self, item: GradItem) -> np.ndarray | None:
        return gradients.gradient_self(self.model, item)

    def gradient_fourth_moment_finite(self, item: GradItem) -> bool:
        return gradients.fourth_moment_finite(self.model, item)

    def sample_scores(self, n: int, generator: torch.Generator, device: torch.device):
        """(log r, weight, score ∇θ log q(x)) for θ = (μq, log σq) (ScoreSampler)."""
        logr, weight, z = self.sample(n, generator, device)                  # z: q's standard score
        return logr, weight, gradients.scores(self.model, z)
