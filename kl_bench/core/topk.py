"""Top-k forward KL, as distillation code computes it, and its exact bias against the full KL. What verl's
on-policy distillation (a floored, clamped top-k sum in float32) and TRL's tail bucket compute, at which
commits, and why the bias is exact: docs/trainers.md section 4.

Options cover the variants: ``by`` picks whose top-k (p: the teacher, as verl; q: the policy),
``renormalize`` restricts both distributions to S and renormalises them (KL(p_S ‖ q_S) ≥ 0), ``tail`` adds
TRL's tail bucket, ``log_prob_min`` floors the gathered log-probs, ``clamp_min``/``clamp_max`` clamp the
per-context value (None: no clamp). :data:`VERL` and :data:`TRL_TAIL` are the libraries' defaults.
"""
from __future__ import annotations

import torch

from . import rollout_dp


def _tail_bucket(logp: torch.Tensor) -> torch.Tensor:
    """[B, k] log-probs over S → [B, k+1] with log(1 − Σ_S p) appended, in TRL's order: the log-sum capped
    at −1e−7 so that the tail is never log 0, then log(−expm1(·)) (no 1 − e^x cancellation)."""
    log_s = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logp, torch.log(-torch.expm1(log_s))], dim=-1)


def topk_forward_kl(log_q: torch.Tensor, log_p: torch.Tensor, k: int, *, by: str = "p", renormalize: bool = False,
                    clamp_min: float | None = 0.0, log_prob_min: float | None = None, clamp_max: float | None = None,
                    tail: bool = False, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Per-context top-k forward KL. ``log_q``, ``log_p``: normalised float64 log-probs [B, V] → [B]
    (float64 holding the value as computed in ``dtype``: verl's sum runs in float32)."""
    if by not in ("p", "q"):
        raise ValueError(f"by must be 'p' or 'q', got {by!r}")
    if not 1 <= k <= log_q.shape[-1]:
        raise ValueError(f"k must lie in [1, {log_q.shape[-1]}], got {k}")
    ids = torch.topk(log_p if by == "p" else log_q, k, dim=-1).indices          # [B, k]
    lp, lq = log_p.gather(-1, ids), log_q.gather(-1, ids)
    if renormalize:                     # KL(p_S ‖ q_S) of the distributions restricted to S
        lp, lq = torch.log_softmax(lp, -1), torch.log_softmax(lq, -1)
    if tail:
        lp, lq = _tail_bucket(lp), _tail_bucket(lq)
    if log_prob_min is not None:        # verl floors both sides before the sum (the weight p̃ too)
        lp, lq = lp.clamp(min=log_prob_min), lq.clamp(min=log_prob_min)
    lp, lq = lp.to(dtype), lq.to(dtype)
    # p log(p/q) with p = 0 contributes 0 (never 0·∞ = NaN)
    terms = torch.where(lp > -torch.inf, lp.exp() * (lp - lq), torch.zeros_like(lp))
    v = terms.sum(-1)
    if clamp_min is not None:
        v = v.clamp(min=clamp_min)
    if clamp_max is not None:
        v = v.clamp(min=-clamp_max, max=clamp_max)
    return v.to(torch.float64)


# The libraries' defaults, as keyword arguments of topk_forward_kl.
VERL = dict(by="p", log_prob_min=-10.0, clamp_min=0.0, clamp_max=10.0, dtype=torch.float32)
TRL_TAIL = dict(by="p", tail=True, clamp_min=None)


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


def topk_union_divergences(log_q: torch.Tensor, log_p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per context (KL, TV) of q and p coarsened to S ∪ {rest}, S = the K most likely tokens of q together with
    the K most likely of p: what a trainer can compute when each side returns its top-K log-probs (DPPO's
    top-K divergence mask). ``log_q``, ``log_p``: normalised float64 log-probs [C, V] → ([C], [C]).

    The rest bucket's masses are sums over the tokens outside S, not 1 − Σ_S (which keeps no digits when S
    holds nearly all the mass). Coarsening never increases a divergence: both are ≤ the full KL and TV."""
    if not 1 <= k <= log_q.shape[-1]:
        raise ValueError(f"K must lie in [1, {log_q.shape[-1]}], got {k}")
    ids_q, ids_p = torch.topk(log_q, k, dim=-1).indices, torch.topk(log_p, k, dim=-1).indices
    in_s = torch.zeros_like(log_q, dtype=torch.bool)
    in_s.scatter_(-1, ids_q, True)
    in_s.scatter_(-1, ids_p, True)
    q, p = log_q.exp(), log_p.exp()
    kl_s = torch.where(in_s & (q > 0), q * (log_q - log_p), torch.zeros_like(q)).sum(-1)
    q_rest = torch.where(in_s, torch.zeros_like(q), q).sum(-1)
    p_rest = torch.where(in_s, torch.zeros_like(p), p).sum(-1)
    rest = torch.where(q_rest > 0, q_rest * (torch.log(q_rest) - torch.log(p_rest)), torch.zeros_like(q_rest))
    tv = (torch.where(in_s, (q - p).abs(), torch.zeros_like(q)).sum(-1) + (q_rest - p_rest).abs()) / 2
    return kl_s + rest, tv
