"""Exact per-position values from full next-token logits (the dense path).

At each position i the policy q_i and the reference p_i are the softmax of their logits [N, V]. With
log r = log p − log q (notation of kl_bench.core.estimators), for every estimator f (a function of log r):

    KL_i = Σ_v q_i(v) log(q_i(v)/p_i(v)),  E_q[f] = Σ_v q_i(v) f(log r_i(v)),  Var_q[f] likewise,

and under the sampler's b_i (kl_bench.audit.generation) E_b[f], Var_b[f], P_b(f < 0), the q-mass b never
draws, and the moments of log b (the consistency check's statistic). Everything is float64 whatever the
logits' dtype: the sums run over up to 10^5 terms, and KL is a small difference of O(1) numbers.
Variances are centred sums Σ w (f − E f)², never E f² − (E f)², which cancels catastrophically at small KL.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch

from ..foundation.errors import ShapeError, SpecError
from ..core.logprob_checks import as_real_tensor, check_logits
from ..core.estimators import resolve_estimator
from .generation import Sampler, sampler_logprobs, sampler_scores


@dataclass(frozen=True)
class SamplerValues:
    """Exact values under one sampling distribution at N positions: [N] tensors, [N, F] for the F
    estimators. ``mean``/``var``/``neg``: E[f], Var[f], P(f < 0); ``miss``: the q-mass it never draws;
    ``log_mean``/``log_var``: its E[log b], Var[log b] (the consistency check's statistic); ``tok_log``:
    log b of the sampled token (NaN where no ids were given, −inf where b cannot draw it). Against the
    policy q whose logits it was built from (the rollout engine's mismatch, if b is the engine's sampler):
    ``kl_q`` = KL(b‖q) = E_b[log b − log q]; ``chi2`` = Σ_{b>0} q²/b − 1 = E_b[(q/b)²] − 1; ``gap_abs`` =
    E_b|log b − log q| (NaN where one pass cannot give it: a full-support b ≠ q). ``tok_score``: the sampled
    token's score s(x) = (transformed z)/T (NaN without ids); ``tau``: the row's threshold τ (−inf where b
    keeps every token): s(x) − τ < 0 is how far below b's support a token another engine drew lies, in
    the scores' units (kl_bench.audit.rollout_engine)."""
    mean: torch.Tensor
    var: torch.Tensor
    neg: torch.Tensor
    miss: torch.Tensor
    log_mean: torch.Tensor
    log_var: torch.Tensor
    tok_log: torch.Tensor
    kl_q: torch.Tensor
    chi2: torch.Tensor
    gap_abs: torch.Tensor
    tok_score: torch.Tensor
    tau: torch.Tensor

    def select(self, rows: torch.Tensor) -> "SamplerValues":
        return SamplerValues(*(getattr(self, f.name)[rows] for f in fields(self)))

    @staticmethod
    def cat(parts: Sequence["SamplerValues"]) -> "SamplerValues":
        return SamplerValues(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(SamplerValues)))


