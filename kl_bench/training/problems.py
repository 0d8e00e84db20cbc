"""From a spec's case to a training problem: the policy's initial logits, the reference, the reward table.

Kinds are looked up by name in :data:`PROBLEMS` (never by type): categorical and rollout train; any
other kind is an input error naming the case.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..foundation.errors import SpecError
from ..sampling.logits import read_logits_file
from ..sampling.seeding import batch_generator
from .categorical import CategoricalProblem
from .config import RewardSpec, TrainConfig
from .rollout import RolloutProblem
from .sequences import KEY, SequenceRolloutProblem, categorical_table, enumerate_checked, rewards_of


def reward_table(spec: RewardSpec, shape: tuple[int, int], case: str, seed: int) -> torch.Tensor:
    """The reward [rows, V] (float64) of one case: rows = contexts (categorical) or buckets (rollout)."""
    rows, vocab = shape
    if not spec.applies_to(case):
        return torch.zeros(shape, dtype=torch.float64)  # host: a reward table from the spec
    if spec.kind == "sequence":           # a categorical's sequence is one token: R([x]) is a table
        try:
            return categorical_table(spec.function, rows, vocab)
        except SpecError as e:
            raise e.located(case=case, key=KEY) from None
    if spec.kind == "random":
        # Its own stream (seed, case/reward): the reward does not move when draws or steps change.
        g = batch_generator(seed + spec.seed, f"{case}/reward", 0, torch.device("cpu"))
        r = spec.scale * torch.randn(shape, dtype=torch.float64, generator=g)  # host: a reward table from the spec
        return -r.abs() if spec.penalty else r
    if spec.kind == "tokens":
        bad = [t for t in spec.tokens if t >= vocab]
        if bad:
            raise SpecError(f"token id {bad[0]} is outside the vocabulary (V = {vocab})", case=case,
                            key="train.reward.tokens")
        out = torch.zeros(shape, dtype=torch.float64)  # host: a reward table from the spec
        out[:, list(spec.tokens)] = spec.value
        return out
    try:
        t = read_logits_file(spec.file, spec.key, what="reward table")
    except SpecError as e:
        raise e.located(case=case, key="train.reward.file") from None
    if tuple(t.shape) != (rows, vocab) and not (t.shape[0] == 1 and t.shape[1] == vocab):
        raise SpecError(f"reward table has shape {list(t.shape)}, needs [{rows}, {vocab}] or [{vocab}]", case=case,
                        key="train.reward.file")
    if not bool(torch.isfinite(t).all()):
        raise SpecError("reward table must be finite", case=case, key="train.reward.file")
    return t.expand(rows, vocab).to(torch.float64).clone()


def _finite(pair, case: str) -> None:
    if pair.has_sampler or pair.precision is not None:
        raise SpecError("training draws from q itself in float64: remove the case's sampler and precision",
                        case=case, key="sampler" if pair.has_sampler else "precision")
    for side, t in (("q", pair.log_q), ("p", pair.log_p)):
        if not bool(torch.isfinite(t).all()):
            raise SpecError("training needs every token with probability > 0 (finite log-probs): θ = log q is "
                            "trained and log r must stay finite", case=case, key=side)


def _categorical(pair, cfg: TrainConfig, seed: int) -> CategoricalProblem:
    _finite(pair, pair.name)
    r = reward_table(cfg.reward, tuple(pair.log_q.shape), pair.name, seed)
    return CategoricalProblem(pair.name, pair.log_q.clone(), pair.log_p, r, cfg.beta)


def _rollout(pair, cfg: TrainConfig, seed: int) -> RolloutProblem:
    model = pair.model              # the rollout kind's tables (kl_bench.kinds.rollout.RolloutModel)
    _finite(model, pair.name)
    shape = tuple(model.log_q.shape)
    if cfg.reward.kind == "sequence" and cfg.reward.applies_to(pair.name):
        return _sequence_rollout(pair.name, model, cfg)
    r = reward_table(cfg.reward, shape, pair.name, seed)
    return RolloutProblem(pair.name, model.log_q.clone(), model.log_p, r, cfg.beta, model.bucket, model.length,
                          model.eos)


def _sequence_rollout(name: str, model, cfg: TrainConfig) -> SequenceRolloutProblem:
    """Every sequence enumerated (or one line past the limit) and R evaluated on each, once."""
    seqs = enumerate_checked(model.bucket, model.vocab, model.length, model.eos, name)
    try:
        values = rewards_of(cfg.reward.function, seqs.tokens, seqs.mask)
    except SpecError as e:
        raise e.located(case=name, key=KEY) from None
    return SequenceRolloutProblem(name, model.log_q.clone(), model.log_p, torch.zeros_like(model.log_q), cfg.beta,
                                  model.bucket, model.length, model.eos, cfg.reward.function, seqs, values)


# Kind name → (builder, the aggregates a combination may name; the first is the default).
PROBLEMS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "categorical": (_categorical, ()),
    "rollout": (_rollout, ("tok", "seq")),
}


def training_kind(kind: str, case: str) -> tuple[Callable, tuple[str, ...]]:
    """The builder and aggregates of a case kind, or a one-line error."""
    if kind not in PROBLEMS:
        raise SpecError(f"kind '{kind}' cannot be trained (trainable kinds: {', '.join(PROBLEMS)})", case=case,
                        key="kind")
    return PROBLEMS[kind]
