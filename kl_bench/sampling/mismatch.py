"""Sampling mismatch: draws come from b ≠ q while the estimators keep using q's and p's log-probs.

Every sampler option is one field of :class:`SamplerSpec`, declared with :func:`option`: its type and
check, how ``describe`` shows it and, for an option that reshapes next-token logits, its transform (applied
in field order by :meth:`SamplerSpec.reshape`; kinds that draw tokens call :meth:`SamplerSpec.logprobs`, so
a new logit option reaches every such kind without an edit there). Each case kind declares which options
it handles (``sampler_keys`` of its registration); an option a kind does not declare is refused for that
kind with one line, so none is ever silently ignored.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..foundation.typed_toml import Table, nonnegative, positive
from ..foundation.errors import SpecError
from .logits import LogitsSource, behavior_logits, parse_logits_source
from ..foundation.registry import did_you_mean
from ..core.draws import Q_ITSELF
from ..core.rejection import Rejection, parse_rejection
from ..core.weights import WeightCorrection


# b = N(μq, (std_scale·σq)²): its variance and the squared standard scores of the exact moments must stay
# finite in float64 (≈ 1.8e308); 1e150² = 1e300 leaves room for σq and the scores.
MAX_STD_SCALE = 1e150


def _std_scale(v: float) -> str | None:
    return positive(v) or (None if v <= MAX_STD_SCALE else f"must be ≤ {MAX_STD_SCALE:g} (the variance "
                           f"(std_scale·σ)² must stay within float64), got {v:g}")


def option(default: Any, kind: str, check: Callable[[Any], str | None] | None = None, *,
           describe: Callable[["SamplerSpec"], str | None] | None = None,
           logits: Callable[[torch.Tensor, Any], torch.Tensor] | None = None):
    """A SamplerSpec field: ``kind``/``check`` for :meth:`config.Table.get`; ``describe(spec)``: its words
    in the sampler's description when set (None: nothing); ``logits(z, value)``: the transform of float64
    logits z [B, V] the option applies when set (−inf outside b's support)."""
    return field(default=default, metadata={"kind": kind, "check": check, "describe": describe, "logits": logits})


def _top_k(z: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (ties at the k-th value are kept too)."""
    if k >= z.shape[-1]:
        return z
    kth = torch.topk(z, k, dim=-1).values[..., -1:]
    return torch.where(z >= kth, z, torch.full_like(z, -torch.inf))


def _top_p(z: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (the first always stays)."""
    if p >= 1:
        return z
    probs = torch.softmax(z, dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p          # mass of the more likely tokens
    keep = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before < p)
    return torch.where(keep, z, torch.full_like(z, -torch.inf))


def _weights_words(sp: "SamplerSpec") -> str:
    more = WeightCorrection.of(sp).words()
    return f"{sp.weights} IS weights" + (f" capped at {sp.weight_cap:g}" if sp.weight_cap else "") \
        + (f", {more}" if more else "")


def _epsilon_low(v: float) -> str | None:
    return None if 0 <= v < 1 else f"must lie in [0, 1) (the clip's lower end 1 − ε must stay positive), got {v:g}"


def _dual(v: float) -> str | None:
    return None if v > 1 else f"must be > 1 (the dual clip bounds ratios above 1 + ε_high), got {v:g}"


def _at_least_one(v: int) -> str | None:
    return None if v >= 1 else f"must be ≥ 1, got {v}"


def _probability(v: float) -> str | None:
    return None if 0 < v <= 1 else f"must lie in (0, 1], got {v}"


@dataclass(frozen=True)
class SamplerSpec:
    """b is q (or ``behavior``, a stale policy) with ``temperature``, then ``top_k``, then ``top_p``
    applied, and EOS suppressed for the first ``min_length`` tokens (rollouts); for Gaussians
    b = N(μq, (std_scale·σq)²). ``weights`` multiplies estimates by q/b: per token ("token") or by the
    product over the sequence ("sequence"); ``weight_cap`` caps each token's q/b; ``reject`` masks whole
    sequences by statistics of their tokens' q/b (rollouts).
    """
    behavior: "LogitsSource | None" = option(None, "behavior", describe=lambda sp: "stale behavior policy")
    temperature: float = option(1.0, "float", positive, describe=lambda sp: f"T={sp.temperature:g}",
                                logits=lambda z, t: z / t)
    top_k: int | None = option(None, "int", _at_least_one, describe=lambda sp: f"top-k={sp.top_k}", logits=_top_k)
    top_p: float | None = option(None, "float", _probability, describe=lambda sp: f"top-p={sp.top_p:g}",
                                 logits=_top_p)
    min_length: int = option(0, "int", nonnegative, describe=lambda sp: f"EOS suppressed for {sp.min_length} tokens")
    std_scale: float = option(1.0, "float", lambda v: _std_scale(v), describe=lambda sp: f"std×{sp.std_scale:g}")
    weights: str = option("none", "weights", describe=_weights_words)
    weight_cap: float | None = option(None, "float", positive)        # described with the weights
    # Further corrections of ρ = q/b (kl_bench.core.weights, docs/weights.md), described with the weights.
    weight_floor: float | None = option(None, "float", positive)      # truncated IS lower bound max(ρ, ·)
    mask_low: float | None = option(None, "float", nonnegative)       # ρ < mask_low: the draw is masked
    mask_high: float | None = option(None, "float", positive)         # ρ > mask_high: masked (IcePop)
    clip_low: float | None = option(None, "float", _epsilon_low)      # PPO surrogate: ε_low
    clip_high: float | None = option(None, "float", nonnegative)      # PPO surrogate: ε_high
    dual_clip: float | None = option(None, "float", _dual)            # dual-clip PPO: c
    # Sequence-level rejection (verl's rollout_rs; kl_bench.core.rejection, docs/weights.md): rollouts.
    reject: Rejection | None = option(None, "reject", describe=lambda sp: sp.reject.words())

    def set_options(self) -> list[dataclasses.Field]:
        """The options not at their defaults, in field order."""
        return [f for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]

    @property
    def reshapes(self) -> bool:
        """Whether b's next-token distribution differs from q's (a behavior policy or a logit option)."""
        return any(f.metadata["logits"] is not None or f.name == "behavior" for f in self.set_options())

    def reshape(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution b of generation code from logits [B, V]: every set logit option's
        transform in field order (temperature, top-k, top-p). Normalised float64 log-probs [B, V], −inf
        outside b's support."""
        z = logits.to(torch.float64)
        for f in self.set_options():
            if f.metadata["logits"] is not None:
                z = f.metadata["logits"](z, getattr(self, f.name))
        return torch.log_softmax(z, dim=-1)

    def logprobs(self, log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
        """b's log-probabilities [B, V] (categoricals and rollouts): the behavior policy's logits (derived
        from q or p, or a file) or q's, reshaped."""
        base = behavior_logits(self.behavior, log_q, log_p) if self.behavior is not None else log_q
        out = self.reshape(base)
        # logits / temperature overflows float64 for a temperature near 0: the softmax of ±inf is NaN.
        if bool(torch.isnan(out).any()):
            raise SpecError(f"the sampler's logits / temperature overflow float64 (temperature {self.temperature:g}): "
                            "use a larger temperature", key="sampler.temperature")
        return out

    def describe(self) -> str:
        bits = [f.metadata["describe"](self) for f in self.set_options() if f.metadata["describe"] is not None]
        return "sampler b: " + (", ".join(bits) or Q_ITSELF)


LOGIT_KEYS = tuple(f.name for f in dataclasses.fields(SamplerSpec) if f.metadata["logits"] is not None)
WEIGHT_KEYS = ("weights", "weight_cap")
CORRECTION_KEYS = ("weight_floor", "mask_low", "mask_high", "clip_low", "clip_high", "dual_clip")


def parse_sampler(t: Table, kind: str, allowed: tuple[str, ...], weight_kinds: tuple[str, ...],
                  others: Callable[[], dict[str, tuple[str, ...]]], spec_dir: Path) -> SamplerSpec:
    """A case's ``sampler`` table. ``allowed``: the keys this kind declares; ``weight_kinds``: the
    ``weights`` values it supports; ``others()``: every kind's keys (for the hint on a refused key; called
    only then, since it imports every kind)."""
    for k in t.data:
        if k not in allowed:
            where = [name for name, keys in others().items() if k in keys]
            hint = f" (only for {' and '.join(where)} cases)" if where else did_you_mean(k, list(allowed))
            raise t.error(f"unknown key for a {kind} sampler{hint}; allowed: {', '.join(allowed)}", key=t.key(k))
    weights = ("none",) + tuple(weight_kinds)

    def value(f: dataclasses.Field) -> Any:
        kind_ = f.metadata["kind"]
        if kind_ == "behavior":
            return parse_logits_source(t, "behavior", "b", spec_dir) if t.has("behavior") else None
        if kind_ == "reject":
            return parse_rejection(t, "reject") if t.has("reject") else None
        if kind_ == "weights":
            return t.get(f.name, "str", f.default, lambda v: None if v in weights else
                         f"must be one of {', '.join(weights)}, got '{v}'{did_you_mean(v, list(weights))}")
        return t.get(f.name, kind_, f.default, f.metadata["check"])
    sampler = SamplerSpec(**{f.name: value(f) for f in dataclasses.fields(SamplerSpec)})
    t.finish()
    if sampler.weight_cap is not None and sampler.weights == "none":
        raise t.error("weight_cap needs weights = \"token\" or \"sequence\"", key=t.key("weight_cap"))
    _check_corrections(t, sampler)
    if sampler.reject is not None and not sampler.reshapes and not sampler.min_length:
        raise t.error("needs a sampler b ≠ q (behavior, temperature, top_k, top_p or min_length): with b = q every "
                      "ratio q/b is 1", key=t.key("reject"))
    return sampler


def _check_corrections(t: Table, sp: SamplerSpec) -> None:
    """The weight corrections act on per-token weights and need consistent bounds."""
    for k in CORRECTION_KEYS:
        if getattr(sp, k) is not None and sp.weights != "token":
            raise t.error("needs weights = \"token\" (it corrects the per-token weight q/b)", key=t.key(k))
    pairs = (("weight_floor", "weight_cap"), ("mask_low", "mask_high"))
    for lo, hi in pairs:
        a, b = getattr(sp, lo), getattr(sp, hi)
        if a is not None and b is not None and a > b:
            raise t.error(f"must be ≤ {hi} ({b:g}), got {a:g}", key=t.key(lo))
    _check_clip(t, sp)


def _check_clip(t: Table, sp: SamplerSpec) -> None:
    """The PPO clip: not with a bound of the detached weight, and a dual clip above the clip's upper end."""
    clipped = [k for k in ("clip_low", "clip_high", "dual_clip") if getattr(sp, k) is not None]
    bounded = [k for k in ("weight_cap", "weight_floor") if getattr(sp, k) is not None]
    if clipped and bounded:       # one ratio here: a bound on the detached ρ and a clip of ρ itself conflict
        raise t.error(f"{bounded[0]} and {clipped[0]} both bound q/b (the detached weight and the PPO ratio): set one "
                      "of them (masks combine with either)", key=t.key(bounded[0]))
    if sp.dual_clip is not None and sp.clip_high is not None and sp.dual_clip <= 1 + sp.clip_high:
        raise t.error(f"must be > 1 + clip_high ({1 + sp.clip_high:g}), got {sp.dual_clip:g}", key=t.key("dual_clip"))
