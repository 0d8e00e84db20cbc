"""Exact gradients of the rollout kind: θ = q's bucket logits [C, V]; ∇θ log q(x | c) = e_x − q(·|c), in row c.

A sequence's score is S = Σ_t s_t with s_t = e_{x_t} − q(·|c_{t−1}) in row c_{t−1}. Two aggregates:

- ``seq``: an estimator f of the sequence log-ratio L = Σ_t log r_t. Every mode's per-draw gradient is
  c(L) · S, with c from :func:`kl_bench.core.modes.coefficient` (log q_θ of the sequence plays the part
  of log q_θ(x); loss_is multiplies by the sequence ratio q_θ/sg(q_θ)).
- ``tok``: Σ_t f(log r_t), as trainers' per-token code. How a mode spreads over the tokens is its token
  form (:data:`TOKEN_FORMS`): ``score`` gives (Σ_t f(log r_t)) · S (the sequence score function);
  ``local`` (loss, loss_is, straight_through) gives Σ_t c(log r_t) s_t: each token's gradient with the
  path held fixed, which leaves out how θ moves the distribution of the later buckets (so on T > 1 they
  are `other` even where the categorical case is exact); ``to_go`` and ``score+local`` as in kl_bench.core.modes.

Exact values (all float64), through the one phased program (kl_bench.kinds.rollout.dp):

- References: autograd through the program. KL(q‖p) = −E_q[L] with both q and L functions of θ;
  KL(p‖q) = E_p[L_p − L_q(θ)].
- Expected gradients: S = Σ_t e_{x_t} − q(·|c_{t−1}) is linear in the step counts N(c, x), so
  E[F·S] follows from E[F·N], and E[F·N] = ∂/∂η E[F e^{Σ_t η(c_{t−1}, x_t)}] at η = 0: autograd of the
  (phased) program with respect to a per-step log-weight, for F = W R^s L^k (seq rows with a
  polynomial c), F = Σ_t f_t (tok score rows) and F = W (tok local rows, whose c_t multiplies the counts).
  Rows whose per-step weights are not products over steps (reward-to-go, a factor of the final length)
  take the forward–backward program of :func:`kl_bench.core.rollout_dp.step_expectations`. The same programs
  run under a sampler b (EOS suppression, temperature, a stale policy), with token or sequence weights W.

Not exact: second moments. |S|² couples the steps drawn from the same bucket, so its expectation would
need a dynamic program over C·V marked states; on rollouts the per-draw variance (trace_cov) and the
batch size for cos ≥ 0.9 use measured variances (exact expected gradient, measured spread,
kl_bench.kinds.rollout.accumulator).

Tensors are made on the model's device; vectors reach the host (numpy, flattened θ [C·V]) at the end.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ...core import rollout_dp
from ...core.aggregates import AGGREGATES
from ...foundation.errors import SpecError
from ...core.modes import MODES, GradItem, has_nonfinite, q_times_coefficient
from . import dp
from .model import RolloutModel


def host_vector(t: torch.Tensor) -> np.ndarray:
    """A gradient [C, V] as the flattened float64 vector [C·V] the kind's gradient rows hold."""
    return t.detach().reshape(-1).cpu().numpy()


def check(model: RolloutModel, case: str) -> None:
    """Refuse (SpecError, one line) gradient rows the case's options do not define: geometric sequence
    weights (W^{1/|y|} is not a product over the path) and rounded log-probs."""
    if not model.weighting.gradients:
        raise SpecError(f"gradient rows are not available with {model.weighting.name} sequence weights: set "
                        "gradients = false", key="sampler.weights", case=case)
    if model.precision is not None:
        raise SpecError("gradient rows are not available with rounded log-probs on rollouts: set gradients = "
                        "false or drop precision", key="precision", case=case)


def excludes(model: RolloutModel, mode: str, aggregate: str) -> bool:
    """Whether a (mode, aggregate) gets no gradient row: under the PPO clip, a token's branch depends on its
    own ratio and cost only in the forms whose terms are each token's own (:attr:`TokenForm.clippable`); a
    score-function row's cost is the whole sequence's (and a seq row has no per-token ratio): those rows are
    left out rather than given a form no trainer computes (docs/weights.md)."""
    clip = model.clip
    return clip is not None and clip.clips(mode) and (
        not AGGREGATES[aggregate].token or not TOKEN_FORMS[MODES[mode].token].clippable)


