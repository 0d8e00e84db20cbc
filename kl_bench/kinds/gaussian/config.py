"""A Gaussian case's keys: the config dataclasses and their parser (``[[case]] kind = "gaussian"``,
docs/spec.md), with the range checks that keep the closed forms inside float64."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...foundation.typed_toml import Table, positive
from ..protocols import CaseConfig


@dataclass(frozen=True)
class GaussianParams:
    """A diagonal Gaussian; ``mean`` and ``std`` have one entry per dimension."""
    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class GaussianCase(CaseConfig):
    q: GaussianParams
    p: GaussianParams


# Range of the parameters: the closed forms square σ and d = μq − μp and multiply squares (σq²d²/σp⁴),
# so every mean and std stays within 1e±30 and, per dimension, σq/σp and |μq − μp|/σ within 1e±10 (then
# KL ≤ ~1e20 and the fourth moments of log r, ~(d/σ)⁸, stay far inside float64). Beyond that the exact
# values would overflow or lose every digit, so such a case is refused rather than answered with inf/NaN.
MAX_ABS = 1e30
MIN_STD = 1e-30
MAX_RATIO = 1e10


def _check_mean(v: tuple[float, ...]) -> str | None:
    bad = next((x for x in v if abs(x) > MAX_ABS), None)
    return None if bad is None else f"must lie in [−{MAX_ABS:g}, {MAX_ABS:g}] (exact values in float64), got {bad:g}"


def _check_std(v: tuple[float, ...]) -> str | None:
    msg = positive(v)
    if msg:
        return msg
    bad = next((x for x in v if not MIN_STD <= x <= MAX_ABS), None)
    return None if bad is None else f"must lie in [{MIN_STD:g}, {MAX_ABS:g}] (exact values in float64), got {bad:g}"


def _params(t: Table) -> GaussianParams:
    mean = t.get("mean", "float_or_list", check=_check_mean)
    std = t.get("std", "float_or_list", check=_check_std)
    t.finish()
    return GaussianParams(mean, std)


def _check_ratios(t: Table, q: GaussianParams, p: GaussianParams) -> None:
    """Per dimension: σq/σp and |μq − μp|/min(σq, σp) within MAX_RATIO (see above)."""
    for i, (mq, sq, mp, sp) in enumerate(zip(q.mean, q.std, p.mean, p.std)):
        dim = f" (dimension {i + 1})" if len(q.mean) > 1 else ""
        ratio = sq / sp
        if not 1 / MAX_RATIO <= ratio <= MAX_RATIO:
            raise t.error(f"σq/σp = {sq:g}/{sp:g} = {ratio:.3g}{dim} must lie in [{1 / MAX_RATIO:g}, {MAX_RATIO:g}]: "
                          "the exact moments of log r would leave float64's range", key="p.std")
        if abs(mq - mp) > MAX_RATIO * min(sq, sp):
            raise t.error(f"|μq − μp| = {abs(mq - mp):g}{dim} must be ≤ {MAX_RATIO:g} × min(σq, σp) = "
                          f"{MAX_RATIO * min(sq, sp):g}: the exact moments of log r would leave float64's range",
                          key="p.mean")


def _broadcast(g: GaussianParams, dim: int) -> GaussianParams:
    """A scalar mean or std repeated to ``dim`` dimensions."""
    return GaussianParams(g.mean * dim if len(g.mean) == 1 else g.mean, g.std * dim if len(g.std) == 1 else g.std)


def parse(t: Table, common: dict[str, Any], spec_dir: Path) -> GaussianCase:
    if t.has("precision"):
        raise t.error("rounded log-probs have no exact oracle on a Gaussian (rounding changes the continuous "
                      "law of log r); use a categorical or rollout case", key="precision")
    q = _params(t.sub("q"))
    p = _params(t.sub("p"))
    t.finish()
    lengths = {len(x) for x in (q.mean, q.std, p.mean, p.std)}
    dim = max(lengths)
    if lengths - {1, dim}:
        raise t.error(f"q.mean, q.std, p.mean, p.std must be scalars or lists of one length; "
                      f"got lengths {len(q.mean)}, {len(q.std)}, {len(p.mean)}, {len(p.std)}", key="q/p")
    q, p = _broadcast(q, dim), _broadcast(p, dim)
    _check_ratios(t, q, p)
    return GaussianCase(q=q, p=p, **common)
