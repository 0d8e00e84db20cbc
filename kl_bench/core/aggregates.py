"""The aggregates: how a row turns the draws into one value each (docs/rollouts.md#rows), one
:class:`Aggregate` entry of :data:`AGGREGATES` per aggregate (its Monte Carlo value, its label, its flags):
- ``""``: single draws (Gaussian, categorical): the estimator applied to log r.
- ``"seq"``: rollouts: the estimator applied to the sequence log-ratio L = Σ_t log r_t (R = e^L).
- ``"tok"``: rollouts: the per-token estimator summed over the generated tokens (what GRPO/PPO code does).
- ``"tok_mean"``: rollouts: that sum divided by the sequence's length |y| (the per-sequence token mean
  that "seq-mean-token-mean" aggregation averages).
- ``"tok_batch"``: rollouts: "token-mean" aggregation over a trainer batch of B consecutive sequences,
  Σ_i Σ_t f_{i,t} / Σ_i |y_i|. One value per group of B draws (``Row.group`` = B): the group's value
  is repeated at each of its members, and the engine counts it once (kl_bench.engine.monte_carlo.make_features).
  Groups are formed within each piece of a batch (kl_bench.sampling.seeding): the last ``piece mod B`` draws of
  a piece belong to no group (their value is NaN). B = 1 is ``tok_mean``.
- ``"tok_gm"``: rollouts under a sampler with ``weights = "geometric"``: the token sum times TRL's
  sequence-level weight exp((1/|y|) Σ_t log(q_t/b_t)), the geometric mean of the token ratios.

What is exact about a row, and which aggregates a case gives, is the kind's: a kind owns the table of
its aggregates' oracles (the rollout kind: kl_bench.kinds.rollout.aggregates). An aggregate registered
from outside (a plug-in) may bring its own ``exact`` and ``enabled`` hooks, which a kind that does not
know the aggregate asks. Nothing here names a kind or its methods.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .draws import LENGTH, Draws, Row
from .estimators import RowSource
from .presets import trl_sequence_weight
from ..foundation.registry import Registry



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


@dataclass
class Batch:
    """What an aggregate's value sees of one batch: the draws, the lengths |y| [n] (when a row needs
    them) and the cache of group rows, B → (group_index [G·B], Σ|y| per group [G])."""
    draws: Draws
    length: torch.Tensor | None
    groups: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def group(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        if b not in self.groups:
            idx = group_index(self.draws, b)
            self.groups[b] = idx, self.length[idx].view(-1, b).sum(1)
        return self.groups[b]


@dataclass(frozen=True)
class Aggregate:
    """How a row turns a draw into one value: one entry of :data:`AGGREGATES` per aggregate.

    ``value(col, row, batch)``: the Monte Carlo value per draw [n], from ``col`` [n], the estimator on the
    draw's log r (or the pair's field), or with ``token`` its per-token sum along the path (a column of
    Draws.tok). ``per_token``: the row is a rate per generated token, so its truth is the target / E_q|y|
    (its target scaling). ``length``: the value needs |y| per draw. ``grouped``: one value per group of
    ``Row.group`` draws. ``applies(source)``: whether an estimator gets a row on it. ``label``: what the
    aggregate is, in words (the report's caption; plain text that LaTeX also takes). ``weight``: which
    importance weight a value carries under a weighted sampler: "draw" (the draw's product W), "draw
    unless token" (W, except in a case that weights each token: then each token's own q/b), "none".

    Hooks for an aggregate registered from outside a kind (the built-ins leave them None: each kind owns
    its aggregates' oracles): ``exact(pair, est)``, the row's (mean, variance); ``enabled(pair)``, whether
    a case gives the aggregate (None: wherever the kind lists it)."""
    name: str
    label: str
    value: Callable[[torch.Tensor, Row, "Batch"], torch.Tensor]
    token: bool = False
    exact: Callable[[Any, RowSource], tuple[float, float]] | None = None
    per_token: bool = False
    length: bool = False
    grouped: bool = False
    applies: Callable[[RowSource], bool] = lambda source: True
    enabled: Callable[[Any], bool] | None = None
    weight: str = "none"

    @property
    def carries_draw_weight(self) -> bool:
        """The value carries the draw's whole importance weight W (unless ``weight`` says a case that
        weights each token puts per-token weights into it instead): its effective sample size is W's."""
        return self.weight != "none"


AGGREGATES: Registry[Aggregate] = Registry("aggregate")


def register_aggregate(agg: Aggregate, *, replace: bool = False) -> Aggregate:
    """Add an aggregate (the table's order is the order of a case's rows)."""
    return AGGREGATES.add(agg.name, agg, replace=replace)


def _weighted(col: torch.Tensor, row: Row, batch: Batch) -> torch.Tensor:
    """Every row is multiplied by the draw's importance weight q/b (when b ≠ q is weighted)."""
    w = batch.draws.weight
    return col if w is None else col * w


def _token_weighted(col: torch.Tensor, row: Row, batch: Batch) -> torch.Tensor:
    """Token sums that carry per-token weights already are not weighted again."""
    return col if batch.draws.tok_weighted else _weighted(col, row, batch)


def _per_sequence_mean(col: torch.Tensor, row: Row, batch: Batch) -> torch.Tensor:
    return _token_weighted(col / batch.length, row, batch)


def _token_mean_batch(col: torch.Tensor, row: Row, batch: Batch) -> torch.Tensor:
    # Σ tok / Σ |y| over each group, repeated at its members; NaN for draws in no whole group. Unweighted
    # draws only (the rollout kind refuses weights). Reshape-and-sum (no scatter-add): the same bytes on
    # every device and every run.
    b = row.group
    idx, den = batch.group(b)
    value = col[idx].view(-1, b).sum(1) / den
    out = torch.full_like(col, math.nan)
    out[idx] = value.repeat_interleave(b)
    return out


def _geometric(col: torch.Tensor, row: Row, batch: Batch) -> torch.Tensor:
    # W^{1/|y|} = exp(mean_t log(q_t/b_t)), from the log-weight: W = Π_t q_t/b_t itself may overflow
    return col * trl_sequence_weight(batch.draws.log_weight, batch.length)


def _plain(source: RowSource) -> bool:
    return source.lam is None


for _agg in (
    Aggregate("", "the estimator of the draw's log r", _weighted, weight="draw"),
    Aggregate("seq", "the estimator of the sequence log-ratio L, the sum of the tokens' log r", _weighted,
              applies=lambda source: not source.token_only, weight="draw"),
    Aggregate("tok", "the per-token estimator summed over the generated tokens", _token_weighted, token=True,
              weight="draw unless token"),
    Aggregate("tok_mean", "the token sum over the sequence's length |y|", _per_sequence_mean, token=True,
              per_token=True, length=True, applies=_plain, weight="draw unless token"),
    Aggregate("tok_batch", "token-mean over a trainer batch of B sequences: their token sums over their lengths",
              _token_mean_batch, token=True, per_token=True, length=True, grouped=True, applies=_plain),
    Aggregate("tok_gm", "the token sum times TRL's weight W^(1/|y|)", _geometric, token=True, length=True,
              applies=_plain),
):
    register_aggregate(_agg)


def per_token_aggregates() -> tuple[str, ...]:
    """The aggregates whose rows are rates per generated token (truth: target / E_q|y|)."""
    return tuple(name for name, a in AGGREGATES.items() if a.per_token)


PER_TOKEN = per_token_aggregates()     # the built-ins' (readers that need plug-ins call the function)


def group_starts(draws: Draws, group: int) -> torch.Tensor:
    """[n] bool: True at the first draw of every whole group of ``group`` draws within each segment."""
    out = torch.zeros(draws.logr.shape[0], dtype=torch.bool, device=draws.logr.device)
    out[group_index(draws, group)[::group]] = True
    return out


def _needs_length(rows: list[Row]) -> bool:
    return any(AGGREGATES[r.aggregate].length for r in rows)


def row_values(draws: Draws, rows: list[Row],
               groups: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """[n, len(rows)] values of every row for every draw. ``groups``: filled with B → (group_index, Σ|y|
    per group) for the group rows, so that a caller needing the groups too does not build them again."""
    batch = Batch(draws, draws.tok[:, -1] if _needs_length(rows) else None, {} if groups is None else groups)
    cols, t = [], 0
    for row in rows:
        agg = AGGREGATES[row.aggregate]
        if agg.token:
            col, t = draws.tok[:, t], t + 1
        else:
            col = getattr(draws, row.est.draws_field) if row.est.analytic else row.est.on(draws.logr, draws.logq)
        value = agg.value(col, row, batch)
        # A rejected sequence's tokens are all masked: 0, never 0·inf (its weight may overflow).
        cols.append(value if draws.keep is None else torch.where(draws.keep > 0, value, torch.zeros_like(value)))
    return torch.stack(cols, dim=-1)


def tok_rows(rows: list[Row]) -> list[Row]:
    """The rows whose per-token sums a rollout accumulates along the path (plus the length row last,
    when a per-sequence mean or a geometric weight needs it)."""
    out = [r for r in rows if AGGREGATES[r.aggregate].token]
    return out + [Row(LENGTH, "tok")] if _needs_length(rows) else out
