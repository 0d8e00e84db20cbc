"""Trajectories: the optimiser driven by each combination's update, exact or from n draws per step, and
the rows of train.csv (exact values of the policy at every recorded step)."""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from ..core.stats import mean_sd, scaled, vector_norm
from ..foundation.errors import SpecError
from ..kinds.trainable import TrainingProblem, require_training
from ..sampling.seeding import BatchStream, piece_draws
from .combos import Combination, parse_combination
from .config import TrainConfig
from .optim import Optimizer
from .rewards import reward_for


METRICS = ("kl_rev", "kl_fwd", "entropy", "reward", "objective", "kl_opt")


@dataclass(frozen=True)
class Plan:
    """One case ready to train: its problem (the kind's, kl_bench.kinds.trainable) and parsed combinations."""
    problem: TrainingProblem
    combos: tuple[Combination, ...]


def plan_case(case, pair, cfg: TrainConfig, seed: int) -> Plan:
    """Validate the combinations against the case's kind and build its problem."""
    oracle = require_training(pair, case.kind, case.name)
    combos = []
    for text in cfg.combinations:
        try:
            combos.append(parse_combination(text, oracle.train_aggregates))
        except SpecError as e:
            raise e.located(case=case.name, key="train.combinations") from None
    return Plan(oracle.training_problem(reward_for(cfg.reward, case.name, seed), cfg.beta), tuple(combos))


