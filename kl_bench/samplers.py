"""Sampling mismatch: draws come from b ≠ q while the estimators keep using q's and p's log-probs.

Each case kind declares which sampler keys it understands (``sampler_keys`` of its registration); a key
that a kind does not declare is refused for that kind, so a new key can never be silently ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import Table, nonnegative, positive
from .logits import LogitsSource, parse_logits_source
from .registry import did_you_mean

@dataclass(frozen=True)
class SamplerSpec:
    """b is q (or ``behavior``, a stale policy) with ``temperature``, then ``top_k``, then ``top_p``
    applied, and EOS suppressed for the first ``min_length`` tokens (rollouts); for Gaussians
    b = N(μq, (std_scale·σq)²). ``weights`` multiplies estimates by q/b: per token ("token") or by the
    product over the sequence ("sequence"); ``weight_cap`` caps each token's q/b.
    """
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_length: int = 0
    std_scale: float = 1.0
    behavior: "LogitsSource | None" = None
    weights: str = "none"
    weight_cap: float | None = None

    def describe(self) -> str:
        bits = []
        if self.behavior is not None:
            bits.append("stale behavior policy")
        if self.temperature != 1.0:
            bits.append(f"T={self.temperature:g}")
        if self.top_k is not None:
            bits.append(f"top-k={self.top_k}")
        if self.top_p is not None:
            bits.append(f"top-p={self.top_p:g}")
        if self.min_length:
            bits.append(f"EOS suppressed for {self.min_length} tokens")
        if self.std_scale != 1.0:
            bits.append(f"std×{self.std_scale:g}")
        if self.weights != "none":
            bits.append(f"{self.weights} IS weights" + (f" capped at {self.weight_cap:g}" if self.weight_cap else ""))
        return "sampler b: " + (", ".join(bits) or "q itself")


# b = N(μq, (std_scale·σq)²): its variance and the squared standard scores of the exact moments must stay
# finite in float64 (≈ 1.8e308); 1e150² = 1e300 leaves room for σq and the scores.
MAX_STD_SCALE = 1e150


def parse_sampler(t: Table, kind: str, allowed: tuple[str, ...], weight_kinds: tuple[str, ...],
                  others: dict[str, tuple[str, ...]], spec_dir: Path) -> SamplerSpec:
    """A case's ``sampler`` table. ``allowed``: the keys this kind declares; ``weight_kinds``: the
    ``weights`` values it supports; ``others``: every kind's keys (for the hint on a refused key)."""
    for k in t.data:
        if k not in allowed:
            where = [name for name, keys in others.items() if k in keys]
            hint = f" (only for {' and '.join(where)} cases)" if where else did_you_mean(k, list(allowed))
            raise t.error(f"unknown key for a {kind} sampler{hint}; allowed: {', '.join(allowed)}", key=t.key(k))
    behavior = parse_logits_source(t, "behavior", "b", spec_dir) if t.has("behavior") else None
    weights = ("none",) + tuple(weight_kinds)
    sampler = SamplerSpec(
        temperature=t.get("temperature", "float", 1.0, positive),
        top_k=t.get("top_k", "int", None, lambda v: None if v >= 1 else f"must be ≥ 1, got {v}"),
        top_p=t.get("top_p", "float", None, lambda v: None if 0 < v <= 1 else f"must lie in (0, 1], got {v}"),
        min_length=t.get("min_length", "int", 0, nonnegative),
        std_scale=t.get("std_scale", "float", 1.0, lambda v: positive(v) or (
            None if v <= MAX_STD_SCALE else f"must be ≤ {MAX_STD_SCALE:g} (the variance (std_scale·σ)² must stay "
            f"within float64), got {v:g}")),
        behavior=behavior,
        weights=t.get("weights", "str", "none", lambda v: None if v in weights else
                      f"must be one of {', '.join(weights)}, got '{v}'{did_you_mean(v, list(weights))}"),
        weight_cap=t.get("weight_cap", "float", None, positive),
    )
    t.finish()
    if sampler.weight_cap is not None and sampler.weights == "none":
        raise t.error("weight_cap needs weights = \"token\" or \"sequence\"", key=t.key("weight_cap"))
    return sampler
