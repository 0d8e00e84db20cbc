"""Sequence-level rejection masks on rollouts: verl's ``algorithm.rollout_correction.rollout_rs``
(volcengine/verl b178a3c, ``verl/trainer/ppo/rollout_corr_helper.py``, ``compute_rollout_rejection_mask``).

Each token t of a sequence drawn from the sampler b has the ratio ρ_t = q(x_t|·)/b(x_t|·). verl clamps
log ρ_t to ±20 and forms one of three per-token statistics

    k1 = −log ρ,   k2 = ½ (log ρ)²,   k3 = ρ − 1 − log ρ,

reduces it over the sequence's tokens by a sum, a mean or (k2, k3 only) a max, and keeps the sequence
when the result lies within the criterion's threshold: log(lower) ≤ stat ≤ log(upper) for k1, stat ≤
upper for k2 and k3. Several criteria are ANDed. A rejected sequence has every token masked: its values
and gradients are zero (it still counts among the draws).

``seq_max_k2``/``seq_max_k3`` keep a sequence iff every token's statistic is ≤ τ: the mask is a product of
per-token indicators (:meth:`Rejection.token_keep`), a multiplicative weight the dynamic programs take
exactly. A sum or a mean couples the tokens: those criteria have Monte Carlo rows only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..foundation.typed_toml import Table, typename
from ..foundation.registry import did_you_mean

# verl's SAFETY_BOUND: log ρ is clamped to [−20, 20] before the statistics (so k3 ≤ e^20 − 21).
SAFETY_BOUND = 20.0
STATS = ("k1", "k2", "k3")
REDUCTIONS = ("sum", "mean", "max")
# How a sampler's description starts its rejection words (kl_bench.analysis.advice recognises a masked case by it).
WORDS = "sequences rejected unless"
CRITERIA = tuple(f"seq_{r}_{k}" for r in REDUCTIONS for k in STATS if not (r == "max" and k == "k1"))


def token_stats(log_rho: torch.Tensor) -> torch.Tensor:
    """[..., 3]: (k1, k2, k3) of log ρ [...], written as verl writes them (exp(·) − 1 − ·, not expm1) so that
    a sequence at a threshold is kept or rejected as verl would."""
    lr = log_rho.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return torch.stack([-lr, 0.5 * lr**2, torch.exp(lr) - 1.0 - lr], dim=-1)


@dataclass(frozen=True)
class Criterion:
    """One rejection criterion: ``name`` in :data:`CRITERIA`; ``lower``/``upper``: its thresholds (k1: the
    ratio band, compared in log space; k2, k3: ``lower`` is None and ``upper`` bounds the statistic)."""
    name: str
    upper: float
    lower: float | None = None

    @property
    def reduction(self) -> str:
        return self.name.split("_")[1]

    @property
    def stat(self) -> int:
        return STATS.index(self.name[-2:])

    @property
    def factorises(self) -> bool:
        return self.reduction == "max"

    def keeps(self, stat: torch.Tensor) -> torch.Tensor:
        """bool, the shape of ``stat``: whether the statistic passes."""
        if self.lower is not None:
            return (stat >= math.log(self.lower)) & (stat <= math.log(self.upper))
        return stat <= self.upper

    def words(self) -> str:
        if self.lower is not None:
            return f"{self.name} in [log {self.lower:g}, log {self.upper:g}]"
        return f"{self.name} ≤ {self.upper:g}"


class RunningStats:
    """Per-sequence running sums and maxima of (k1, k2, k3) and token counts over the steps of a batch of
    rollouts, for :meth:`Rejection.keep`."""

    def __init__(self, n: int, device: torch.device):
        self.sums = torch.zeros(n, 3, dtype=torch.float64, device=device)
        self.maxes = torch.full((n, 3), -math.inf, dtype=torch.float64, device=device)
        self.count = torch.zeros(n, dtype=torch.float64, device=device)

    def add(self, log_rho: torch.Tensor, alive: torch.Tensor) -> None:
        """One step: ``log_rho`` [n] of the tokens drawn, ``alive`` [n] 1.0 where the step belongs to the
        sequence (steps after EOS are not its tokens)."""
        k = token_stats(log_rho)
        on = alive[:, None] > 0
        self.sums += torch.where(on, k, torch.zeros_like(k))
        self.maxes = torch.where(on, torch.maximum(self.maxes, k), self.maxes)
        self.count += alive


@dataclass(frozen=True)
class Rejection:
    """The criteria of a sampler's ``reject`` table, ANDed."""
    criteria: tuple[Criterion, ...]

    @property
    def factorises(self) -> bool:
        """Whether the mask is a product of per-token indicators (every criterion a max): exact oracles."""
        return all(c.factorises for c in self.criteria)

    def token_keep(self, log_rho: torch.Tensor) -> torch.Tensor:
        """float64 0/1, the shape of ``log_rho``: the per-token factor of the mask's max criteria (a max is
        ≤ τ iff every token's statistic is). The sum and mean criteria are not in it."""
        k = token_stats(log_rho)
        keep = torch.ones_like(log_rho, dtype=torch.bool)
        for c in self.criteria:
            if c.factorises:
                keep &= c.keeps(k[..., c.stat])
        return keep.to(torch.float64)

    def keep(self, run: RunningStats) -> torch.Tensor:
        """float64 0/1 [n]: which sequences pass every criterion. A mean is verl's masked_mean, sum / (count
        + 1e-8), kept so that a sequence at a threshold falls as it does in verl."""
        keep = torch.ones_like(run.count, dtype=torch.bool)
        for c in self.criteria:
            stat = {"sum": run.sums, "mean": run.sums / (run.count[:, None] + 1e-8), "max": run.maxes}[c.reduction]
            keep &= c.keeps(stat[:, c.stat])
        return keep.to(torch.float64)

    def words(self) -> str:
        text = f"{WORDS} " + " and ".join(c.words() for c in self.criteria)
        return text if self.factorises else text + " (Monte Carlo only: a sum or mean over tokens has no exact value here)"


