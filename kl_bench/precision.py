"""The arithmetic precision of the log-probs that feed an estimator, as a trainer computes them.

A case key ``precision = { logits = "bf16", logprobs = "float32", estimator = "float32" }``: the logits
are rounded to ``logits``, log-softmax is computed in ``logprobs``, and log r = log p − log q and the
estimator are computed in ``estimator`` (each one of float64, float32, bfloat16, float16, also spelled
fp64, fp32, bf16, fp16; a missing key is float64). Draws still come from the exact q (or the sampler) and
the truth stays the float64 KL.

Why the oracles stay exact: the rounded per-token value v(c, x) = f(round(log p̃(x|c)) − round(log q̃(x|c)))
is a fixed function of (context, token), so E_q[v] = Σ_x q(x|c) v(c, x) is an exact float64 sum for
categoricals, and the token rows of a rollout keep their dynamic program (whose per-step table is v). The
rounding is therefore a deterministic transform of two tables: the per-(context, token) log-ratio (which
:func:`rounded_logr` computes once, stored as float64 values that are exactly representable in the
``estimator`` dtype) and the estimator's values (:func:`in_precision` evaluates the estimator in that
dtype). No oracle exists for a continuous pair (a Gaussian), where rounding would change the
distribution of log r: the key is refused there.

As logits, kl-bench rounds the case's normalised log-probabilities (log-softmax is invariant to a shift,
rounding is not: a model's raw logits carry a per-context offset that changes which values round where;
the normalised ones are the reproducible choice).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .config import Table
from .estimators import Estimator, RowSource

# Canonical names and accepted spellings.
DTYPES: dict[str, torch.dtype] = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}
ALIASES = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
           **{k: k for k in DTYPES}}
SHORT = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
KEYS = ("logits", "logprobs", "estimator")


@dataclass(frozen=True)
class Precision:
    """Dtypes (canonical names) of the three stages of a trainer's log-prob pipeline."""
    logits: str = "float64"
    logprobs: str = "float64"
    estimator: str = "float64"

    def dtype(self, stage: str) -> torch.dtype:
        return DTYPES[getattr(self, stage)]

    def describe(self) -> str:
        """e.g. 'logits bf16, log-softmax fp32, estimator fp32'."""
        return (f"logits {SHORT[self.logits]}, log-softmax {SHORT[self.logprobs]}, "
                f"estimator {SHORT[self.estimator]}")


def parse_precision(t: Table) -> Precision | None:
    """The optional ``precision`` sub-table of a case (unknown keys and dtypes are one-line errors)."""
    if not t.has("precision"):
        return None
    sub = t.sub("precision")
    values = {}
    for k in KEYS:
        v = sub.get(k, "str", "float64", lambda v: None if v in ALIASES else
                    f"must be one of float64, float32, bfloat16, float16 (or fp64, fp32, bf16, fp16), got '{v}'")
        values[k] = ALIASES[v]
    sub.finish(list(KEYS))
    return Precision(**values)


def rounded_logr(log_q: torch.Tensor, log_p: torch.Tensor, precision: Precision) -> torch.Tensor:
    """log r = log p̃ − log q̃ as the trainer computes it: logits rounded to ``logits``, log-softmax in
    ``logprobs``, the difference in ``estimator``. [..., V] float64 (exactly the rounded values)."""
    def logprobs(logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.to(precision.dtype("logits")).to(precision.dtype("logprobs")), -1)
    de = precision.dtype("estimator")
    return (logprobs(log_p).to(de) - logprobs(log_q).to(de)).to(torch.float64)


def _in_dtype(logr: torch.Tensor, base, dtype: torch.dtype) -> torch.Tensor:
    # The table's values are already representable in ``dtype`` (rounded_logr), so .to(dtype) is exact;
    # the estimator's own arithmetic (exp, squares, the clamps) then rounds as the trainer's does.
    return base(logr.to(dtype)).to(logr.dtype)


def in_precision(source: RowSource, precision: Precision) -> RowSource:
    """``source`` evaluated in the ``estimator`` dtype; pair-supplied rows and cv(λ) rows (whose λ curve
    is a float64 analysis of the same rounded log r) are returned unchanged. The result has no polynomial
    form any more (rounding is not a polynomial), so on rollouts it gets token-level rows only."""
    if source.analytic or source.lam is not None or precision == Precision():
        return source
    return Estimator(source.name, functools.partial(_in_dtype, base=source.fn, dtype=precision.dtype("estimator")),
                     source.target, False, source.nonnegative, f"{source.formula} in {SHORT[precision.estimator]}",
                     straight_through=source.straight_through, weighted=source.weighted, source=source.source,
                     library_mode=source.library_mode)
