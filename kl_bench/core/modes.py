"""Where a trainer puts an estimator, as a per-draw gradient c(log r) · ∇θ log q(x) (docs/gradients.md).

Every mode is one :class:`Mode` entry of :data:`MODES` (its coefficient, its polynomial form, its
trainer objective, its label, the estimators it applies to); nothing else in the package branches on a
mode's name. The built-in modes:

| mode | what is differentiated | c(log r) |
|---|---|---|
| loss | f(log r), the sample held fixed | −f′(log r) |
| reward | sg(f) · log q_θ(x) (score function) | f(log r) |
| loss_is | f(log r) · q_θ/sg(q_θ) | f(log r) − f′(log r) |
| straight_through | value of f, gradient of k2 (estimators that declare it: k3) | −log r |
| loss_is_nemo | clamp(w·f(clamp(log r))), w = q/sg(q) detached where a clamp fires (NeMo-RL) | (f − f′)·1[no clamp] |
| reward+loss | sg(f)·log q + f: the KL term in the reward and in the loss (Shah et al.'s fix) | f − f′ |
| reward_to_go | Σ_{s≥t} sg(f_s) · log q(x_t): each token's score times the KL still to come (Tang & Munos) | f |
| reward_partial | Σ_t sg(f_t) · log q(x_t): each token's score times its own f only (a partial form) | f |

f′ comes from autograd of the estimator function itself, so clamped variants differentiate as trainers'
code does. The last three differ from ``loss_is`` and ``reward`` only on a rollout's token rows (on one
draw, or on the sequence log-ratio, reward+loss is loss_is and the other two are reward), so they have
token rows only (:attr:`Mode.token_only`); :attr:`Mode.token` says how each mode spreads over a
sequence's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..foundation.errors import SpecError
from .estimators import Estimator, Poly, poly_derivative
from ..foundation.registry import Registry

Coefficient = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Mode:
    """One place a trainer puts an estimator f.

    ``coefficient(est)``: c(log r) [shape-preserving] with per-draw gradient c(log r)·∇θ log q(x).
    ``poly(est)``: c as a polynomial Σ a r^s (log r)^k (d/dL r^s = s r^s), or None where it is not one
    (the exact oracles of the Gaussian and the rollout sequence rows need it).
    ``trainer_loss(est, log_q_x, log_p_x)``: the per-draw objective as trainers write it (log_q_x depends
    on θ); autograd of it gives c(log r)·∇θ log q(x) (checks ``coefficient``; the plain baseline).
    ``applies(est)``: whether the estimator gets a row in this mode.
    ``score``: the gradient is the value times the whole score of the draw (score function): on rollout
    token rows (Σ_t f_t)·S, where the other modes give each token's own Σ_t c(log r_t) s_t.
    ``off_policy``: defined under a sampler b ≠ q (NeMo-RL's clamp order is defined on-policy only).
    ``weighted(est, logr, w)``: the coefficient under a weighted sampler's detached importance weight w = q/b
    where the mode takes w inside its own clamp (NeMo-RL's use_on_policy_kl_approximation: the output clamp
    sees w·f); None: the weight multiplies the coefficient, w·c(log r).
    """
    name: str
    label: str
    coefficient: Callable[[Estimator], Coefficient]
    poly: Callable[[Estimator], Poly | None]
    trainer_loss: Callable[[Estimator, torch.Tensor, torch.Tensor], torch.Tensor]
    applies: Callable[[Estimator], bool] = lambda est: True
    token: str = "local"
    token_only: bool = False
    off_policy: bool = True
    weighted: Callable[[Estimator, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self):
        if self.token not in TOKEN_FORMS:
            raise ValueError(f"mode '{self.name}': token must be one of {TOKEN_FORMS}, not '{self.token}'")

    @property
    def score(self) -> bool:
        """The mode's token rows multiply the sequence's score S by a value (score or score+local)."""
        return self.token in ("score", "score+local")


TOKEN_FORMS = ("local", "score", "to_go", "score+local")


MODES: Registry[Mode] = Registry("gradient mode")


def register_mode(mode: Mode, *, replace: bool = False) -> Mode:
    """Add a gradient mode (its rows appear wherever an estimator it applies to has gradient rows)."""
    return MODES.add(mode.name, mode, replace=replace)


# ----------------------------------------------------------------------------- the maths of the built-ins
def derivative(est: Estimator, what: str = "gradient") -> Coefficient:
    """f′(log r) by autograd of the estimator's own function (clamps differentiate as in trainers' code)."""
    def deriv(logr: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x = logr.detach().clone().requires_grad_(True)
            try:
                (g,) = torch.autograd.grad(est.fn(x).sum(), x)
            except RuntimeError as e:       # a plug-in written with non-differentiable operations
                raise SpecError(f"estimator '{est.name}' is not differentiable with autograd, which the "
                                f"{what} gradient mode needs: {str(e).splitlines()[0]}") from None
        return g
    return deriv


def _loss_poly(est: Estimator) -> Poly | None:
    return None if est.poly is None else {key: -v for key, v in poly_derivative(est.poly).items()}


def _loss_is_poly(est: Estimator) -> Poly | None:
    if est.poly is None:
        return None
    out = dict(est.poly)
    for key, v in poly_derivative(est.poly).items():
        out[key] = out.get(key, 0.0) - v
    return out


def _loss_is_coefficient(est: Estimator, what: str = "loss_is") -> Coefficient:
    d = derivative(est, what)
    return lambda logr: est.fn(logr) - d(logr)


def _is_weight(log_q_x: torch.Tensor) -> torch.Tensor:
    """q_θ/sg(q_θ): value 1, gradient ∇θ log q(x)."""
    return torch.exp(log_q_x - log_q_x.detach())


def _straight_through_loss(est: Estimator, log_q_x: torch.Tensor, log_p_x: torch.Tensor) -> torch.Tensor:
    logr = log_p_x - log_q_x              # the value of the estimator (k3), the gradient of k2
    k2 = 0.5 * logr**2
    return k2 + (est.fn(logr) - k2).detach()


def nemo_active(est: Estimator, logr: torch.Tensor) -> torch.Tensor:
    """Where neither of NeMo-RL's clamps fires (on-policy, w = 1): kl_bench.core.presets.WeightedClamp.active."""
    return est.weighted.active(logr)


