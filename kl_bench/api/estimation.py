"""``kl_bench.estimate``: per-token values of any estimator on a trainer's own tensors, inside a training
loop. It imports the estimators and torch, and no case kind (tests/test_api.py checks it in a fresh
process), so a trainer pays nothing for the rest of kl-bench."""
from __future__ import annotations

import torch

from ..foundation.errors import ShapeError, SpecError
from ..core.estimators import resolve_estimator


def estimate(*args, policy: torch.Tensor | None = None, reference: torch.Tensor | None = None,
             estimator="k3", policy_logits: torch.Tensor | None = None,
             reference_logits: torch.Tensor | None = None, ids: torch.Tensor | None = None,
             mask: torch.Tensor | None = None, aggregation: str | None = None) -> torch.Tensor:
    """Per-token values (or their aggregate) of a registered estimator on a trainer's tensors.

    Keywords only: ``estimate(policy=logprobs, reference=ref_logprobs, estimator="k3")``. Which side is
    which decides the sign of log r = log p − log q, and trainers disagree on the order of positional
    arguments (TRL, verl and OpenRLHF pass the policy first; an older form of this function took the
    reference first), so a positional call is refused (a TypeError saying so) rather than read in one
    order or the other: a swap would silently flip the direction of the KL.

    ``policy``, ``reference``: log q(x) and log p(x) of the sampled tokens, any (equal) shape and dtype;
    the values are computed in that dtype, as a trainer would, and autograd flows through them.
    ``policy_logits``, ``reference_logits`` [..., V] instead: with ``ids`` [...] (the sampled tokens) the
    log-probs are their log-softmax (in the logits' dtype) at ``ids``; with ``estimator="full"`` the value
    at each position is the exact KL(q‖p) = Σ_v q log(q/p), in float64 (kl_bench.audit). ``mask``
    (the values' shape, bool or 0/1) zeroes padding. ``aggregation``: ``"token-mean"``,
    ``"seq-mean-token-mean"`` or ``"seq-mean-token-sum"`` (with a [B, T] mask; the trainers' formulas,
    kl_bench.audit.aggregate) returns one 0-d tensor. ``estimator``: a registry name, a plug-in
    reference, or an Estimator.

    >>> import torch, kl_bench
    >>> logq = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.5]], dtype=torch.float64))
    >>> logp = torch.log(torch.tensor([[0.25, 0.25], [0.5, 1.0]], dtype=torch.float64))
    >>> mask = torch.tensor([[1, 1], [1, 0]])
    >>> kl_bench.estimate(policy=logq, reference=logp, estimator="k3", mask=mask).round(decimals=4).tolist()
    [[0.1931, 0.0], [0.0, 0.0]]
    >>> round(kl_bench.estimate(policy=logq, reference=logp, estimator="k3", mask=mask,
    ...                         aggregation="token-mean").item(), 4)
    0.0644
    """
    if args:
        raise TypeError(f"estimate() takes keyword arguments only, got {len(args)} positional: call "
                        "estimate(policy=..., reference=..., estimator=...) (positional tensors could be read in "
                        "either order, and a swap flips the direction of the KL silently)")
    est = resolve_estimator(estimator)
    logq, logp = _estimate_inputs(policy, reference, policy_logits, reference_logits, ids, est)
    if est.analytic:
        from ..audit.exact import position_values
        v = logq.shape[-1]
        values = position_values(logq.detach().reshape(-1, v), logp.detach().reshape(-1, v), ()).kl.view(logq.shape[:-1])
    else:
        values = est.fn(logp - logq)
    if mask is None:
        if aggregation is not None:
            raise SpecError("an aggregation needs the mask", key="mask")
        return values
    mask = torch.as_tensor(mask, device=values.device)
    if mask.shape != values.shape:
        raise ShapeError(f"mask must have the log-probs' shape {list(values.shape)}, got {list(mask.shape)}")
    if aggregation is not None:
        from ..audit.aggregate import aggregate
        return aggregate(values, mask, aggregation)
    # where, not a product: a padded position may hold inf or NaN log-probs, and inf·0 would be NaN.
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def _estimate_inputs(policy, reference, policy_logits, reference_logits, ids, est):
    """(log q, log p) for :func:`estimate`: sampled tokens' log-probs, or logits [..., V] for ``full``."""
    forms = [(policy, reference), (policy_logits, reference_logits)]
    given = [i for i, (a, b) in enumerate(forms) if a is not None or b is not None]
    if len(given) != 1 or any(x is None for x in forms[given[0]] if given):
        raise SpecError("give policy= and reference= (the sampled tokens' log-probs), or policy_logits= and "
                        "reference_logits=: one pair, both sides")
    q, p = (torch.as_tensor(x) for x in forms[given[0]])  # host: the caller's tensors keep their device
    if q.shape != p.shape:
        raise ShapeError(f"policy and reference must have one shape, got {list(q.shape)} and {list(p.shape)}")
    logits = given[0] == 1
    if est.analytic:
        if not logits or ids is not None:
            raise SpecError(f"'{est.name}' needs the full next-token distributions: policy_logits= and "
                            "reference_logits= [..., V], no ids")
        return q, p
    return _sampled_logprobs(q, p, ids) if logits else (q, p)


def _sampled_logprobs(q: torch.Tensor, p: torch.Tensor, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [..., V] of both sides → the log-probs [...] of the sampled tokens ``ids`` [...]."""
    if ids is None:
        raise SpecError("logits need ids= (the sampled tokens) for a per-token estimator")
    ids = torch.as_tensor(ids, device=q.device).to(torch.long)
    if ids.shape != q.shape[:-1]:
        raise ShapeError(f"ids must have the logits' shape without the vocabulary {list(q.shape[:-1])}, "
                        f"got {list(ids.shape)}")
    q = torch.log_softmax(q, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    p = torch.log_softmax(p, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return q, p
