"""What one batch of draws hands to the estimators, and the rows that are estimated from it.

A **row** is an estimator with an aggregation:
- ``""``: single draws (Gaussian, categorical): the estimator applied to log r.
- ``"seq"``: rollouts: the estimator applied to the sequence log-ratio L = Σ_t log r_t (R = e^L).
- ``"tok"``: rollouts: the per-token estimator summed over the generated tokens (what GRPO/PPO code does).
- ``"tok_mean"``: rollouts: that sum divided by the sequence's length |y| (the per-sequence token mean
  that "seq-mean-token-mean" aggregation averages).
- ``"tok_batch"``: rollouts: "token-mean" aggregation over a trainer batch of B consecutive sequences,
  Σ_i Σ_t f_{i,t} / Σ_i |y_i|. One value per group of B draws (``Row.group`` = B): the group's value
  is repeated at each of its members, and the engine counts it once (kl_bench.engine.make_features).
  Groups are formed within each piece of a batch (kl_bench.seeding): the last ``piece mod B`` draws of
  a piece belong to no group (their value is NaN). B = 1 is ``tok_mean``.
- ``"tok_gm"``: rollouts under a sampler with ``weights = "geometric"``: the token sum times TRL's
  sequence-level weight exp((1/|y|) Σ_t log(q_t/b_t)), the geometric mean of the token ratios.
A pair-supplied row (``full``: the analytic per-context KL, Rao–Blackwellised) has aggregate "" or "tok".
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .estimators import Estimator, RowSource
from .presets import trl_sequence_weight
from .targets import REVERSE

TOK_AGGREGATES = ("tok", "tok_mean", "tok_gm", "tok_batch")   # rows built from per-token sums along the path
PER_TOKEN = ("tok_mean", "tok_batch")   # divided by lengths: rates per generated token, not sequence totals
# A hidden token row whose per-step value is 1: its sum is the sequence length |y|, which tok_mean,
# tok_gm and tok_batch rows need per draw. It is the last column of Draws.tok whenever such a row is present.
LENGTH = Estimator("length", lambda logr: torch.ones_like(logr), REVERSE, False, True, "1 per token")


def row_key(name: str, lam: float | None, aggregate: str) -> str:
    """The unique key of a row within a case ('k3', 'cv@0.5', 'tok:k3'); reservoir.npz uses it too."""
    base = name if lam is None else f"{name}@{lam!r}"
    return f"{aggregate}:{base}" if aggregate else base


def row_label(r) -> str:
    """How a summary row is shown: 'k3', 'cv(0.5)', 'cv_opt(0.583)', 'seq k3', 'tok cv(1)'."""
    lam = r.get("lambda", float("nan"))
    name = r["estimator"]
    if isinstance(lam, float) and lam == lam:
        name = f"{name}({lam:.3g})"
    agg = r.get("aggregate", "")
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
    """
    logr: torch.Tensor
    full: torch.Tensor
    tok: torch.Tensor | None = None
    tok_b: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    tok_weighted: bool = False
    segments: list[int] | None = None
    log_weight: torch.Tensor | None = None


def _needs_length(rows: list[Row]) -> bool:
    return any(r.aggregate in ("tok_mean", "tok_gm", "tok_batch") for r in rows)


def groups_in(size: int, group: int, piece: int) -> int:
    """Values a group row gets from a batch of ``size`` draws drawn in pieces of ``piece``: whole groups
    of ``group`` draws within each piece."""
    full, rest = divmod(size, piece)
    return full * (piece // group) + rest // group


def group_index(draws: Draws, group: int) -> torch.Tensor:
    """[G·B] int64: the positions of the draws in whole groups of ``group`` = B consecutive draws within each
    segment, group after group (no Python loop over segments: small batches make thousands of them)."""
    device = draws.logr.device
    m = torch.tensor(draws.segments or [draws.logr.shape[0]], dtype=torch.int64, device=device)
    k = m // group * group                                  # draws of each segment in whole groups
    starts, k_starts = torch.cumsum(m, 0) - m, torch.cumsum(k, 0) - k
    total = int(k.sum())
    return (torch.repeat_interleave(starts, k, output_size=total)
            + torch.arange(total, device=device) - torch.repeat_interleave(k_starts, k, output_size=total))


def group_starts(draws: Draws, group: int) -> torch.Tensor:
    """[n] bool: True at the first draw of every whole group of ``group`` draws within each segment."""
    out = torch.zeros(draws.logr.shape[0], dtype=torch.bool, device=draws.logr.device)
    out[group_index(draws, group)[::group]] = True
    return out


def row_values(draws: Draws, rows: list[Row],
               groups: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """[n, len(rows)] values of every row for every draw. ``groups``: filled with B → (group_index, Σ|y|
    per group) for the group rows, so that a caller needing the groups too does not build them again."""
    cols, t = [], 0
    w = draws.weight
    length = draws.tok[:, -1] if _needs_length(rows) else None
    groups = {} if groups is None else groups
    for row in rows:
        if row.aggregate in TOK_AGGREGATES:
            col = draws.tok[:, t]
            t += 1
            if row.aggregate == "tok_mean":
                col = col / length
            if row.aggregate == "tok_batch":        # unweighted draws only (the rollout kind refuses weights)
                # Σ tok / Σ |y| over each group, repeated at its members; NaN for draws in no whole group.
                # Reshape-and-sum (no scatter-add): the same bytes on every device and every run.
                b = row.group
                if b not in groups:
                    idx = group_index(draws, b)
                    groups[b] = idx, length[idx].view(-1, b).sum(1)
                idx, den = groups[b]
                value = col[idx].view(-1, b).sum(1) / den
                col = torch.full_like(col, math.nan)
                col[idx] = value.repeat_interleave(b)
            if row.aggregate == "tok_gm":
                # W^{1/|y|} = exp(mean_t log(q_t/b_t)), from the log-weight: W itself may overflow
                col = col * trl_sequence_weight(draws.log_weight, length)
            elif w is not None and not draws.tok_weighted:
                col = col * w
        else:
            col = getattr(draws, row.est.draws_field) if row.est.analytic else row.est.fn(draws.logr)
            if w is not None:
                col = col * w
        cols.append(col)
    return torch.stack(cols, dim=-1)


def tok_rows(rows: list[Row]) -> list[Row]:
    """The rows whose per-token sums a rollout accumulates along the path (plus the length row last,
    when a per-sequence mean or a geometric weight needs it)."""
    out = [r for r in rows if r.aggregate in TOK_AGGREGATES]
    return out + [Row(LENGTH, "tok")] if _needs_length(rows) else out
