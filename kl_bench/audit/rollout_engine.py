"""The rollout engine's mismatch (training–inference), measured against what can be recomputed exactly.

When a separate engine draws the tokens (vLLM, SGLang) and returns its log-probs of them (TRL with
``use_vllm``: ``sampling_per_token_logps``; verl: ``rollout_log_probs``), trainers compare those with the
trainer's own and log Monte Carlo metrics of the gap. Per masked token, with e the engine's log-prob of
the sampled token, ℓ = log q(x) the trainer's (full vocabulary, from the audited logits, float64) and
ℓ_b = log b(x) the generation settings' sampler applied to the trainer's logits (truncated and
renormalised: what an engine that "processes" its logits returns):

- **convention**: whether the engine's log-probs are raw (e ≈ ℓ) or processed (e ≈ ℓ_b), by the mean
  squared distance to each; "either" when the sampler truncates nothing (ℓ_b = ℓ);
- **sampler gap**: ℓ_b − ℓ, exact, per token: under top-k/top-p at T = 1 it is −log(kept mass), the bias
  a processed engine puts into ``old − sampling`` (TRL's importance ratio) from the sampler alone;
- **the metrics trainers log**, measured over the tokens (x drawn by the engine), each with a standard
  error clustered by sequence (a sequence's tokens depend on each other; sequences do not):
  verl's ``rollout_corr/kl`` = mean(e − ℓ) and ``k3_kl`` = mean(ρ − 1 − log ρ) with ρ = exp(ℓ − e), both
  meant as KL(engine‖trainer) (k3_kl's expectation is that minus the q-mass the engine never draws, as
  E_engine[ρ] = Σ_{support} q < 1 under truncation); ``chi2_token`` = mean(ρ²) − 1; TRL's
  ``sampling/sampling_logp_difference/mean`` = mean|ℓ − e|;
- **their exact values** were the engine exactly the sampler on the trainer's own logits: the token means
  of KL(b‖q), χ²(q‖b) and E_b|log b − log q| (processed; 0 if raw), kl_bench.audit.exact.SamplerValues.
  z = (measured − exact)/SE then says whether the engine differs from the trainer beyond its sampler:
  its own precision (bf16 kernels), its own numerics, another model version.

The sums are additive over rows and processes, as the step audit's (kl_bench.audit.step).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..foundation.errors import SpecError
from ..results.schema import ENGINE_COLUMNS  # noqa: F401  (engine.csv's columns, re-exported)
from .exact import PositionValues

# Per metric m: Σx, Σ_seq S², Σ_seq n·S (S: a sequence's Σx, n its tokens); and Σ_seq n², Σ n shared.
METRICS = ("kl", "k3_kl", "chi2", "logp_diff")
ENGINE_SUMS = ("tokens", "seq_n2", "raw_sq", "processed_sq", "sampler_gap", "exact_kl", "exact_chi2",
               "exact_gap_abs", "exact_miss", "outside", "logp_diff_max") + tuple(f"{m}_{k}" for m in METRICS for k in ("sum", "ss", "ns"))


def _per_token(e: torch.Tensor, lq: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metrics' per-token terms from the engine's log-probs e and the trainer's log q (float64)."""
    log_rho = lq - e
    return {"kl": e - lq, "k3_kl": torch.expm1(log_rho) - log_rho, "chi2": torch.exp(2 * log_rho),
            "logp_diff": log_rho.abs()}


