"""The sampling distribution b of generation code, exactly, from the policy's logits.

transformers (and TRL through it) turns the policy's logits z into b by this chain, in this order
(``GenerationMixin._get_logits_processor``): the repetition penalty (z/θ where z > 0, z·θ where z < 0,
at every id already in the context), EOS banned until ``min_new_tokens`` completion tokens exist, the
temperature, top-k (ties at the k-th value kept), top-p (the smallest set of most likely tokens whose
mass reaches p; the most likely token always stays), min-p (tokens with probability below
min_p × the largest probability dropped). Every step after the temperature keeps exactly the tokens whose
score s = (transformed z)/T is at least a per-row threshold τ, so that

    b(x) = exp(s(x)) · 1[s(x) ≥ τ] / Σ_y exp(s(y)) · 1[s(y) ≥ τ].

The dense form below uses :meth:`kl_bench.sampling.mismatch.SamplerSpec.reshape` (temperature, top-k, top-p) and adds
what it lacks; the streamed form (kl_bench.audit.stream) finds the same τ tile by tile.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

import torch

from ..foundation.errors import SpecError
from ..sampling.mismatch import SamplerSpec


@dataclass(frozen=True)
class Sampler:
    """Generation settings that change b. ``None``/1.0/0 mean "off", as in transformers' GenerationConfig.
    ``eos_token_id``: the ids banned while fewer than ``min_new_tokens`` completion tokens exist."""
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    min_new_tokens: int = 0
    eos_token_id: tuple[int, ...] = ()
    repetition_penalty: float = 1.0

    def __post_init__(self):
        _check_types(self)

        def bad(key, msg):
            raise SpecError(msg, key=f"sampler.{key}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            bad("temperature", f"must be a positive number, got {self.temperature}")
        if self.top_k is not None and self.top_k < 0:
            bad("top_k", f"must be ≥ 0 (0: off), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            bad("top_p", f"must lie in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            bad("min_p", f"must lie in [0, 1], got {self.min_p}")
        if self.min_new_tokens < 0:
            bad("min_new_tokens", f"must be ≥ 0, got {self.min_new_tokens}")
        if self.min_new_tokens and not self.eos_token_id:
            bad("min_new_tokens", "needs eos_token_id")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            bad("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}")

    @classmethod
    def from_dict(cls, d: dict, file: str | None = None) -> "Sampler":
        """From a dict (a saved step's ``generation`` settings); an unknown key, or a value of the wrong type
        or range, is an error naming it (key ``generation.<name>``)."""
        known = {f.name for f in fields(cls)}
        for k in d:
            if k not in known:
                raise SpecError(f"unknown generation setting; known: {', '.join(sorted(known))}", file=file,
                                key=f"generation.{k}")
        d = dict(d)
        if "eos_token_id" in d:
            e = d["eos_token_id"]
            d["eos_token_id"] = () if e is None else tuple(e) if isinstance(e, (list, tuple)) else (e,)
        try:
            return cls(**d)
        except SpecError as e:
            key = e.key or ""
            raise SpecError(e.message, file=e.file or file,
                            key="generation." + key.removeprefix("sampler.") if key else "generation") from None

    @property
    def spec(self) -> SamplerSpec:
        """What this shares with the engine's sampler model (temperature, top-k, top-p) as that model: the one
        definition of how they reshape b (kl_bench.sampling.mismatch.SamplerSpec); the rest (the repetition
        penalty, the EOS ban, min-p) is generation's own and applied around it."""
        return SamplerSpec(temperature=self.temperature, top_k=self.k, top_p=self.p)

    # Normalised views: 0/None/1.0 → off.
    @property
    def k(self) -> int | None:
        return self.top_k if self.top_k else None

    @property
    def p(self) -> float | None:
        return self.top_p if self.top_p is not None and self.top_p < 1 else None

    @property
    def mp(self) -> float | None:
        return self.min_p if self.min_p else None

    @property
    def truncates(self) -> bool:
        """b drops tokens (a threshold τ > −∞ in some row)."""
        return self.k is not None or self.p is not None or self.mp is not None

    @property
    def is_identity(self) -> bool:
        """b = q at every position (nothing set)."""
        return (self.temperature == 1.0 and not self.truncates and self.repetition_penalty == 1.0
                and self.min_new_tokens == 0)

    def describe(self) -> str:
        bits = [f"{n}={getattr(self, n)}" for n in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
                if getattr(self, n) not in (None, 0, 1.0)]
        if self.min_new_tokens:
            bits.append(f"min_new_tokens={self.min_new_tokens}")
        return "b = q" if self.is_identity else "b: " + ", ".join(bits)


# What each setting must hold: (integer only, None allowed). Booleans are neither numbers nor integers here
# (JSON's true would otherwise pass as 1).
_TYPES = {"temperature": (False, False), "top_k": (True, True), "top_p": (False, True), "min_p": (False, True),
          "min_new_tokens": (True, False), "repetition_penalty": (False, False)}


def _is_number(x, integer: bool) -> bool:
    kind = numbers.Integral if integer else numbers.Real
    return isinstance(x, kind) and not isinstance(x, bool)


def _check_types(s: Sampler) -> None:
    """Each setting's type, before its range is compared (a list or a string had raised TypeError from the
    comparison, top_k = true or 1.5 a TypeError from torch.topk deep in the audit)."""
    for name, (integer, optional) in _TYPES.items():
        value = getattr(s, name)
        if value is None and optional:
            continue
        if not _is_number(value, integer):
            what = "an integer" if integer else "a number"
            raise SpecError(f"must be {what}{' or null' if optional else ''}, got {type(value).__name__} {value!r}"[:200],
                            key=f"sampler.{name}")
        _check_size(value, name)
    if not isinstance(s.eos_token_id, tuple) or not all(_is_number(e, True) for e in s.eos_token_id):
        shown = list(s.eos_token_id) if isinstance(s.eos_token_id, tuple) else s.eos_token_id
        raise SpecError(f"must be an integer token id or a list of them, got {shown!r}"[:200],
                        key="sampler.eos_token_id")
    for e in s.eos_token_id:
        _check_size(e, "eos_token_id")
    if any(e < 0 for e in s.eos_token_id):
        raise SpecError(f"must hold token ids ≥ 0, got {list(s.eos_token_id)}"[:200], key="sampler.eos_token_id")


def _check_size(value, name: str) -> None:
    """An integer setting within 2^63 (JSON holds any: a 400-digit temperature in a step's metadata made
    float() raise OverflowError in the range checks, a traceback)."""
    if isinstance(value, int) and abs(value) >= 2**63:
        raise SpecError(f"must be below 2^63 in size, got a {len(str(abs(value)))}-digit integer", key=f"sampler.{name}")


def penalize(logits: torch.Tensor, context_ids: torch.Tensor | None, penalty: float, lo: int = 0) -> torch.Tensor:
    """transformers' repetition penalty on a vocabulary tile [n, t] holding ids [lo, lo + t): at every id
    in the row's ``context_ids`` [n, L] (−1: padding), z > 0 → z/θ, z ≤ 0 → z·θ. Returns a new tensor."""
    if penalty == 1.0 or context_ids is None:
        return logits
    t = logits.shape[-1]
    idx = context_ids.to(torch.long) - lo
    inside = (idx >= 0) & (idx < t)
    seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    seen.scatter_(-1, torch.where(inside, idx, 0), inside)
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def sampler_scores(logits: torch.Tensor, sampler: Sampler, *, lo: int = 0, eos_banned: torch.Tensor | None = None,
                   context_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The score s = (transformed z)/T of a vocabulary tile [n, t] (ids [lo, lo + t)), in the logits' dtype
    (float32 or float64; 16-bit logits are up-cast to float32): repetition penalty, EOS ban (rows where
    ``eos_banned`` [n] is true), temperature. b ∝ exp(s) where s ≥ τ."""
    z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    z = penalize(z, context_ids, sampler.repetition_penalty, lo)
    if eos_banned is not None and sampler.eos_token_id:
        t = z.shape[-1]
        for e in sampler.eos_token_id:
            if lo <= e < lo + t:
                z = z.clone()
                z[:, e - lo] = torch.where(eos_banned, -torch.inf, z[:, e - lo])
    return z / sampler.temperature


def sampler_logprobs(logits: torch.Tensor, sampler: Sampler | None = None, *, eos_banned: torch.Tensor | None = None,
                     context_ids: torch.Tensor | None = None) -> torch.Tensor:
    """log b [N, V] (float64, −inf outside b's support) from the policy's logits [N, V] (any dtype).

    ``eos_banned`` [N] bool: rows where fewer than ``min_new_tokens`` completion tokens precede the
    position; ``context_ids`` [N, L] (−1 padding): the ids the repetition penalty sees at each position."""
    sampler = sampler or Sampler()
    # Temperature, top-k and top-p are kl_bench.sampling.mismatch.SamplerSpec.reshape (the benchmark's own emulation);
    # the penalty and the EOS ban act on the raw logits before it, min-p on its output.
    z = sampler_scores(logits.to(torch.float64), Sampler(repetition_penalty=sampler.repetition_penalty,
                                       min_new_tokens=sampler.min_new_tokens, eos_token_id=sampler.eos_token_id),
                       eos_banned=eos_banned, context_ids=context_ids)
    lb = sampler.spec.reshape(z)
    if sampler.mp is not None:
        # min-p compares probabilities with min_p × the largest one: in log space, a fixed offset from the max.
        keep = lb >= lb.max(dim=-1, keepdim=True).values + math.log(sampler.mp)
        lb = torch.log_softmax(torch.where(keep, lb, torch.full_like(lb, -torch.inf)), dim=-1)
    return lb