def trajectory(theta0: torch.Tensor, opt: Optimizer, steps: int,
               direction: Callable[[torch.Tensor, int], torch.Tensor]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(t, θ_t, g_t) for t = 0..steps: g_t = direction(θ_t, t) is the update taken from θ_t (the last one is
    computed but not applied)."""
    theta, state = theta0, opt.init(theta0)
    for t in range(steps + 1):
        g = direction(theta, t)
        yield t, theta, g
        if t < steps:
            theta, state = opt.step(theta, g, state)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """cos(a, b), each scaled by a power of two first where its entries are beyond 2^±500 (their squares and
    products would overflow or underflow: ‖g‖ of 1e200 was inf and the cosine NaN)."""
    (a, _), (b, _) = scaled(a), scaled(b)          # a cosine is scale-free: the factors 2^k drop out
    na, nb = float(a.norm()), float(b.norm())
    return float((a * b).sum()) / (na * nb) if na > 0 and nb > 0 else math.nan


def recorded(steps: int, every: int) -> list[int]:
    """The steps written: every k-th and the last."""
    return sorted(set(range(0, steps + 1, every)) | {steps})


def run_trajectory(problem, opt: Optimizer, steps: int, every: int, direction,
                   progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """Exact metrics, |g| and cos(g, ∇J) at every recorded step: {name: [K]}. ``progress(1)`` after
    every step (steps + 1 calls: the last update is computed too)."""
    keep = set(recorded(steps, every))
    out: dict[str, list[float]] = {k: [] for k in (*METRICS, "grad_norm", "cos_true")}
    for t, theta, g in trajectory(problem.theta0, opt, steps, direction):
        if progress is not None:
            progress(1)
        if t in keep:
            values, grad_j = problem.evaluate(theta)
            for k in METRICS:
                out[k].append(values[k])
            out["grad_norm"].append(vector_norm(g))
            out["cos_true"].append(cosine(g, grad_j))
    return {k: np.asarray(v) for k, v in out.items()}


def _rows(case: str, combo: Combination, kind: str, draws: int, seeds: int, steps: list[int],
          mean: dict[str, np.ndarray], sd: dict[str, np.ndarray] | None) -> list[dict]:
    rows = []
    for i, t in enumerate(steps):
        row = {"case": case, "combination": combo.label, "estimator": combo.estimator, "mode": combo.mode,
               "aggregate": combo.aggregate, "gradients": kind, "draws": draws, "seeds": seeds, "step": t}
        row.update({k: float(v[i]) for k, v in mean.items()})
        row.update({f"{k}_sd": float(sd[k][i]) if sd is not None else math.nan for k in METRICS})
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Unit:
    """One independent piece of a training run: a combination's exact trajectory (``run`` = None) or its
    sampled run ``run`` (streams (seed, "<case>/train/<run>", step): no unit depends on another, so units
    can run in any process and in any order and give the same bytes)."""
    plan: int
    combo: int
    run: int | None


def units(plans: list[Plan], cfg: TrainConfig) -> list[Unit]:
    """Every unit of a run, in train.csv's order (plan, combination, exact then sampled runs)."""
    out = []
    for i, plan in enumerate(plans):
        for j, combo in enumerate(plan.combos):
            if "exact" in cfg.gradients:
                out.append(Unit(i, j, None))
            if "sampled" in cfg.gradients and (not cfg.sampled_combinations or combo.label in cfg.sampled_combinations):
                out.extend(Unit(i, j, r) for r in range(cfg.seeds))
    return out


def unit_label(plans: list[Plan], unit: Unit) -> str:
    """How progress names a unit: 'rollout: k3/loss (exact)', 'vocab: k1/reward (sampled run 2)'."""
    plan = plans[unit.plan]
    how = "exact" if unit.run is None else f"sampled run {unit.run + 1}"
    return f"{plan.problem.name}: {plan.combos[unit.combo].label} ({how})"


def on_device(problem, device: torch.device):
    """The problem with its tables on the run's device (docs/devices.md: a trajectory runs where its
    policy lives; θ, the reference and the reward table are [B, V] or [C, V], copied once per unit)."""
    moved = {}
    for f in dataclasses.fields(problem):
        value = getattr(problem, f.name)
        if isinstance(value, torch.Tensor):
            moved[f.name] = value.to(device)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            moved[f.name] = on_device(value, device)      # the sequences of a per-sequence reward, say
    return dataclasses.replace(problem, **moved)


def run_unit(plans: list[Plan], unit: Unit, cfg: TrainConfig, *, seed: int, draws: int,
             device: torch.device, progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
    """The recorded metrics of one unit ({name: [K]}, :func:`run_trajectory`; ``progress``: its)."""
    plan = plans[unit.plan]
    pb, combo, opt = on_device(plan.problem, device), plan.combos[unit.combo], cfg.optimizer
    if unit.run is None:
        return run_trajectory(pb, opt, cfg.steps, cfg.record_every, lambda th, t: pb.expected_update(th, combo),
                              progress)
    piece = piece_draws(device)

    def direction(th, t):
        batch = BatchStream(seed, f"{pb.name}/train/{unit.run}", t, draws, device)
        return pb.sampled_update(th, combo, batch, piece, cfg.chunk)
    return run_trajectory(pb, opt, cfg.steps, cfg.record_every, direction, progress)


def assemble(plans: list[Plan], cfg: TrainConfig, results: dict[Unit, dict[str, np.ndarray]], draws: int) -> list[dict]:
    """train.csv's rows from every unit's metrics: exact rows, then the mean and spread of the sampled runs
    (in run order, whichever process ran them)."""
    steps = recorded(cfg.steps, cfg.record_every)
    rows: list[dict] = []
    all_units = units(plans, cfg)
    for i, plan in enumerate(plans):
        for j, combo in enumerate(plan.combos):
            mine = [u for u in all_units if (u.plan, u.combo) == (i, j)]
            rows += _combination_rows(plan.problem.name, combo, steps, draws,
                                      [results[u] for u in mine if u.run is None],
                                      [results[u] for u in mine if u.run is not None])
    return rows


def _combination_rows(case: str, combo: Combination, steps: list[int], draws: int, exact: list, runs: list) -> list[dict]:
    """One combination's rows: its exact trajectory, then the mean and spread of its sampled runs."""
    rows = _rows(case, combo, "exact", 0, 1, steps, exact[0], None) if exact else []
    if runs:
        # Without overflow (kl_opt of 1e300 at β = 1e-300 had an sd of inf): core.stats.mean_sd. ddof = 1: the
        # spread of one sampled trajectory (NaN for one seed); the mean's standard error is sd/√seeds.
        spread = {k: mean_sd([x[k] for x in runs], ddof=1) for k in runs[0]}
        mean = {k: m for k, (m, _) in spread.items()}
        sd = {k: spread[k][1] for k in METRICS}
        rows += _rows(case, combo, "sampled", draws, len(runs), steps, mean, sd)
    return rows


def train_combination(plan: Plan, combo: Combination, cfg: TrainConfig, *, seed: int, draws: int,
                      device: torch.device) -> list[dict]:
    """Rows of one combination: its exact trajectory and/or the mean and spread of ``cfg.seeds`` sampled ones."""
    one = Plan(plan.problem, (combo,))
    results = {u: run_unit([one], u, cfg, seed=seed, draws=draws, device=device) for u in units([one], cfg)}
    return assemble([one], cfg, results, draws)
