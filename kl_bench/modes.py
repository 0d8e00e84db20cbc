"""Where a trainer puts an estimator, as a per-draw gradient c(log r) · ∇θ log q(x) (docs/gradients.md).

| mode | what is differentiated | c(log r) |
|---|---|---|
| loss | f(log r), the sample held fixed | −f′(log r) |
| reward | sg(f) · log q_θ(x) (score function) | f(log r) |
| loss_is | f(log r) · q_θ/sg(q_θ) | f(log r) − f′(log r) |
| straight_through | value of f, gradient of k2 (estimators that declare it: k3) | −log r |
| loss_is_nemo | clamp(w·f(clamp(log r))), w = q/sg(q) detached where a clamp fires (NeMo-RL) | (f − f′)·1[no clamp] |

f′ comes from autograd of the estimator function itself, so clamped variants differentiate as trainers'
code does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .errors import SpecError
from .estimators import Estimator, Poly

MODES = ("loss", "reward", "loss_is", "straight_through", "loss_is_nemo")


def nemo_active(est: Estimator, logr: torch.Tensor) -> torch.Tensor:
    """Where neither of NeMo-RL's clamps fires (on-policy, w = 1): kl_bench.presets.WeightedClamp.active."""
    return est.weighted.active(logr)


def coefficient(est: Estimator, mode: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """c(log r) such that the mode's per-draw gradient is c(log r) · ∇θ log q(x). Shape-preserving."""
    def deriv(logr: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x = logr.detach().clone().requires_grad_(True)
            try:
                (g,) = torch.autograd.grad(est.fn(x).sum(), x)
            except RuntimeError as e:       # a plug-in written with non-differentiable operations
                raise SpecError(f"estimator '{est.name}' is not differentiable with autograd, which the "
                                f"{mode} gradient mode needs: {str(e).splitlines()[0]}") from None
        return g
    if mode == "loss":
        return lambda logr: -deriv(logr)
    if mode == "reward":
        return lambda logr: est.fn(logr)
    if mode == "loss_is":
        return lambda logr: est.fn(logr) - deriv(logr)
    if mode == "straight_through":
        return lambda logr: -logr
    if mode == "loss_is_nemo":
        # ∇(w·f(log r)) = w·(f − f′)·s where no clamp fires (∇w = w s, ∇ log r = −s, w = 1 on-policy); zero
        # where one fires, since NeMo-RL detaches the weight there and the clamped value is constant.
        return est.weighted.coefficient
    raise ValueError(mode)


def trainer_loss(est: Estimator, mode: str, log_q_x: torch.Tensor, log_p_x: torch.Tensor) -> torch.Tensor:
    """The per-draw objective of a mode as trainers write it (log_q_x depends on θ): autograd of it
    gives c(log r)·∇θ log q(x). Used to check :func:`coefficient` and as the plain benchmark baseline."""
    logr = log_p_x - log_q_x
    if mode == "loss":
        return est.fn(logr)
    if mode == "reward":
        return est.fn(logr).detach() * log_q_x
    if mode == "loss_is":
        return est.fn(logr) * torch.exp(log_q_x - log_q_x.detach())
    if mode == "straight_through":            # the value of k3, the gradient of k2
        k2 = 0.5 * logr**2
        return k2 + (est.fn(logr) - k2).detach()
    if mode == "loss_is_nemo":            # NeMo-RL: clamp(w · f(clamp(log r))), w detached where a clamp fires
        wc = est.weighted
        w = torch.exp(log_q_x - log_q_x.detach())
        w = torch.where(nemo_active(est, logr.detach()), w, w.detach())
        x = logr.clamp(-wc.logr_clamp, wc.logr_clamp) if wc.logr_clamp is not None else logr
        v = w * wc.base(x)
        return v.clamp(-wc.clamp, wc.clamp) if wc.clamp is not None else v
    raise ValueError(mode)


def coefficient_poly(est: Estimator, mode: str) -> Poly | None:
    """c as a polynomial Σ a r^s (log r)^k, when the estimator is one (d/dL r^s = s r^s)."""
    if mode == "straight_through":
        return {(0, 1): -1.0}
    if est.poly is None or mode == "loss_is_nemo":
        return None
    deriv: Poly = {}
    for (s, k), a in est.poly.items():
        if s:
            deriv[(s, k)] = deriv.get((s, k), 0.0) + a * s
        if k:
            deriv[(s, k - 1)] = deriv.get((s, k - 1), 0.0) + a * k
    if mode == "reward":
        return dict(est.poly)
    if mode == "loss":
        return {key: -v for key, v in deriv.items()}
    out = dict(est.poly)
    for key, v in deriv.items():
        out[key] = out.get(key, 0.0) - v
    return out


def modes_for(est: Estimator) -> list[str]:
    """The modes an estimator gets: straight_through and loss_is_nemo only where the estimator declares them."""
    return [m for m in MODES if (m != "straight_through" or est.straight_through)
            and (m != "loss_is_nemo" or est.weighted is not None)]


@dataclass(frozen=True)
class GradItem:
    """One gradient row: an estimator in a mode, on an aggregate of the pair ("" for single draws).
    ``coef`` maps log r [n] to the per-draw coefficient c(log r) of the score; ``cpoly`` is c as a
    polynomial Σ a r^s (log r)^k when it is one (else None)."""
    est: Estimator
    mode: str
    aggregate: str
    coef: Callable[[torch.Tensor], torch.Tensor]
    cpoly: Poly | None

    @classmethod
    def of(cls, est: Estimator, mode: str, aggregate: str = "") -> "GradItem":
        return cls(est, mode, aggregate, coefficient(est, mode), coefficient_poly(est, mode))


@dataclass
class ExactGrad:
    mean: np.ndarray          # E[c s], flattened θ [P]
    second: float             # E[c² |s|²]; NaN where not exact
    proj_var: dict            # direction name → Var(c s·u); may be empty


@dataclass
class GradBatch:
    """Sums over one batch's draws, for every item j and direction d."""
    proj: np.ndarray              # [J, D]: Σ g·u_d
    sq: np.ndarray                # [J]: Σ |g|²
    proj2: np.ndarray | None = None   # [J, D]: Σ (g·u_d)², when the kind measures spreads itself
