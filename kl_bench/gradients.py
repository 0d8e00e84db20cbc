"""Gradients of KL estimators: what each estimator optimises in each place a trainer puts it.

θ parameterises q (categorical: its logits [B, V]; Gaussian: (mean, log std) per dimension; rollout:
its bucket logits [C, V], see kl_bench.rollout_grad for the seq and tok rows). With
s = ∇θ log q_θ(x) and log r = log p(x) − log q_θ(x), every mode's per-draw gradient is c(log r) · s:

| mode | what is differentiated | c(log r) |
|---|---|---|
| loss | f(log r), the sample held fixed | −f′(log r) |
| reward | sg(f) · log q_θ(x) (score function) | f(log r) |
| loss_is | f(log r) · q_θ/sg(q_θ) | f(log r) − f′(log r) |
| straight_through | value of k3, gradient of k2 (k3 rows only) | −log r |

f′ comes from autograd of the estimator function itself, so clamped variants differentiate as trainers'
code does. Under a sampler (x ~ b ≠ q, a stale or tempered policy) the score stays q's, and importance
weights multiply each per-draw gradient by the detached q/b. Exact expected gradients: sums over the
vocabulary (categorical), tilted-Gaussian moments E_b[w^m r^s (log r)^k z^j] (Gaussian, polynomial
estimators, uncapped weights) and the rollout dynamic program (kl_bench.rollout_grad). The reference
gradients ∇KL(q‖p) and ∇KL(p‖q) are closed forms (rollouts: autograd through the dynamic program); the
`equals` column names which one a mode's expectation is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd
import torch
from scipy import stats

from . import exact
from .engine import batch_seed, batch_sizes
from .estimators import Estimator, Poly
from .pairs import CategoricalPair, GaussianPair, Pair

MODES = ("loss", "reward", "loss_is", "straight_through")

GRAD_SCHEMA: dict[str, str] = {
    "case": "case name", "estimator": "estimator (or clamped variant label)",
    "aggregate": "rollouts: seq (estimator of the sequence log-ratio L) or tok (per-token estimator summed over "
                 "tokens; see kl_bench.rollout_grad); empty for Gaussians and categoricals",
    "lambda": "λ for cv rows",
    "sampler": "the case's sampler, empty when x ~ q: draws come from b, and with importance weights every "
               "per-draw gradient is multiplied by the detached q/b (rollouts: per token or per sequence)",
    "mode": "loss | reward | loss_is | straight_through (see kl_bench.gradients)",
    "params": "number of parameters θ (categorical: B·V logits; Gaussian: 2 per dimension; rollout: C·V logits)",
    "draws": "Monte Carlo draws",
    "equals": "what the exact expected gradient equals: reverse (∇KL(q||p)), forward (∇KL(p||q)), zero, other",
    "cos_reverse": "cosine of the Monte Carlo mean gradient with the exact ∇KL(q||p)",
    "cos_forward": "cosine of the Monte Carlo mean gradient with the exact ∇KL(p||q)",
    "relerr_reverse": "|mean gradient − ∇KL(q||p)| / |∇KL(q||p)| (Monte Carlo)",
    "relerr_forward": "|mean gradient − ∇KL(p||q)| / |∇KL(p||q)| (Monte Carlo)",
    "exact_cos_reverse": "cosine of the exact expected gradient with ∇KL(q||p)",
    "exact_cos_forward": "cosine of the exact expected gradient with ∇KL(p||q)",
    "exact_relerr_reverse": "|E[gradient] − ∇KL(q||p)| / |∇KL(q||p)| (exact)",
    "exact_relerr_forward": "|E[gradient] − ∇KL(p||q)| / |∇KL(p||q)| (exact)",
    "z_reverse": "(MC − exact) of the gradient's component along ∇KL(q||p), in batch-means standard errors",
    "z_forward": "the same along ∇KL(p||q)",
    "trace_cov": "per-draw gradient variance: trace of its covariance (Monte Carlo)",
    "exact_trace_cov": "the same, exact (empty on rollouts: no exact second moments)",
    "z_trace": "(E|g|² measured − exact) in batch-means standard errors; empty where E|g|⁴ = ∞ (Gaussian rows "
               "whose coefficient has an r term when E_q[r⁴] = ∞): there the measured trace cannot be trusted",
    "n_for_cos90": "batch size for cosine ≥ 0.9 with ∇KL(q||p) with 95% probability (normal approximation, "
                   "exact moments; rollouts: exact mean, measured variances); inf when the expectation itself is "
                   "not within 0.9 or the per-draw variance is infinite; empty without an exact mean",
    "exact_along_reverse": "exact E[gradient]·u, u the unit vector along ∇KL(q||p) (for the cosine-vs-batch plot)",
    "exact_norm": "|E[gradient]| (exact)",
}


def coefficient(est: Estimator, mode: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """c(log r) such that the mode's per-draw gradient is c(log r) · ∇θ log q(x). Shape-preserving."""
    def deriv(logr: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x = logr.detach().clone().requires_grad_(True)
            (g,) = torch.autograd.grad(est.fn(x).sum(), x)
        return g
    if mode == "loss":
        return lambda logr: -deriv(logr)
    if mode == "reward":
        return lambda logr: est.fn(logr)
    if mode == "loss_is":
        return lambda logr: est.fn(logr) - deriv(logr)
    if mode == "straight_through":
        return lambda logr: -logr
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
    raise ValueError(mode)


def coefficient_poly(est: Estimator, mode: str) -> Poly | None:
    """c as a polynomial Σ a r^s (log r)^k, when the estimator is one (d/dL r^s = s r^s)."""
    if mode == "straight_through":
        return {(0, 1): -1.0}
    if est.poly is None:
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
    return [m for m in MODES if m != "straight_through" or est.name == "k3"]


# ----------------------------------------------------------------------------- exact: categorical
@dataclass
class ExactGrad:
    mean: np.ndarray          # E[c s], flattened θ
    second: float             # E[c² |s|²]
    proj_var: dict            # direction name → Var(c s·u)


def _cat_tables(pair: CategoricalPair) -> tuple[torch.Tensor, torch.Tensor]:
    """(context index, token index) of every drawn (context, token) id."""
    return pair._support // pair.vocab, pair._support % pair.vocab


def categorical_exact(pair: CategoricalPair, c_table: torch.Tensor, directions: dict[str, np.ndarray]) -> ExactGrad:
    """E[c s] for s = e_x − q_b (in row b), under the mixture (1/B) q_b(x); θ = logits [B, V]."""
    b, v = pair.contexts, pair.vocab
    q = pair.log_q.exp()
    w = pair._weights()
    ctx, tok = _cat_tables(pair)
    cw = torch.zeros(b, v, dtype=torch.float64)
    cw[ctx, tok] = w * c_table                            # (1/B) q_b(x) c(x)
    mean = cw - q * cw.sum(-1, keepdim=True)              # row b: (1/B)(q⊙c − q Σ q c)
    s_norm2 = 1 - 2 * q[ctx, tok] + (q * q).sum(-1)[ctx]  # |e_x − q_b|²
    second = float((w * c_table**2 * s_norm2).sum())
    proj_var = {}
    for name, u in directions.items():
        ut = torch.as_tensor(u, dtype=torch.float64).reshape(b, v)
        su = ut[ctx, tok] - (q * ut).sum(-1)[ctx]        # s·u for each id
        m1 = float((w * c_table * su).sum())
        proj_var[name] = float((w * (c_table * su - m1) ** 2).sum())
    return ExactGrad(mean.reshape(-1).numpy(), second, proj_var)


def categorical_reference(pair: CategoricalPair) -> tuple[np.ndarray, np.ndarray]:
    """(∇θ KL(q‖p), ∇θ KL(p‖q)) for θ = q's logits, averaged over contexts: rows (1/B) q⊙(log q −
    log p − KL) and (1/B)(q − p)."""
    q, lq, lp = pair.log_q.exp(), pair.log_q, pair.log_p
    b = pair.contexts
    kl = (q * (lq - lp)).sum(-1, keepdim=True)
    rev = q * (lq - lp - kl) / b
    fwd = (q - lp.exp()) / b
    return rev.reshape(-1).numpy(), fwd.reshape(-1).numpy()


# ----------------------------------------------------------------------------- exact: Gaussian
def _gauss_moment(g: exact.GaussianPairParams, s: int, k: int, i: int, j: int, b=None, m: int = 0) -> float:
    """E_b[w^m r^s (log r)^k z_i^j] with z_i = (x_i − μq_i)/σq_i and w = q/b (b = q when None), via the
    tilted Gaussian ∝ b^{1−m} q^{m−s} p^s: per dimension log r and z are polynomials of one standard
    normal; dimensions are independent under the tilt."""
    tilt = exact._tilt(g, s, b, m)
    if tilt is None:
        return math.inf
    log_z, m, var = tilt
    c0, c1, c2 = exact._logr_quadratic(g, m, var)
    sd = np.sqrt(var)
    zi = np.array([(m[i] - g.mq[i]) / g.sq[i], sd[i] / g.sq[i]])      # z_i = a + b ζ
    li = np.array([c0[i], c1[i], c2[i]])
    others = [exact._quadratic_raw_moments(a, b_, c, k) for d, (a, b_, c) in enumerate(zip(c0, c1, c2)) if d != i]
    rest = exact._sum_raw_moments(others, k) if others else [1.0] + [0.0] * k
    total = 0.0
    for a in range(k + 1):
        poly = np.array([1.0])
        for _ in range(a):
            poly = np.convolve(poly, li)
        for _ in range(j):
            poly = np.convolve(poly, zi)
        e = sum(cf * exact._std_normal_moment(n) for n, cf in enumerate(poly))
        total += math.comb(k, a) * e * rest[k - a]
    return math.exp(log_z) * total


def gaussian_exact(pair: GaussianPair, cpoly: Poly | None, directions: dict[str, np.ndarray]) -> ExactGrad | None:
    """E_b[(w) c s] with s = (z/σ per dimension, z² − 1 per dimension), θ = (μ, log σ) of q, b the
    case's sampler (q when none); None for non-polynomial c or capped weights."""
    if cpoly is None or pair.weight_cap is not None:
        return None
    from .estimators import poly_square
    g, dim = pair.params, pair.dim
    b = pair._b if pair.has_sampler else None     # under a sampler: E_b[w^m ·], m = 1 with weights
    wm = 1 if pair.weighted else 0

    def e(poly: Poly, i: int, j: int, power: int = 1) -> float:
        """E_b[w^{m·power} poly(r, log r) z_i^j]: power 2 for second moments (they carry w²)."""
        return sum(a * _gauss_moment(g, s, k, i, j, b, wm * power) for (s, k), a in poly.items() if a != 0)
    mean = np.array([e(cpoly, i, 1) / g.sq[i] for i in range(dim)] +
                    [e(cpoly, i, 2) - e(cpoly, i, 0) for i in range(dim)])
    c2 = poly_square(cpoly)

    def e2(i: int, j: int) -> float:
        return e(c2, i, j, 2)

    def combine(*terms: float) -> float:
        """Σ of (coefficient, moment) products; ∞ when a moment is (no ∞ − ∞ = NaN)."""
        return math.inf if any(math.isinf(t) for _, t in terms) else sum(a * t for a, t in terms)
    # |s|² = Σ_i z_i²/σ_i² + (z_i² − 1)² = Σ_i z_i²/σ_i² + z_i⁴ − 2 z_i² + 1
    second = sum(combine((1 / g.sq[i] ** 2, e2(i, 2)), (1, e2(i, 4)), (-2, e2(i, 2)), (1, e2(i, 0)))
                 for i in range(dim))
    proj_var = {}
    for name, u in directions.items():
        # (c s·u)² = c² (Σ_i u_μi z_i/σ_i + u_σi (z_i² − 1))²: needs cross-dimension terms; exact for D = 1.
        if dim != 1:
            proj_var[name] = math.nan
            continue
        um, us = u[0] / g.sq[0], u[1]
        ex = combine((um**2, e2(0, 2)), (us**2, e2(0, 4)), (-2 * us**2, e2(0, 2)), (us**2, e2(0, 0)),
                     (2 * um * us, e2(0, 3)), (-2 * um * us, e2(0, 1)))
        proj_var[name] = ex - float(mean @ u) ** 2
    return ExactGrad(mean, second, proj_var)


def gaussian_reference(pair: GaussianPair) -> tuple[np.ndarray, np.ndarray]:
    """∇(μq, log σq) of KL(q‖p) = (d/σp², σq²/σp² − 1) and of KL(p‖q) = (d/σq², 1 − (σp² + d²)/σq²)."""
    g = pair.params
    d = g.mq - g.mp
    rev = np.concatenate([d / g.sp**2, g.sq**2 / g.sp**2 - 1])
    fwd = np.concatenate([d / g.sq**2, 1 - (g.sp**2 + d**2) / g.sq**2])
    return rev, fwd


# ----------------------------------------------------------------------------- Monte Carlo
def _unit(v: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(v)
    return v / n if n > 0 else v


def gradient_rows(pair: Pair, estimators: list[Estimator], *, draws: int, seed: int, batches: int,
                  device: torch.device) -> list[dict]:
    """gradients.csv rows for one case (categorical, 1-D/diagonal Gaussian or rollout)."""
    from .pairs import RolloutPair
    ests = [e for e in estimators if e.name != "full"]
    sizes = batch_sizes(draws, batches)
    proj2 = None
    if isinstance(pair, RolloutPair):
        from . import rollout_grad as RG
        rev, fwd = RG.reference(pair)
        dirs = {"reverse": _unit(rev), "forward": _unit(fwd)}
        items = [(e, m, a) for a in RG.AGGREGATES for e in ests for m in modes_for(e)]
        mc = RG.monte_carlo(pair, items, list(dirs.values()), sizes, seed, device, coefficient)
        total, proj, proj2, sq = mc.total, mc.proj, mc.proj2, mc.sq
        exacts = []
        for e, m, a in items:
            mean = RG.exact_mean(pair, e, m, a)
            exacts.append(None if mean is None else ExactGrad(mean, math.nan, {}))
    elif isinstance(pair, (CategoricalPair, GaussianPair)):
        rev, fwd = categorical_reference(pair) if isinstance(pair, CategoricalPair) else gaussian_reference(pair)
        dirs = {"reverse": _unit(rev), "forward": _unit(fwd)}
        items = [(e, m, "") for e in ests for m in modes_for(e)]
        mc_fn = _categorical_mc if isinstance(pair, CategoricalPair) else _gaussian_mc
        total, proj, sq, exacts = mc_fn(pair, items, dirs, sizes, seed, device)
    else:
        return []
    n_k = np.array(sizes, dtype=np.float64)
    k = len(sizes)

    def batch_mean_se(sums: np.ndarray) -> tuple[float, float]:
        """Overall mean of per-draw values from per-batch sums, and its batch-means standard error."""
        m = float(sums.sum() / draws)
        return m, math.sqrt(k / (k - 1) * float(((n_k / draws) ** 2 * (sums / n_k - m) ** 2).sum()))
    rows = []
    for j, (est, mode, agg) in enumerate(items):
        mc_mean = total[j] / draws
        ex = exacts[j]
        row = {"case": pair.name, "estimator": est.name, "aggregate": agg, "sampler": getattr(pair, "sampler_label", ""),
               "lambda": est.lam if est.lam is not None else math.nan,
               "mode": mode, "params": rev.shape[0], "draws": draws}
        row.update(_compare("", mc_mean, rev, fwd))
        m2, se_m2 = batch_mean_se(sq[:, j])
        row["trace_cov"] = m2 - float(mc_mean @ mc_mean)
        # E|g|² from batch means of Σ|g|²; its SE makes the trace testable against the exact value.
        row["z_trace"] = (m2 - ex.second) / se_m2 if ex is not None and se_m2 > 0 and math.isfinite(ex.second) \
            and _fourth_moment_finite(pair, est, mode) else math.nan
        for d, name in enumerate(("reverse", "forward")):
            m, se = batch_mean_se(proj[:, j, d])
            ref = float(ex.mean @ dirs[name]) if ex is not None else math.nan
            row[f"z_{name}"] = (m - ref) / se if se > 0 and math.isfinite(ref) else math.nan
        if ex is not None:
            row.update(_compare("exact_", ex.mean, rev, fwd))
            row["exact_trace_cov"] = ex.second - float(ex.mean @ ex.mean)
            row["equals"] = _equals(ex.mean, rev, fwd)
            var_u, trace = ex.proj_var.get("reverse", math.nan), row["exact_trace_cov"]
            if proj2 is not None:       # rollouts: exact mean, measured spread (see kl_bench.rollout_grad)
                mu_u = float(proj[:, j, 0].sum() / draws)
                var_u, trace = float(proj2[:, j, 0].sum() / draws) - mu_u**2, row["trace_cov"]
            row["n_for_cos90"] = n_for_cosine(ex.mean, dirs["reverse"], var_u, trace)
            row["exact_along_reverse"] = float(ex.mean @ dirs["reverse"])
            row["exact_norm"] = float(np.linalg.norm(ex.mean))
            if row["equals"] == "zero":          # the cosine of a zero vector is rounding noise
                for c in ("exact_cos_reverse", "exact_cos_forward"):
                    row[c] = math.nan
        else:
            row.update({c: math.nan for c in ("exact_cos_reverse", "exact_cos_forward", "exact_relerr_reverse",
                                              "exact_relerr_forward", "exact_trace_cov", "n_for_cos90",
                                              "exact_along_reverse", "exact_norm")})
            row["equals"] = ""
        rows.append(row)
    return rows


def _categorical_mc(pair: CategoricalPair, items, dirs, sizes, seed, device):
    """(Σ gradient [J, P], per-batch Σ g·u [K, J, 2], per-batch Σ|g|² [K, J], exact) by token counts:
    every per-draw quantity is a table over the drawn (context, token) ids, so a batch is one bincount."""
    coefs = [coefficient(e, m) for e, m, _ in items]
    k, nj = len(sizes), len(items)
    proj, sq = np.zeros((k, nj, 2)), np.zeros((k, nj))
    ctx, tok = _cat_tables(pair)
    q = pair.log_q.exp()
    c_tab = torch.stack([c(pair._logr) for c in coefs])                    # [J, M]
    if pair._is_weight is not None:                                        # a sampler's detached q/b
        c_tab = c_tab * pair._is_weight
    su = torch.stack([torch.as_tensor(u, dtype=torch.float64).reshape(q.shape)[ctx, tok]
                      - (q * torch.as_tensor(u, dtype=torch.float64).reshape(q.shape)).sum(-1)[ctx]
                      for u in dirs.values()])                              # [2, M]
    s_norm2 = 1 - 2 * q[ctx, tok] + (q * q).sum(-1)[ctx]
    table = torch.cat([(c_tab[:, None, :] * su[None]).reshape(-1, c_tab.shape[1]), c_tab**2 * s_norm2])
    counts_total = torch.zeros(c_tab.shape[1], dtype=torch.float64)
    for i, n in enumerate(sizes):
        gen = torch.Generator(device=device).manual_seed(batch_seed(seed, f"{pair.name}/gradients", i))
        counts = torch.bincount(pair.sample_ids(n, gen, device), minlength=c_tab.shape[1]).double().cpu()
        out = (table @ counts).numpy()
        proj[i] = out[: 2 * nj].reshape(nj, 2)
        sq[i] = out[2 * nj:]
        counts_total += counts
    b, v = pair.contexts, pair.vocab
    total = np.zeros((nj, b * v))
    for j in range(nj):
        cw = torch.zeros(b, v, dtype=torch.float64)
        cw[ctx, tok] = counts_total * c_tab[j]
        total[j] = (cw - q * cw.sum(-1, keepdim=True)).reshape(-1).numpy()
    exacts = [categorical_exact(pair, c_tab[j], dirs) for j in range(nj)]
    return total, proj, sq, exacts


def _gaussian_mc(pair: GaussianPair, items, dirs, sizes, seed, device):
    """The same for a Gaussian: per-draw gradients c(log r) · (z/σ, z² − 1), batch by batch."""
    coefs = [coefficient(e, m) for e, m, _ in items]
    k, nj = len(sizes), len(items)
    proj, sq = np.zeros((k, nj, 2)), np.zeros((k, nj))
    total = np.zeros((nj, 2 * pair.dim))
    g = pair.params
    sq_t = torch.as_tensor(g.sq, dtype=torch.float64)
    u = np.stack(list(dirs.values())).T
    for i, n in enumerate(sizes):
        gen = torch.Generator(device=device).manual_seed(batch_seed(seed, f"{pair.name}/gradients", i))
        logr, weight, z = pair._sample(n, gen, device)                      # z: q's standard score
        s = torch.cat([z / sq_t.to(device), z * z - 1], dim=-1)              # [n, 2D]
        for j, c in enumerate(coefs):
            gj = (c(logr) if weight is None else c(logr) * weight)[:, None] * s
            gsum = gj.sum(0).cpu().numpy()
            total[j] += gsum
            sq[i, j] = float((gj * gj).sum())
            proj[i, j] = gsum @ u
    exacts = [gaussian_exact(pair, coefficient_poly(e, m), dirs) for e, m, _ in items]
    return total, proj, sq, exacts


def _fourth_moment_finite(pair: Pair, est: Estimator, mode: str) -> bool:
    """E|c s|⁴ < ∞: always on a finite vocabulary; for Gaussians iff q^{1−4s} p^{4s} (under a sampler:
    b^{1−4m} q^{4m−4s} p^{4s}) normalises, s the largest power of r in c (|s|⁴ is a polynomial in z)."""
    if not isinstance(pair, GaussianPair):
        return True
    poly = coefficient_poly(est, mode)
    if poly is None:
        return False
    s_max = max((s for (s, _), a in poly.items() if a != 0), default=0)
    if pair.has_sampler:
        return exact._tilt(pair.params, 4 * s_max, pair._b, 4 if pair.weighted and pair.weight_cap is None else 0) \
            is not None
    return exact._tilt(pair.params, 4 * s_max) is not None


def _compare(prefix: str, g: np.ndarray, rev: np.ndarray, fwd: np.ndarray) -> dict:
    out = {}
    for name, ref in (("reverse", rev), ("forward", fwd)):
        gn, rn = np.linalg.norm(g), np.linalg.norm(ref)
        out[f"{prefix}cos_{name}"] = float(g @ ref / (gn * rn)) if gn > 0 and rn > 0 else math.nan
        out[f"{prefix}relerr_{name}"] = float(np.linalg.norm(g - ref) / rn) if rn > 0 else math.nan
    return out


def _equals(g: np.ndarray, rev: np.ndarray, fwd: np.ndarray) -> str:
    """Which exact gradient the expectation equals (to float64 rounding of exact sums)."""
    scale = max(np.linalg.norm(rev), np.linalg.norm(fwd))
    tol = 1e-9 * scale
    if np.linalg.norm(g - rev) <= tol:
        return "reverse"
    if np.linalg.norm(g - fwd) <= tol:
        return "forward"
    if np.linalg.norm(g) <= tol:
        return "zero"
    return "other"


def n_for_cosine(mean: np.ndarray, u: np.ndarray, var_u: float, trace_cov: float, target: float = 0.9,
                 prob: float = 0.95) -> float:
    """Smallest n with P(cos(batch mean, u) ≥ target) ≥ prob, normal approximation: the component along
    u is N(m·u, Var_u/n), the squared norm concentrates at |m|² + tr(Σ)/n."""
    mu = float(mean @ u)
    m2 = float(mean @ mean)
    if math.isnan(var_u) or math.isnan(trace_cov):
        return math.nan            # a variance without a value (e.g. D > 1 Gaussians): unknown, not ∞
    if not (math.isfinite(var_u) and math.isfinite(trace_cov)) or m2 == 0 or mu / math.sqrt(m2) <= target:
        return math.inf
    zq = stats.norm.ppf(prob)

    def ok(n: float) -> bool:
        return (mu - zq * math.sqrt(max(var_u, 0) / n)) / math.sqrt(m2 + max(trace_cov, 0) / n) >= target
    lo, hi = 0.0, 1.0
    while not ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1e18:
            return math.inf
    while hi - lo > 1:
        mid = math.floor((lo + hi) / 2)
        lo, hi = (mid, hi) if not ok(mid) else (lo, mid)
    return float(max(hi, 1))


def to_frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=list(GRAD_SCHEMA))