def engine_sums(values: PositionValues, engine: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Additive sums [len(ENGINE_SUMS)] of one batch, float64 on the values' device: ``values`` at the
    masked positions of ``mask`` [B, T] (row-major), ``engine`` [B, T] the engine's log-probs of the
    sampled tokens (padding ignored). ``logp_diff_max`` is a maximum (reduce it with MAX across ranks)."""
    device = values.kl.device
    mask = mask.to(device).bool()
    if engine.shape != mask.shape:
        raise SpecError(f"the engine's log-probs have shape {list(engine.shape)} but the mask {list(mask.shape)}",
                        key="engine_logprobs")
    e = engine.detach().to(device=device, dtype=torch.float64)[mask]
    lq, lb = values.tok_logq, values.b.tok_log
    rows = mask.nonzero(as_tuple=True)[0]
    n_seq = torch.zeros(mask.shape[0], dtype=torch.float64, device=device).index_add_(0, rows, torch.ones_like(e))
    terms = _per_token(e, lq)
    inside, zero = torch.isfinite(lb), torch.zeros_like(lq)
    out = {"tokens": e.new_tensor(float(e.numel())), "seq_n2": n_seq.square().sum(),
           # the convention is read where b can draw the token (an engine whose own truncation kept a token the
           # emulated one drops is counted in `outside`, not in either distance)
           "raw_sq": torch.where(inside, e - lq, zero).square().sum(), "processed_sq": torch.where(inside, e - lb, zero)
           .square().sum(), "sampler_gap": torch.where(inside, lb - lq, zero).sum(), "outside": (~inside).sum(),
           "exact_kl": values.b.kl_q.sum(), "exact_chi2": values.b.chi2.sum(), "exact_gap_abs": values.b.gap_abs.sum(),
           "exact_miss": values.b.miss.sum(),
           "logp_diff_max": terms["logp_diff"].max() if e.numel() else e.new_tensor(0.0)}
    for m, x in terms.items():
        s = torch.zeros_like(n_seq).index_add_(0, rows, x)
        out.update({f"{m}_sum": x.sum(), f"{m}_ss": s.square().sum(), f"{m}_ns": (n_seq * s).sum()})
    return torch.stack([out[k].to(torch.float64) for k in ENGINE_SUMS])


@dataclass(frozen=True)
class EngineAudit:
    """One step's engine mismatch: engine.csv's row (:data:`ENGINE_COLUMNS`)."""
    step: int
    tokens: int
    outside: int
    convention: str
    sampler_gap: float
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

    @classmethod
    def from_sums(cls, sums: torch.Tensor, *, step: int) -> "EngineAudit":
        s = dict(zip(ENGINE_SUMS, sums.cpu().tolist()))
        n = max(s["tokens"], 1.0)

        def mean_se(m: str) -> tuple[float, float]:
            mean = s[f"{m}_sum"] / n
            # clustered by sequence: Σ_seq (S − n·mean)² = Σ S² − 2 mean Σ n S + mean² Σ n²
            ss = s[f"{m}_ss"] - 2 * mean * s[f"{m}_ns"] + mean * mean * s["seq_n2"]
            return mean, math.sqrt(max(ss, 0.0)) / n
        convention = ("either" if abs(s["sampler_gap"]) <= 1e-12 * n else
                      "processed" if s["processed_sq"] < s["raw_sq"] else "raw")
        kl, kl_se = mean_se("kl")
        k3, k3_se = mean_se("k3_kl")
        chi, chi_se = mean_se("chi2")
        diff, diff_se = mean_se("logp_diff")
        gap_exact = s["exact_gap_abs"] / n if convention == "processed" else 0.0
        return cls(step, int(s["tokens"]), int(s["outside"]), convention, s["sampler_gap"] / n, kl, kl_se, s["exact_kl"] / n, k3, k3_se,
                   (s["exact_kl"] - s["exact_miss"]) / n, chi - 1.0, chi_se, s["exact_chi2"] / n, diff, diff_se,
                   gap_exact, s["logp_diff_max"])

    def z(self, name: str) -> float:
        """(measured − exact)/SE of a metric."""
        exact = getattr(self, f"{name}_exact")
        se = getattr(self, f"{name}_se")
        return (getattr(self, name) - exact) / se if se > 0 else math.nan

    def row(self) -> dict:
        return asdict(self)


def engine_line(a: EngineAudit) -> str:
    """One line per step (the callback and ``kl-bench audit`` print it)."""
    return (f"step {a.step} engine ({a.convention} log-probs, {a.tokens} tokens): sampler gap {a.sampler_gap:+.3g}; "
            f"kl {a.kl:+.3g} ± {a.kl_se:.2g} (exact {a.kl_exact:.3g}, z = {a.z('kl'):+.2f}), chi2 {a.chi2:.3g} "
            f"± {a.chi2_se:.2g} (exact {a.chi2_exact:.3g}), logp diff {a.logp_diff:.3g} ± {a.logp_diff_se:.2g} "
            f"(exact {a.logp_diff_exact:.3g})")