# ----------------------------------------------------------------------------- references and targets
def reference(model: RolloutModel) -> tuple[np.ndarray, np.ndarray]:
    """(∇θ KL(q‖p), ∇θ KL(p‖q)) flattened [C·V], by autograd through the dynamic program."""
    ones = torch.ones_like(model.log_q)
    theta = model.log_q.clone().requires_grad_(True)
    lq = torch.log_softmax(theta, -1)
    rev = -dp.path_moments(model, theta, ones, model.log_p - lq, 1)[1]
    (g_rev,) = torch.autograd.grad(rev, theta)
    theta = model.log_q.clone().requires_grad_(True)
    fwd = dp.path_moments(model, model.log_p, ones, model.log_p - torch.log_softmax(theta, -1), 1)[1]
    (g_fwd,) = torch.autograd.grad(fwd, theta)
    return host_vector(g_rev), host_vector(g_fwd)


def ukl(model: RolloutModel) -> np.ndarray | None:
    """∇θ UKL(q_S‖p) flattened [C·V]: the unnormalised KL Σ_{y∈S} q(y)(log q(y)/p(y) − 1) + p(y) over S,
    the sequences the sampler can draw (every step's token in b's support at that step), by autograd
    through the dynamic program with the mask 1[b > 0] as the multiplicative weight m of each phase and
    h = log q − log p. q_S is q restricted to S without renormalising (sub-stochastic per step), so its
    mass depends on θ; that is the difference from ∇KL(q‖p), which it equals when S holds all of q's
    mass. None where it is not finite (p = 0 inside S)."""
    theta = model.log_q.clone().requires_grad_(True)
    q, lq = torch.softmax(theta, -1), torch.log_softmax(theta, -1)
    tables = []
    for lb, steps in model.phases:
        inside = (lb > -torch.inf) & (model.log_q > -torch.inf)
        h = torch.where(inside, lq - model.log_p, torch.zeros_like(lq))   # never 0·inf outside S
        tables.append((q, inside.to(torch.float64), h, steps))
    mom = rollout_dp.propagate_tensor(dp.matrices(model, tables, 1))
    # Σ_S q(log q/p) − Σ_S q (+ Σ_S p, constant in θ)
    (g,) = torch.autograd.grad(mom[1] - mom[0], theta)
    out = host_vector(g)
    return out if np.isfinite(out).all() else None


# A row's value v as a function of θ (the ``self`` target): (model, θ, log r(θ) [C, V], item) → E_q[v], or None.
SelfValue = Callable[[RolloutModel, torch.Tensor, torch.Tensor, GradItem], "torch.Tensor | None"]


def sequence_value(model: RolloutModel, theta: torch.Tensor, g: torch.Tensor, item: GradItem) -> torch.Tensor | None:
    """E_q[f(L)] for a polynomial f = Σ a R^s L^k (None otherwise)."""
    if item.est.poly is None:
        return None
    return sum(a * dp.path_moments(model, theta, torch.exp(s * g), g, k)[k] for (s, k), a in item.est.poly.items())


def token_sum_value(model: RolloutModel, theta: torch.Tensor, g: torch.Tensor, item: GradItem) -> torch.Tensor:
    """E_q[Σ_t f_t]; for ``full``, f_t = KL(q_θ(·|c_{t−1}) ‖ p(·|c_{t−1})), θ in the law and in each step's KL."""
    if item.est.analytic:
        lq = torch.log_softmax(theta, -1)
        kl = (lq.exp() * (lq - model.log_p)).sum(-1, keepdim=True).expand_as(g)
        return dp.path_moments(model, theta, torch.ones_like(g), kl, 1)[1]
    return dp.path_moments(model, theta, torch.ones_like(g), item.est.fn(g), 1)[1]