def _nemo_coefficient(est: Estimator) -> Coefficient:
    # ∇(w·f(log r)) = w·(f − f′)·s where no clamp fires (∇w = w s, ∇ log r = −s, w = 1 on-policy); zero
    # where one fires, since NeMo-RL detaches the weight there and the clamped value is constant
    # (kl_bench.core.presets.WeightedClamp.coefficient, defined at log r = −∞ too).
    return est.weighted.coefficient


def _nemo_loss(est: Estimator, log_q_x: torch.Tensor, log_p_x: torch.Tensor) -> torch.Tensor:
    """NeMo-RL: clamp(w · f(clamp(log r))), w detached where a clamp fires."""
    logr = log_p_x - log_q_x
    wc = est.weighted
    w = _is_weight(log_q_x)
    w = torch.where(nemo_active(est, logr.detach()), w, w.detach())
    x = logr.clamp(-wc.logr_clamp, wc.logr_clamp) if wc.logr_clamp is not None else logr
    v = w * wc.base(x)
    return v.clamp(-wc.clamp, wc.clamp) if wc.clamp is not None else v


for _mode in (
    Mode("loss", "f in the loss, sample held fixed",
         coefficient=lambda est: (lambda logr, d=derivative(est, "loss"): -d(logr)),
         poly=_loss_poly, trainer_loss=lambda est, lq, lp: est.fn(lp - lq)),
    Mode("reward", "score function: sg(f)·log q",
         coefficient=lambda est: est.fn, poly=lambda est: None if est.poly is None else dict(est.poly),
         trainer_loss=lambda est, lq, lp: est.fn(lp - lq).detach() * lq, token="score"),
    Mode("loss_is", "f·q/sg(q) in the loss",
         coefficient=_loss_is_coefficient, poly=_loss_is_poly,
         trainer_loss=lambda est, lq, lp: est.fn(lp - lq) * _is_weight(lq)),
    Mode("straight_through", "value of f, gradient of k2",
         coefficient=lambda est: (lambda logr: -logr), poly=lambda est: {(0, 1): -1.0},
         trainer_loss=_straight_through_loss, applies=lambda est: est.straight_through),
    Mode("loss_is_nemo", "NeMo-RL's clamped f·q/sg(q)",
         coefficient=_nemo_coefficient, poly=lambda est: None, trainer_loss=_nemo_loss,
         applies=lambda est: est.weighted is not None, off_policy=False,
         weighted=lambda est, logr, w: est.weighted.coefficient(logr, w)),
    # One draw's form (coefficient, polynomial, trainer loss) is what a categorical or one sequence
    # log-ratio would get; the token form is what distinguishes these three (kl_bench.kinds.rollout).
    Mode("reward+loss", "f in the reward and in the loss",
         coefficient=_loss_is_coefficient, poly=_loss_is_poly,
         trainer_loss=lambda est, lq, lp: est.fn(lp - lq).detach() * lq + est.fn(lp - lq),
         token="score+local", token_only=True),
    Mode("reward_to_go", "score times the f still to come",
         coefficient=lambda est: est.fn, poly=lambda est: None if est.poly is None else dict(est.poly),
         trainer_loss=lambda est, lq, lp: est.fn(lp - lq).detach() * lq, token="to_go", token_only=True),
    Mode("reward_partial", "each token's score times its own f (partial)",
         coefficient=lambda est: est.fn, poly=lambda est: None if est.poly is None else dict(est.poly),
         trainer_loss=lambda est, lq, lp: est.fn(lp - lq).detach() * lq, token="local", token_only=True),
):
    register_mode(_mode)


