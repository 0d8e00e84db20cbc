"""Optimisation trajectories (issue #22): what an estimator × mode × aggregate does to a policy over a
training run, exact (the expected update) or from n draws a step, on categoricals and rollouts.

Layers: :mod:`.optim` (pure SGD/Adam), :mod:`.categorical` and :mod:`.rollout` (exact values, ∇J, the
trainer's expected and sampled updates), :mod:`.config` (the ``[train]`` table), :mod:`.run` (the
trajectories and train.csv's rows), :mod:`.result` (files and summary), :mod:`.plots` (figures),
:mod:`.sequences` (a per-sequence reward R(y): its registry, the enumeration, the rollout problem).
docs/training.md has the math.
"""
from __future__ import annotations

import time

import torch

from ..errors import SpecError
from ..pairs import build_pair
from ..registry import did_you_mean
from .categorical import CategoricalProblem, count_gradient, expected_score_gradient
from .combos import Combination, parse_combination
from .config import TrainConfig, parse_train
from .optim import Optimizer, adam, sgd
from .result import TrainResult
from .rollout import RolloutProblem
from .sequences import SEQUENCE_REWARDS, SequenceReward, SequenceRolloutProblem
from .run import TRAIN_SCHEMA, plan_case, run_trajectory, train_combination, trajectory


def train_rows(spec, device: torch.device) -> tuple[list[dict], TrainConfig, float]:
    """Every row of train.csv for a validated spec with a [train] table: (rows, config, seconds).
    Everything is validated (cases built, combinations parsed) before the first step."""
    cfg = parse_train(spec.train, str(spec.path), spec.path.parent)
    names = [c.name for c in spec.cases]
    for key, listed in (("train.cases", cfg.cases), ("train.reward.cases", cfg.reward.cases)):
        for n in listed:
            if n not in names:
                raise SpecError(f"no case named '{n}'{did_you_mean(n, names)}", file=str(spec.path), key=key)
    cases = [c for c in spec.cases if not cfg.cases or c.name in cfg.cases]
    draws = cfg.draws or spec.experiment.draws
    plans = []
    for case in cases:
        try:
            plans.append(plan_case(case, build_pair(case, str(spec.path)), cfg, spec.experiment.seed))
        except SpecError as e:
            raise e.located(file=str(spec.path)) from None
    start = time.perf_counter()
    try:        # a plug-in reward can still fail on a sampled path: one line naming the file
        rows = [row for plan in plans for combo in plan.combos
                for row in train_combination(plan, combo, cfg, seed=spec.experiment.seed, draws=draws, device=device)]
    except SpecError as e:
        raise e.located(file=str(spec.path)) from None
    return rows, cfg, time.perf_counter() - start


__all__ = ["TRAIN_SCHEMA", "CategoricalProblem", "Combination", "Optimizer", "RolloutProblem", "SEQUENCE_REWARDS",
           "SequenceReward", "SequenceRolloutProblem", "TrainConfig",
           "TrainResult", "adam", "count_gradient", "expected_score_gradient", "parse_combination", "parse_train",
           "plan_case", "run_trajectory", "sgd", "train_combination", "train_rows", "trajectory"]