def token_mean_value(model: RolloutModel, theta: torch.Tensor, g: torch.Tensor, item: GradItem) -> torch.Tensor:
    """E_q[Σ_t f_t / |y|], the program split on the final length."""
    by_len = dp.path_by_length(model, theta, torch.ones_like(g), item.est.fn(g), 1)[:, 1]
    return (by_len / torch.arange(1, model.length + 1, dtype=torch.float64, device=g.device)).sum()


def self_gradient(model: RolloutModel, item: GradItem, value: SelfValue | None) -> np.ndarray | None:
    """∇θ E_q[v] flattened [C·V] for the row's value v (the ``self`` target), by autograd through the
    dynamic program with θ both in the sampling law and in log r; ``value``: the aggregate's (None, or
    None from it: no exact value)."""
    theta = model.log_q.clone().requires_grad_(True)
    v = None if value is None else value(model, theta, model.log_p - torch.log_softmax(theta, -1), item)
    if v is None:
        return None
    (grad,) = torch.autograd.grad(v, theta)
    return host_vector(grad)


# ----------------------------------------------------------------------------- expected per-draw gradients
def count_moment(model: RolloutModel, m_fn: dp.TableFn, h_fn: dp.TableFn, coefs: list[float],
                 phase: int | None = None) -> torch.Tensor:
    """Σ_k a_k E_b[M S^k N(c, x)] for every (c, x) at once, [C, V]: N(c, x) counts the steps that drew
    x from bucket c, and E_b[M S^k N] = ∂/∂η E_b[M e^{Σ_t η(c_{t−1}, x_t)} S^k] at η = 0, i.e. autograd
    of the (phased) dynamic program with respect to a per-step log-weight. b is the case's sampler (q
    when it has none); ``m_fn``/``h_fn`` map a phase's log b to the per-step tables of M and S.
    ``phase``: count only the steps of that sampler phase."""
    eta = torch.zeros_like(model.log_q, requires_grad=True)
    mom = rollout_dp.propagate_tensor(dp.phase_matrices(model, m_fn, h_fn, len(coefs) - 1, eta=eta, phase=phase))
    total = sum(a * mom[k] for k, a in enumerate(coefs) if a != 0)
    if not isinstance(total, torch.Tensor) or not total.requires_grad:
        return torch.zeros_like(model.log_q)
    (g,) = torch.autograd.grad(total, eta)
    return g


def score_part(model: RolloutModel, counts: torch.Tensor) -> torch.Tensor:
    """E[F · S] [C, V] from E[F · N]: S = Σ_t e_{x_t} − q(·|c_{t−1}), so row c is E[F N_c] − (Σ_x E[F N_c(x)]) q_c."""
    return counts - counts.sum(-1, keepdim=True) * model.log_q.exp()


def expected_counts(model: RolloutModel, item: GradItem, gamma: torch.Tensor | None = None) -> torch.Tensor | None:
    """E_b[F·N] [C, V] of one row (N the step counts): by the program with η for sequence rows and for token
    rows whose weights are products over steps, by the forward–backward program for the others. ``gamma``
    [T]: the aggregate's factor of the final length (None: 1). None where no exact value exists."""
    agg = AGGREGATES[item.aggregate]
    if not agg.token:
        return _sequence_counts(model, item)
    if agg.length and gamma is None:
        raise ValueError(f"the '{item.aggregate}' rows' gradients need their factor of the final length (gamma)")
    form = TOKEN_FORMS[item.token]
    if gamma is None and form.product is not None:
        return form.product(model, item)
    return form.steps(_Steps(model, gamma), model, item, None if item.est.analytic else item.est.fn(model.logr_table))


def exact_mean(model: RolloutModel, item: GradItem, gamma: torch.Tensor | None = None) -> np.ndarray | None:
    """E_b[per-draw gradient] of one row, flattened [C·V], b the case's sampler (q when none), with its
    importance weights; None where no exact value exists (a non-polynomial estimator of the sequence
    log-ratio, moments beyond float64, a rejection by a sum or mean over the tokens). ``gamma``: as in
    :func:`expected_counts`."""
    if not model.exact_under_rejection:
        return None                      # a rejection by a sum or mean over the tokens: Monte Carlo only
    counts = expected_counts(model, item, gamma)
    if counts is None:
        return None
    out = host_vector(score_part(model, counts))
    return out if np.isfinite(out).all() else None      # E[R^s …] beyond float64: no exact value


