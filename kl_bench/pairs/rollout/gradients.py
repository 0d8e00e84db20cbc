"""Gradient oracles of the rollout kind: θ = q's bucket logits [C, V]; ∇θ log q(x | c) = e_x − q(·|c), in row c.

A sequence's score is S = Σ_t s_t with s_t = e_{x_t} − q(·|c_{t−1}) in row c_{t−1}. Two aggregates:

- ``seq``: an estimator f of the sequence log-ratio L = Σ_t log r_t. Every mode's per-draw gradient is
  c(L) · S, with c from :func:`kl_bench.modes.coefficient` (log q_θ of the sequence plays the part
  of log q_θ(x); loss_is multiplies by the sequence ratio q_θ/sg(q_θ)).
- ``tok``: Σ_t f(log r_t), as trainers' per-token code. ``reward`` gives (Σ_t f(log r_t)) · S (the
  sequence score function). ``loss``, ``loss_is`` (per-token ratio q_θ(x_t)/sg(q_θ(x_t))) and
  ``straight_through`` give Σ_t c(log r_t) s_t: each token's gradient with the path held fixed, which
  leaves out how θ moves the distribution of the later buckets (so on T > 1 they are `other` even where
  the categorical case is exact).

Exact values (all float64):

- References: autograd through the dynamic program (:mod:`kl_bench.rollout_dp`). KL(q‖p) = −E_q[L]
  with both q and L functions of θ; KL(p‖q) = E_p[L_p − L_q(θ)].
- Expected gradients: S = Σ_t e_{x_t} − q(·|c_{t−1}) is linear in the step counts N(c, x), so
  E[F·S] follows from E[F·N], and E[F·N] = ∂/∂η E[F e^{Σ_t η(c_{t−1}, x_t)}] at η = 0: autograd of the
  (phased) dynamic program with respect to a per-step log-weight, for F = W R^s L^k (seq rows with a
  polynomial c), F = Σ_t f_t (tok reward) and F = W (tok local rows, whose c_t multiplies the counts).
  The same program runs under a sampler b (EOS suppression, temperature, a stale policy), with token
  or sequence importance weights W.

Not exact: second moments. |S|² couples the steps drawn from the same bucket, so its expectation would
need a dynamic program over C·V marked states; on rollouts the per-draw variance (trace_cov) and the
batch size for cos ≥ 0.9 use measured variances (exact expected gradient, measured spread).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from ... import rollout_dp
from ...seeding import BatchStream
from ...draws import AGGREGATES, groups_in
from ...errors import SpecError
from ..base import GradBatch, GradientAccumulator, GradItem


class RolloutTables(Protocol):
    """What the gradient oracles read of a rollout pair (kl_bench.pairs.rollout.pair implements it; this
    module does not import it): q's and p's bucket tables, the bucket map, the sampling phases, weights."""
    log_q: torch.Tensor            # [C, V] log q(x | bucket c)
    log_p: torch.Tensor            # [C, V]
    logr_table: torch.Tensor       # [C, V] log r(c, x) (rounded where the case sets a precision)
    bucket: torch.Tensor           # bucket map of rollout_dp
    buckets: int                   # C
    vocab: int                     # V
    eos: int | None                # the end-of-sequence token (None: every path has length T)
    length: int                    # T, the maximal length
    phases: list                   # [(log b [C, V], steps)]: the sampler's phases
    weights: str                   # importance weights: "none", "token" or "sequence"
    token_mean_batch: int | None   # B of the tok_batch rows (None: none)
    clip: object | None            # the PPO clip (a kl_bench.weights.WeightCorrection), or None
    rejection: object | None       # a sequence rejection mask (a kl_bench.rejection.Rejection), or None
    exact_under_rejection: bool    # False: the mask does not factorise over tokens (no exact gradients)

    def token_weight(self, lb: torch.Tensor) -> torch.Tensor: ...

    def batch_length_factor(self) -> torch.Tensor: ...

    def b_moments(self, m_fn, h_fn, kmax: int) -> list[float]: ...

    def keep_table(self, lb: torch.Tensor) -> torch.Tensor: ...

    def piece_draws(self, device: torch.device) -> int: ...

    def simulate(self, sizes: list[int], gens: list[torch.Generator], device: torch.device,
                 tok_rows: list = (), record: list | None = None): ...


# ----------------------------------------------------------------------------- exact
def _moments(pair: RolloutTables, log_sample: torch.Tensor, m: torch.Tensor, h: torch.Tensor, kmax: int) -> torch.Tensor:
    """E_{sample}[M S^k], k = 0..kmax, as a differentiable tensor (sampling from softmax(log_sample))."""
    a, e = rollout_dp.moment_matrices(torch.softmax(log_sample, -1), m, h, pair.bucket, pair.buckets, pair.eos, kmax)
    return rollout_dp.propagate_tensor([(a, e, pair.length)])


def path_moments(pair: RolloutTables, log_sample: torch.Tensor, m: torch.Tensor, h: torch.Tensor,
                 kmax: int = 1) -> torch.Tensor:
    """E[M S^k], k = 0..kmax, for paths drawn from softmax(``log_sample``) [C, V] with the pair's buckets,
    length and EOS (M = Π_t m, S = Σ_t h; m, h: [C, V]): a tensor [kmax + 1], differentiable with
    respect to ``log_sample``, m and h (kl_bench.training differentiates J(θ) through it)."""
    return _moments(pair, log_sample, m, h, kmax)


def reference(pair: RolloutTables) -> tuple[np.ndarray, np.ndarray]:
    """(∇θ KL(q‖p), ∇θ KL(p‖q)) flattened [C·V], by autograd through the dynamic program."""
    ones = torch.ones_like(pair.log_q)
    theta = pair.log_q.clone().requires_grad_(True)
    lq = torch.log_softmax(theta, -1)
    rev = -_moments(pair, theta, ones, pair.log_p - lq, 1)[1]
    (g_rev,) = torch.autograd.grad(rev, theta)
    theta = pair.log_q.clone().requires_grad_(True)
    fwd = _moments(pair, pair.log_p, ones, pair.log_p - torch.log_softmax(theta, -1), 1)[1]
    (g_fwd,) = torch.autograd.grad(fwd, theta)
    return g_rev.reshape(-1).numpy(), g_fwd.reshape(-1).numpy()


def ukl(pair: RolloutTables) -> np.ndarray | None:
    """∇θ UKL(q_S‖p) flattened [C·V]: the unnormalised KL Σ_{y∈S} q(y)(log q(y)/p(y) − 1) + p(y) over S,
    the sequences the sampler can draw (every step's token in b's support at that step), by autograd
    through the dynamic program with the mask 1[b > 0] as the multiplicative weight m of each phase and
    h = log q − log p. q_S is q restricted to S without renormalising (sub-stochastic per step), so its
    mass depends on θ; that is the difference from ∇KL(q‖p), which it equals when S holds all of q's
    mass. None where it is not finite (p = 0 inside S)."""
    theta = pair.log_q.clone().requires_grad_(True)
    q, lq = torch.softmax(theta, -1), torch.log_softmax(theta, -1)
    phases = []
    for lb, steps in pair.phases:
        inside = (lb > -torch.inf) & (pair.log_q > -torch.inf)
        m = inside.to(torch.float64)
        h = torch.where(inside, lq - pair.log_p, torch.zeros_like(lq))   # never 0·inf outside S
        a, e = rollout_dp.moment_matrices(q, m, h, pair.bucket, pair.buckets, pair.eos, 1)
        phases.append((a, e, steps))
    mom = rollout_dp.propagate_tensor(phases)
    # Σ_S q(log q/p) − Σ_S q (+ Σ_S p, constant in θ)
    (g,) = torch.autograd.grad(mom[1] - mom[0], theta)
    out = g.reshape(-1).numpy()
    return out if np.isfinite(out).all() else None


def self_gradient(pair: RolloutTables, item: GradItem) -> np.ndarray | None:
    """∇θ E_q[v] flattened [C·V] for the row's value v (the ``self`` target), by autograd through the
    dynamic program with θ both in the sampling law and in log r: v = Σ_t f_t (``tok``), Σ_t f_t/|y|
    (``tok_mean``, split on the final length) or f(L) for a polynomial f (``seq``; else None)."""
    theta = pair.log_q.clone().requires_grad_(True)
    g = pair.log_p - torch.log_softmax(theta, -1)
    ones = torch.ones_like(g)
    if item.aggregate == "tok":
        value = _moments(pair, theta, ones, item.est.fn(g), 1)[1]
    elif item.aggregate == "tok_mean":
        a, e = rollout_dp.moment_matrices(torch.softmax(theta, -1), ones, item.est.fn(g), pair.bucket,
                                          pair.buckets, pair.eos, 1)
        by_len = rollout_dp.propagate_by_length([(a, e, pair.length)])[:, 1]
        value = (by_len / torch.arange(1, pair.length + 1, dtype=torch.float64)).sum()
    elif item.est.poly is not None:
        value = sum(a * _moments(pair, theta, torch.exp(s * g), g, k)[k] for (s, k), a in item.est.poly.items())
    else:
        return None
    (grad,) = torch.autograd.grad(value, theta)
    return grad.reshape(-1).numpy()


def _count_moment(pair: RolloutTables, m_fn, h_fn, coefs: list[float], phase: int | None = None) -> torch.Tensor:
    """Σ_k a_k E_b[M S^k N(c, x)] for every (c, x) at once, [C, V]: N(c, x) counts the steps that drew
    x from bucket c, and E_b[M S^k N] = ∂/∂η E_b[M e^{Σ_t η(c_{t−1}, x_t)} S^k] at η = 0, i.e. autograd
    of the (phased) dynamic program with respect to a per-step log-weight. b is the case's sampler (q
    when it has none); ``m_fn``/``h_fn`` map a phase's log b to the per-step tables of M and S.
    ``phase``: count only the steps of that sampler phase."""
    eta = torch.zeros_like(pair.log_q, requires_grad=True)
    phases = []
    for i, (lb, steps) in enumerate(pair.phases):
        b = lb.exp()
        # Where b never draws, weights are irrelevant (and may be inf): zero them, never 0·inf. The
        # rejection mask's per-token factor multiplies M (paths through a rejected token count 0).
        m = torch.where(b > 0, m_fn(lb) * pair.keep_table(lb), torch.zeros_like(b))
        if phase is None or phase == i:
            m = m * torch.exp(eta)
        h = torch.where(b > 0, h_fn(lb), torch.zeros_like(b))
        a, e = rollout_dp.moment_matrices(b, m, h, pair.bucket, pair.buckets, pair.eos, len(coefs) - 1)
        phases.append((a, e, steps))
    mom = rollout_dp.propagate_tensor(phases)
    total = sum(a * mom[k] for k, a in enumerate(coefs) if a != 0)
    if not isinstance(total, torch.Tensor) or not total.requires_grad:
        return torch.zeros_like(pair.log_q)
    (g,) = torch.autograd.grad(total, eta)
    return g


def _score_part(pair: RolloutTables, counts: torch.Tensor) -> np.ndarray:
    """E[F · S] from E[F · N]: S = Σ_t e_{x_t} − q(·|c_{t−1}), so row c is E[F N_c] − (Σ_x E[F N_c(x)]) q_c."""
    q = pair.log_q.exp()
    return (counts - counts.sum(-1, keepdim=True) * q).reshape(-1).numpy()


def exact_mean(pair: RolloutTables, item: GradItem) -> np.ndarray | None:
    """E_b[per-draw gradient] of one row, flattened [C·V], b the case's sampler (q when none), with its
    importance weights; None where no exact value exists (a non-polynomial estimator of the sequence
    log-ratio, or moments beyond float64)."""
    agg = AGGREGATES[item.aggregate]
    if not pair.exact_under_rejection:
        return None                      # a rejection by a sum or mean over the tokens: Monte Carlo only
    if not agg.token:
        counts = _sequence_counts(pair, item)
    elif item.aggregate == "tok" and item.token in ("local", "score"):
        counts = _score_counts(pair, item) if item.score else _local_counts(pair, item)
    else:
        counts = _step_counts(pair, item, _length_factor(pair, item.aggregate))
    if counts is None:
        return None
    out = _score_part(pair, counts)
    return out if np.isfinite(out).all() else None      # E[R^s …] beyond float64: no exact value


def _length_factor(pair: RolloutTables, aggregate: str) -> torch.Tensor | None:
    """γ(ℓ) [T], the factor of the final length |y| = ℓ that an aggregate puts on a sequence's terms:
    None (1) for ``tok``, 1/ℓ for ``tok_mean``, B·E[1/(ℓ + L′)] for ``tok_batch`` (L′ the other B − 1
    lengths of the group, under the sampler: :func:`kl_bench.rollout_dp.inverse_total_length`)."""
    if aggregate == "tok":
        return None
    if aggregate == "tok_mean":
        return 1.0 / torch.arange(1, pair.length + 1, dtype=torch.float64)
    if aggregate == "tok_batch":
        return pair.batch_length_factor()
    raise ValueError(f"no gradient rows on aggregate '{aggregate}'")


def _step_tables(pair: RolloutTables, f: torch.Tensor, u: list[torch.Tensor] | None = None) -> list[rollout_dp.StepTables]:
    """Per step t = 1..T the tables of :func:`kl_bench.rollout_dp.step_expectations` under the sampler:
    sequence weights multiply (m), token weights weigh each step's own count (u) and, inside a score
    row's sum, each token's f (the convention of the ``score`` form: (Σ_t w_t f_t)·S). ``u``: per phase,
    the step weights to use instead (a local row's :func:`local_tables`)."""
    out = []
    for i, (lb, steps) in enumerate(pair.phases):
        b = lb.exp()
        w = torch.where(b > 0, pair.token_weight(lb), torch.zeros_like(b)) if pair.weights != "none" \
            else torch.ones_like(b)
        ones = torch.ones_like(b)
        keep = torch.where(b > 0, pair.keep_table(lb), torch.zeros_like(b))      # the rejection mask's factor
        st = rollout_dp.StepTables(b, (w if pair.weights == "sequence" else ones) * keep, f,
                                   u[i] if u is not None else w if pair.weights == "token" else ones)
        out.extend([st] * steps)
    return out


def _step_counts(pair: RolloutTables, item: GradItem, gamma: torch.Tensor | None) -> torch.Tensor:
    """E[γ(|y|) · per-step weight · N] for a token row of any form (kl_bench.modes.TOKEN_FORMS), by the
    forward–backward program of :func:`kl_bench.rollout_dp.step_expectations`."""
    f = item.est.fn(pair.logr_table)
    tok_w = pair.weights == "token"

    def run(part: str, table: torch.Tensor, u: list[torch.Tensor] | None = None) -> torch.Tensor:
        steps = _step_tables(pair, table, u)
        if part == "all" and tok_w:          # (Σ_t w_t f_t)·S: the weight inside the sum, not on the step
            steps = [rollout_dp.StepTables(st.b, st.m, st.u * table, torch.ones_like(st.b)) for st in steps]
        return rollout_dp.step_expectations(steps, pair.bucket, pair.eos, part, gamma)

    if item.token == "local":
        return run("one", f, local_tables(pair, item))
    if item.token == "to_go":                # Σ_t w_t (Σ_{s≥t} f_s) s_t: the ratio on the advantage
        return run("to_go", f)
    score = run("all", f)
    if item.token == "score":
        return score
    return score + run("one", f) * (item.coef(pair.logr_table) - f)       # score+local


def _ones(lb: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(lb)


def _sequence_weight(pair: RolloutTables):
    """W = Π_t w_t, which multiplies sequence terms, as a per-step table of a phase's log b."""
    return pair.token_weight if pair.weights != "none" else _ones


def _score_counts(pair: RolloutTables, item: GradItem) -> torch.Tensor:
    """E[F·N] for a score-function token row, F = Σ_t f_t: token weights inside the sum, sequence weights
    outside."""
    f = item.est.fn(pair.logr_table)
    if pair.weights == "token":
        return _count_moment(pair, _ones, lambda lb: pair.token_weight(lb) * f, [0.0, 1.0])
    return _count_moment(pair, _sequence_weight(pair), lambda lb: f, [0.0, 1.0])


def local_tables(pair: RolloutTables, item: GradItem) -> list[torch.Tensor]:
    """Per sampler phase, the per-step coefficient [C, V] of a local token row Σ_t a_t s_t: c(log r)
    times the token weight w = q/b (weights = "token", zero where b never draws), or the PPO surrogate's
    coefficient where the case clips (kl_bench.weights.WeightCorrection.coefficient: ρ·c on the free
    branch, the clipped branch's own gradient elsewhere, from the raw ratio ρ = q/b); c alone otherwise."""
    c_tab = item.coef(pair.logr_table)
    if pair.weights != "token":
        return [c_tab for _ in pair.phases]
    out = []
    for lb, _ in pair.phases:
        drawn = lb.exp() > 0
        if pair.clip is not None and pair.clip.clips(item.mode):
            rho = torch.exp(pair.log_q - lb)
            t = pair.clip.coefficient(item.est, item.mode, pair.logr_table.reshape(-1), rho.reshape(-1))
            t = t.reshape(lb.shape)
        else:
            t = pair.token_weight(lb) * c_tab
        out.append(torch.where(drawn, t, torch.zeros_like(t)))
    return out


def _local_counts(pair: RolloutTables, item: GradItem) -> torch.Tensor:
    """Σ_phases E[N_phase]·a_phase for Σ_t a_t s_t: linear in the counts N (token weights and the clip
    depend on the phase's b: each phase's steps are counted apart)."""
    tables = local_tables(pair, item)
    if pair.weights == "token":
        return sum(_count_moment(pair, _ones, _ones, [1.0], phase=i) * t for i, t in enumerate(tables))
    return _count_moment(pair, _sequence_weight(pair), _ones, [1.0]) * tables[0]


def _sequence_counts(pair: RolloutTables, item: GradItem) -> torch.Tensor | None:
    """E[W c(L) N] for a sequence row whose coefficient is a polynomial Σ a R^s L^k (else None)."""
    poly = item.cpoly
    if poly is None:
        return None
    g, seq_w = pair.logr_table, _sequence_weight(pair)
    by_s: dict[int, list[float]] = {}
    for (s, k), a in poly.items():
        coefs = by_s.setdefault(s, [])
        coefs.extend([0.0] * (k + 1 - len(coefs)))
        coefs[k] += a
    return sum(_count_moment(pair, lambda lb, s=s: seq_w(lb) * torch.exp(s * g), lambda lb: g, coefs)
               for s, coefs in by_s.items())


# ----------------------------------------------------------------------------- group baselines
def baseline_exact(pair: RolloutTables, est, aggregate: str):
    """(E_b[W F S] [C·V], E_b[W S] [C·V], E_b[F]) of a reward row with F = f(L) (``seq``, polynomial f)
    or Σ_t f_t (``tok``), W the sequence weight (1 without one); None where the first has no exact value.
    E_b[W S] is zero on x ~ q and under weights that undo a full-support sampler; under truncation it is
    the gradient of the mass q puts on what b can draw. E_b[F] is unweighted: a trainer's group mean is
    the plain mean of the group's values."""
    mean = exact_mean(pair, GradItem.of(est, "reward", aggregate))
    if mean is None:
        return None
    score = _score_part(pair, _count_moment(pair, _sequence_weight(pair), _ones, [1.0]))
    g = pair.logr_table
    if aggregate == "seq":
        mu = sum(a * pair.b_moments(lambda lb, s=s: torch.exp(s * g), lambda lb: g, k)[k]
                 for (s, k), a in est.poly.items())
    else:
        f = est.fn(g)
        mu = pair.b_moments(torch.ones_like, lambda lb: f, 1)[1]
    return mean, score, float(mu)


def baseline_draws(pair: RolloutTables, est, aggregate: str, u: np.ndarray, device):
    """(n, generator) → (F, W, S·u, |S|²) per rollout [n] (kl_bench.pairs.base.BaselineDraws), from
    recorded paths: F = f(L) or Σ_t f_t, W = Π_t w_t with sequence weights (else 1)."""
    q = pair.log_q.exp()
    ut = torch.as_tensor(u, dtype=torch.float64).reshape(q.shape)
    hu = (ut - (q * ut).sum(-1, keepdim=True)).reshape(-1).to(device)      # u(c, x) − ⟨q_c, u_c⟩
    q_flat, qq, g_flat = q.reshape(-1).to(device), (q * q).sum(-1).to(device), pair.logr_table.reshape(-1).to(device)

    def draw(n: int, gen: torch.Generator):
        rec: list = []
        pair.simulate([n], [gen], device, record=rec)
        keys = torch.stack([r[0] for r in rec], 1)
        alive = torch.stack([r[1] for r in rec], 1)
        logr_t = g_flat[keys] * alive                  # 0 after the end: f(0) = 0 adds nothing there
        f = est.fn(logr_t.sum(1)) if aggregate == "seq" else (est.fn(logr_t) * alive).sum(1)
        w = torch.ones_like(f) if pair.weights == "none" else torch.where(
            alive > 0, torch.stack([r[2] for r in rec], 1), torch.ones_like(alive)).prod(1)
        su = (hu[keys] * alive).sum(1)
        s2 = SortedPaths.of(keys, q_flat, qq, pair.vocab).sq_norm(alive)
        return f.cpu(), w.cpu(), su.cpu(), s2.cpu()
    return draw


# ----------------------------------------------------------------------------- Monte Carlo
def _run_start(ids: torch.Tensor) -> torch.Tensor:
    """For rows of sorted ids [n, T]: the index where each element's run of equal ids starts."""
    i = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return torch.where(new, i, torch.zeros_like(i)).cummax(1).values


def _run_prefix(vals: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums of ``vals`` [n, T] within runs (``start`` from :func:`_run_start`)."""
    cs = vals.cumsum(1)
    return cs - F.pad(cs, (1, 0)).gather(1, start)


@dataclass
class SortedPaths:
    """A batch of paths sorted by key per row, so that equal (bucket, token) keys and equal buckets are
    contiguous; |g|² then needs prefix sums only (no scatter: deterministic on CUDA too)."""
    order: torch.Tensor       # [n, T] permutation
    key_start: torch.Tensor   # run starts of equal keys
    bucket_start: torch.Tensor
    qx: torch.Tensor          # q(x_t | c_{t−1}), sorted
    qq: torch.Tensor          # |q(·|c_{t−1})|², sorted

    @classmethod
    def of(cls, keys: torch.Tensor, q_flat: torch.Tensor, qq: torch.Tensor, vocab: int) -> "SortedPaths":
        order = torch.argsort(keys, dim=1, stable=True)
        ks = keys.gather(1, order)
        cb = torch.div(ks, vocab, rounding_mode="floor")
        return cls(order, _run_start(ks), _run_start(cb), q_flat[ks], qq[cb])

    def sq_norm(self, w: torch.Tensor) -> torch.Tensor:
        """|Σ_t w_t s_t|² per draw, [n], for per-step weights w [n, T] (0 on steps after the end).

        = Σ_keys W² − 2 Σ_c A_c B_c + Σ_c A_c² |q_c|², with W the weight summed per (bucket, token),
        A_c = Σ_{t in c} w_t and B_c = Σ_{t in c} w_t q(x_t|c). Each double sum over a run is
        Σ_i a_i (2·prefix_i − a_i), or Σ_i (a_i·prefix_b,i + b_i·prefix_a,i − a_i b_i) for two sequences."""
        ws = w.gather(1, self.order)
        wq = ws * self.qx
        pa, pb = _run_prefix(ws, self.bucket_start), _run_prefix(wq, self.bucket_start)
        same_key = ws * (2 * _run_prefix(ws, self.key_start) - ws)
        cross = ws * pb + wq * pa - ws * wq
        diag = self.qq * ws * (2 * pa - ws)
        return (same_key - 2 * cross + diag).sum(1)


class RolloutGradients(GradientAccumulator):
    """Per-batch sums of every row's per-draw gradient, its projections and squared norm, from recorded
    paths (``RolloutPair.simulate(record=...)``); totals accumulate on the CPU with index_add_."""

    def __init__(self, pair: RolloutTables, items: list[GradItem], directions: list[np.ndarray], device):
        self.pair, self.items, self.device = pair, items, device
        c_, v = pair.buckets, pair.vocab
        q = self.q = pair.log_q.exp()
        self.q_flat, self.g_flat = q.reshape(-1).to(device), pair.logr_table.reshape(-1).to(device)
        self.qq = (q * q).sum(-1).to(device)
        # Projections g·u = Σ_t w_t (u(c, x_t) − ⟨q_c, u_c⟩): one additive table per direction.
        self.hu = torch.stack([(torch.as_tensor(u).reshape(c_, v) - (q * torch.as_tensor(u).reshape(c_, v))
                                .sum(-1, keepdim=True)).reshape(-1) for u in directions]).to(device)
        # Rows whose per-step weight depends on the step alone (local tok rows, no importance weights)
        # need only the (bucket, token) counts for their totals; the others accumulate their own weights.
        # Token rows of a mode that is not a score function: Σ_t w_t c(log r_t) s_t, one table c(c, x).
        self._local_rows(pair, items, device)
        self.w_total = torch.zeros(c_ * v, len(self.per_draw), dtype=torch.float64)
        self.counts = torch.zeros(c_ * v, dtype=torch.float64)
        # Draws per piece: [m, T] recorded steps stay within 2^21 entries (fixed per case: same bytes for
        # any chunk).
        self.piece = max(1, min(pair.piece_draws(device), 2**21 // max(1, pair.length)))

    def add(self, batch: BatchStream) -> GradBatch:
        pair, items = self.pair, self.items
        nj, nd = len(items), self.hu.shape[0]
        proj, proj2, sq = np.zeros((nj, nd)), np.zeros((nj, nd)), np.zeros(nj)
        for m, generator in batch.pieces(self.piece):
            rec: list = []
            keep = pair.simulate([m], [generator], self.device, record=rec).keep      # [m] 0/1, or None
            keys = torch.stack([r[0] for r in rec], 1)                # [m, T]
            alive = torch.stack([r[1] for r in rec], 1)               # [m, T] 1.0 while in the sequence
            # Importance weights: per token w_t (weights = "token") or W = Π_t w_t on every term.
            tok_w = torch.stack([r[2] for r in rec], 1) * alive if pair.weights == "token" else alive
            seq_w = torch.where(alive > 0, torch.stack([r[2] for r in rec], 1), torch.ones_like(alive)).prod(
                1, keepdim=True) if pair.weights != "none" else 1.0
            logr_t = self.g_flat[keys] * alive
            big_l = logr_t.sum(1)
            units = {1: (keys, SortedPaths.of(keys, self.q_flat, self.qq, pair.vocab), self.hu[:, keys], None, 1.0)}
            w_cols = []
            for j, it in enumerate(items):
                w = seq_w * it.coef(big_l)[:, None] * alive if not AGGREGATES[it.aggregate].token else \
                    self._token_weights(it, j, keys, alive, logr_t, tok_w, seq_w)
                w = _masked(w, keep)
                b = pair.token_mean_batch if AGGREGATES[it.aggregate].grouped else 1
                if b not in units:
                    units[b] = self._groups(keys, alive, b, batch.size)
                _, srt, hs, per_member, factor = units[b]
                if per_member is not None:   # one gradient per group: Σ_i Σ_t w s / Σ_i |y_i|
                    n = per_member.shape[0]
                    w = torch.cat([factor * w[:n] / per_member[:, None], torch.zeros_like(w[n:])])
                    uw = w[:n].reshape(n // b, -1) / factor
                else:
                    uw = w
                if j not in self.local:
                    w_cols.append(w)
                pj = (uw[None] * hs).sum(2)                          # [D, units]
                proj[j] += factor * pj.sum(1).cpu().numpy()
                proj2[j] += factor * (pj * pj).sum(1).cpu().numpy()
                sq[j] += factor * float(srt.sq_norm(uw).sum())
            flat_keys = keys.reshape(-1).cpu()
            self.counts.index_add_(0, flat_keys, alive.reshape(-1).cpu())
            if w_cols:
                self.w_total.index_add_(0, flat_keys, torch.stack(w_cols, -1).reshape(-1, len(w_cols)).cpu())
        return GradBatch(proj, sq, proj2)

    def _local_rows(self, pair: RolloutTables, items: list[GradItem], device) -> None:
        """The tables of the local token rows: one coefficient table c(c, x) each, or per sampler phase with
        token weights (and the PPO clip); ``local``: the rows whose totals follow from the counts alone."""
        per_token = [j for j, it in enumerate(items) if AGGREGATES[it.aggregate].token and it.token == "local"]
        self.local = [j for j in per_token if items[j].aggregate == "tok"] if _counts_suffice(pair) else []
        self.per_draw = [j for j in range(len(items)) if j not in self.local]
        self.tables = {j: items[j].coef(pair.logr_table).reshape(-1).to(device) for j in per_token}
        self.phase_tables = {j: torch.stack([t.reshape(-1) for t in local_tables(pair, items[j])]).to(device)
                             for j in per_token} if pair.weights == "token" else {}
        self.phase_of = torch.tensor([i for i, (_, steps) in enumerate(pair.phases) for _ in range(steps)],
                                     device=device)

    def _groups(self, keys: torch.Tensor, alive: torch.Tensor, b: int, size: int):
        """The units of a tok_batch row in a piece: its whole groups of B = ``b`` consecutive paths as
        (keys [G, B·T], their SortedPaths, projections [D, G, B·T], Σ|y| of each member's group [G·B],
        factor). Each group's gradient is one value; ``factor`` = draws / groups of the batch makes the
        batch's sums those of the group mean times its draws (the engine divides by draws), so the draws
        that fall in no whole group (the end of a piece) leave no bias."""
        groups = groups_in(size, b, self.piece)
        if groups == 0:
            raise SpecError(f"batches of {size} rollouts hold no whole group of token_mean_batch = {b}: raise "
                            "the draws or lower the batches", case=getattr(self.pair, "name", None), key="token_mean_batch")
        g = keys.shape[0] // b
        kg = keys[:g * b].reshape(g, -1)
        per_member = alive[:g * b].sum(1).view(g, b).sum(1).repeat_interleave(b)
        return kg, SortedPaths.of(kg, self.q_flat, self.qq, self.pair.vocab), self.hu[:, kg], per_member, size / groups

    def _token_weights(self, it: GradItem, j: int, keys, alive, logr_t, tok_w, seq_w) -> torch.Tensor:
        """Per-step weights w [m, T] of a token row, its per-draw gradient being Σ_t w_t s_t (forms:
        kl_bench.modes.TOKEN_FORMS): local c_t, score Σ_s f_s, to_go Σ_{s≥t} f_s, score+local both; token
        importance weights w_t on each step (inside the sum for score), a sequence weight W on all; times
        1/|y| for ``tok_mean``."""
        outer = seq_w if self.pair.weights == "sequence" else 1.0
        w = torch.zeros_like(alive)
        if j in self.phase_tables:          # Σ_t a_phase(t)(x_t) s_t: the weight is in the table
            w = w + self.phase_tables[j][self.phase_of[None, :keys.shape[1]], keys] * alive
        elif it.token in ("local", "score+local"):
            table = self.tables[j] if it.token == "local" else (
                it.coef(self.g_flat) - it.est.fn(self.g_flat))
            w = w + table[keys] * tok_w
        if it.score:
            w = w + (it.est.fn(logr_t) * tok_w).sum(1, keepdim=True) * alive
        elif it.token == "to_go":            # the sum still to come: a reversed cumulative sum per path
            f = it.est.fn(logr_t) * alive
            w = w + f.flip(1).cumsum(1).flip(1) * tok_w
        w = outer * w
        if it.aggregate == "tok_mean":
            w = w / alive.sum(1, keepdim=True)
        return w

    def total(self) -> np.ndarray:
        total = np.zeros((len(self.items), self.pair.buckets * self.pair.vocab))
        for col, j in enumerate(self.per_draw):
            total[j] = _grad_from_weights(self.w_total[:, col], self.q)
        for j in self.local:
            total[j] = _grad_from_weights(self.counts * self.tables[j].cpu(), self.q)
        return total


def _counts_suffice(pair: RolloutTables) -> bool:
    """Whether local tok rows' totals follow from the (bucket, token) counts alone: no per-draw factor (no
    importance weights, no rejection mask)."""
    return pair.weights == "none" and pair.rejection is None


def _masked(w: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Per-step weights [m, T] of a row with a rejected sequence's every step zeroed (``keep`` [m] 0/1; None:
    no mask); 0, never 0·inf."""
    return w if keep is None else torch.where(keep[:, None] > 0, w, torch.zeros_like(w))


def _grad_from_weights(w: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    """Σ_steps w (e_x − q_c) from W(c, x) = Σ w over the steps that drew x from bucket c."""
    wm = w.reshape(q.shape)
    return (wm - wm.sum(-1, keepdim=True) * q).reshape(-1).numpy()
