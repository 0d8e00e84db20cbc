"""What a trainer puts in its loss: an estimator (registry name, plug-in or library preset) × a gradient
mode (kl_bench.core.modes) × an aggregate (rollouts: ``tok``, the per-token estimator summed along the
sequence as trainers write it, or ``seq``, the estimator of the sequence log-ratio; categoricals: none).

Written ``"estimator/mode"`` or ``"estimator/mode/aggregate"`` in a spec (``"k3/loss"``,
``"verl.low_var_kl+/loss/tok"``): "/" appears in no estimator name or plug-in reference.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..foundation.errors import SpecError
from ..core.estimators import lookup
from ..core.modes import MODES, GradItem, modes_for
from ..foundation.registry import did_you_mean


@dataclass(frozen=True)
class Combination:
    """One trained combination: ``label`` as written in the spec; ``item`` its per-draw gradient."""
    label: str
    item: GradItem

    @property
    def estimator(self) -> str:
        return self.item.est.name

    @property
    def mode(self) -> str:
        return self.item.mode

    @property
    def aggregate(self) -> str:
        return self.item.aggregate


def check_combination(text: str):
    """The part of a combination's check that needs no case kind (its form, estimator and mode): the
    estimator. A SpecError (one line) otherwise; run on the [train] table as it is read, so that a
    misspelt estimator is named there, not as an unknown value of a list checked against it."""
    parts = text.split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise SpecError(f"'{text}' must be \"estimator/mode\" or \"estimator/mode/aggregate\"")
    name, mode = parts[0], parts[1]
    est = lookup(name)
    if est.analytic:
        raise SpecError(f"'{name}' is not a function of log r and has no per-draw gradient")
    if mode not in MODES:
        raise SpecError(f"'{text}': unknown mode '{mode}'{did_you_mean(mode, list(MODES))}; known: {', '.join(MODES)}")
    if mode not in modes_for(est, token=True):     # token-only modes: on a categorical, loss_is or reward
        raise SpecError(f"'{text}': estimator '{name}' has no {mode} mode (it has {', '.join(modes_for(est, token=True))})")
    return est


def parse_combination(text: str, aggregates: tuple[str, ...]) -> Combination:
    """``text`` = "estimator/mode[/aggregate]"; ``aggregates``: those the case kind has ((): none, ("tok",
    "seq"): rollouts, default the first). A SpecError (one line) for anything else."""
    est = check_combination(text)
    parts = text.split("/")
    name, mode = parts[0], parts[1]
    aggregate = parts[2] if len(parts) == 3 else (aggregates[0] if aggregates else "")
    if aggregate not in (aggregates or ("",)):
        allowed = ", ".join(aggregates) if aggregates else "none (a categorical has no aggregates)"
        raise SpecError(f"'{text}': aggregate '{aggregate}' is not available here; allowed: {allowed}")
    if aggregate == "seq" and est.poly is None:
        raise SpecError(f"'{text}': '{name}' is not a polynomial in r and log r, so its sequence-level row has no "
                        "exact gradient: use /tok")
    return Combination(text, GradItem.of(est, mode, aggregate))
