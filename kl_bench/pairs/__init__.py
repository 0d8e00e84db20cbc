"""Distribution pairs (q, p): one module per case kind, one registry of kinds.

A pair knows its exact KL in both directions, the exact moments of every estimator, and how to
turn random draws into per-batch sums of per-draw features (see :mod:`kl_bench.engine`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..registry import Registry
from .base import Pair
from .categorical import CategoricalPair
from .gaussian import GaussianPair
from .rollout import RolloutPair


@dataclass(frozen=True)
class CaseKind:
    name: str
    build: Callable[..., Pair]
    description: str


CASE_KINDS: Registry[CaseKind] = Registry("case kind")
CASE_KINDS.add("gaussian", CaseKind("gaussian", GaussianPair.from_case,
                                    "diagonal Gaussians q = N(μq, σq²), p = N(μp, σp²); closed forms"))
CASE_KINDS.add("categorical", CaseKind("categorical", CategoricalPair.from_case,
                                       "categoricals over a vocabulary, [V] or [B, V] logits; exact sums"))
CASE_KINDS.add("rollout", CaseKind("rollout", RolloutPair.from_case,
                                   "T-token rollouts of two bucketed autoregressive models, [C, V] logits; "
                                   "exact dynamic programming"))


def build_pair(case, spec_file: str | None = None) -> Pair:
    """Build the pair for a validated case from the spec (may load logits files); errors name
    ``spec_file`` and the case."""
    from ..errors import SpecError
    try:
        return CASE_KINDS.get(case.kind).build(case)
    except SpecError as e:
        raise e.located(file=spec_file, case=case.name) from None


__all__ = ["Pair", "GaussianPair", "CategoricalPair", "RolloutPair", "CASE_KINDS", "build_pair"]
