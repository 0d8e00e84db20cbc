"""Distribution pairs (q, p): one module per case kind, each registering itself in :data:`CASE_KINDS`.

A pair knows the exact value of each target it supports, the exact moments of every row, how to turn
random draws into per-batch sums of per-draw features (see :mod:`kl_bench.engine.monte_carlo`), and its gradient
oracles. The interface is :class:`kl_bench.kinds.defaults.Pair`; a new kind is one module with a class
decorated by :func:`register_kind` (a test registers a toy kind from its own file).
"""
from __future__ import annotations

import importlib
import pkgutil

from ..foundation.errors import SpecError
from .protocols import CASE_KINDS, CaseConfig, CaseKind, register_kind
from .defaults import Pair

# The protocols every kind meets (what the engine, the experiment and training ask of a pair) and the defaults
# a kind may inherit: not kinds.
PROTOCOL_MODULES = ("protocols", "defaults", "trainable")

# Every other module or package in this folder is a kind named after it, which registers itself when imported:
# adding a kind is adding its module, nothing here. Each is imported when a spec (or a listing) first
# names it, so `import kl_bench.kinds` costs the protocols only (kl_bench.estimate loads no kind).
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in PROTOCOL_MODULES:
        CASE_KINDS.add_lazy(_module.name, f"{__name__}.{_module.name}")

# The built-in kinds' classes, imported on first use (PEP 562).
_CLASSES = {"CategoricalCase": "categorical", "CategoricalPair": "categorical", "GaussianCase": "gaussian",
            "GaussianPair": "gaussian", "RolloutCase": "rollout", "RolloutPair": "rollout"}


def __getattr__(name: str):
    if name in _CLASSES:
        return getattr(importlib.import_module(f".{_CLASSES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_pair(case: CaseConfig, spec_file: str | None = None) -> Pair:
    """Build the pair for a validated case (may load logits files); errors name ``spec_file`` and the case."""
    try:
        return CASE_KINDS[case.kind].pair.from_config(case)
    except SpecError as e:
        raise e.located(file=spec_file, case=case.name) from None


__all__ = ["Pair", "CaseConfig", "CaseKind", "GaussianPair", "CategoricalPair", "RolloutPair", "GaussianCase",
           "CategoricalCase", "RolloutCase", "CASE_KINDS", "register_kind", "build_pair"]
