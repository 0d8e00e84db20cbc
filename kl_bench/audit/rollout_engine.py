"""The rollout engine's mismatch (training–inference), measured against what can be recomputed exactly
(docs/audit.md §8: the metrics trainers log, their exact values, KL(engine‖trainer) and the certification).

When a separate engine draws the tokens and returns its log-probs e of them, per masked token: the
convention (raw e ≈ ℓ = log q(x), or processed e ≈ ℓ_b = log b(x)), the exact sampler gap ℓ_b − ℓ,
verl's ``rollout_corr/{kl, k3_kl, chi2_token}`` and TRL's ``sampling_logp_difference`` measured with
standard errors clustered by sequence, beside their exact values were the engine exactly the sampler on
the trainer's logits; a **departure** is any metric with power beyond its SE past what float32 rounding of
e explains, and the cause that fits (another sampler, precision, another model version) is named.
The sums are additive over rows and processes, as the step audit's (kl_bench.audit.step).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from ..foundation.errors import SpecError
from ..results.schema import ENGINE_COLUMNS  # noqa: F401  (engine.csv's columns, re-exported)
from .exact import PositionValues

# What float32 rounding may move an engine's log-prob of a token by, relative to the numbers a log-softmax forms
# there (the token's score and the normaliser): δ = F32·(1 + |s(x)| + |s(x) − log q(x)|). One log-softmax rounds
# to ~8 ulps (8·2⁻²⁴); a whole forward pass through another engine's float32 kernels (fused attention, other
# reduction orders) is allowed 256 ulps, 2⁻¹⁶. A bf16 engine's per-token error, ~2⁻⁸ of the logits, is 256 times
# that. Departures within δ are float32 rounding, not a mismatch.
F32 = 2.0 ** -16
# Per metric m: Σx, Σ_seq S², Σ_seq n·S (S: a sequence's Σx, n its tokens); and Σ_seq n², Σ n shared. ``kl_raw``:
# KL(engine‖trainer) per token for an engine that returns raw log-probs (its own kept mass is not returned: the
# trainer-side sampler's log b − log q stands in for its −log kept mass). ``k3_b``, ``k3_q``: k3 of ℓ − e at the
# tokens b can draw (0 elsewhere), ℓ = log b or log q: the engine against the trainer-side sampler itself, exactly
# 0 for an engine that is that sampler, ≈ KL(engine‖b) otherwise, with a per-token SD of the order of that KL
# (k3_kl's against q carries the sampler's own −log kept mass, whose spread over positions hides a small shift).
METRICS = ("kl", "k3_kl", "chi2", "logp_diff", "kl_raw", "k3_b", "k3_q")
# Maxima, not sums (reduce them with MAX across ranks).
MAXED = ("logp_diff_max", "outside_depth")
ENVELOPES = ("env_kl", "env_k3_kl", "env_chi2", "env_k3_b", "env_k3_q")
ENGINE_SUMS = ("tokens", "seq_n2", "raw_sq", "processed_sq", "raw_sum", "processed_sum", "inside", "sampler_gap",
               "exact_kl", "exact_chi2", "exact_gap_abs", "exact_miss", "drawn", "exact_kl_g", "outside",
               "outside_beyond") + ENVELOPES + MAXED \
    + tuple(f"{m}_{k}" for m in METRICS for k in ("sum", "ss", "ns"))
# The dtypes an engine may declare, and whether their rounding can move its log-probs past float32's.
COARSE = {"bfloat16": True, "float16": True, "float32": False, "float64": False}


def _k3(y: torch.Tensor) -> torch.Tensor:
    return torch.expm1(y) - y


def _per_token(e: torch.Tensor, lq: torch.Tensor, gap: torch.Tensor, inside: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics' per-token terms from the engine's log-probs e, the trainer's log q (float64) and the
    sampler's exact gap log b − log q (0 outside b's support, ``inside`` false)."""
    log_rho = lq - e
    zero = torch.zeros_like(e)
    return {"kl": e - lq, "k3_kl": _k3(log_rho), "chi2": torch.exp(2 * log_rho), "logp_diff": log_rho.abs(),
            "kl_raw": e - lq + gap, "k3_b": torch.where(inside, _k3(log_rho + gap), zero),
            "k3_q": torch.where(inside, _k3(log_rho), zero)}


