"""Case kind ``logprobs``: per-token log-prob pairs of sampled tokens, as a trainer logs them.

Inputs (each [B, T], or [N] for single tokens): ``logp_policy`` = log q(x_t|h_t) and ``logp_ref`` =
log p(x_t|h_t) of the tokens the policy sampled, an optional ``mask`` (1 on generated tokens) and an
optional ``kl_full`` = KL(q(·|h_t) ‖ p(·|h_t)) per position from the full vocabulary. Each is a key of
one ``file`` (.pt dict or .safetensors; by default named as above), a ``{file, key}`` table, or a
tensor (Python API).

The truth is unknown here: a draw resamples one logged sequence uniformly (the empirical distribution
of the log), so ``exact_mean``/``exact_std`` are exact moments over the logged sequences (what the log
itself says: mean, spread, negative fraction, sequence-level vs token-level aggregation), and the KL
reference, only when ``kl_full`` is given, is the ``full`` row's mean ± SE (Σ_t kl_full), never exact.
Each row's bias against it (``ref_diff``) is the log's own, with the log's SE (``ref_diff_se``, std over
the B sequences / √B): the resampling SE of ``se`` only says how well the draws reproduce the log.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core import oracles as exact
from ..foundation.typed_toml import Table
from ..core.draws import Draws, Row
from ..foundation.errors import SpecError
from ..core.estimators import RowSource
from ..sampling.logits import log_ratio_problem
from ..sampling.logits_files import is_array, read_tensor_file, unsupported_array
from ..core.targets import FORWARD, REVERSE, TV
from .protocols import CaseConfig, JointMoments, register_kind
from .defaults import Pair

TENSORS = ("logp_policy", "logp_ref", "mask", "kl_full")
REQUIRED = ("logp_policy", "logp_ref")


@dataclass(frozen=True)
class TensorRef:
    """Where one input comes from: (file, key) or an in-memory tensor."""
    file: Path | None = None
    key: str | None = None
    tensor: torch.Tensor | None = field(default=None, compare=False, repr=False)
    optional: bool = False      # a default key that may be absent from the file


@dataclass(frozen=True, kw_only=True)
class LogprobsCase(CaseConfig):
    inputs: dict[str, TensorRef] = field(default_factory=dict)


# r = e^{log r} is finite below log(float64 max) ≈ 709.78: logged sequences (drawn from q) with a larger
# log-ratio make r = inf on a sampled draw, and the sequence estimators' means inf − inf = NaN.
_LOG_MAX = math.log(sys.float_info.max)


def _read_inputs(case: LogprobsCase) -> dict[str, torch.Tensor]:
    """Every input tensor of the case (an optional one that its file does not hold is left out)."""
    data: dict[str, torch.Tensor] = {}
    for name, ref in case.inputs.items():
        if ref.tensor is not None:
            data[name] = ref.tensor
            continue
        try:
            data[name] = read_tensor_file(ref.file, ref.key, what=name)
        except SpecError as e:
            if ref.optional and "no tensor named" in e.message:
                continue
            raise e.located(key=name) from None
    return data


def _checked_shapes(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every input of logp_policy's shape, [B, T] or [N] (→ [N, 1]: one token per sequence)."""
    shape = data["logp_policy"].shape
    for name, v in data.items():
        if v.shape != shape:
            raise SpecError(f"has shape {list(v.shape)} but logp_policy has {list(shape)}", key=name)
        if v.ndim not in (1, 2) or 0 in v.shape:
            raise SpecError(f"must have shape [B, T] or [N], got {list(v.shape)}", key=name)
    return {k: (v[:, None] if v.ndim == 1 else v) for k, v in data.items()}


def _checked_mask(mask: torch.Tensor) -> torch.Tensor:
    """The unmasked tokens (bool [B, T]) of a 0/1 mask in which every sequence has one."""
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise SpecError("must hold 0 and 1 only", key="mask")
    if not bool((mask.sum(-1) > 0).all()):
        raise SpecError("a sequence has no unmasked token", key="mask")
    return mask > 0


