"""Optimisation trajectories (issue #22): what an estimator × mode × aggregate does to a policy over a
training run, exact (the expected update) or from n draws a step, on categoricals and rollouts.

Training is a protocol a kind implements (kl_bench.kinds.trainable): a trainable kind's pair gives the
problem (exact values, ∇J, the trainer's expected and sampled updates: kl_bench.kinds.categorical.training,
kl_bench.kinds.rollout.training). This package keeps what every kind shares: :mod:`.optim` (pure SGD/Adam),
:mod:`.combos` (estimator × mode × aggregate), :mod:`.config` (the ``[train]`` table), :mod:`.rewards` (the
spec's reward made for a case), :mod:`.sequences` (rewards of whole sequences: the registry and the checked
call), :mod:`.run` (the trajectories and train.csv's rows) and :mod:`.result` (files and summary); it imports
no kind's internals. docs/training.md has the math.
"""
from __future__ import annotations

import time

import torch

from ..engine.distributed import SINGLE, Ranks
from ..foundation.errors import SpecError
from ..kinds import build_pair
from ..foundation.registry import did_you_mean
from .combos import Combination, parse_combination
from .config import TrainConfig, check_step_draws, parse_train
from .optim import Optimizer, adam, sgd
from .result import TrainResult
from .sequences import SEQUENCE_REWARDS, SequenceReward
from ..results.schema import TRAIN_SCHEMA
from .run import (assemble, plan_case, run_trajectory, run_unit, train_combination, trajectory,
                  unit_label, units)


def _plans(spec, cfg: TrainConfig) -> list:
    """The cases to train, each built and its combinations parsed (kl_bench.training.run.Plan)."""
    names = [c.name for c in spec.cases]
    for key, listed in (("train.cases", cfg.cases), ("train.reward.cases", cfg.reward.cases)):
        for n in listed:
            if n not in names:
                raise SpecError(f"no case named '{n}'{did_you_mean(n, names)}", file=str(spec.path), key=key)
    plans = []
    for case in (c for c in spec.cases if not cfg.cases or c.name in cfg.cases):
        try:
            plans.append(plan_case(case, build_pair(case, str(spec.path)), cfg, spec.experiment.seed))
        except SpecError as e:
            raise e.located(file=str(spec.path)) from None
    return plans


def _run_units(plans, mine: list, cfg: TrainConfig, seed: int, draws: int, device: torch.device, progress) -> dict:
    """{unit: its metrics} of this process's units, in order."""
    done: dict = {}
    if progress is not None:
        progress.set_total(len(mine) * (cfg.steps + 1))
    for u in mine:
        if progress is not None:
            progress.label(unit_label(plans, u))
        done[u] = run_unit(plans, u, cfg, seed=seed, draws=draws, device=device,
                           progress=None if progress is None else progress.advance)
    return done


def train_rows(spec, device: torch.device, ranks: Ranks = SINGLE,
               progress=None) -> tuple[list[dict] | None, TrainConfig, float]:
    """Every row of train.csv for a validated spec with a [train] table: (rows, config, seconds).
    Everything is validated (cases built, combinations parsed) before the first step. ``ranks``: split the
    units (each exact trajectory, each sampled run: kl_bench.training.run.Unit) round-robin across torchrun's
    processes and gather their metrics on rank 0, which assembles the rows (the other ranks get None): the
    same bytes for any number of processes, since no unit's numbers depend on where it runs. ``progress``:
    a :class:`kl_bench.foundation.progress.LazyProgress` (or anything with ``set_total``, ``label`` and ``advance``),
    told of this process's units and steps."""
    cfg = parse_train(spec.train, str(spec.path), spec.path.parent)
    draws = check_step_draws(cfg, spec.experiment.draws, str(spec.path))
    plans = _plans(spec, cfg)
    start = time.perf_counter()
    done: dict = {}
    failure = None
    try:        # a plug-in reward can still fail on a sampled path: one line naming the file
        done = _run_units(plans, units(plans, cfg)[ranks.rank::ranks.world_size], cfg, spec.experiment.seed, draws,
                          device, progress)
    except SpecError as e:
        failure = e.located(file=str(spec.path))
        if ranks.world_size == 1:
            raise failure from None
    gathered = ranks.gather((done, failure))        # every rank takes part, failed or not
    if gathered is None:
        return None, cfg, time.perf_counter() - start
    errors = [f for _, f in gathered if f is not None]
    if errors:
        raise errors[0]
    results = {u: m for part, _ in gathered for u, m in part.items()}
    return assemble(plans, cfg, results, draws), cfg, time.perf_counter() - start


__all__ = ["TRAIN_SCHEMA", "Combination", "Optimizer", "SEQUENCE_REWARDS", "SequenceReward", "TrainConfig",
           "TrainResult", "adam", "parse_combination", "parse_train",
           "plan_case", "run_trajectory", "sgd", "train_combination", "train_rows", "trajectory"]