def _envelopes(e: torch.Tensor, lq: torch.Tensor, score: torch.Tensor, gap: torch.Tensor,
               inside: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per token, how far each metric moves when the engine's log-prob moves by float32 rounding δ (F32's
    comment): the linear metrics by δ, χ²'s ρ² by ρ²·expm1(2δ), k3 by its larger change over y ± δ."""
    y = lq - e
    delta = F32 * (1 + score.abs() + (score - lq).abs())

    def k3(y):
        return torch.maximum((_k3(y + delta) - _k3(y)).abs(), (_k3(y - delta) - _k3(y)).abs())
    zero = torch.zeros_like(e)
    return {"delta": delta, "env_kl": delta, "env_k3_kl": k3(y), "env_chi2": torch.exp(2 * y) * torch.expm1(2 * delta),
            "env_k3_b": torch.where(inside, k3(y + gap), zero), "env_k3_q": torch.where(inside, k3(y), zero)}


def engine_sums(values: PositionValues, engine: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Additive sums [len(ENGINE_SUMS)] of one batch, float64 on the values' device: ``values`` at the
    masked positions of ``mask`` [B, T] (row-major), ``engine`` [B, T] the engine's log-probs of the
    sampled tokens (padding ignored). :data:`MAXED` entries are maxima."""
    device = values.kl.device
    mask = mask.to(device).bool()
    if engine.shape != mask.shape:
        raise SpecError(f"the engine's log-probs have shape {list(engine.shape)} but the mask {list(mask.shape)}",
                        key="engine_logprobs")
    e = engine.detach().to(device=device, dtype=torch.float64)[mask]
    lq, lb, b = values.tok_logq, values.b.tok_log, values.b
    rows = mask.nonzero(as_tuple=True)[0]
    n_seq = torch.zeros(mask.shape[0], dtype=torch.float64, device=device).index_add_(0, rows, torch.ones_like(e))
    inside, zero = torch.isfinite(lb), torch.zeros_like(lq)
    gap = torch.where(inside, lb - lq, zero)
    terms, env = _per_token(e, lq, gap, inside), _envelopes(e, lq, b.tok_score, gap, inside)
    # how far below b's threshold an outside token lies, beyond float32 rounding (> 0: not a rounding flip)
    depth = torch.where(inside, torch.full_like(lq, -torch.inf), (b.tau - b.tok_score) - env["delta"])
    drawn = values.g is not None

    def top(x):
        return x.max() if x.numel() else x.new_tensor(-torch.inf)
    out = {"tokens": e.new_tensor(float(e.numel())), "seq_n2": n_seq.square().sum(),
           # the convention is read where b can draw the token (an engine whose own truncation kept a token the
           # emulated one drops is counted in `outside`, not in either distance)
           "raw_sq": torch.where(inside, e - lq, zero).square().sum(), "processed_sq": torch.where(inside, e - lb, zero)
           .square().sum(), "raw_sum": torch.where(inside, e - lq, zero).sum(),
           "processed_sum": torch.where(inside, e - lb, zero).sum(), "inside": inside.sum(), "sampler_gap": gap.sum(),
           "outside": (~inside).sum(), "outside_beyond": (depth > 0).sum(), "outside_depth": top(depth),
           "exact_kl": b.kl_q.sum(), "exact_chi2": b.chi2.sum(), "exact_gap_abs": b.gap_abs.sum(),
           "exact_miss": b.miss.sum(), "drawn": e.new_tensor(float(e.numel()) if drawn else 0.0),
           "exact_kl_g": values.g.kl_q.sum() if drawn else e.new_tensor(0.0),
           "logp_diff_max": top(terms["logp_diff"])}
    out.update({k: env[k].sum() for k in ENVELOPES})
    for m, x in terms.items():
        s = torch.zeros_like(n_seq).index_add_(0, rows, x)
        out.update({f"{m}_sum": x.sum(), f"{m}_ss": s.square().sum(), f"{m}_ns": (n_seq * s).sum()})
    return torch.stack([out[k].to(torch.float64) for k in ENGINE_SUMS])


def merge_engine_sums(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two batches' engine sums: added, the :data:`MAXED` entries their maximum."""
    out = a + b
    for k in MAXED:
        i = ENGINE_SUMS.index(k)
        out[i] = torch.maximum(a[i], b[i])
    return out


def _mean_se(s: dict, m: str, n: float) -> tuple[float, float]:
    mean = s[f"{m}_sum"] / n
    # clustered by sequence: Σ_seq (S − n·mean)² = Σ S² − 2 mean Σ n S + mean² Σ n²
    ss = s[f"{m}_ss"] - 2 * mean * s[f"{m}_ns"] + mean * mean * s["seq_n2"]
    return mean, math.sqrt(max(ss, 0.0)) / n


def _convention(s: dict, n: float) -> str:
    return ("either" if abs(s["sampler_gap"]) <= 1e-12 * n else
            "processed" if s["processed_sq"] < s["raw_sq"] else "raw")


def _spread(s: dict, convention: str) -> float:
    """The standard deviation of e − ℓ over the tokens b can draw (ℓ: log b processed, log q raw): the
    engine's own log-prob noise against the trainer-side sampler, token by token."""
    side = "processed" if convention == "processed" else "raw"
    k = s["inside"]
    if k < 2:
        return math.nan
    mean = s[f"{side}_sum"] / k
    return math.sqrt(max(s[f"{side}_sq"] / k - mean * mean, 0.0))


@dataclass(frozen=True)
class EngineAudit:
    """One step's engine mismatch: engine.csv's row (:data:`ENGINE_COLUMNS`). ``kl_engine``: KL(engine‖trainer)
    as measured from the engine's own log-probs of its draws (± ``kl_engine_se``, clustered by sequence),
    ``kl_sampler`` its value were the engine exactly the sampler on the trainer's logits (KL(b‖q), exact),
    ``kl_excess`` the difference; ``kl_drawn`` KL(g‖q) exactly where the drawing pass's hidden states were
    given (NaN otherwise). ``excess_k3``: the engine beyond its sampler with power, mean k3(ℓ − e) at the
    tokens b can draw (ℓ = log b processed, log q raw), ≈ KL(engine‖b), exactly 0 (``excess_k3_exact``) for an
    engine that is the sampler. The trainers' metrics (kl, k3_kl, chi2, logp_diff) each with its SE, its exact
    sampler-only value and ``env_*``: how far float32 rounding of the engine's log-probs moves it.
    ``spread``: the SD of the engine's log-probs against the trainer-side sampler's at the tokens it can
    draw; ``outside_beyond``: tokens outside its support by more than float32 rounding, the deepest
    ``outside_depth`` below its threshold (score units). ``cause``: what fits (:func:`cause_of`)."""
    step: int
    tokens: int
    outside: int
    outside_beyond: int
    outside_depth: float
    spread: float
    convention: str
    engine_dtype: str
    sampler_gap: float
    kl_engine: float
    kl_engine_se: float
    kl_sampler: float
    kl_excess: float
    kl_drawn: float
    excess_k3: float
    excess_k3_se: float
    excess_k3_exact: float
    kl: float
    kl_se: float
    kl_exact: float
    k3_kl: float
    k3_kl_se: float
    k3_kl_exact: float
    chi2: float
    chi2_se: float
    chi2_exact: float
    logp_diff: float
    logp_diff_se: float
    logp_diff_exact: float
    logp_diff_max: float
    env_kl: float
    env_k3_kl: float
    env_chi2: float
    env_excess_k3: float
    cause: str

    @classmethod
    def from_sums(cls, sums: torch.Tensor, *, step: int, engine_dtype: str = "", z: float = 5.0) -> "EngineAudit":
        """From :func:`engine_sums` (several batches merged); ``z``: the threshold that names a cause."""
        s = dict(zip(ENGINE_SUMS, sums.cpu().tolist()))
        n = max(s["tokens"], 1.0)
        convention = _convention(s, n)
        raw = convention == "raw"            # the engine's raw log-probs are the trainer's q: every exact value 0
        kl, kl_se = _mean_se(s, "kl", n)
        k3, k3_se = _mean_se(s, "k3_kl", n)
        chi, chi_se = _mean_se(s, "chi2", n)
        diff, diff_se = _mean_se(s, "logp_diff", n)
        engine, engine_se = _mean_se(s, "kl_raw" if raw else "kl", n)
        side = "q" if raw else "b"
        excess, excess_se = _mean_se(s, f"k3_{side}", n)
        sampler = s["exact_kl"] / n
        a = cls(step, int(s["tokens"]), int(s["outside"]), int(s["outside_beyond"]), s["outside_depth"],
                _spread(s, convention), convention, engine_dtype, s["sampler_gap"] / n, engine, engine_se, sampler,
                engine - sampler, s["exact_kl_g"] / s["drawn"] if s["drawn"] else math.nan, excess, excess_se, 0.0,
                kl, kl_se, 0.0 if raw else sampler, k3, k3_se, 0.0 if raw else (s["exact_kl"] - s["exact_miss"]) / n,
                chi - 1.0, chi_se, 0.0 if raw else s["exact_chi2"] / n, diff, diff_se,
                0.0 if raw else s["exact_gap_abs"] / n, s["logp_diff_max"],
                s["env_kl"] / n, s["env_k3_kl"] / n, s["env_chi2"] / n, s[f"env_k3_{side}"] / n, "")
        return _with_cause(a, z)

    def z(self, name: str) -> float:
        """(measured − exact)/SE of a metric."""
        exact = getattr(self, f"{name}_exact")
        se = getattr(self, f"{name}_se")
        return (getattr(self, name) - exact) / se if se > 0 else math.nan

    def departure(self, name: str) -> float:
        """A metric's departure from its sampler-only exact value in SEs, past float32 rounding of the engine's
        log-probs (``env_*``: a float32 engine equal to the trainer departs by 0 ± 1)."""
        gap = getattr(self, name) - getattr(self, f"{name}_exact")
        env = self.envelope(name)
        past = math.copysign(max(abs(gap) - env, 0.0), gap)
        se = getattr(self, f"{name}_se")
        return past / se if se > 0 else (0.0 if past == 0 else math.copysign(math.inf, past))

    def envelope(self, name: str) -> float:
        """How far float32 rounding of the engine's log-probs moves a metric (token mean)."""
        return getattr(self, {"logp_diff": "env_kl"}.get(name, f"env_{name}"))

    def worst(self) -> str:
        """The metric that departs most (in SEs): the trainers' four and ``excess_k3``."""
        return max(DEPARTING, key=lambda m: abs(self.departure(m)))

    def departs(self, z: float) -> bool:
        return abs(self.departure(self.worst())) > z

    def deep(self, z: float) -> bool:
        """Tokens lie outside the trainer-side support deeper than the engine's own log-prob noise explains: a
        rounding flip at the threshold needs the token's and the threshold's errors (each of SD ``spread``) to
        differ by its depth, beyond z·√2·spread at |z| > ``z`` a one-in-millions event."""
        if not self.outside_beyond:
            return False
        return not math.isfinite(self.spread) or self.outside_depth > z * math.sqrt(2) * self.spread

    def row(self) -> dict:
        return asdict(self)


# The metrics a departure is read from (EngineAudit.departure).
DEPARTING = ("excess_k3", "k3_kl", "chi2", "logp_diff", "kl")


def cause_of(a: EngineAudit, z: float) -> str:
    """What fits a step's engine audit: "" (nothing departs), "sampler" (tokens outside the trainer-side
    support beyond the engine's own noise: it samples with other settings), else by the engine's declared
    dtype: "precision" (bfloat16, float16), "version" (float32 or finer: its rounding is inside the envelope
    already, so another model version, stale weights or other kernels), "precision or version" (undeclared)."""
    if a.deep(z):
        return "sampler"
    if not (a.departs(z) or a.outside_beyond):
        return ""
    if a.engine_dtype in COARSE:
        return "precision" if COARSE[a.engine_dtype] else "version"
    return "precision or version"


def _with_cause(a: EngineAudit, z: float) -> EngineAudit:
    return replace(a, cause=cause_of(a, z))


def engine_line(a: EngineAudit) -> str:
    """One line per step (the callback and ``kl-bench audit`` print it)."""
    drawn = "" if math.isnan(a.kl_drawn) else f", {a.kl_drawn:.3g} exact from the drawing pass"
    dtype = f", {a.engine_dtype}" if a.engine_dtype else ""
    return (f"step {a.step} engine ({a.convention} log-probs{dtype}, {a.tokens} tokens): KL(engine‖trainer) "
            f"{a.kl_engine:.3g} ± {a.kl_engine_se:.2g} measured, {a.kl_sampler:.3g} from the sampler alone (excess "
            f"{a.kl_excess:+.3g}{drawn}; k3 against the sampler {a.excess_k3:.3g} ± {a.excess_k3_se:.2g}); "
            f"k3_kl {a.k3_kl:.3g} ± {a.k3_kl_se:.2g} (sampler alone {a.k3_kl_exact:.3g}), "
            f"chi2 {a.chi2:.3g} ± {a.chi2_se:.2g} ({a.chi2_exact:.3g}), logp diff {a.logp_diff:.3g} ± "
            f"{a.logp_diff_se:.2g} ({a.logp_diff_exact:.3g}); sampler gap {a.sampler_gap:+.3g}; "
            f"{a.outside} outside the trainer-side support")