def _check_log_ratios(logp: torch.Tensor, logq: torch.Tensor, on: torch.Tensor, ref) -> None:
    """Refuse logged log-probs whose log-ratios leave float64 in the estimators: per token and per
    sequence, r = e^{log r} finite and |log r| within :data:`~kl_bench.sampling.logits.MAX_ABS_LOG_RATIO`."""
    g = torch.where(on, logp - logq, torch.zeros_like(logp))
    seq = g.sum(-1)
    where = f"{ref.file}: " if ref.file is not None else ""
    problem = log_ratio_problem(torch.cat([g.reshape(-1), seq]))
    if problem is None and max(float(g.max()), float(seq.max())) >= _LOG_MAX:
        problem = (f"a log-ratio log p − log q reaches {max(float(g.max()), float(seq.max())):.4g}: r = p/q "
                   f"overflows float64 beyond e^{_LOG_MAX:.4g}")
    if problem:
        raise SpecError(f"{where}{problem} (implausible log-probs?)", key="logp_ref")


@register_kind("logprobs", description="logged per-token log-probs of sampled tokens (logp_policy, logp_ref, mask, "
               "kl_full): no exact truth; moments over the log, reference = Σ kl_full when given")
class LogprobsPair(Pair):
    aggregates = ("seq", "tok")
    supplies_logq = True

    def __init__(self, name: str, logq: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor,
                 kl_full: torch.Tensor | None, label: str = ""):
        """``logq``, ``logp``, ``mask``, ``kl_full``: float64 [B, T] (mask 0/1)."""
        self.name, self.label = name, label
        self.mask = mask
        self.g = torch.where(mask > 0, logp - logq, torch.zeros_like(logp))        # log r_t, 0 off the mask
        self.L = self.g.sum(-1)                                                      # [B] sequence log-ratio
        self.lq = torch.where(mask > 0, logq, torch.zeros_like(logq))              # log q_t, 0 off the mask
        self.kl_full = kl_full
        self.full = (mask * kl_full).sum(-1) if kl_full is not None else torch.full_like(self.L, math.nan)
        self.tok_b = (mask * torch.expm1(self.g)).sum(-1)
        self.tokens = int(mask.sum())
        self._tok_cache: dict[str, torch.Tensor] = {}

    @classmethod
    def parse(cls, t: Table, common: dict[str, Any], spec_dir: Path) -> LogprobsCase:
        file = t.get("file", "str", None)
        base = None if file is None else spec_dir / file
        inputs = {}
        for name in TENSORS:
            raw = t.raw(name)
            if is_array(raw):
                msg = unsupported_array(raw)
                if msg:
                    raise t.error(msg, key=name)
                # host: a spec table, hashed from host bytes
                inputs[name] = TensorRef(tensor=torch.as_tensor(raw).detach().to("cpu", torch.float64))
            elif isinstance(raw, str):
                if base is None:
                    raise t.error(f"names a key ('{raw}') but the case has no 'file'", key=name)
                inputs[name] = TensorRef(base, raw)
            elif isinstance(raw, dict):
                sub = t.sub(name)
                inputs[name] = TensorRef(spec_dir / sub.get("file", "str"), sub.get("key", "str", None))
                sub.finish()
            elif raw is None:
                if base is not None:
                    inputs[name] = TensorRef(base, name, optional=name not in REQUIRED)
                elif name in REQUIRED:
                    raise t.error("missing required key (or give a 'file' holding it)", key=name)
            else:
                raise t.error(f"must be a key of 'file', a {{file, key}} table or a tensor, got {raw!r}", key=name)
        t.finish()
        return LogprobsCase(inputs=inputs, **common)

    @classmethod
    def from_config(cls, case: LogprobsCase) -> "LogprobsPair":
        data = _checked_shapes(_read_inputs(case))
        mask = data.get("mask", torch.ones_like(data["logp_policy"]))
        on = _checked_mask(mask)
        for name in ("logp_policy", "logp_ref", "kl_full"):
            if name in data and not bool(torch.isfinite(data[name][on]).all()):
                raise SpecError("holds NaN or ±inf on unmasked tokens", key=name)
            if name in data and name != "kl_full" and bool((data[name][on] > 1e-6).any()):
                raise SpecError("log-probabilities must be ≤ 0", key=name)
        _check_log_ratios(data["logp_ref"], data["logp_policy"], on, case.inputs["logp_ref"])
        b, tt = mask.shape
        return cls(case.name, data["logp_policy"], data["logp_ref"], mask, data.get("kl_full"),
                   label=f"{b} logged sequences × {tt} positions, {int(mask.sum())} tokens"
                   + (", kl_full" if "kl_full" in data else ""))

    def metadata(self) -> dict[str, Any]:
        return {**super().metadata(), "label": self.label,
                "reference": "full mean ± SE over the log (Σ_t kl_full; not exact)" if self.kl_full is not None
                else "none: no kl_full given, so no KL reference exists"}

    def aggregates_for(self, source: RowSource) -> tuple[str, ...]:
        if source.analytic and self.kl_full is None:
            return ()
        return ("tok",) if source.token_only else self.aggregates

    def true_values(self) -> dict[str, float]:
        return {REVERSE: math.nan, FORWARD: math.nan, TV: math.nan}     # unknown: only the log is known

    def reference_row(self) -> str | None:
        return "tok:full" if self.kl_full is not None else None

    def reference_comparison(self, est: RowSource, aggregate: str) -> tuple[float, float, float, float] | None:
        """Against Σ_t kl_full over the log: the reference, the row's mean and their difference are means over
        the B logged sequences, exactly (no resampling noise), and their SEs are std/√B over those sequences:
        resampling the log adds nothing about the policy, so its SE never stands in for the log's."""
        if self.kl_full is None:
            return None
        b = self.L.shape[0]
        ref, ref_se = float(self.full.mean()), float(self.full.std(correction=1)) / math.sqrt(b)
        if est.target != REVERSE:
            return ref, ref_se, math.nan, math.nan
        d = self._per_sequence(est, aggregate) - self.full
        return ref, ref_se, float(d.mean()), float(d.std(correction=1)) / math.sqrt(b)

    def _per_sequence(self, est: RowSource, aggregate: str) -> torch.Tensor:
        """The row's value on every logged sequence, [B]."""
        if est.analytic:
            return self.full
        if aggregate == "seq":
            return est.fn(self.L)
        key = est.name if est.lam is None else f"{est.name}@{est.lam!r}"
        if key not in self._tok_cache:
            self._tok_cache[key] = (self.mask * est.on(self.g, self.lq)).sum(-1)
        return self._tok_cache[key]

    def exact_moments(self, est: RowSource, aggregate: str = "seq") -> tuple[float, float]:
        # Exact over the logged sequences (the distribution that draws resample), not over the policy.
        v = self._per_sequence(est, aggregate)
        return exact.weighted_moments(torch.full_like(v, 1.0 / v.shape[0]), v)

    def exact_joint(self, aggregate: str = "seq") -> JointMoments:
        w = 1.0 / self.L.shape[0]
        a = -self.L
        b = torch.expm1(self.L) if aggregate == "seq" else self.tok_b
        ma, mb = float(a.mean()), float(b.mean())
        return JointMoments(ma, mb, float(((a - ma) ** 2).sum() * w), float(((b - mb) ** 2).sum() * w),
                            float(((a - ma) * (b - mb)).sum() * w))

    def exact_prob_negative(self, fn, aggregate: str = "") -> float:
        return math.nan

    def describe(self) -> str:
        return f"logged log-probs: {self.label} (resampled; truth unknown)"

    def sample_draws(self, n: int, generator: torch.Generator, device: torch.device,
                     tok_rows: list[Row] = ()) -> Draws:
        idx = torch.randint(self.L.shape[0], (n,), generator=generator, device=device)
        tok = torch.stack([self._per_sequence(r.est, "tok").to(device)[idx] for r in tok_rows], -1) if tok_rows \
            else torch.zeros(n, 0, dtype=torch.float64, device=device)
        return Draws(self.L.to(device)[idx], self.full.to(device)[idx], tok, self.tok_b.to(device)[idx])