# ----------------------------------------------------------------------------- lookups
def coefficient(est: Estimator, mode: str) -> Coefficient:
    """c(log r) such that the mode's per-draw gradient is c(log r) · ∇θ log q(x). Shape-preserving."""
    return MODES[mode].coefficient(est)


def trainer_loss(est: Estimator, mode: str, log_q_x: torch.Tensor, log_p_x: torch.Tensor) -> torch.Tensor:
    """The per-draw objective of a mode as trainers write it (log_q_x depends on θ): autograd of it
    gives c(log r)·∇θ log q(x). Used to check :func:`coefficient` and as the plain benchmark baseline."""
    return MODES[mode].trainer_loss(est, log_q_x, log_p_x)


def coefficient_poly(est: Estimator, mode: str) -> Poly | None:
    """c as a polynomial Σ a r^s (log r)^k, when the estimator is one (d/dL r^s = s r^s)."""
    return MODES[mode].poly(est)


def has_nonfinite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds an inf or NaN (one host sync); False on the meta device, which holds no values (the
    device-rule tests run the algebra there)."""
    return t.device.type != "meta" and not bool(torch.isfinite(t).all())


def q_times_coefficient(lq: torch.Tensor, log_r: torch.Tensor, poly: Poly) -> torch.Tensor:
    """q ⊙ c(log r) for a coefficient that is a polynomial Σ c_sk r^s (log r)^k (``poly``: {(s, k): c_sk}),
    as Σ c_sk exp(log q + s·log r)(log r)^k: finite where q ⊙ c is, though r = p/q overflows float64 once
    log q < log p − 709 (q·r = p: k3 in the loss pulls such a token back with weight p, where q ⊙ (r − 1)
    formed directly is 0·inf = NaN). lq, log_r: [B, V] → [B, V]."""
    out = torch.zeros_like(lq)
    for (s, k), c in poly.items():
        if c != 0:
            out = out + c * torch.exp(lq + s * log_r) * (log_r ** k if k else 1.0)
    return out


def modes_for(est: Estimator, token: bool = False) -> list[str]:
    """The modes an estimator gets (straight_through and loss_is_nemo only where the estimator declares
    them); ``token``: on a token aggregate (else the token-only modes are left out). None for an estimator of
    log q(x) too (``needs_logq``): a mode's coefficient is a function of log r alone."""
    if est.needs_logq:
        return []
    return [name for name, mode in MODES.items() if mode.applies(est) and (token or not mode.token_only)]


@dataclass(frozen=True)
class GradItem:
    """One gradient row: an estimator in a mode, on an aggregate of the pair ("" for single draws).
    ``coef`` maps log r [n] to the per-draw coefficient c(log r) of the score; ``cpoly`` is c as a
    polynomial Σ a r^s (log r)^k when it is one (else None); ``token``: the mode's form on token rows
    (:attr:`Mode.token`); ``weighted``: the mode's own way of taking an importance weight (:attr:`Mode.weighted`)."""
    est: Estimator
    mode: str
    aggregate: str
    coef: Callable[[torch.Tensor], torch.Tensor]
    cpoly: Poly | None
    token: str = "local"
    weighted: Callable[[Estimator, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @property
    def score(self) -> bool:
        return self.token in ("score", "score+local")

    @classmethod
    def of(cls, est: Estimator, mode: str, aggregate: str = "") -> "GradItem":
        m = MODES[mode]
        return cls(est, mode, aggregate, m.coefficient(est), m.poly(est), m.token, m.weighted)


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
