"""Training as a protocol a kind implements, as it implements gradients (:class:`TrainingOracle`).

``kl-bench train`` (kl_bench.training) owns the optimiser, the combinations and the loop; it asks a case's pair
for a :class:`TrainingProblem` and never looks at the kind's tables. A kind trains by giving its pair

- ``train_aggregates``: the aggregates a combination may name on it (the first is the default; () for a
  kind whose draws are single tokens), and
- ``training_problem(reward, beta)``: the problem for the policy θ0 = the case's log q, trained towards its
  reference p under ``reward`` (:class:`Reward`) with KL weight β.

A kind without them cannot be trained, and says so in one line naming the kinds that can.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from ..foundation.errors import SpecError
from ..sampling.seeding import BatchStream
from .protocols import CASE_KINDS


# The spec key that names a reward of whole sequences: the errors of calling it, and of a case too large to
# enumerate, point there.
SEQUENCE_REWARD_KEY = "train.reward.sequence"


@dataclass(frozen=True)
class Reward:
    """What training hands a kind: the spec's reward, made for the kind's shapes.

    ``table(shape)``: the per-token reward [rows, V] (float64) for a kind whose reward is a table of its
    (context or bucket, token) cells: zeros where the case gets no reward. A per-sequence reward on a
    single-token kind is a table too, R([x]) in every context.
    ``sequence``: R(tokens, mask) → [N] float64 of whole sequences (tokens int64 [N, T], −1 past each end;
    mask bool [N, T]), checked and with its errors located; None for a per-token reward. A kind whose
    draws are sequences uses it instead of the table."""
    table: Callable[[tuple[int, int]], torch.Tensor]
    sequence: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


class Combo(Protocol):
    """What a problem asks of a combination (kl_bench.training.combos.Combination): its gradient item
    (estimator × mode × aggregate, kl_bench.core.modes.GradItem) and its label for messages."""
    item: Any
    label: str


@runtime_checkable
class TrainingProblem(Protocol):
    """One case to train. θ: the policy's logits, the shape of θ0 ([rows, V]); every method is exact in
    float64 except :meth:`sampled_update`, which draws ``batch.size`` draws from its generators."""
    name: str
    theta0: torch.Tensor

    def evaluate(self, theta: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
        """Exact values at θ (kl_rev, kl_fwd, entropy, reward, objective, kl_opt) and ∇J, the shape of θ."""

    def expected_update(self, theta: torch.Tensor, combo: Combo) -> torch.Tensor:
        """The trainer's expected ascent direction at θ, exact (NaN everywhere once the trajectory has left
        float64)."""

    def sampled_update(self, theta: torch.Tensor, combo: Combo, batch: BatchStream, piece: int,
                       chunk: int) -> torch.Tensor:
        """The trainer's ascent direction from the batch's draws of q_θ."""


@runtime_checkable
class TrainingOracle(Protocol):
    """A pair that trains (module docstring)."""
    train_aggregates: tuple[str, ...]

    def training_problem(self, reward: Reward, beta: float) -> TrainingProblem:
        """The problem for this case's policy under ``reward`` and KL weight β."""


def training_oracle(pair: Any) -> TrainingOracle | None:
    """The pair as a training oracle, or None where its kind does not train. The registered kind decides, not the
    pair's class: a kind may build pairs of another kind's class (the model kind's next-token case is a
    categorical pair) without taking on that kind's training."""
    trains = pair.kind in CASE_KINDS and hasattr(CASE_KINDS[pair.kind].pair, "training_problem")
    return pair if trains and isinstance(pair, TrainingOracle) else None


def trainable_kinds() -> list[str]:
    """The registered kinds whose pairs train (each kind is imported: called on the error path only)."""
    kinds = [CASE_KINDS.get(name) for name in CASE_KINDS.names()]     # None: a kind that cannot be loaded
    return [k.name for k in kinds if k is not None and hasattr(k.pair, "training_problem")]


def require_training(pair: Any, kind: str, case: str) -> TrainingOracle:
    """The pair as a training oracle, or a one-line error naming the kinds that train."""
    oracle = training_oracle(pair)
    if oracle is None:
        raise SpecError(f"kind '{kind}' cannot be trained (trainable kinds: {', '.join(trainable_kinds())})",
                        case=case, key="kind")
    return oracle


def check_trainable(name: str, has_sampler: bool, precision: Any, log_q: torch.Tensor, log_p: torch.Tensor) -> None:
    """Training draws from q itself in float64 and trains θ = log q: no sampler b ≠ q, no precision, and every
    log-prob finite (log r must stay finite). One line naming the key otherwise."""
    if has_sampler or precision is not None:
        raise SpecError("training draws from q itself in float64: remove the case's sampler and precision",
                        case=name, key="sampler" if has_sampler else "precision")
    for side, t in (("q", log_q), ("p", log_p)):
        if not bool(torch.isfinite(t).all()):
            raise SpecError("training needs every token with probability > 0 (finite log-probs): θ = log q is "
                            "trained and log r must stay finite", case=name, key=side)
