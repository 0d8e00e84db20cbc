"""Library presets: the KL penalties of verl, OpenRLHF, TRL and NeMo-RL, formula for formula.

Each preset is a pure function of log r = log p(x) − log q(x) (Tensor[...] → Tensor[...], same shape and
dtype) written in the order of operations of the library it names, so that its value agrees with the
library's bit for bit in the same dtype. In the libraries ``logprob`` is log q (the policy) and
``ref_logprob`` is log p (the reference), so ``ref_logprob − logprob`` = log r. Sources (read for facts
only; the code below is ours) are pinned in :data:`COMMITS`; each preset's source file, formula and the
library's gradient mode are in docs/trainers.md section 1.

Nonnegativity: (e^ℓ − 1) − ℓ (OpenRLHF, TRL PPO, NeMo-RL) is −ℓ < 0 in floating point for 0 < ℓ below
half an ulp of 1 (e^ℓ rounds to 1), so those presets do not claim f ≥ 0; (e^ℓ − ℓ) − 1 (verl, TRL GRPO)
rounds to 0 there. Numerics: the libraries write e^ℓ − 1 (not expm1): for |ℓ| ≪ 1 that loses the relative precision of
r − 1, and the presets keep that loss on purpose (a preset is what the library computes, not what it
should). The ±20 clamp of log r keeps e^ℓ finite in float16/bfloat16 (e^20 ≈ 4.9·10⁸); the ±10 output
clamp bounds one token's penalty.

Where p(x) = 0 (log r = −∞) a preset's value and its gradient with respect to log r are the limits of the
library's as log r → −∞, never NaN, and the library's own wherever that is not NaN (docs/trainers.md
section 1, "At p(x) = 0").

NeMo-RL's importance-weighted order (the ``loss_is_nemo`` gradient mode, kl_bench.core.modes) needs the
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
    """How NeMo-RL puts an importance weight w around a clamped estimator (``calculate_kl``):
    loss = clamp(w · base(clamp(log r, ±logr_clamp)), ±clamp), w detached where the input clamp fires,
    so where either clamp fires the token's gradient is zero (kl_bench.core.modes, mode ``loss_is_nemo``).
    On-policy w = q/sg(q) = 1; with ``use_on_policy_kl_approximation`` under a sampler b, w = q/b."""
    base: Callable[[torch.Tensor], torch.Tensor] = field(compare=False)
    logr_clamp: float | None
    clamp: float | None

    def active(self, logr: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Where neither clamp fires: |log r| ≤ logr_clamp and |w · base(clamp(log r))| ≤ clamp, inclusive
        as torch.clamp passes gradients at the bounds (w = 1 when None). Bool, shape of ``logr``."""
        x = logr.clamp(-self.logr_clamp, self.logr_clamp) if self.logr_clamp is not None else logr
        ok = logr.abs() <= self.logr_clamp if self.logr_clamp is not None else torch.ones_like(logr, dtype=torch.bool)
        v = self.base(x) if weight is None else weight * self.base(x)
        return ok & (v.abs() <= self.clamp) if self.clamp is not None else ok

    def coefficient(self, logr: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """Per-draw gradient coefficient c with ∇θ loss = c · ∇θ log q: w (f − f′)(log r) where no clamp
        fires (∇w = w s, ∇ log r = −s, w not detached there), 0 where one does. Shape of ``logr``."""
        with torch.enable_grad():
            x = logr.detach().clone().requires_grad_(True)
            f = self.base(x)
            (df,) = torch.autograd.grad(f.sum(), x)
        c = f.detach() - df
        c = c if weight is None else weight * c
        return torch.where(self.active(logr, weight), c, torch.zeros_like(c))


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


class _ValueWithK2Gradient(torch.autograd.Function):
    """Returns ``value`` unchanged; its backward is that of ½(log r)² (d/dℓ = ℓ). Written as a Function,
    not as k2 − sg(k2) + sg(f), so that at log r = −∞ the value stays f (∞ − ∞ would be NaN) and the
    gradient is the limit ℓ = −∞ of k2's (never 0·∞)."""

    @staticmethod
    def forward(ctx, logr: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logr)
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (logr,) = ctx.saved_tensors
        return grad * logr, None


def straight_through(value_fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """verl's ``+`` suffix: ½(log r)² − sg(½(log r)²) + sg(value). The value is exactly ``value_fn``
    ((a − a) + f = f exactly for finite a), the gradient with respect to log r is that of k2."""
    return _with_k2_gradient(_ValueWithK2Gradient, value_fn, "plus")


def _with_k2_gradient(function: type[_ValueWithK2Gradient], value_fn: Callable[[torch.Tensor], torch.Tensor],
                      suffix: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """f(log r) = function(log r, value_fn(sg(log r))), named ``<value_fn>_<suffix>``."""
    def fn(logr: torch.Tensor) -> torch.Tensor:
        return function.apply(logr, value_fn(logr.detach()))
    fn.__name__ = f"{value_fn.__name__}_{suffix}"
    return fn


def neg_inf_limit(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` with its gradient at log r = −∞ set to its limit 0 (the value there is unchanged).

    For functions whose derivative tends to 0 as log r → −∞ (an output clamp that fires, r·log r) but
    whose autograd graph multiplies a zero by an infinite intermediate there (NaN): ``fn`` is evaluated
    at a finite stand-in where log r = −∞ and the true value is put back, detached (the usual
    double-``where``: the unselected branch never sees an infinity)."""
    def safe(logr: torch.Tensor) -> torch.Tensor:
        inf = torch.isneginf(logr)
        out = fn(torch.where(inf, torch.zeros_like(logr), logr))
        # f(−∞) is one constant: evaluated on a single element, not on the whole tensor again
        at_inf = fn(torch.full((1,), -torch.inf, dtype=logr.dtype, device=logr.device)).detach()
        return torch.where(inf, at_inf, out)
    safe.__name__ = fn.__name__
    return safe


# ----------------------------------------------------------------------------- OpenRLHF
# OpenRLHF casts both log-probs to float32 (``.float()``) before it subtracts them, so its arithmetic is
# float32 whatever the model's dtype. The presets receive log r and cast it to float32: the same numbers
# when log r was formed in float32 from float32 or bf16 log-probs (a difference of two bf16 numbers is
# exact in float32: a case with precision estimator = "fp32"); from float64 log-probs the difference is
# rounded once, at the end instead of per operand. The result is returned in the input's dtype.
def openrlhf_k1(logr: torch.Tensor) -> torch.Tensor:
    """OpenRLHF ``k1``: log_probs − log_probs_base = −log r in float32, clamped to ±10. Shape-preserving."""
    return _clip_out(_neg(logr.float())).to(logr.dtype)


@neg_inf_limit
def openrlhf_k2(logr: torch.Tensor) -> torch.Tensor:
    """OpenRLHF ``k2``: (log_probs − log_probs_base)²/2 in float32, clamped to ±10. Shape-preserving.
    At log r = −∞ the clamp fires (value 10); OpenRLHF's backward is 0·∞ = NaN there, the preset's is the
    limit 0."""
    return _clip_out(_neg(logr.float()) ** 2 / 2.0).to(logr.dtype)


def openrlhf_k3(logr: torch.Tensor) -> torch.Tensor:
    """OpenRLHF ``k3``: (e^ℓ − 1) − ℓ in float32 with ℓ = −(log_probs − log_probs_base), clamped to ±10."""
    return _clip_out(_k3_exp_m1_first(logr.float())).to(logr.dtype)


class _OpenRLHFUnbiased(_ValueWithK2Gradient):
    """OpenRLHF's ``unbiased_gradient`` straight-through, in its order: value.detach() + g − g.detach()
    with g = w·(log_ratio²/2) (float32, w = 1 on-policy): the value is (v + g) − g, rounded as OpenRLHF
    rounds it (not v itself), the gradient that of g. Where g = ∞ (log r = −∞) OpenRLHF's value is
    ∞ − ∞ = NaN; the preset returns its limit v."""

    @staticmethod
    def forward(ctx, logr: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logr)
        g = _neg(logr.float()) ** 2 / 2.0
        return torch.where(torch.isfinite(g), (value.float() + g) - g, value.float()).to(logr.dtype)
    # backward: k2's, inherited


def openrlhf_unbiased(value_fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """OpenRLHF ``--algo.kl.unbiased_gradient`` (OpenRLHF #1309): the clamped value of ``value_fn``,
    the gradient of ½(log r)² (on-policy; off-policy OpenRLHF multiplies it by sg(min(q/q_old, 10)):
    in kl-bench a sampler with weights = "token", weight_cap = 10). Shape-preserving, float32 arithmetic."""
    return _with_k2_gradient(_OpenRLHFUnbiased, value_fn, "unbiased")


# ----------------------------------------------------------------------------- TRL
def trl_grpo(logr: torch.Tensor) -> torch.Tensor:
    """TRL GRPOTrainer ``per_token_kl``: e^ℓ − ℓ − 1, no clamp. Shape-preserving. With
    ``use_bias_correction_kl`` (default True since TRL #6503) TRL multiplies it by coef_1 = π_θ/π_old,
    non-detached: on-policy that is the ``loss_is`` gradient mode, whose coefficient (f − f′) = −ℓ is k1's
    score-function one (an unbiased ∇KL(q‖p)); under a sampler b = π_old, weights = "token" (uncapped)."""
    return _k3_exp(logr)


def trl_ppo_k1(logr: torch.Tensor) -> torch.Tensor:
    """TRL PPOTrainer ``kl_estimator = "k1"``: −logr, put in the reward. Shape-preserving."""
    return _neg(logr)


def trl_ppo_k3(logr: torch.Tensor) -> torch.Tensor:
    """TRL PPOTrainer ``kl_estimator = "k3"``: (logr.exp() − 1) − logr, put in the reward. Shape-preserving."""
    return _k3_exp_m1_first(logr)


def trl_sequence_weight(log_weight: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """TRL's ``importance_sampling_level = "sequence"`` weight exp((1/|y|) Σ_t log(q_t/b_t)), from the summed
    log-ratio ``log_weight`` [n] and the lengths |y| [n] → [n]. Formed as TRL forms it
    (trl/trainer/grpo_trainer.py, ``log_importance_weights``: the masked log-ratio sum over the length, then
    exp), in log space: the product Π_t q_t/b_t overflows float64 once |Σ log w| > 709 (a 4096-token
    sequence with Σ = 720 has weight e^{720/4096} = 1.19, not ∞^{1/4096})."""
    return torch.exp(log_weight / length)


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


# The commits (or release) each preset was read at; the "source" of every preset names file and function.
COMMITS = {
    "verl": "verl-project/verl 1dda039 (= volcengine/verl b178a3c for these files)",
    "openrlhf": "OpenRLHF/OpenRLHF 3c3be62; unbiased_gradient: OpenRLHF #1309 (commit 8ac8e06, not in 3c3be62)",
    "trl": "TRL 1.16.0 (PyPI); PPO: huggingface/trl 0062ee1, a file the 1.16.0 wheel does not ship",
    "nemo": "NVIDIA-NeMo/RL 7ea279a (calculate_kl's order since NeMo-RL #2958)",
}


@dataclass(frozen=True)
class Preset:
    """One library formula: its registry name, function, what it resembles and where it comes from.
    ``poly``: its value as Σ c r^s (log r)^k when it has no clamp (exact moments everywhere);
    ``abs_poly``: |Σ …|; ``weighted``: NeMo-RL's importance-weighted clamp order; ``mode``: the gradient
    mode (kl_bench.core.modes) the library applies to it by default, ``where`` in words (the option that
    picks it); the presets get rows in every mode, ``mode`` says which one is the library's."""
    name: str
    fn: Callable[[torch.Tensor], torch.Tensor] = field(compare=False)
    unbiased: bool
    nonnegative: bool
    formula: str
    source: str
    mode: str = "loss"
    where: str = ""
    poly: dict | None = None
    abs_poly: dict | None = None
    weighted: WeightedClamp | None = None
    rounding_negative: bool = False     # ≥ 0 but for the rounding of its order of operations (Estimator's field)


K1_POLY = {(0, 1): -1.0}
K2_POLY = {(0, 2): 0.5}
K3_POLY = {(1, 0): 1.0, (0, 0): -1.0, (0, 1): -1.0}
_VERL = f"verl/trainer/ppo/core_algos.py (kl_penalty, kl_penalty_forward) at {COMMITS['verl']}"
_VERL_WHERE = "actor.use_kl_loss (loss; default low_var_kl) or algorithm.use_kl_in_reward (reward)"
_ORLHF = f"openrlhf/models/utils.py (compute_approx_kl) at {COMMITS['openrlhf']}"
_ORLHF_WHERE = "reward by default (experience_maker); --algo.kl.use_loss puts it in the loss"
_ORLHF_UNB = "--algo.kl.use_loss --algo.kl.unbiased_gradient (off-policy: weight sg(min(q/q_old, 10)))"
_TRL_GRPO = f"trl/trainer/grpo_trainer.py:3100-3105 (_compute_loss: per_token_kl, use_bias_correction_kl) at {COMMITS['trl']}"
_TRL_PPO = f"trl/experimental/ppo/ppo_trainer.py (kl_estimator) at {COMMITS['trl']}"
_NEMO = (f"nemo_rl/algorithms/utils.py (calculate_kl) and nemo_rl/algorithms/loss/loss_functions.py (ClippedPGLossFn) "
         f"at {COMMITS['nemo']}")
_NEMO_WHERE = ("loss: clamp(w·f(clamp(log r, ±20)), ±10), w = exp(curr − sg curr) detached where the input clamp "
               "fires; use_on_policy_kl_approximation: w = exp(curr − gen), the same on-policy")

PRESETS: tuple[Preset, ...] = (
    Preset("verl.kl", verl_kl, True, False, "logprob − ref_logprob (= −log r)", _VERL, "loss", _VERL_WHERE,
           poly=K1_POLY),
    Preset("verl.abs", verl_abs, False, True, "|logprob − ref_logprob|", _VERL, "loss", _VERL_WHERE,
           abs_poly={(0, 1): 1.0}),
    Preset("verl.mse", verl_mse, False, True, "½(logprob − ref_logprob)²", _VERL, "loss", _VERL_WHERE, poly=K2_POLY),
    Preset("verl.low_var_kl", verl_low_var_kl, False, True, "clamp(e^ℓ̃ − ℓ̃ − 1, ±10), ℓ̃ = clamp(log r, ±20)",
           _VERL, "loss", _VERL_WHERE),
    Preset("verl.kl+", straight_through(verl_kl), True, False, "value −log r, gradient of ½(log r)²", _VERL,
           "loss", _VERL_WHERE),
    Preset("verl.abs+", straight_through(verl_abs), False, True, "value |log r|, gradient of ½(log r)²", _VERL,
           "loss", _VERL_WHERE),
    # verl returns the plain value for "mse+"/"k2+" (k2 is its own straight-through): the same as verl.mse.
    Preset("verl.mse+", verl_mse, False, True, "½(log r)² (verl treats mse+ as mse)", _VERL, "loss", _VERL_WHERE,
           poly=K2_POLY),
    Preset("verl.low_var_kl+", straight_through(verl_low_var_kl), False, True,
           "value of verl.low_var_kl, gradient of ½(log r)²", _VERL, "loss", _VERL_WHERE),
    Preset("openrlhf.k1", openrlhf_k1, False, False, "clamp(−log r, ±10)", _ORLHF, "reward", _ORLHF_WHERE),
    Preset("openrlhf.k2", openrlhf_k2, False, True, "clamp(½(log r)², ±10)", _ORLHF, "reward", _ORLHF_WHERE),
    Preset("openrlhf.k3", openrlhf_k3, False, False, "clamp((r − 1) − log r, ±10)", _ORLHF, "reward", _ORLHF_WHERE,
           rounding_negative=True),
    Preset("openrlhf.k1+", openrlhf_unbiased(openrlhf_k1), False, False,
           "value clamp(−log r, ±10), gradient of ½(log r)²", _ORLHF, "loss", _ORLHF_UNB),
    Preset("openrlhf.k2+", openrlhf_unbiased(openrlhf_k2), False, True,
           "value clamp(½(log r)², ±10), gradient of ½(log r)²", _ORLHF, "loss", _ORLHF_UNB),
    Preset("openrlhf.k3+", openrlhf_unbiased(openrlhf_k3), False, False,
           "value clamp((r − 1) − log r, ±10), gradient of ½(log r)²", _ORLHF, "loss", _ORLHF_UNB, rounding_negative=True),
    Preset("trl.grpo", trl_grpo, True, True, "e^ℓ − ℓ − 1, unclamped (× coef_1 = π_θ/π_old)", _TRL_GRPO, "loss_is",
           "GRPOConfig.beta > 0; use_bias_correction_kl = True (default since TRL #6503: loss_is), False: loss",
           poly=K3_POLY),
    Preset("trl.ppo_k1", trl_ppo_k1, True, False, "−log r", _TRL_PPO, "reward", "PPOConfig.kl_estimator = \"k1\"",
           poly=K1_POLY),
    Preset("trl.ppo_k3", trl_ppo_k3, True, False, "(r − 1) − log r", _TRL_PPO, "reward",
           "PPOConfig.kl_estimator = \"k3\"", poly=K3_POLY, rounding_negative=True),
    Preset("nemo.k1", nemo_k1, False, False, "clamp(−clamp(log r, ±20), ±10)", _NEMO, "loss_is_nemo", _NEMO_WHERE,
           weighted=WeightedClamp(_neg, LOGR_CLAMP, OUT_CLAMP)),
    Preset("nemo.k2", nemo_k2, False, True, "clamp(½ clamp(log r, ±20)², ±10)", _NEMO, "loss_is_nemo", _NEMO_WHERE,
           weighted=WeightedClamp(_half_square, LOGR_CLAMP, OUT_CLAMP)),
    Preset("nemo.k3", nemo_k3, False, False, "clamp(e^ℓ̃ − 1 − ℓ̃, ±10), ℓ̃ = clamp(log r, ±20)", _NEMO,
           "loss_is_nemo", _NEMO_WHERE, weighted=WeightedClamp(_k3_exp_m1_first, LOGR_CLAMP, OUT_CLAMP),
           rounding_negative=True),
)