class SequenceMask:
    """The mask of a batch of rollouts accumulated along its steps, from the raw log q/b of every phase's
    (bucket, token) [C·V]. ``rejection`` None keeps every sequence (:meth:`add` does nothing, :meth:`keep` is
    None), so that a sampling loop needs no branch of its own."""

    def __init__(self, rejection: Rejection | None, log_q: torch.Tensor, log_b: list[torch.Tensor], n: int,
                 device: torch.device):
        self.rejection = rejection
        self.stats = RunningStats(n, device) if rejection is not None else None
        self.log_rho = [(log_q - lb).reshape(-1).to(device) for lb in log_b] if rejection is not None else []

    def add(self, phase: int, key: torch.Tensor, alive: torch.Tensor) -> None:
        """One step: the phase's index, the drawn keys c·V + x [n], alive [n] (see :meth:`RunningStats.add`)."""
        if self.stats is not None:
            self.stats.add(self.log_rho[phase][key], alive)

    def keep(self) -> torch.Tensor | None:
        """float64 0/1 [n] (None without a mask): :meth:`Rejection.keep`."""
        return None if self.stats is None else self.rejection.keep(self.stats)


def parse_rejection(t: Table, key: str) -> Rejection:
    """The sampler's ``reject`` sub-table: criterion = threshold; k1 criteria take an upper ratio bound u
    (the band [1/u, u], as verl) or [lower, upper], k2/k3 criteria one positive upper bound."""
    sub = t.sub(key)
    if not sub.data:
        raise t.error(f"must name at least one criterion: {', '.join(CRITERIA)}", key=t.key(key))
    out = []
    for name, raw in sub.data.items():
        if name not in CRITERIA:
            hint = " (token-level: mask_low/mask_high is verl's token_k1 band)" if name.startswith("token_") else \
                did_you_mean(name, list(CRITERIA))
            raise sub.error(f"unknown rejection criterion{hint}; known: {', '.join(CRITERIA)}", key=sub.key(name))
        out.append(_criterion(sub, name, raw))
    sub.finish()
    return Rejection(tuple(out))


def _criterion(sub: Table, name: str, raw) -> Criterion:
    if not name.endswith("k1"):
        if isinstance(raw, list):
            raise sub.error(f"takes one upper bound (a number), got {typename(raw)} {raw!r}", key=sub.key(name))
        return Criterion(name, sub.get(name, "float", check=_positive))
    bounds = sub.get(name, "float_or_list", check=lambda v: None if len(v) <= 2 and all(x > 0 for x in v) else
                     f"must be an upper ratio bound u > 0 or [lower, upper] with both > 0, got {list(v)}")
    lower, upper = (1.0 / bounds[0], bounds[0]) if len(bounds) == 1 else bounds
    if lower > upper:
        raise sub.error(f"lower bound {lower:g} must be ≤ upper bound {upper:g}", key=sub.key(name))
    return Criterion(name, upper, lower)


def _positive(v: float) -> str | None:
    return None if v > 0 else f"must be > 0, got {v:g}"
