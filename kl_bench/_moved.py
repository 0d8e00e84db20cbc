"""Old import paths, kept for one release (issue 34: the layer table became the package tree).

``import kl_bench.estimators`` still works and gives the module now at ``kl_bench.core.estimators`` (the
same module object, so patching one patches the other), with a DeprecationWarning naming the new path.
:data:`MOVED` is the whole table; ``kl_bench/__init__`` installs the finder, which answers only for the
names in it. ``kl_bench.engine``, ``kl_bench.experiment`` and ``kl_bench.api`` are packages now: their old
module-level names are forwarded by the packages themselves (:func:`forward`)."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any, Callable

REMOVED_IN = "0.3"
MOVED = {        # old module (or package prefix) → where it lives now
    **{f"kl_bench.{m}": f"kl_bench.foundation.{m}" for m in
       "errors registry config safe_io storage signals progress threads version formatting".split()},
    **{f"kl_bench.{m}": f"kl_bench.core.{m}" for m in
       ("estimators targets presets modes weights rejection aggregates draws oracles rollout_dp topk precision "
        "stats planning").split()},
    **{f"kl_bench.{m}": f"kl_bench.sampling.{m}" for m in "logits samplers seeding alias multinomial".split()},
    "kl_bench.pairs": "kl_bench.kinds",
    "kl_bench.pairs.rollout.baselines": "kl_bench.kinds.rollout.group_baselines",
    "kl_bench.distributed": "kl_bench.engine.distributed",
    "kl_bench.spec": "kl_bench.experiment.spec",
    "kl_bench.lambdas": "kl_bench.experiment.lambdas",
    "kl_bench.gradients": "kl_bench.experiment.gradient_rows",
    "kl_bench.baselines": "kl_bench.experiment.group_baselines",
    "kl_bench.gate": "kl_bench.analysis.gate",
    "kl_bench.advice": "kl_bench.analysis.advice",
    "kl_bench.display": "kl_bench.present.tables",
    "kl_bench.plots": "kl_bench.present.plots",
    "kl_bench.report": "kl_bench.present.report",
    "kl_bench.figstyle": "kl_bench.present.figstyle",
    "kl_bench.pages": "kl_bench.present.pages",
    "kl_bench.training.report": "kl_bench.present.training_report",
    "kl_bench.training.plots": "kl_bench.present.training_plots",
    "kl_bench.audit.report": "kl_bench.present.audit_report",
    "kl_bench.estimation": "kl_bench.api.estimation",
    "kl_bench.runner": "kl_bench.api.folders",
    "kl_bench.results.rows": "kl_bench.experiment.rows",
}


def new_path(old: str) -> str | None:
    """Where module ``old`` lives now (the longest moved prefix), or None if it did not move."""
    parts = old.split(".")
    for i in range(len(parts), 1, -1):
        head = ".".join(parts[:i])
        if head in MOVED:
            return ".".join([MOVED[head], *parts[i:]])
    return None


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old path stops working in kl-bench {REMOVED_IN}",
                  DeprecationWarning, stacklevel=3)


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new path (the same object)."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # Executed already; the import system has just set its __spec__ to the old name's: put its own back
        # (importlib.reload and importlib.resources read it).
        module.__spec__ = self.spec


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of :data:`MOVED` (and nothing else)."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("kl_bench.") or (new := new_path(fullname)) is None:
            return None
        if importlib.util.find_spec(new) is None:
            return None
        _warn(fullname, new)
        return importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``kl_bench/__init__`` calls it)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        # first: an old name under a moved package (kl_bench.pairs.rollout) must not be found again by the
        # path finder through the new package's __path__, which would load a second copy of the module
        sys.meta_path.insert(0, MovedFinder())


def forward(package: str, module: str):
    """A module ``__getattr__`` for ``package`` that was the module ``module`` before: its names resolve, with a
    DeprecationWarning."""
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = getattr(importlib.import_module(module), name)    # AttributeError for a name it never had
        _warn(f"{package}.{name}", f"{module}.{name}")
        setattr(sys.modules[package], name, value)                # warned once
        return value
    return __getattr__


def renamed(module: str, names: dict[str, tuple[str, Callable[[], Any]]]):
    """A module ``__getattr__`` for ``module``'s names that were renamed or moved by the package tree: old name →
    (the new one, in words; a function giving its value). Each resolves, with a DeprecationWarning, for one
    release."""
    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new, value = names[name]
        _warn(f"{module}.{name}", new)
        return value()
    return __getattr__
