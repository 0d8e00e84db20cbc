"""The rollout kind's aggregates: what the kind does with each (kl_bench.core.aggregates holds how a row's values
are computed from the draws; this table holds what is exact about them on rollouts). Nothing in the kind
branches on an aggregate's name: it looks the aggregate up here.

``exact(oracle, est)``: the row's (mean, variance) (kl_bench.kinds.rollout.oracle); ``enabled(model)``:
whether a case gives the aggregate (the optional ones are switched on by the case's keys); ``joint``: the
moments of (−L, b) behind the λ curve, on the aggregates whose cv(λ) rows have one; ``kurtosis``: rows
whose tails are those of R^s (the kurtosis proxy applies); ``gradients``: the aggregate has gradient rows;
``length_factor(oracle)``: γ(|y|) [T], the factor of the final length on a token row's terms (None: 1);
``self_value``: the row's value as a function of θ (the ``self`` target of its gradient rows; None: none).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...core.estimators import RowSource
from ..protocols import JointMoments
from . import gradients
from .model import RolloutModel
from .oracle import RolloutOracle


def _always(model: RolloutModel) -> bool:
    return True


@dataclass(frozen=True)
class RolloutAggregate:
    """One aggregate on rollouts (module docstring)."""
    name: str
    exact: Callable[[RolloutOracle, RowSource], tuple[float, float]]
    enabled: Callable[[RolloutModel], bool] = _always
    joint: Callable[[RolloutOracle], JointMoments] | None = None
    kurtosis: bool = False
    gradients: bool = True
    length_factor: Callable[[RolloutOracle], torch.Tensor] | None = None
    self_value: gradients.SelfValue | None = None


ROLLOUT_AGGREGATES: dict[str, RolloutAggregate] = {a.name: a for a in (
    RolloutAggregate("seq", RolloutOracle.seq, joint=RolloutOracle.joint_seq, kurtosis=True,
                     self_value=gradients.sequence_value),
    RolloutAggregate("tok", RolloutOracle.tok, joint=RolloutOracle.joint_tok, self_value=gradients.token_sum_value),
    RolloutAggregate("tok_mean", RolloutOracle.tok_mean, enabled=lambda model: model.per_sequence_mean,
                     length_factor=RolloutOracle.inverse_length, self_value=gradients.token_mean_value),
    # The token-mean of B sequences depends on θ through the other sequences' lengths too: no self target.
    RolloutAggregate("tok_batch", RolloutOracle.tok_batch, enabled=lambda model: model.token_mean_batch is not None,
                     length_factor=RolloutOracle.batch_length_factor),
    RolloutAggregate("tok_gm", RolloutOracle.tok_gm, enabled=lambda model: model.weighting.geometric, gradients=False),
)}