@dataclass(frozen=True)
class PositionValues:
    """Exact values at N positions. [N] tensors, [N, F] for the F ``estimators`` (columns in that order).

    ``kl``: KL(q‖p); ``mean_q``/``var_q``: E_q[f], Var_q[f]; ``tok_logq``/``tok_logp``: log q, log p of the
    sampled token (NaN where no ids were given); ``b``: values under the sampler b applied to the scored
    policy's own logits (the settings' effect); ``g``: under the sampler applied to the logits of the pass
    that drew the tokens, when those were given (None: the same pass, g = b). ``mean_b``, ``logb_mean``,
    ... name the fields of ``b``."""
    estimators: tuple[str, ...]
    kl: torch.Tensor
    mean_q: torch.Tensor
    var_q: torch.Tensor
    tok_logq: torch.Tensor
    tok_logp: torch.Tensor
    b: SamplerValues
    g: SamplerValues | None = None

    @property
    def sampled(self) -> SamplerValues:
        """The distribution the tokens were drawn from: ``g`` when known, else ``b``."""
        return self.b if self.g is None else self.g

    mean_b = property(lambda self: self.b.mean)
    var_b = property(lambda self: self.b.var)
    neg_b = property(lambda self: self.b.neg)
    miss = property(lambda self: self.b.miss)
    logb_mean = property(lambda self: self.b.log_mean)
    logb_var = property(lambda self: self.b.log_var)
    tok_logb = property(lambda self: self.b.tok_log)

    @property
    def n(self) -> int:
        return self.kl.shape[0]

    def column(self, estimator: str) -> int:
        try:
            return self.estimators.index(estimator)
        except ValueError:
            raise SpecError(f"estimator '{estimator}' was not audited; audited: {', '.join(self.estimators)}") from None

    def select(self, rows: torch.Tensor) -> "PositionValues":
        """The values at ``rows`` (an index or bool mask over the N positions)."""
        return PositionValues(self.estimators, self.kl[rows], self.mean_q[rows], self.var_q[rows],
                              self.tok_logq[rows], self.tok_logp[rows], self.b.select(rows),
                              None if self.g is None else self.g.select(rows))

    @staticmethod
    def cat(parts: Sequence["PositionValues"]) -> "PositionValues":
        """Positions of several tables, in order (chunks of one step, or rows gathered from ranks)."""
        est = parts[0].estimators
        if any(p.estimators != est for p in parts):
            raise SpecError("tables audit different estimators")
        if len({p.g is None for p in parts}) > 1:
            raise SpecError("tables differ in whether the sampling pass was audited")
        tensors = [torch.cat([getattr(p, name) for p in parts]) for name in ("kl", "mean_q", "var_q", "tok_logq", "tok_logp")]
        g = None if parts[0].g is None else SamplerValues.cat([p.g for p in parts])
        return PositionValues(est, *tensors, SamplerValues.cat([p.b for p in parts]), g)


def estimator_functions(estimators: Sequence) -> tuple[tuple[str, ...], list]:
    """Registry names (or Estimator objects) → (names, functions of log r). ``full`` is refused: it is
    the KL itself, always reported."""
    names, fns = [], []
    if isinstance(estimators, str):      # "k1" is one estimator, not the estimators "k" and "1"
        estimators = (estimators,)
    for item in estimators:
        est = resolve_estimator(item)
        if est.analytic:
            raise SpecError(f"'{est.name}' is not a function of log r: the exact KL is always reported")
        names.append(est.name)
        fns.append(est.fn)
    return tuple(names), fns


