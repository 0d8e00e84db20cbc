"""The arithmetic precision of the log-probs that feed an estimator, as a trainer computes them.

A case key ``precision = { logits = "bf16", logprobs = "float32", estimator = "float32", of = "logits" }``:
the logits are rounded to ``logits``, log-softmax is computed in ``logprobs``, and log r = log p − log q and
the estimator are computed in ``estimator`` (each one of float64, float32, bfloat16, float16, also spelled
fp64, fp32, bf16, fp16; a missing key is float64). Draws still come from the exact q (or the sampler) and
the truth stays the float64 KL.

``of`` says what the ``logits`` dtype rounds:
- ``"logits"`` (default): the logits as the source holds them: a file's or a tensor's raw values, a
  generator's output with its stated offset (``{logits = "zipf", offset = 20.0}``: the top token's logit;
  ``{from = "q", noise = ..., offset = ...}`` adds one to the derived side). This is what a trainer's bf16
  model hands to log-softmax. bf16's spacing grows with the magnitude (2⁻⁸ relative): a raw logit near 20
  is rounded in steps of 2⁻³, a normalised log-prob near 0 in steps far finer, so the offset matters.
- ``"logprobs"``: the case's normalised log-probabilities (log-softmax of the source), rounded as if they
  were the logits: kl-bench's rounding before this option existed, reproducible whatever the offset.
(``kind = "model"`` needs neither: its models run in their own ``dtype``, and their logits are the
model's own output in it.)

Why the oracles stay exact: the rounded per-token value v(c, x) = f(round(log p̃(x|c)) − round(log q̃(x|c)))
is a fixed function of (context, token), so E_q[v] = Σ_x q(x|c) v(c, x) is an exact float64 sum for
categoricals, and the token rows of a rollout keep their dynamic program (whose per-step table is v). The
rounding is therefore a deterministic transform of two tables: the per-(context, token) log-ratio (which
:func:`rounded_logr` computes once, stored as float64 values that are exactly representable in the
``estimator`` dtype) and the estimator's values (:func:`in_precision` evaluates the estimator in that
dtype). No oracle exists for a continuous pair (a Gaussian), where rounding would change the
distribution of log r: the key is refused there.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..foundation.typed_toml import Table
from .estimators import Estimator, RowSource

# Canonical names and accepted spellings.
DTYPES: dict[str, torch.dtype] = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16}
ALIASES = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
           **{k: k for k in DTYPES}}
SHORT = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
KEYS = ("logits", "logprobs", "estimator")
OF = ("logits", "logprobs")     # what the logits dtype rounds: the source's logits, or the normalised log-probs


@dataclass(frozen=True)
class Precision:
    """Dtypes (canonical names) of the three stages of a trainer's log-prob pipeline; ``of``: what the
    first stage rounds (module docstring)."""
    logits: str = "float64"
    logprobs: str = "float64"
    estimator: str = "float64"
    of: str = "logits"

    def dtype(self, stage: str) -> torch.dtype:
        return DTYPES[getattr(self, stage)]

    def describe(self) -> str:
        """e.g. 'logits bf16 as given, log-softmax fp32, estimator fp32' (or 'log-probs rounded to bf16, …')."""
        first = (f"logits {SHORT[self.logits]} as given" if self.of == "logits"
                 else f"log-probs rounded to {SHORT[self.logits]}")
        return f"{first}, log-softmax {SHORT[self.logprobs]}, estimator {SHORT[self.estimator]}"

    def rounding_input(self, logits: tuple[torch.Tensor, torch.Tensor] | None, log_q: torch.Tensor,
                       log_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the ``logits`` dtype rounds, (q side, p side) [..., V]: the source's ``logits`` when
        ``of = "logits"`` and the pair has them (a pair built from log-probs alone is given those), else
        the normalised log-probs."""
        return logits if self.of == "logits" and logits is not None else (log_q, log_p)

    def metadata(self, given: tuple[torch.Tensor, torch.Tensor]) -> dict:
        """For run.json: the dtypes, ``of``, and the largest value rounded on each side (the logit offset
        the rounding saw: 0 for normalised log-probs' top token up to −log of its probability)."""
        return {"logits": self.logits, "logprobs": self.logprobs, "estimator": self.estimator, "of": self.of,
                "max_rounded": {side: float(t[torch.isfinite(t)].max()) for side, t in zip("qp", given)}}


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
    values["of"] = sub.get("of", "str", "logits", lambda v: None if v in OF else
                           f"must be \"logits\" (the source's logits as given) or \"logprobs\" (the normalised "
                           f"log-probs), got '{v}'")
    sub.finish(list(KEYS) + ["of"])
    return Precision(**values)


def rounded_logr(logits_q: torch.Tensor, logits_p: torch.Tensor, precision: Precision) -> torch.Tensor:
    """log r = log p̃ − log q̃ as the trainer computes it from the given logits [..., V] (unnormalised, or
    normalised log-probs: :meth:`Precision.rounding_input` picks): rounded to ``logits``, log-softmax in
    ``logprobs``, the difference in ``estimator``. [..., V] float64 (exactly the rounded values)."""
    def logprobs(logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits.to(precision.dtype("logits")).to(precision.dtype("logprobs")), -1)
    de = precision.dtype("estimator")
    return (logprobs(logits_p).to(de) - logprobs(logits_q).to(de)).to(torch.float64)


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
