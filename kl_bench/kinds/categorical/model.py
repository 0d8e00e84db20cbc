"""A categorical case's frozen tables: q, p (and a sampler b) over B contexts × V tokens, the (context, token)
ids the sampler draws, and every per-id quantity the oracle, the sampler, the gradients, the baselines and
training read. Nothing here draws or caches: building it is O(B·V), and the parts are functions of it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...core.precision import Precision, rounded_logr
from ...core.weights import WeightCorrection
from ...foundation.errors import SpecError


@dataclass(frozen=True)
class CategoricalModel:
    """``log_q``, ``log_p``: normalised float64 log-probabilities [B, V]; ``log_b``: a sampler b ≠ q that draws
    the tokens while the estimators keep using q's and p's log-probs (None: q draws). Per drawn id [M]
    (flattened context·V + token, those the sampler can draw): ``support`` the ids, ``logr`` log r as the
    estimators see it (rounded where ``precision`` is set), ``full`` the context's analytic KL, ``is_weight``
    the importance weight q/b after the ``correction`` (None: unweighted), ``raw_weight`` q/b before it, and
    ``logq`` log q(x) of the id (for the estimators of the token's own probabilities),
    ``pvals`` the sampling distribution renormalised in float64 (numpy's multinomial checks that it sums
    to 1). ``support_miss``: the mass of q that b never draws (mean over contexts). ``rounded``: the
    precision's rounding input (kl_bench.core.precision), for run.json."""
    log_q: torch.Tensor
    log_p: torch.Tensor
    log_b: torch.Tensor | None
    support: torch.Tensor
    logr: torch.Tensor
    full: torch.Tensor
    is_weight: torch.Tensor | None
    raw_weight: torch.Tensor | None
    pvals: np.ndarray
    support_miss: float
    logq: torch.Tensor
    correction: WeightCorrection
    precision: Precision | None = None
    rounded: Any = None

    @classmethod
    def build(cls, log_q: torch.Tensor, log_p: torch.Tensor, log_b: torch.Tensor | None = None,
              weights: str = "none", correction: WeightCorrection | None = None, precision: Precision | None = None,
              logits: tuple[torch.Tensor, torch.Tensor] | None = None) -> "CategoricalModel":
        """The tables of q, p and b ([B, V] each; ``weights`` "token" multiplies every estimate by q/b after
        ``correction``; ``precision`` rounds log r as a trainer does from ``logits``, (q's, p's) as the source
        holds them, None: the log-probs are what is given)."""
        log_q, log_p = log_q.to(torch.float64), log_p.to(torch.float64)
        log_b = None if log_b is None else log_b.to(torch.float64)
        sample = log_q if log_b is None else log_b
        if log_b is not None and bool(((log_b > -torch.inf) & (log_q == -torch.inf)).any()):
            raise SpecError("the sampler draws tokens that q gives probability 0", key="sampler")
        # Draws come from the mixture (1/B) b(x|context) over the flattened (context, token) ids; ids
        # that b never draws are dropped so that a −inf log-ratio never meets a zero count (0·inf = NaN).
        w = (sample.exp() / sample.shape[0]).reshape(-1)
        support = torch.nonzero(w > 0).squeeze(1)
        logr = (log_p - log_q).reshape(-1)[support]
        rounded = None
        if precision is not None:       # a fixed function of (context, token): exact sums stay exact
            rounded = precision.rounding_input(logits, log_q, log_p)
            logr = rounded_logr(*rounded, precision).reshape(-1)[support]
        pw = w[support].numpy()
        # Importance weights q/b of the drawn ids (a cap bounds the variance at the price of bias).
        correction = correction if correction is not None else WeightCorrection()
        is_weight = raw_weight = None
        if log_b is not None and weights == "token":
            raw_weight = torch.exp((log_q - log_b).reshape(-1)[support])
            is_weight = correction.detached(raw_weight)
        # Mass of q that b never draws: an unweighted estimate is biased, a weighted one misses it. "Never" as
        # the sampler draws: where b's probability is 0 in float64 (log b = −inf, or below −745 as a
        # temperature near 0 makes it: such a token is left out of the draws' support above).
        support_miss = 0.0 if log_b is None else float((log_q.exp() * (log_b.exp() == 0)).sum(-1).mean())
        # The `full` estimator: each (context, token) entry carries its context's analytic KL.
        kl_ctx = torch.where(log_q.exp() > 0, log_q.exp() * (log_q - log_p), torch.zeros_like(log_q)).sum(-1)
        full = kl_ctx[:, None].expand_as(log_q).reshape(-1)[support]
        return cls(log_q, log_p, log_b, support, logr, full, is_weight, raw_weight, pw / pw.sum(), support_miss,
                   log_q.reshape(-1)[support], correction, precision, rounded)

    @property
    def contexts(self) -> int:
        return int(self.log_q.shape[0])

    @property
    def vocab(self) -> int:
        return int(self.log_q.shape[1])

    @property
    def ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(context index, token index) of every drawn id, int64 [M] each."""
        return self.support // self.vocab, self.support % self.vocab

    def weights(self) -> torch.Tensor:
        """The sampling distribution (b, or q) over the drawn ids, (1/B) b(x|context), [M]."""
        sample = self.log_q if self.log_b is None else self.log_b
        return (sample.exp() / self.contexts).reshape(-1)[self.support]

    def values(self, est) -> torch.Tensor:
        """Per-id values of a row source (an estimator of log r, or ``full``), importance-weighted where the
        sampler is, [M]."""
        v = self.full if est.analytic else est.on(self.logr, self.logq)
        return v if self.is_weight is None else v * self.is_weight