def _moments(logw: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E and Var of ``values`` [N, V, F] under the normalised weights exp(logw) [N, V] (−inf: excluded).
    Excluded entries are replaced by 0 first, so that an infinite value where the weight is 0 is no NaN."""
    w = torch.exp(logw).unsqueeze(-1)
    v = torch.where(w > 0, values, torch.zeros_like(values))
    mean = (w * v).sum(dim=1)
    var = (w * (v - mean.unsqueeze(1)).square()).sum(dim=1)
    return mean, var


def _gather(logp: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    if ids is None:
        return torch.full(logp.shape[:1], torch.nan, dtype=torch.float64, device=logp.device)
    return logp.gather(-1, ids.to(torch.long).view(-1, 1)).squeeze(-1)


def _threshold(scores: torch.Tensor, lb_cut: torch.Tensor, min_p: float | None) -> torch.Tensor:
    """τ [N] from the scores s [N, V] and log b [N, V] of top-k and top-p alone: the lowest score they keep
    (−inf where they keep every token of finite score: an EOS ban's −inf scores are no threshold), raised to
    min-p's bound max s + log(min_p), which is a bound rather than a score (the streamed τ, tiling.threshold)."""
    kept = torch.isfinite(lb_cut)
    tau = torch.where(kept, scores, torch.full_like(scores, torch.inf)).amin(-1)
    tau = torch.where((kept == torch.isfinite(scores)).all(-1), torch.full_like(tau, -torch.inf), tau)
    return tau if min_p is None else torch.maximum(tau, scores.amax(-1) + math.log(min_p))


def _sampler_values(lq, lb, f, ids, scores, tau) -> SamplerValues:
    """SamplerValues of log b [N, V] for values f [N, V, F], with log q [N, V] for the q-mass b misses, and
    the scores s [N, V] b is built from with its threshold τ [N]."""
    mean, var = _moments(lb, f)
    neg = _moments(lb, (f < 0).to(torch.float64))[0]
    miss = torch.where(torch.isneginf(lb), torch.exp(lq), torch.zeros_like(lq)).sum(dim=-1)
    log_mean, log_var = (t.squeeze(-1) for t in _moments(lb, lb.unsqueeze(-1)))
    gap = torch.where(torch.isneginf(lb), torch.zeros_like(lb), lb - lq)
    kl_q, gap_abs = (t.squeeze(-1) for t in _moments(lb, torch.stack([gap, gap.abs()], -1))[0].split(1, -1))
    chi2 = torch.where(torch.isneginf(lb), torch.zeros_like(lb), torch.exp(2 * lq - lb)).sum(-1) - 1.0
    return SamplerValues(mean, var, neg, miss, log_mean, log_var, _gather(lb, ids), kl_q, chi2, gap_abs,
                         _gather(scores, ids), tau)


def position_values(policy: torch.Tensor, reference: torch.Tensor, estimators: Sequence = ("k1", "k3"),
                    sampler: Sampler | None = None, *, ids: torch.Tensor | None = None,
                    eos_banned: torch.Tensor | None = None, context_ids: torch.Tensor | None = None,
                    sampling: torch.Tensor | None = None) -> PositionValues:
    """Exact per-position values from logits ``policy`` [N, V] and ``reference`` [N, V] (any float dtype).

    ``ids`` [N]: the token sampled at each position (for the sampled-token columns); ``eos_banned`` [N]
    and ``context_ids`` [N, L]: per-position inputs of the sampler (:func:`~.generation.sampler_logprobs`);
    ``sampling`` [N, V]: the policy's logits in the pass that drew the tokens, where it differs from the
    scored pass (dropout, position ids, a cache, precision): its sampler values are ``g``.
    Memory: a few [N, V, F] float64 tensors; for large V use :func:`kl_bench.audit.stream.stream_values`."""
    # Arrays and lists taken as tensors (an ndarray had been "'numpy.ndarray' object has no attribute 'to'")
    policy, reference = as_real_tensor(policy, "policy"), as_real_tensor(reference, "reference")
    sampling = None if sampling is None else as_real_tensor(sampling, "sampling")
    if policy.shape != reference.shape or policy.ndim != 2:
        raise SpecError(f"policy and reference logits must be [N, V] of one shape, got {list(policy.shape)} "
                        f"and {list(reference.shape)}")
    if policy.shape[-1] == 0:
        raise ShapeError("policy and reference logits need a vocabulary: V must be ≥ 1, got [N, 0]")
    for t, what in ((policy, "policy"), (reference, "reference"), (sampling, "sampling")):
        if t is not None and t.device.type != "meta":    # meta tensors (the device-rule tests) hold no values
            check_logits(t, key=what)    # NaN or +inf: every value would be NaN; −inf marks a zero probability
    if sampling is not None and sampling.shape != policy.shape:
        raise SpecError(f"the sampling pass's logits must be [N, V] = {list(policy.shape)}, got {list(sampling.shape)}")
    names, fns = estimator_functions(estimators)
    sampler = sampler or Sampler()
    lq = torch.log_softmax(policy.to(torch.float64), dim=-1)
    lp = torch.log_softmax(reference.to(torch.float64), dim=-1)
    logr = lp - lq
    f = torch.stack([fn(logr) for fn in fns], dim=-1) if fns else logr.new_zeros(logr.shape + (0,))
    mean_q, var_q = _moments(lq, f)
    kl = _moments(lq, (-logr).unsqueeze(-1))[0].squeeze(-1)

    def under(logits):
        lb = lq if logits is policy and sampler.is_identity else \
            sampler_logprobs(logits, sampler, eos_banned=eos_banned, context_ids=context_ids)
        s = sampler_scores(logits.to(torch.float64), sampler, eos_banned=eos_banned, context_ids=context_ids)
        cut = lb if sampler.mp is None else sampler_logprobs(logits, replace(sampler, min_p=None),
                                                              eos_banned=eos_banned, context_ids=context_ids)
        return _sampler_values(lq, lb, f, ids, s, _threshold(s, cut, sampler.mp))
    b = under(policy)
    g = None if sampling is None else under(sampling)
    return PositionValues(names, kl, mean_q, var_q, _gather(lq, ids), _gather(lp, ids), b, g)
