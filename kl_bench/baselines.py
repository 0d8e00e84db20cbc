"""Group baselines for an estimator in the reward (docs/weights.md#group-baselines-reward-mode): GRPO's group mean and RLOO's
leave-one-out.

A trainer draws G samples per prompt and uses the per-draw gradient (f_i − b_i)·s_i, s_i = ∇θ log q(x_i),
with b_i the mean of f over the group (``group_mean``, i included) or over the other G − 1
(``leave_one_out``). Groups are G consecutive draws by draw index within a batch, and every batch holds
whole groups, so the draws depend on (seed, batch index) alone and batch means are independent.

Under a sampler b ≠ q the draws come from b and a trainer multiplies each draw's centred reward by its
importance weight: the per-draw gradient is ρ_i (f_i − b_i)·s_i, ρ = q/b with the sampler's corrections
(cap, floor, mask; ρ = 1 with weights = "none"), while b_i is still the plain mean of the group's f.

Exact moments (x ~ b i.i.d., b = q without a sampler; μ = E_b[f], σ² = Var_b f, φ(x) any per-draw feature
such as ρ²|s|² or (ρ s·u)²):
- leave-one-out: b_i is independent of x_i, so E[ρ(f − b)s] = E[ρ f s] − μ E[ρ s] and
  E[(f − b)² φ] = E[f² φ] − 2μ E[f φ] + (μ² + σ²/(G − 1)) E[φ]. E[ρ s] = 0 on x ~ q (E_q[s] = 0) and
  under weights that undo a full-support sampler; a truncating sampler (top-k, top-p) or a mask leaves
  E[ρ s] = Σ_S q s ≠ 0, so there even leave-one-out moves the gradient (by −μ E[ρ s]);
- group mean: f_i − b_i = (1 − 1/G)(f_i − b_i^loo), so every moment is the leave-one-out one times
  (1 − 1/G) (the mean) or (1 − 1/G)² (second moments): the group mean shrinks the KL gradient.
The PPO clip is not modelled here (its branch depends on the centred advantage): refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .errors import SpecError
from .estimators import Estimator
from .registry import Registry
from .seeding import PIECE_DRAWS, batch_sizes, batch_streams, piece_draws
from .stats import mean_and_se
from .targets import REVERSE


@dataclass(frozen=True)
class Baseline:
    """``centre(f, G)``: f − b for f [N] in groups of G consecutive draws (N a multiple of G), [N];
    ``factor(G)``: the per-draw gradient is factor × the leave-one-out one (exactly, draw by draw)."""
    name: str
    label: str
    centre: Callable[[torch.Tensor, int], torch.Tensor]
    factor: Callable[[int], float]


def _group_mean(f: torch.Tensor, g: int) -> torch.Tensor:
    v = f.view(-1, g)
    return (v - v.mean(1, keepdim=True)).reshape(-1)


def _leave_one_out(f: torch.Tensor, g: int) -> torch.Tensor:
    v = f.view(-1, g)
    return (v - (v.sum(1, keepdim=True) - v) / (g - 1)).reshape(-1)


BASELINES: Registry[Baseline] = Registry("baseline")
BASELINES.add("group_mean", Baseline("group_mean", "GRPO: minus the group's mean (i included)", _group_mean,
                                     lambda g: 1 - 1 / g))
BASELINES.add("leave_one_out", Baseline("leave_one_out", "RLOO: minus the mean of the other G − 1",
                                        _leave_one_out, lambda g: 1.0))


# Groups are drawn within pieces of whole groups, so a group may not exceed the smallest piece size.
MAX_GROUP = min(PIECE_DRAWS.values())


def check_group(group: int, key: str = "group") -> None:
    if not 2 <= group <= MAX_GROUP:
        raise SpecError(f"a group baseline needs 2 ≤ G ≤ {MAX_GROUP} draws per group, got {group}", key=key)


def check_pair(pair) -> None:
    """Refuse (SpecError) a categorical pair whose sampler clips: the PPO clip is not modelled here."""
    if pair.correction.clips("reward"):
        raise SpecError("group baselines with the PPO clip are not modelled (the clip's branch depends on the "
                        "centred advantage): drop clip_low/clip_high/dual_clip or the baseline_groups", key="sampler")


def _id_tables(pair):
    """Per drawn id of a categorical pair: its probability under the draw mixture (1/B)·b [M], the weight
    ρ [M] (ones without token weights), log r [M], |s|² [M] and the (context, token) indices
    (s = e_x − q_context)."""
    check_pair(pair)
    q, v = pair.log_q.exp(), pair.vocab
    ids = pair.support_ids
    ctx, tok = ids // v, ids % v
    rho = pair.support_weight if pair.support_weight is not None else torch.ones_like(pair.support_logr)
    s_norm2 = 1 - 2 * q[ctx, tok] + (q * q).sum(-1)[ctx]
    return pair.support_probs, rho, pair.support_logr, s_norm2, ctx, tok


def exact_second(w: torch.Tensor, f: torch.Tensor, phi: torch.Tensor, baseline: str | None, group: int) -> float:
    """E[(f − b)² φ] for draws with probabilities w [M], values f [M] and features φ [M] (module
    docstring); ``baseline`` None: E[f² φ]."""
    if baseline is None:
        return float((w * f**2 * phi).sum())
    mu = float((w * f).sum())
    var = float((w * (f - mu) ** 2).sum())
    loo = float((w * f**2 * phi).sum()) - 2 * mu * float((w * f * phi).sum()) \
        + (mu**2 + var / (group - 1)) * float((w * phi).sum())
    return BASELINES[baseline].factor(group) ** 2 * loo


def exact_baseline_gradient(pair, est: Estimator, baseline: str | None, group: int) -> dict:
    """Exact E[g] [P] (flattened logits) and E|g|² of the reward-mode per-draw gradient ρ(f − b)s with a
    group baseline (None: none) on a categorical pair (module docstring)."""
    w, rho, logr, s2, _, _ = _id_tables(pair)
    f = est.fn(logr)
    if baseline is None:
        c = rho * f
    else:      # factor·ρ(f − μ): the baseline's mean μ = E_b[f] times E[ρ s] (zero on x ~ q, exactly)
        c = BASELINES[baseline].factor(group) * rho * (f - (w * f).sum())
    mean = pair.exact_gradient_of_table(c, {}).mean
    return {"mean": mean, "second": exact_second(w, f, rho**2 * s2, baseline, group)}


def _batch_sums(pair, est: Estimator, baseline: str, group: int, stream, tables) -> tuple[float, float]:
    """(Σ g·u, Σ |g|²) over one batch of whole groups, drawn piece by piece (pieces of whole groups).
    ``tables``: (ρ, log r, |s|², s·u) per drawn id, each [M]."""
    rho, logr, s2, su = tables
    proj = sq = 0.0
    for n, gen in stream.pieces(piece_draws(stream.device) // group * group):
        ids = pair.sample_ids(n, gen, stream.device)
        c = BASELINES[baseline].centre(est.fn(logr[ids]), group) * rho[ids]
        proj += float((c * su[ids]).sum())
        sq += float((c**2 * s2[ids]).sum())
    return proj, sq


def baseline_rows(pair, estimators, baselines, groups, *, draws: int, seed: int, batches: int = 100,
                  device=torch.device("cpu")) -> list[dict]:
    """One row per (estimator, baseline, G) on a categorical pair: exact and Monte Carlo reward-mode
    gradients with the baseline, against the same estimator with no baseline. ``draws`` is rounded down
    to whole groups; batches hold whole groups."""
    rev = pair.gradient_references()[REVERSE]
    u_np = rev / np.linalg.norm(rev)
    u = torch.as_tensor(u_np).reshape(pair.contexts, pair.vocab)
    _, rho, logr, s2, ctx, tok = _id_tables(pair)
    tables = (rho, logr, s2, u[ctx, tok] - (pair.log_q.exp() * u).sum(-1)[ctx])      # s·u per id
    rows = []
    for g in groups:
        check_group(g)
        sizes = [k * g for k in batch_sizes(draws // g, batches)]
        streams = batch_streams(seed, f"{pair.name}/baseline-G{g}", sizes, device)
        for est in estimators:
            plain = exact_baseline_gradient(pair, est, None, g)
            for name in baselines:
                rows.append(_row(pair, est, name, g, plain, streams, tables, u_np))
    return rows


def _row(pair, est, name, g, plain, streams, tables, u_np) -> dict:
    """One baseline row (``baseline_rows``'s columns)."""
    ex = exact_baseline_gradient(pair, est, name, g)
    sums = np.array([_batch_sums(pair, est, name, g, s, tables) for s in streams])
    sizes = np.array([s.size for s in streams], dtype=float)
    m, se = mean_and_se(sums[:, 0], sizes)
    m2, se2 = mean_and_se(sums[:, 1], sizes)
    ref_u = float(ex["mean"] @ u_np)
    plain_norm = float(np.linalg.norm(plain["mean"]))
    trace = ex["second"] - float(ex["mean"] @ ex["mean"])
    trace_plain = plain["second"] - plain_norm**2
    return {"case": pair.name, "sampler": pair.sampler_label, "estimator": est.name, "mode": "reward", "baseline": name, "group": g,
            "draws": int(sizes.sum()),
            "exact_shrink": float(np.linalg.norm(ex["mean"])) / plain_norm if plain_norm > 0 else math.nan,
            "mc_along_reverse": m, "exact_along_reverse": ref_u, "z_reverse": (m - ref_u) / se if se > 0 else math.nan,
            "mc_second": m2, "exact_second": ex["second"],
            "z_second": (m2 - ex["second"]) / se2 if se2 > 0 else math.nan,
            "exact_trace_cov": trace, "exact_trace_cov_none": trace_plain,
            "variance_ratio": trace / trace_plain if trace_plain > 0 else math.nan}
