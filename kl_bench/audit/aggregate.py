"""Trainers' masked aggregations of per-token values [B, T] into one number, as per-token weights.

| name | value | trainers |
|---|---|---|
| token-mean | Σ_bt m·v / Σ_bt m | TRL's logged ``kl`` (GRPO), verl ``token-mean``, OpenRLHF's global token mean |
| seq-mean-token-mean | (1/B) Σ_b (Σ_t m·v / max(Σ_t m, 1)) | TRL ``loss_type = "grpo"``, verl ``seq-mean-token-mean`` |
| seq-mean-token-sum | (1/B) Σ_b Σ_t m·v | RLOO's per-sequence KL in the reward, verl ``seq-mean-token-sum`` |

Each is Σ_bt w_bt v_bt with weights w [B, T] that depend on the mask only, so expectations and
variances of the aggregate follow from per-token ones (kl_bench.audit.step).
"""
from __future__ import annotations

import torch

from ..foundation.errors import ShapeError, SpecError
from ..foundation.registry import did_you_mean

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
# How a step's micro-batches combine: "pooled" (one aggregate of all their rows) or "mean" (the mean of
# each micro-batch's aggregate: TRL's logged GRPO `kl`, and the loss of loss types that divide each
# micro-batch's loss by the accumulation steps).
MICRO_BATCHES = ("pooled", "mean")


def aggregation_units(mask: torch.Tensor, aggregation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token units u [B, T] and the denominator D (0-d), float64, with weights w = u / D. Both are
    additive over the rows, so that ranks holding different rows reduce (Σ u·x, D) by summing:
    token-mean u = m, D = Σ m; seq-mean-token-mean u = m / max(Σ_t m, 1), D = B; seq-mean-token-sum
    u = m, D = B."""
    if aggregation not in LOSS_AGGREGATIONS:
        raise SpecError(f"unknown aggregation '{aggregation}'{did_you_mean(aggregation, list(LOSS_AGGREGATIONS))}; "
                        f"known: {', '.join(LOSS_AGGREGATIONS)}", key="aggregation")
    if mask.ndim != 2:
        raise ShapeError(f"an aggregation needs a [B, T] mask, got shape {list(mask.shape)}", key="mask")
    m = mask.to(torch.float64)
    rows = torch.tensor(float(m.shape[0]), dtype=torch.float64, device=m.device)
    if aggregation == "token-mean":
        return m, m.sum()
    if aggregation == "seq-mean-token-mean":
        return m / m.sum(dim=-1, keepdim=True).clamp(min=1.0), rows
    return m, rows


def aggregation_weights(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Per-token weights w [B, T] (float64, 0 where ``mask`` [B, T] is 0) of ``aggregation``."""
    u, d = aggregation_units(mask, aggregation)
    return u / d.clamp(min=1.0)


def aggregate(values: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """The aggregate (a 0-d tensor in ``values``' dtype; autograd flows) of ``values`` [B, T] under
    ``mask`` [B, T], in the trainers' order of operations (so that the float32 result is theirs bit for
    bit): token-mean = Σ(v·m) / max(Σ m, 1); seq-mean-token-mean = mean_b(Σ_t v·m / max(Σ_t m, 1));
    seq-mean-token-sum = mean_b(Σ_t v·m). Padded entries may hold inf or NaN: they count as 0."""
    aggregation_weights(mask[:1], aggregation)          # validates the name and the shape
    if values.shape != mask.shape:
        raise ShapeError(f"mask must have the values' shape {list(values.shape)}, got {list(mask.shape)}", key="mask")
    m = mask.to(device=values.device, dtype=values.dtype)
    v = torch.where(m.bool(), values, torch.zeros_like(values))
    if aggregation == "token-mean":
        return (v * m).sum() / m.sum().clamp(min=1.0)
    if aggregation == "seq-mean-token-mean":
        return ((v * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    return (v * m).sum(-1).mean()
