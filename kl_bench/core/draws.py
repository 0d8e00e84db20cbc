"""What one batch of draws hands to the estimators, and the rows that are estimated from it.

A **row** is an estimator with an aggregation (kl_bench.core.aggregates: how a row turns the draws into
values; :func:`kl_bench.core.aggregates.row_values` computes every row's value for every draw). A
pair-supplied row (``full``: the analytic per-context KL, Rao–Blackwellised) has aggregate "" or "tok". This
module holds the types only: the aggregates import it, never the other way round.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .estimators import Estimator, RowSource
from .targets import REVERSE

# A hidden token row whose per-step value is 1: its sum is the sequence length |y|, which the aggregates
# with ``length`` need per draw. It is the last column of Draws.tok whenever such a row is present.
LENGTH = Estimator("length", lambda logr: torch.ones_like(logr), REVERSE, False, True, "1 per token")


# The sampler column of a case whose [sampler] table changes nothing (sampling.mismatch.SamplerSpec.describe):
# its draws come from q itself, so the on-policy identities hold and no mismatch biases anything.
Q_ITSELF = "q itself"


def draws_from_b(sampler) -> bool:
    """Whether a row's sampler column says its draws come from a sampler b ≠ q: not blank, not "q itself"."""
    return isinstance(sampler, str) and sampler not in ("", Q_ITSELF)


def row_key(name: str, lam: float | None, aggregate: str) -> str:
    """The unique key of a row within a case ('k3', 'cv@0.5', 'tok:k3'); reservoir.npz uses it too."""
    base = name if lam is None else f"{name}@{lam!r}"
    return f"{aggregate}:{base}" if aggregate else base


def row_label(r, aggregate: bool = True) -> str:
    """How a row (a summary or gradients row, anything with ``estimator``, ``lambda`` and ``aggregate``)
    is shown: 'k3', 'cv(0.5)', 'cv_opt(0.583)', 'seq k3', 'tok cv(1)'; without the aggregate when
    ``aggregate`` is False (a figure of one aggregate's rows)."""
    lam = r.get("lambda", float("nan"))
    name = r["estimator"]
    if isinstance(lam, float) and lam == lam:
        name = f"{name}({lam:.3g})"
    agg = r.get("aggregate", "") if aggregate else ""
    return f"{agg} {name}" if isinstance(agg, str) and agg else name


@dataclass(frozen=True)
class Row:
    est: RowSource
    aggregate: str = ""
    group: int = 1          # draws per value: B for "tok_batch" (one value per trainer batch), else 1

    @property
    def label(self) -> str:
        """Unique key within a run: cv variants differ by λ, rollout rows by aggregate."""
        return row_key(self.est.name, self.est.lam, self.aggregate)


@dataclass
class Draws:
    """Per-draw quantities, all float64 with leading shape [n] (for categoricals: [M] table entries).

    logr:  log r of the draw; for rollouts the sequence log-ratio L.
    full:  Σ over the draw's contexts (steps) of the analytic KL(q(·|c) ‖ p(·|c)).
    tok:   rollouts: [n, len(tok_rows)] per-token sums Σ_t f(log r_t), one column per tok row.
    tok_b: rollouts: Σ_t (r_t − 1), the control variate's per-token term.
    weight: importance weight q/b of the draw (sequence: Π_t q/b) when a sampler b ≠ q is weighted;
        None means 1. Every row is multiplied by it, except token rows when ``tok_weighted``.
    log_weight: rollouts: Σ_t log(q_t/b_t) of the draw (log of ``weight``, never overflowing), for tok_gm.
    tok_weighted: the token sums already carry per-token weights.
    segments: sizes of the consecutive pieces the draws come from (None: one piece); group rows form
        their groups within each piece, so that a batch's groups never depend on how pieces are joined.
    keep: rollouts under a rejection mask (kl_bench.core.rejection): 1.0 for a kept sequence, 0.0 for a rejected
        one, whose every row's value is 0 (None: every draw kept).
    logq: log q(x) of the draw, for the estimators that need it (Estimator.needs_logq; None where the kind has
        no per-draw probabilities: rollouts hand token rows their values through ``tok``).
    """
    logr: torch.Tensor
    full: torch.Tensor
    tok: torch.Tensor | None = None
    tok_b: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    tok_weighted: bool = False
    segments: list[int] | None = None
    log_weight: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    logq: torch.Tensor | None = None


__all__ = ["Draws", "LENGTH", "Row", "row_key", "row_label"]
