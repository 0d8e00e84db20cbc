"""``kl_bench.estimate``: per-token values of any estimator on a trainer's own tensors, inside a training
loop. It imports the estimators and torch, and no case kind (tests/test_api.py checks it in a fresh
process), so a trainer pays nothing for the rest of kl-bench."""
from __future__ import annotations

import torch

from ..foundation.errors import ShapeError, SpecError
from ..core.estimators import resolve_estimator
from ..core.logprob_checks import as_mask, as_real_tensor, check_logits, first_index


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

    Refused with a :class:`SpecError` naming the argument (a :class:`ShapeError` for shapes): logits with
    NaN, +inf or a row all −inf (as a spec's logits are), a vocabulary V of 0, ``ids`` that are not
    integers or lie outside [0, V), ``ids`` with log-probs instead of logits, a ``mask`` that is neither
    bool nor all 0 and 1 (−1, 0.5, NaN: the per-token values would read it as bool, an aggregation as a
    weight), a meta tensor where values are read. NaN or ±inf log-probs (``policy``, ``reference``) are the caller's: a padded position may
    hold them, and ``mask`` zeroes it.

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
    if aggregation is not None and not isinstance(aggregation, str):
        raise SpecError(f"must be the name of an aggregation (e.g. 'token-mean') or None, got "
                        f"{type(aggregation).__name__}", key="aggregation")
    logq, logp = _estimate_inputs(policy, reference, policy_logits, reference_logits, ids, est)
    if est.analytic:
        from ..audit.exact import position_values
        v = logq.shape[-1]
        values = position_values(logq.detach().reshape(-1, v), logp.detach().reshape(-1, v), ()).kl.view(logq.shape[:-1])
    else:
        values = est.fn(logp - logq)
    return _masked(values, mask, aggregation)


def _masked(values: torch.Tensor, mask, aggregation: str | None) -> torch.Tensor:
    """:func:`estimate`'s values with ``mask`` applied (padding zeroed), or their ``aggregation``."""
    if mask is None:
        if aggregation is not None:
            raise SpecError("an aggregation needs the mask", key="mask")
        return values
    mask = as_mask(mask, "mask").to(values.device)
    if mask.shape != values.shape:
        raise ShapeError(f"mask must have the log-probs' shape {list(values.shape)}, got {list(mask.shape)}")
    if aggregation is not None:
        from ..audit.aggregate import aggregate
        return aggregate(values, mask, aggregation)
    # where, not a product: a padded position may hold inf or NaN log-probs, and inf·0 would be NaN.
    return torch.where(mask.bool(), values, torch.zeros_like(values))


def _needs_logits(est) -> SpecError:
    return SpecError(f"'{est.name}' needs the full next-token distributions: policy_logits= and "
                     "reference_logits= [..., V], no ids")


def _estimate_inputs(policy, reference, policy_logits, reference_logits, ids, est):
    """(log q, log p) for :func:`estimate`: sampled tokens' log-probs, or logits [..., V] for ``full``."""
    q, p, names = _given_pair(policy, reference, policy_logits, reference_logits)
    if names[0] == "policy":
        if ids is not None:       # silently unused, it would hide that these are not the logits it goes with
            raise SpecError("ids= goes with policy_logits= and reference_logits=; policy= and reference= are "
                            "the sampled tokens' log-probs already", key="ids")
        if est.analytic:
            raise _needs_logits(est)
        return q, p
    q, p = (_checked_logits(x, key) for x, key in zip((q, p), names))
    if est.analytic:
        if ids is not None:
            raise _needs_logits(est)
        return q, p
    return _sampled_logprobs(q, p, ids)


def _given_pair(policy, reference, policy_logits, reference_logits) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """The one pair given (log-probs or logits) as tensors of one shape, with its arguments' names."""
    forms = [(policy, reference), (policy_logits, reference_logits)]
    given = [i for i, (a, b) in enumerate(forms) if a is not None or b is not None]
    if len(given) != 1 or any(x is None for x in forms[given[0]] if given):
        raise SpecError("give policy= and reference= (the sampled tokens' log-probs), or policy_logits= and "
                        "reference_logits=: one pair, both sides")
    names = ("policy_logits", "reference_logits") if given[0] == 1 else ("policy", "reference")
    q, p = (as_real_tensor(x, key) for x, key in zip(forms[given[0]], names))  # host: the caller's tensors keep their device
    if q.shape != p.shape:
        raise ShapeError(f"{names[0]} and {names[1]} must have one shape, got {list(q.shape)} and {list(p.shape)}")
    return q, p, names


def _no_data(t: torch.Tensor, key: str) -> None:
    """A meta tensor has a shape and no values: a check of its values (NaN, a token id's range) cannot run."""
    if t.device.type == "meta":
        raise SpecError("a tensor on the 'meta' device has a shape but no data", key=key)


def _checked_logits(t: torch.Tensor, key: str) -> torch.Tensor:
    """Logits [..., V] with V ≥ 1 whose every row is a distribution, refused as a spec's are
    (kl_bench.sampling.logits.check_logits: NaN, +inf, a row all −inf). Integer logits are read as float64
    (the softmax needs a float)."""
    _no_data(t, key)
    if t.ndim == 0 or t.shape[-1] == 0:
        raise ShapeError(f"{key} must be [..., V] with a vocabulary V ≥ 1, got {list(t.shape)}")
    if not t.is_floating_point():
        t = t.to(torch.float64)
    check_logits(t, key=key)
    return t


def _sampled_logprobs(q: torch.Tensor, p: torch.Tensor, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [..., V] of both sides → the log-probs [...] of the sampled tokens ``ids`` [...]."""
    if ids is None:
        raise SpecError("logits need ids= (the sampled tokens) for a per-token estimator")
    ids = as_real_tensor(ids, "ids")
    _no_data(ids, "ids")
    if ids.shape != q.shape[:-1]:
        raise ShapeError(f"ids must have the logits' shape without the vocabulary {list(q.shape[:-1])}, "
                        f"got {list(ids.shape)}")
    # Float ids were truncated (2.7 → token 2) before: a token id is a whole number, so the dtype says so.
    if ids.is_floating_point():
        raise SpecError(f"must hold integer token ids, got dtype {ids.dtype}", key="ids")
    ids = ids.to(q.device, torch.long)
    v = q.shape[-1]
    out = (ids < 0) | (ids >= v)
    if bool(out.any()):     # gather's own error names neither ids nor V; a negative id is no token either
        raise SpecError(f"token ids must lie in [0, V) = [0, {v}) (V: the logits' last dimension), got "
                        f"{int(ids[out][0])} at index {first_index(out)}", key="ids")
    q = torch.log_softmax(q, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    p = torch.log_softmax(p, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return q, p
