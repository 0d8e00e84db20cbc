"""Distribution pairs (q, p): one module per case kind, each registering itself in :data:`CASE_KINDS`.

A pair knows the exact value of each target it supports, the exact moments of every row, how to turn
random draws into per-batch sums of per-draw features (see :mod:`kl_bench.engine`), and its gradient
oracles. The interface is :class:`kl_bench.pairs.base.Pair`; a new kind is one module with a class
decorated by :func:`register_kind` (a test registers a toy kind from its own file).
"""
from __future__ import annotations

import importlib
import pkgutil

from ..errors import SpecError
from .base import CASE_KINDS, CaseConfig, CaseKind, Pair, register_kind

# Every module or package in this folder is a kind that registers itself on import: adding a kind is
# adding its module, nothing here.
for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f".{_module.name}", __name__)

from .categorical import CategoricalCase, CategoricalPair  # noqa: E402  (re-exports of the built-in kinds)
from .gaussian import GaussianCase, GaussianPair  # noqa: E402
from .rollout import RolloutCase, RolloutPair  # noqa: E402


def build_pair(case: CaseConfig, spec_file: str | None = None) -> Pair:
    """Build the pair for a validated case (may load logits files); errors name ``spec_file`` and the case."""
    try:
        return CASE_KINDS[case.kind].pair.from_config(case)
    except SpecError as e:
        raise e.located(file=spec_file, case=case.name) from None


__all__ = ["Pair", "CaseConfig", "CaseKind", "GaussianPair", "CategoricalPair", "RolloutPair", "GaussianCase",
           "CategoricalCase", "RolloutCase", "CASE_KINDS", "register_kind", "build_pair"]
