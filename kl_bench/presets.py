"""Library presets: the KL penalties of verl, OpenRLHF, TRL and NeMo-RL, formula for formula.

Each preset is a pure function of log r = log p(x) − log q(x) (Tensor[...] → Tensor[...], same shape and
dtype) written in the order of operations of the library it names, so that its value agrees with the
library's bit for bit in the same dtype. In the libraries ``logprob`` is log q (the policy) and
``ref_logprob`` is log p (the reference), so ``ref_logprob − logprob`` = log r. Sources (read for facts
only; the code below is ours):

| preset | source file | formula (ℓ = log r) |
|---|---|---|
| verl.kl, verl.abs, verl.mse | verl/trainer/ppo/core_algos.py, ``kl_penalty_forward`` | −ℓ, \\|ℓ\\|, ½ℓ² |
| verl.low_var_kl | same | clamp(e^ℓ̃ − ℓ̃ − 1, ±10), ℓ̃ = clamp(ℓ, ±20) |
| verl.<name>+ | same, ``kl_penalty`` | value of <name>, gradient of ½ℓ² (straight-through) |
| openrlhf.k1, k2, k3 | openrlhf/models/utils.py, ``compute_approx_kl`` | −ℓ, ½ℓ², e^ℓ − 1 − ℓ in float32; ±10 |
| trl.grpo | trl/trainer/grpo_trainer.py (``per_token_kl``) | e^ℓ − ℓ − 1, unclamped |
| trl.ppo_k1, trl.ppo_k3 | trl/trainer/ppo_trainer.py (``kl_estimator``) | −ℓ; (e^ℓ − 1) − ℓ |
| nemo.k1, k2, k3 | nemo_rl/algorithms/utils.py (``calculate_kl``), loss_functions.py | −ℓ̃, ½ℓ̃², e^ℓ̃ − 1 − ℓ̃; ±10 |

Nonnegativity: (e^ℓ − 1) − ℓ (OpenRLHF, TRL PPO, NeMo-RL) is −ℓ < 0 in floating point for 0 < ℓ below
half an ulp of 1 (e^ℓ rounds to 1), so those presets do not claim f ≥ 0; (e^ℓ − ℓ) − 1 (verl, TRL GRPO)
rounds to 0 there. Numerics: the libraries write e^ℓ − 1 (not expm1): for |ℓ| ≪ 1 that loses the relative precision of
r − 1, and the presets keep that loss on purpose (a preset is what the library computes, not what it
should). The ±20 clamp of log r keeps e^ℓ finite in float16/bfloat16 (e^20 ≈ 4.9·10⁸); the ±10 output
clamp bounds one token's penalty.

NeMo-RL's importance-weighted order (the ``loss_is_nemo`` gradient mode, kl_bench.modes) needs the
unclamped base function and the two clamp constants: :class:`WeightedClamp`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

LOGR_CLAMP = 20.0     # verl low_var_kl and NeMo-RL's default kl_input_clamp_value
OUT_CLAMP = 10.0      # verl low_var_kl, OpenRLHF compute_approx_kl, NeMo-RL's kl_output_clamp_value


@dataclass(frozen=True)
class WeightedClamp:
    """How NeMo-RL puts an importance weight w = q/sg(q) around a clamped estimator:
    loss = clamp(w · base(clamp(log r, ±logr_clamp)), ±clamp); where either clamp fires the weight is
    detached, so the token's gradient is zero (kl_bench.modes, mode ``loss_is_nemo``)."""
    base: Callable[[torch.Tensor], torch.Tensor] = field(compare=False)
    logr_clamp: float | None
    clamp: float | None


# ----------------------------------------------------------------------------- base formulas
def _neg(logr: torch.Tensor) -> torch.Tensor:
    # logprob − ref_logprob = −(ref_logprob − logprob): negation is exact, so the value is identical.
    return -logr


def _half_square(logr: torch.Tensor) -> torch.Tensor:
    return 0.5 * logr.square()


def _k3_exp(logr: torch.Tensor) -> torch.Tensor:
    """e^ℓ − ℓ − 1, in the libraries' order (verl low_var_kl, TRL GRPO): (ratio − ℓ) − 1."""
    return (torch.exp(logr) - logr) - 1


def _k3_exp_m1_first(logr: torch.Tensor) -> torch.Tensor:
    """(e^ℓ − 1) − ℓ, in OpenRLHF's, TRL PPO's and NeMo-RL's order."""
    return (torch.exp(logr) - 1) - logr


def _clip_in(logr: torch.Tensor) -> torch.Tensor:
    return logr.clamp(min=-LOGR_CLAMP, max=LOGR_CLAMP)