def _sequence_counts(model: RolloutModel, item: GradItem) -> torch.Tensor | None:
    """E[W c(L) N] for a sequence row whose coefficient is a polynomial Σ a R^s L^k (else None)."""
    poly = item.cpoly
    if poly is None:
        return None
    g = model.logr_table
    by_s: dict[int, list[float]] = {}
    for (s, k), a in poly.items():
        coefs = by_s.setdefault(s, [])
        coefs.extend([0.0] * (k + 1 - len(coefs)))
        coefs[k] += a
    return sum(count_moment(model, lambda lb, s=s: model.sequence_weight(lb) * torch.exp(s * g), lambda lb: g, coefs)
               for s, coefs in by_s.items())


def _ones(lb: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(lb)


def _score_counts(model: RolloutModel, item: GradItem) -> torch.Tensor:
    """E[F·N] for a score-function token row, F = Σ_t f_t: token weights inside the sum, sequence weights
    outside."""
    f = item.est.fn(model.logr_table)
    if model.weighting.per_token:
        return count_moment(model, _ones, lambda lb: model.token_weight(lb) * f, [0.0, 1.0])
    return count_moment(model, model.sequence_weight, lambda lb: f, [0.0, 1.0])


def local_tables(model: RolloutModel, item: GradItem) -> list[torch.Tensor]:
    """Per sampler phase, the per-step coefficient [C, V] of a local token row Σ_t a_t s_t: c(log r)
    times the token weight w = q/b (weights = "token", zero where b never draws), or the PPO surrogate's
    coefficient where the case clips (kl_bench.core.weights.WeightCorrection.coefficient: ρ·c on the free
    branch, the clipped branch's own gradient elsewhere, from the raw ratio ρ = q/b); c alone otherwise."""
    c_tab = item.coef(model.logr_table)
    if not model.weighting.per_token:
        return [c_tab for _ in model.phases]
    out = []
    for lb, _ in model.phases:
        drawn = lb.exp() > 0
        if model.clip is not None and model.clip.clips(item.mode):
            rho = torch.exp(model.log_q - lb)
            t = model.clip.coefficient(item.est, item.mode, model.logr_table.reshape(-1), rho.reshape(-1))
            t = t.reshape(lb.shape)
        else:
            t = model.token_weight(lb) * c_tab
        out.append(torch.where(drawn, t, torch.zeros_like(t)))
    return out


def _local_counts(model: RolloutModel, item: GradItem) -> torch.Tensor:
    """Σ_phases E[N_phase]·a_phase for Σ_t a_t s_t: linear in the counts N (token weights and the clip
    depend on the phase's b: each phase's steps are counted apart)."""
    tables = local_tables(model, item)
    if model.weighting.per_token:
        return sum(count_moment(model, _ones, _ones, [1.0], phase=i) * t for i, t in enumerate(tables))
    counts = count_moment(model, model.sequence_weight, _ones, [1.0])
    out = counts * tables[0]
    if not model.has_sampler and item.cpoly is not None and has_nonfinite(out):
        # c(log r) is inf where log q falls 709 below log p (r beyond float64) and E[N] there is ~0: 0·inf.
        # On-policy E[N(c, x)] = E[visits to c]·q(x|c), so E[N]·c = visits(c)·(q ⊙ c), the latter from c's
        # polynomial in log space (k3 in the loss: q − p, bounded; a trajectory had been called diverged).
        visits = counts.sum(-1, keepdim=True)
        exact = visits * q_times_coefficient(model.log_q, model.logr_table, item.cpoly)
        out = torch.where(torch.isfinite(out), out, exact)
    return out


@dataclass(frozen=True)
class _Steps:
    """The forward–backward program (kl_bench.core.rollout_dp.step_expectations) of one model and length factor."""
    model: RolloutModel
    gamma: torch.Tensor | None

    def tables(self, f: torch.Tensor, u: list[torch.Tensor] | None = None) -> list[rollout_dp.StepTables]:
        """Per step t = 1..T the tables under the sampler: sequence weights multiply (m), token weights weigh
        each step's own count (u). ``u``: per phase, the step weights to use instead (a local row's
        :func:`local_tables`)."""
        model, out = self.model, []
        for i, (lb, steps) in enumerate(model.phases):
            b = lb.exp()
            w = torch.where(b > 0, model.token_weight(lb), torch.zeros_like(b)) if model.weighting.weighted \
                else torch.ones_like(b)
            ones = torch.ones_like(b)
            keep = torch.where(b > 0, model.keep_table(lb), torch.zeros_like(b))      # the rejection mask's factor
            st = rollout_dp.StepTables(b, (w if model.weighting.on_sums else ones) * keep, f,
                                       u[i] if u is not None else w if model.weighting.per_token else ones)
            out.extend([st] * steps)
        return out

    def run(self, part: str, f: torch.Tensor, u: list[torch.Tensor] | None = None) -> torch.Tensor:
        """E[Σ_t u_t N_t · M · γ(|y|) · F_t] [C, V] with F_t of kl_bench.core.rollout_dp.SUMS[``part``]."""
        return rollout_dp.step_expectations(self.tables(f, u), self.model.bucket, self.model.eos, part, self.gamma)

    def score(self, f: torch.Tensor) -> torch.Tensor:
        """E[γ(|y|) · (Σ_t w_t f_t) · N] [C, V]: a score row's sum carries the token weights inside the sum,
        not on the step (the ``score`` form's convention: (Σ_t w_t f_t)·S)."""
        steps = self.tables(f)
        if self.model.weighting.per_token:
            steps = [rollout_dp.StepTables(st.b, st.m, st.u * f, torch.ones_like(st.b)) for st in steps]
        return rollout_dp.step_expectations(steps, self.model.bucket, self.model.eos, "all", self.gamma)


# ----------------------------------------------------------------------------- the Rao–Blackwellised gradient
RAO_BLACKWELL = "rao_blackwell"     # the gradient rows' mode name of the `full` row (not a registered mode)


def _no_coefficient(logr: torch.Tensor) -> torch.Tensor:
    raise TypeError("the Rao–Blackwellised row has no coefficient c(log r): its gradient is not c·∇log q")


def rao_blackwell_item() -> GradItem:
    """The gradient row of ``full`` on tok (Amini, Vieira & Cotterell, arXiv 2504.10637): per path
    Σ_t ∇θ KL(c_{t−1}) + Σ_t s_t Σ_{t'>t} KL(c_{t'−1}), the exact per-step KL differentiated where it stands and
    its future values as the reward of each step's score, all times the sequence weight W = Π_t q/b under a
    sampler b. Its expectation is ∇KL(q‖p) (:func:`rao_blackwell_applies`)."""
    from ...core.estimators import FULL
    return GradItem(FULL, RAO_BLACKWELL, "tok", _no_coefficient, None, "rb")


def rao_blackwell_applies(model: RolloutModel) -> bool:
    """The row is defined on-policy, and under a sampler whose sequences carry the plain weight W = Π_t q/b
    (``weights = "sequence"``) and that draws every token q may draw: then E_b[W·N(c, x)] = E_q[N(c, x)] =
    visits_c·q(x|c), which both the direct part and its exact value rest on. A cap, floor or mask of q/b, a
    rejection mask, token or geometric weights, no weights at all, or a sampler that never draws some of q's
    tokens (top-k, top-p, EOS held back by min_length) break that identity (the row would not estimate
    ∇KL(q‖p)): no row there."""
    if not model.has_sampler:
        return True
    w = model.weighting                 # W = Π_t q/b on every term: the sequence weighting's flags
    return (w.weighted and w.on_sums and not w.geometric and model.weight_cap is None and model.correction is None
            and model.rejection is None and model.support_miss == 0)


def rb_direct(model: RolloutModel) -> torch.Tensor:
    """∇θ_c KL(q(·|c) ‖ p(·|c)) in row c: q ⊙ (log(q/p) − KL(c)), [C, V] (0 where q = 0). It is also
    E_{x~q(·|c)}[k1(x)·s(x)]: the conditional mean of k1's score term, which is why the row has less variance."""
    q = model.log_q.exp()
    k1 = torch.where(q > 0, model.log_q - model.log_p, torch.zeros_like(q))
    return q * (k1 - model.kl_ctx[:, None])


def _rb_counts(model: RolloutModel, item: GradItem) -> torch.Tensor:
    """E_b[W·F·N]-counts of the Rao–Blackwellised row (score_part of them is its expected gradient): the direct
    part as a local row with coefficient k1 (score_part(E_b[W·N]·k1) = Σ_c visits_c·∇KL(c), since E_b[W·N(c, x)]
    = visits_c·q(x|c) where the row applies), and the future per-step KLs as each step's reward: to-go minus the
    step's own (the program carries W)."""
    q = model.log_q.exp()
    k1 = torch.where(q > 0, model.log_q - model.log_p, torch.zeros_like(q))
    kl = model.kl_ctx[:, None].expand_as(q)
    program = _Steps(model, None)
    direct = count_moment(model, model.sequence_weight, _ones, [1.0]) * k1
    return direct + program.run("to_go", kl) - program.run("one", kl)


def _rb_steps(program: "_Steps", model: RolloutModel, item: GradItem, f: torch.Tensor) -> torch.Tensor:
    raise ValueError("the Rao–Blackwellised row is on the tok aggregate only")


@dataclass(frozen=True)
class TokenForm:
    """How a token form (kl_bench.core.modes.TOKEN_FORMS) makes a rollout row's per-draw gradient Σ_t a_t s_t,
    exactly and per path:

    ``product(model, item)``: E[F·N] by the program with η, where the weights are products over steps (the
    ``tok`` aggregate; None: no such form); ``steps(program, model, item, f)``: E[γ(|y|)·F·N] by the
    forward–backward program, f = the estimator's table [C, V]; ``local(item, g_flat)``: the per-(bucket,
    token) coefficient [C·V] a step adds times its token weight (None: none); ``path(item, logr_t, alive,
    tok_w)``: the per-step weights [n, T] from the path's own f's (None: none); ``clippable``: the PPO clip
    is defined on the form (each token's term depends on its own ratio and cost alone)."""
    name: str
    steps: Callable[[_Steps, RolloutModel, GradItem, torch.Tensor], torch.Tensor]
    product: Callable[[RolloutModel, GradItem], torch.Tensor] | None = None
    local: Callable[[GradItem, torch.Tensor], torch.Tensor] | None = None
    path: Callable[[GradItem, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    clippable: bool = False
    dense: bool = False     # the Rao–Blackwellised row: a dense term per visited context besides Σ_t a_t s_t

    @property
    def per_step(self) -> bool:
        """Each step's weight is a function of its (bucket, token) alone (times its token weight): totals
        follow from the step counts."""
        return self.path is None and not self.dense


def _score_path(item: GradItem, logr_t: torch.Tensor, alive: torch.Tensor, tok_w: torch.Tensor) -> torch.Tensor:
    """(Σ_s w_s f_s) on every step of the path."""
    return (item.est.fn(logr_t) * tok_w).sum(1, keepdim=True) * alive


def _to_go_path(item: GradItem, logr_t: torch.Tensor, alive: torch.Tensor, tok_w: torch.Tensor) -> torch.Tensor:
    """w_t Σ_{s≥t} f_s: the sum still to come, a reversed cumulative sum per path."""
    f = item.est.fn(logr_t) * alive
    return f.flip(1).cumsum(1).flip(1) * tok_w


TOKEN_FORMS: dict[str, TokenForm] = {form.name: form for form in (
    TokenForm("local", steps=lambda p, model, item, f: p.run("one", f, local_tables(model, item)),
              product=_local_counts, local=lambda item, g: item.coef(g), clippable=True),
    TokenForm("score", steps=lambda p, model, item, f: p.score(f), product=_score_counts, path=_score_path),
    TokenForm("to_go", steps=lambda p, model, item, f: p.run("to_go", f), path=_to_go_path),
    TokenForm("score+local",
              steps=lambda p, model, item, f: p.score(f) + p.run("one", f) * (item.coef(model.logr_table) - f),
              local=lambda item, g: item.coef(g) - item.est.fn(g), path=_score_path),
    TokenForm("rb", steps=_rb_steps, product=_rb_counts, dense=True),
)}
