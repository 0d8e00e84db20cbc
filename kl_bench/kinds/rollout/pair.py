"""Case kind ``rollout``: sequences from two autoregressive token models over a vocabulary of size V.

The pair composes the kind's parts and answers the protocols of kl_bench.kinds.protocols with them: the model
(``model``: every table), the exact oracles by aggregate (``oracle``, looked up in
:data:`~kl_bench.kinds.rollout.aggregates.ROLLOUT_AGGREGATES`), the sampler, the gradients (exact, and the
Monte Carlo accumulator) and the group baselines. Sequence-level rows ("seq") apply an estimator to
L = Σ_t log r_t (R = e^L); token-level rows ("tok") sum the per-token estimator over the generated tokens, as
GRPO/PPO code does; ``full`` sums the analytic per-step KL(q(·|c) ‖ p(·|c)) along the path (docs/rollouts.md).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...core.aggregates import AGGREGATES
from ...foundation.typed_toml import Table
from ...core.draws import Draws, Row
from ...core.estimators import RowSource
from ...sampling.logits import describe_sources
from ...core.precision import in_precision
from ...sampling.mismatch import CORRECTION_KEYS, LOGIT_KEYS, WEIGHT_KEYS
from ...core.targets import FORWARD, REVERSE
from ..protocols import (BaselineExact, BatchSums, ExactGrad, Features, GradientAccumulator, GradItem, JointMoments,
                         register_kind)
from ..defaults import GradientDefaults, Pair
from . import group_baselines as baselines, config, gradients, sampler
from .accumulator import RolloutGradients
from .aggregates import ROLLOUT_AGGREGATES
from .model import RolloutModel
from .oracle import RolloutOracle
from .sequences import enumerate_checked
from .training import RolloutProblem, SequenceRolloutProblem
from ..trainable import Reward, check_trainable


@register_kind("rollout", description="T-token rollouts of two bucketed autoregressive models, [C, V] logits; "
               "exact dynamic programming",
               sampler_keys=(*LOGIT_KEYS, "min_length", "behavior", *WEIGHT_KEYS, *CORRECTION_KEYS, "reject"),
               weight_kinds=("token", "sequence", "geometric", "cumulative"))
class RolloutPair(GradientDefaults, Pair):
    aggregates = ("seq", "tok")
    supplies_logq = True
    baseline_aggregates = ("seq", "tok")
    train_aggregates = ("tok", "seq")       # kl_bench.kinds.trainable: a combination's aggregate, tok by default

    def __init__(self, name: str, log_q: torch.Tensor, log_p: torch.Tensor, bucket: torch.Tensor, length: int,
                 eos: int | None, label: str = "", sampler_label: str = "", **options):
        """The pair of ``RolloutModel.build(log_q, log_p, bucket, length, eos, **options)`` (kl_bench.kinds.rollout.
        model: q and p normalised [C, V], ``bucket`` int [V] in [0, C), T and EOS; the sampler's options
        ``log_b``, ``min_length``, ``weights``, ``weight_cap``, ``correction``, ``rejection``; the rows'
        ``per_sequence_mean``, ``token_mean_batch``, ``precision`` with the sources' ``logits``)."""
        self._compose(name, RolloutModel.build(log_q, log_p, bucket, length, eos, **options).validate(), label,
                      sampler_label)

    def training_problem(self, reward: Reward, beta: float) -> RolloutProblem:
        """θ0 = log q [C, V] trained towards p (kl_bench.kinds.trainable): under a per-token reward table [C, V]
        by the dynamic program, under a reward of whole sequences by enumerating every sequence."""
        m = self.model
        check_trainable(self.name, m.has_sampler, m.precision, m.log_q, m.log_p)
        if reward.sequence is not None:
            seqs = enumerate_checked(m.bucket, m.vocab, m.length, m.eos, self.name)
            values = reward.sequence(seqs.tokens, seqs.mask)
            return SequenceRolloutProblem(self.name, m.log_q.clone(), m.log_p, torch.zeros_like(m.log_q), beta,
                                          m.bucket, m.length, m.eos, reward.sequence, seqs, values)
        return RolloutProblem(self.name, m.log_q.clone(), m.log_p, reward.table(tuple(m.log_q.shape)), beta,
                              m.bucket, m.length, m.eos)

    @classmethod
    def of(cls, name: str, model: RolloutModel, label: str = "", sampler_label: str = "") -> "RolloutPair":
        """The pair of a built model."""
        pair = cls.__new__(cls)
        pair._compose(name, model, label, sampler_label)
        return pair

    def _compose(self, name: str, model: RolloutModel, label: str, sampler_label: str) -> None:
        self.name, self.label, self.sampler_label = name, label, sampler_label
        self.model, self.oracle = model, RolloutOracle(model)
        self.has_sampler, self.weights = model.has_sampler, model.weighting.name

    @property
    def support_miss(self) -> float:
        return self.model.support_miss

    # ---------------------------------------------------------------- spec → pair
    @classmethod
    def parse(cls, t: Table, common: dict[str, Any], spec_dir: Path) -> config.RolloutCase:
        return config.parse(t, common, spec_dir)

    @classmethod
    def from_config(cls, case: config.RolloutCase) -> "RolloutPair":
        return cls.of(case.name, config.model_of(case), label=describe_sources(case.q, case.p),
                      sampler_label=case.sampler.describe() if case.sampler is not None else "")

    def metadata(self) -> dict[str, Any]:
        # `length`: the report plots std/true against it across cases of one family (`label`).
        meta = {**super().metadata(), "label": self.label, "length": self.model.length}
        precision = self.model.precision
        return meta if precision is None else {**meta, "precision": precision.metadata(self.model.rounded)}

    def adapt(self, source: RowSource) -> RowSource:
        return source if self.model.precision is None else in_precision(source, self.model.precision)

    def describe(self) -> str:
        m = self.model
        eos = f", eos={m.eos}" if m.eos is not None else ""
        return (f"rollout V={m.vocab}, C={m.buckets}, T={m.length}{eos}" + (f": {self.label}" if self.label else "")
                + (f"; {self.sampler_label}" if self.sampler_label else "")
                + (f"; {m.precision.describe()}" if m.precision is not None else ""))

    # ---------------------------------------------------------------- rows and their truth
    def aggregates_for(self, source: RowSource) -> tuple[str, ...]:
        # In the table's order (kl_bench.core.aggregates): those the case gives (seq and tok, then the ones its keys
        # switch on; an outside aggregate by its own hook), where the estimator gets a row (a function of L
        # other than a polynomial in R and L has no exact sequence-level oracle: tok rows only).
        return tuple(name for name, a in AGGREGATES.items() if self._gives(name) and a.applies(source))

    def _gives(self, aggregate: str) -> bool:
        own, hook = ROLLOUT_AGGREGATES.get(aggregate), AGGREGATES[aggregate].enabled
        return own.enabled(self.model) if own is not None else hook is not None and hook(self)

    @property
    def gradient_aggregates(self) -> tuple[str, ...]:
        return tuple(name for name, a in ROLLOUT_AGGREGATES.items() if a.gradients and a.enabled(self.model))

    def row_group(self, aggregate: str) -> int:
        return self.model.token_mean_batch if AGGREGATES[aggregate].grouped else 1

    def true_values(self) -> dict[str, float]:
        return self.oracle.true_values()

    def gate_rates(self, gate, delta: float):
        return self.oracle.gate_rates(gate, delta)

    def true_value(self, target: str, aggregate: str = "") -> float:
        # Rows divided by lengths estimate a rate per generated token: compare them with the target over
        # E_q|y| (what the token-mean of an unbiased per-token estimator converges to, draws from q).
        value = super().true_value(target)
        return value / self.oracle.mean_length() if AGGREGATES[aggregate].per_token else value

    def exact_moments(self, est: RowSource, aggregate: str = "seq") -> tuple[float, float]:
        if not self.model.exact_under_rejection:
            return math.nan, math.nan           # a sum or mean over the tokens: Monte Carlo only
        own, hook = ROLLOUT_AGGREGATES.get(aggregate), AGGREGATES[aggregate].exact
        if own is not None:
            return own.exact(self.oracle, est)
        return hook(self, est) if hook is not None else (math.nan, math.nan)

    def exact_joint(self, aggregate: str = "seq") -> JointMoments:
        return ROLLOUT_AGGREGATES[aggregate].joint(self.oracle)

    def kurtosis_proxy(self, est: RowSource, aggregate: str = "seq") -> float:
        own = ROLLOUT_AGGREGATES.get(aggregate)
        return self.oracle.kurtosis_proxy(est) if own is not None and own.kurtosis else math.nan

    # ---------------------------------------------------------------- sampling
    def sample_draws(self, n: int, generator: torch.Generator, device: torch.device,
                     tok_rows: list[Row] = ()) -> Draws:
        """``n`` rollouts of at most T steps; never materialises [n, V]."""
        return sampler.simulate(self.model, [n], [generator], device, tok_rows)

    def batch_sums(self, features: Features, tok_rows, device: torch.device) -> BatchSums:
        return sampler.batch_sums(self.model, features, tok_rows, device)

    def batches_per_chunk(self, batch_size: int, chunk_draws: int) -> int:
        # ~ (10 + tok rows) float64 values per rollout stay alive across the T steps (and B·(7 + tok rows) for
        # a block of B steps: kl_bench.sampling.seeding.STEP_BLOCKS, 1 on the CPU).
        return max(1, chunk_draws // max(1, batch_size * 4))

    # ---------------------------------------------------------------- gradients (θ = q's bucket logits)
    def require_gradients(self) -> None:
        gradients.check(self.model, self.name)
        super().require_gradients()

    @property
    def gradient_params(self) -> int:
        return self.model.buckets * self.model.vocab

    def gradient_references(self) -> dict[str, np.ndarray]:
        rev, fwd = gradients.reference(self.model)
        return {REVERSE: rev, FORWARD: fwd}

    def gradient_exact(self, item: GradItem, directions: dict[str, np.ndarray]) -> ExactGrad | None:
        factor = ROLLOUT_AGGREGATES[item.aggregate].length_factor
        mean = gradients.exact_mean(self.model, item, None if factor is None else factor(self.oracle))
        return None if mean is None else ExactGrad(mean, math.nan, {})

    def gradient_excludes(self, mode: str, aggregate: str) -> bool:
        return gradients.excludes(self.model, mode, aggregate)

    def gradient_pair_rows(self, sources) -> list[GradItem]:
        """The Rao–Blackwellised gradient of ``full`` (tok): on-policy, and under a sampler with plain sequence
        weights (kl_bench.kinds.rollout.gradients.rao_blackwell_applies)."""
        wanted = any(s.analytic and s.name == "full" for s in sources)
        return [gradients.rao_blackwell_item()] if wanted and gradients.rao_blackwell_applies(self.model) else []

    def gradient_self(self, item: GradItem) -> np.ndarray | None:
        return gradients.self_gradient(self.model, item, ROLLOUT_AGGREGATES[item.aggregate].self_value)

    def gradient_ukl(self) -> np.ndarray | None:
        return gradients.ukl(self.model)

    def gradient_accumulator(self, items, directions, device) -> GradientAccumulator:
        return RolloutGradients(self.model, items, list(directions.values()), device, case=self.name)

    # ---------------------------------------------------------------- group baselines (kl_bench.experiment.group_baselines)
    def baseline_check(self) -> None:
        baselines.check(self.model, self.name)

    def baseline_exact(self, est, aggregate: str) -> BaselineExact | None:
        """Exact expected gradient (second moments are measured: kl_bench.kinds.rollout.group_baselines)."""
        out = baselines.exact(self.model, est, aggregate)
        return None if out is None else BaselineExact(*out)

    def baseline_draws(self, est, aggregate: str, u: np.ndarray, device: torch.device):
        return baselines.draws(self.model, est, aggregate, u, device)

    def baseline_piece(self, device: torch.device) -> int:
        return baselines.piece(self.model, device)