def _clip_out(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(min=-OUT_CLAMP, max=OUT_CLAMP)


# ----------------------------------------------------------------------------- verl
def verl_kl(logr: torch.Tensor) -> torch.Tensor:
    """verl ``kl``/``k1``: logprob − ref_logprob = −log r. Shape-preserving."""
    return _neg(logr)


def verl_abs(logr: torch.Tensor) -> torch.Tensor:
    """verl ``abs``: |logprob − ref_logprob| = |log r|. Shape-preserving."""
    return logr.abs()


def verl_mse(logr: torch.Tensor) -> torch.Tensor:
    """verl ``mse``/``k2``: ½(logprob − ref_logprob)² = ½(log r)². Shape-preserving."""
    return _half_square(logr)


def verl_low_var_kl(logr: torch.Tensor) -> torch.Tensor:
    """verl ``low_var_kl``/``k3``: log r clamped to ±20, then e^ℓ − ℓ − 1 clamped to ±10. Shape-preserving."""
    return _clip_out(_k3_exp(_clip_in(logr)))


def straight_through(value_fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """verl's ``+`` suffix: backward = ½(log r)² − sg(½(log r)²) + sg(value). The value is exactly
    ``value_fn`` (a − a = 0 exactly), the gradient with respect to log r is that of k2."""
    def fn(logr: torch.Tensor) -> torch.Tensor:
        backward = _half_square(logr)
        # ∞ − ∞ would be NaN where p(x) = 0 (log r = −∞); there the zero term is written as 0.
        zero = torch.where(torch.isfinite(backward), backward - backward.detach(), torch.zeros_like(backward))
        return zero + value_fn(logr).detach()
    fn.__name__ = f"{value_fn.__name__}_plus"
    return fn


# ----------------------------------------------------------------------------- OpenRLHF
# OpenRLHF casts both log-probs to float32 (``.float()``) before it subtracts them, so its arithmetic is
# float32 whatever the model's dtype. The presets receive log r and cast it to float32: the same numbers
# when log r was formed in float32 from float32 or bf16 log-probs (a difference of two bf16 numbers is
# exact in float32: a case with precision estimator = "fp32"); from float64 log-probs the difference is
# rounded once, at the end instead of per operand. The result is returned in the input's dtype.
def openrlhf_k1(logr: torch.Tensor) -> torch.Tensor:
    """OpenRLHF ``k1``: log_probs − log_probs_base = −log r in float32, clamped to ±10. Shape-preserving."""
    return _clip_out(_neg(logr.float())).to(logr.dtype)


def openrlhf_k2(logr: torch.Tensor) -> torch.Tensor:
    """OpenRLHF ``k2``: (log_probs − log_probs_base)²/2 in float32, clamped to ±10. Shape-preserving."""
    return _clip_out(_neg(logr.float()) ** 2 / 2.0).to(logr.dtype)


def openrlhf_k3(logr: torch.Tensor) -> torch.Tensor:
    """OpenRLHF ``k3``: (e^ℓ − 1) − ℓ in float32 with ℓ = −(log_probs − log_probs_base), clamped to ±10."""
    return _clip_out(_k3_exp_m1_first(logr.float())).to(logr.dtype)


# ----------------------------------------------------------------------------- TRL
def trl_grpo(logr: torch.Tensor) -> torch.Tensor:
    """TRL GRPOTrainer ``per_token_kl``: e^ℓ − ℓ − 1, no clamp. Shape-preserving."""
    return _k3_exp(logr)


def trl_ppo_k1(logr: torch.Tensor) -> torch.Tensor:
    """TRL PPOTrainer ``kl_estimator = "k1"``: −logr. Shape-preserving."""
    return _neg(logr)


def trl_ppo_k3(logr: torch.Tensor) -> torch.Tensor:
    """TRL PPOTrainer ``kl_estimator = "k3"``: (logr.exp() − 1) − logr. Shape-preserving."""
    return _k3_exp_m1_first(logr)


# ----------------------------------------------------------------------------- NeMo-RL
def nemo_k1(logr: torch.Tensor) -> torch.Tensor:
    """NeMo-RL ``k1``: −clamp(ℓ, ±20), clamped to ±10. Shape-preserving."""
    return _clip_out(_neg(_clip_in(logr)))


def nemo_k2(logr: torch.Tensor) -> torch.Tensor:
    """NeMo-RL ``k2``: clamp(ℓ, ±20)²/2, clamped to ±10. Shape-preserving."""
    return _clip_out(_clip_in(logr).square() / 2)


def nemo_k3(logr: torch.Tensor) -> torch.Tensor:
    """NeMo-RL ``k3``: e^ℓ̃ − 1 − ℓ̃ with ℓ̃ = clamp(ℓ, ±20), clamped to ±10. Shape-preserving."""
    return _clip_out(_k3_exp_m1_first(_clip_in(logr)))


@dataclass(frozen=True)
class Preset:
    """One library formula: its registry name, function, what it resembles and where it comes from.
    ``poly``: its value as Σ c r^s (log r)^k when it has no clamp (exact moments everywhere);
    ``abs_poly``: |Σ …|; ``weighted``: NeMo-RL's importance-weighted clamp order."""
    name: str
    fn: Callable[[torch.Tensor], torch.Tensor] = field(compare=False)
    unbiased: bool
    nonnegative: bool
    formula: str
    source: str
    poly: dict | None = None
    abs_poly: dict | None = None
    weighted: WeightedClamp | None = None


K1_POLY = {(0, 1): -1.0}
K2_POLY = {(0, 2): 0.5}
K3_POLY = {(1, 0): 1.0, (0, 0): -1.0, (0, 1): -1.0}
_VERL = "verl/trainer/ppo/core_algos.py (kl_penalty, kl_penalty_forward)"
_ORLHF = "openrlhf/models/utils.py (compute_approx_kl)"
_NEMO = "nemo_rl/algorithms/utils.py (calculate_kl) and nemo_rl/algorithms/loss_functions.py (ClippedPGLossFn)"

PRESETS: tuple[Preset, ...] = (
    Preset("verl.kl", verl_kl, True, False, "logprob − ref_logprob (= −log r)", _VERL, poly=K1_POLY),
    Preset("verl.abs", verl_abs, False, True, "|logprob − ref_logprob|", _VERL, abs_poly={(0, 1): 1.0}),
    Preset("verl.mse", verl_mse, False, True, "½(logprob − ref_logprob)²", _VERL, poly=K2_POLY),
    Preset("verl.low_var_kl", verl_low_var_kl, False, True, "clamp(e^ℓ̃ − ℓ̃ − 1, ±10), ℓ̃ = clamp(log r, ±20)",
           _VERL),
    Preset("verl.kl+", straight_through(verl_kl), True, False, "value −log r, gradient of ½(log r)²", _VERL),
    Preset("verl.abs+", straight_through(verl_abs), False, True, "value |log r|, gradient of ½(log r)²", _VERL),
    # verl returns the plain value for "mse+"/"k2+" (k2 is its own straight-through): the same as verl.mse.
    Preset("verl.mse+", verl_mse, False, True, "½(log r)² (verl treats mse+ as mse)", _VERL, poly=K2_POLY),
    Preset("verl.low_var_kl+", straight_through(verl_low_var_kl), False, True,
           "value of verl.low_var_kl, gradient of ½(log r)²", _VERL),
    Preset("openrlhf.k1", openrlhf_k1, False, False, "clamp(−log r, ±10)", _ORLHF),
    Preset("openrlhf.k2", openrlhf_k2, False, True, "clamp(½(log r)², ±10)", _ORLHF),
    Preset("openrlhf.k3", openrlhf_k3, False, False, "clamp((r − 1) − log r, ±10)", _ORLHF),
    Preset("trl.grpo", trl_grpo, True, True, "e^ℓ − ℓ − 1, unclamped", "trl/trainer/grpo_trainer.py (per_token_kl)",
           poly=K3_POLY),
    Preset("trl.ppo_k1", trl_ppo_k1, True, False, "−log r", "trl/trainer/ppo_trainer.py (kl_estimator = \"k1\")",
           poly=K1_POLY),
    Preset("trl.ppo_k3", trl_ppo_k3, True, False, "(r − 1) − log r", "trl/trainer/ppo_trainer.py (kl_estimator = \"k3\")",
           poly=K3_POLY),
    Preset("nemo.k1", nemo_k1, False, False, "clamp(−clamp(log r, ±20), ±10)", _NEMO,
           weighted=WeightedClamp(_neg, LOGR_CLAMP, OUT_CLAMP)),
    Preset("nemo.k2", nemo_k2, False, True, "clamp(½ clamp(log r, ±20)², ±10)", _NEMO,
           weighted=WeightedClamp(_half_square, LOGR_CLAMP, OUT_CLAMP)),
    Preset("nemo.k3", nemo_k3, False, False, "clamp(e^ℓ̃ − 1 − ℓ̃, ±10), ℓ̃ = clamp(log r, ±20)", _NEMO,
           weighted=WeightedClamp(_k3_exp_m1_first, LOGR_CLAMP, OUT_CLAMP)),
)
