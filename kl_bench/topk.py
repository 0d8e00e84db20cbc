"""Top-k forward KL, as distillation code computes it, and its exact bias against the full KL.

verl's on-policy distillation (verl/trainer/distillation/fsdp/losses.py, ``compute_forward_kl_topk``)
keeps only the teacher's k most likely tokens: with the teacher as the reference p and the student as the
policy q, it computes Σ_{x ∈ S} p(x) (log p(x) − log q(x)) over S = top-k of p, from the full-vocabulary
log-probs (no renormalisation over S). That truncated sum is not a divergence: it can be negative where q
puts more mass than p on S, hence the clamp at 0 that some versions apply. Options cover the variants:
``by`` picks whose top-k (p: the teacher, as verl; q: the policy), ``renormalize`` restricts both
distributions to S and renormalises them (then the sum is KL(p_S ‖ q_S) ≥ 0), ``clamp_min`` clamps the
per-context value from below (None: no clamp).

Exact everywhere: the per-context value is a deterministic function of the context, so for categoricals
its mean is the average over contexts, and along rollout paths (x ~ q, as on-policy distillation samples)
E_q[Σ_t g(c_{t−1})] is the dynamic program with h = g(c) (kl_bench.rollout_dp). The reference is the
same sum with the full forward KL(p(·|c) ‖ q(·|c)) per step.
"""
from __future__ import annotations

import torch

from . import rollout_dp


def topk_forward_kl(log_q: torch.Tensor, log_p: torch.Tensor, k: int, *, by: str = "p", renormalize: bool = False,
                    clamp_min: float | None = 0.0) -> torch.Tensor:
    """Per-context top-k forward KL. ``log_q``, ``log_p``: normalised float64 log-probs [B, V] → [B]."""
    if by not in ("p", "q"):
        raise ValueError(f"by must be 'p' or 'q', got {by!r}")
    if not 1 <= k <= log_q.shape[-1]:
        raise ValueError(f"k must lie in [1, {log_q.shape[-1]}], got {k}")
    ids = torch.topk(log_p if by == "p" else log_q, k, dim=-1).indices          # [B, k]
    lp, lq = log_p.gather(-1, ids), log_q.gather(-1, ids)
    if renormalize:                     # KL(p_S ‖ q_S) of the distributions restricted to S
        lp, lq = torch.log_softmax(lp, -1), torch.log_softmax(lq, -1)
    # p log(p/q) with p = 0 contributes 0 (never 0·∞ = NaN)
    terms = torch.where(lp > -torch.inf, lp.exp() * (lp - lq), torch.zeros_like(lp))
    v = terms.sum(-1)
    return v.clamp(min=clamp_min) if clamp_min is not None else v


def full_forward_kl(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """KL(p(·|c) ‖ q(·|c)) per context, [B, V] → [B]."""
    terms = torch.where(log_p > -torch.inf, log_p.exp() * (log_p - log_q), torch.zeros_like(log_p))
    return terms.sum(-1)


def categorical_topk(log_q: torch.Tensor, log_p: torch.Tensor, k: int, **kw) -> dict[str, float]:
    """Exact {topk, full, bias, rel_bias} for a categorical whose draws pick one of the B contexts
    uniformly: means over the contexts of the per-context values."""
    top = float(topk_forward_kl(log_q, log_p, k, **kw).mean())
    full = float(full_forward_kl(log_q, log_p).mean())
    return {"topk": top, "full": full, "bias": top - full, "rel_bias": (top - full) / full if full else float("nan")}


def rollout_topk(log_q: torch.Tensor, log_p: torch.Tensor, bucket: torch.Tensor, length: int, eos: int | None,
                 k: int, **kw) -> dict[str, float]:
    """Exact {topk, full, bias, rel_bias} along rollout paths x ~ q: E_q[Σ_t g(c_{t−1})] for g the top-k
    and the full forward KL of each step's context (bucket logits [C, V], bucket map [V])."""
    q = log_q.exp()
    c = log_q.shape[0]

    def path_sum(g: torch.Tensor) -> float:
        h = g[:, None].expand_as(log_q)
        a, e = rollout_dp.moment_matrices(q, torch.ones_like(q), h, bucket, c, eos, 1)
        return rollout_dp.propagate(a, e, length)[1]
    top = path_sum(topk_forward_kl(log_q, log_p, k, **kw))
    full = path_sum(full_forward_kl(log_q, log_p))
    return {"topk": top, "full": full, "bias": top - full, "rel_bias": (top - full) / full if full else float("nan")}
