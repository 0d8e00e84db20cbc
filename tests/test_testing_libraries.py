"""The four libraries' KL functions through assert_kl_function (issue 45 item 2), as docs/testing.md tells
each library to call it. The functions below are written here from each library's documented formula
(read at the commits cited; not their code), with the library's own signature:

- TRL f2cd577, trl/trainer/grpo_trainer.py (_compute_loss): per_token_kl = exp(ref − π) − (ref − π) − 1,
  times coef_1 = exp(π − π_old) when use_bias_correction_kl (default True);
- verl b178a3c, verl/trainer/ppo/core_algos.py: kl_penalty(logprob, ref_logprob, kl_penalty), with
  kl_penalty_forward's "kl"/"k1", "abs", "mse"/"k2", "low_var_kl"/"k3" (log r clamped to ±20, value to
  ±10), and "+" for the straight-through gradient of ½(log q − log p)²;
- OpenRLHF 3c3be62, openrlhf/models/utils.py: compute_approx_kl(log_probs, log_probs_base, kl_estimator),
  in float32, value clamped to ±10;
- NeMo-RL 7ea279a, nemo_rl/algorithms/utils.py: calculate_kl(logprobs, logprobs_reference, kl_type,
  input_clamp_value=20, output_clamp_value=10, importance_sampling_weights=None), the weights
  exp(curr − sg curr) of ClippedPGLossFn (nemo_rl/algorithms/loss/loss_functions.py).
"""
import functools

import pytest
import torch

from kl_bench.testing import assert_kl_function

pytestmark = pytest.mark.testing
BF16 = (torch.float32, torch.bfloat16)


# ----------------------------------------------------------------------------- the libraries' formulas
def trl_per_token_kl(per_token_logps, ref_per_token_logps):
    d = ref_per_token_logps - per_token_logps
    return torch.exp(d) - d - 1


def verl_kl_penalty(logprob, ref_logprob, kl_penalty):
    name = kl_penalty.rstrip("+")
    if name in ("kl", "k1"):
        value = logprob - ref_logprob
    elif name == "abs":
        value = (logprob - ref_logprob).abs()
    elif name in ("mse", "k2"):
        value = 0.5 * (logprob - ref_logprob).square()
    else:                                    # low_var_kl, k3
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        value = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    if not kl_penalty.endswith("+") or name in ("mse", "k2"):
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


def openrlhf_compute_approx_kl(log_probs, log_probs_base, kl_estimator="k1"):
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_estimator == "k2":
        log_ratio = log_ratio ** 2 / 2.0
    elif kl_estimator == "k3":
        log_ratio = (-log_ratio).exp() - 1 + log_ratio
    return log_ratio.clamp(min=-10, max=10)


def nemo_calculate_kl(logprobs, logprobs_reference, kl_type="k3", input_clamp_value=20.0, output_clamp_value=10.0,
                      importance_sampling_weights=None):
    logr = logprobs_reference - logprobs
    clamped = logr.clamp(min=-input_clamp_value, max=input_clamp_value)
    if importance_sampling_weights is not None:
        importance_sampling_weights = torch.where(logr == clamped, importance_sampling_weights,
                                                  importance_sampling_weights.detach())
    logr = clamped
    kl = {"k1": lambda: -logr, "k2": lambda: torch.square(logr) / 2, "k3": lambda: torch.exp(logr) - 1 - logr}[kl_type]()
    if importance_sampling_weights is not None:
        kl = importance_sampling_weights * kl
    return kl.clamp(min=-output_clamp_value, max=output_clamp_value)


# ----------------------------------------------------------------------------- the checks docs/testing.md gives
def test_trl_grpo_k3_with_bias_correction_follows_the_reverse_kl():
    assert_kl_function(trl_per_token_kl, "k3", placement="loss_is", follows="KL(q||p)", dtypes=BF16)


def test_trl_grpo_k3_without_bias_correction_follows_the_forward_kl():
    """use_bias_correction_kl = False (before TRL #6503): the plain loss; its gradient is ∇KL(p‖q)."""
    assert_kl_function(trl_per_token_kl, "k3", placement="loss", follows="KL(p||q)")
    with pytest.raises(AssertionError, match="follows ∇KL\\(p‖q\\), expected ∇KL\\(q‖p\\)"):
        assert_kl_function(trl_per_token_kl, "k3", placement="loss", follows="KL(q||p)")


def test_trl_grpo_k3_overflows_next_to_a_zero_filled_reference():
    """TRL #6637's overflow, reached by a zero-filled reference log-prob (NeMo-RL #4218's padding): e^100 is
    inf in float32, and inf·0 is NaN after the mask."""
    with pytest.raises(AssertionError, match=r"masked position \(logprobs = -100, ref_logprobs = 0\): got nan"):
        assert_kl_function(trl_per_token_kl, "k3", placement="loss_is", follows="KL(q||p)", masked="zero")


@pytest.mark.parametrize("name, estimator, follows", [
    ("low_var_kl", "k3", "KL(p||q)"), ("low_var_kl+", "k3", "KL(q||p)"), ("kl", "k1", "0"),
    ("k1+", "k1", "KL(q||p)"), ("mse", "k2", "KL(q||p)"), ("abs+", "abs", "KL(q||p)")])
def test_verl_kl_penalty_in_the_loss(name, estimator, follows):
    clamps = {"clamp": (-10, 10), "input_clamp": 20} if name.startswith("low_var_kl") else {}
    assert_kl_function(functools.partial(verl_kl_penalty, kl_penalty=name), estimator, placement="loss",
                       follows=follows, masked="zero", dtypes=BF16, **clamps)


def test_verl_low_var_kl_survives_minus_inf_padding_but_its_straight_through_does_not():
    """low_var_kl clamps log r (+inf → 20) before exp, so −inf padding is harmless; "low_var_kl+" adds
    ½(log q − log p)² − sg(same), which is inf − inf = NaN there."""
    assert_kl_function(functools.partial(verl_kl_penalty, kl_penalty="low_var_kl"), "k3", clamp=10, input_clamp=20,
                       placement="loss", masked="-inf")
    with pytest.raises(AssertionError, match=r"masked position \(logprobs = -inf, ref_logprobs = -0.5\): got nan"):
        assert_kl_function(functools.partial(verl_kl_penalty, kl_penalty="low_var_kl+"), "k3", clamp=10,
                           input_clamp=20, placement="loss", follows="KL(q||p)", masked="-inf")


def test_verl_kl_in_the_reward_follows_the_reverse_kl():
    assert_kl_function(functools.partial(verl_kl_penalty, kl_penalty="kl"), "k1", placement="reward", follows="KL(q||p)")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_openrlhf_compute_approx_kl_in_the_reward(estimator):
    assert_kl_function(functools.partial(openrlhf_compute_approx_kl, kl_estimator=estimator), estimator, clamp=10,
                       placement="reward", masked="zero", dtypes=BF16)


def test_openrlhf_k3_in_the_loss_gets_a_nan_gradient_where_exp_overflows():
    """Its value is clamped after exp, so e^100 = inf becomes 10; the backward of the clamp is 0·inf = NaN
    (OpenRLHF #1335, fixed after 3c3be62): fine in the reward (detached), not in the loss."""
    fn = functools.partial(openrlhf_compute_approx_kl, kl_estimator="k3")
    with pytest.raises(AssertionError, match=r"masked position \(logprobs = -100, ref_logprobs = 0\): the gradient"):
        assert_kl_function(fn, "k3", clamp=10, placement="loss", masked="zero")


@pytest.mark.parametrize("kl_type, follows", [("k1", "KL(q||p)"), ("k3", "KL(q||p)")])
def test_nemo_calculate_kl_with_its_importance_weight(kl_type, follows):
    def fn(logprobs, logprobs_reference):
        w = torch.exp(logprobs - logprobs.detach())     # ClippedPGLossFn: value 1, gradient the score,
        w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)     # and 0 where log q = −inf (−inf + inf)
        return nemo_calculate_kl(logprobs, logprobs_reference, kl_type, importance_sampling_weights=w)
    assert_kl_function(fn, kl_type, clamp=10, input_clamp=20, placement="loss", follows=follows, masked="zero",
                       dtypes=BF16)
    # −inf padding in logprobs: the weight exp(−inf − (−inf)) is NaN; nan_to_num zeroes its value but
    # not its backward (exp's derivative is its NaN value), so the gradient at the padded token is NaN.
    with pytest.raises(AssertionError, match=r"\(logprobs = -inf, ref_logprobs = -0.5\): the gradient through"):
        assert_kl_function(fn, kl_type, clamp=10, input_clamp=20, placement="loss", follows=follows, masked="-inf")


def test_nemo_calculate_kl_without_the_weight_is_k3_in_the_loss():
    """Without importance_sampling_weights (NeMo-RL before #2506 when the weight was detached), k3 in the
    loss follows the forward KL: the check says so when told the reverse."""
    fn = functools.partial(nemo_calculate_kl, kl_type="k3")
    with pytest.raises(AssertionError, match="follows ∇KL\\(p‖q\\), expected ∇KL\\(q‖p\\) \\(direction swapped; relative difference 0.3"):
        assert_kl_function(fn, "k3", clamp=10, input_clamp=20, placement="loss", follows="KL(q||p)")


# ----------------------------------------------------------------------------- docs/testing.md's snippets run
def _doc_blocks() -> list[str]:
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "testing.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_self_contained_snippets_of_the_docs_pass():
    """The quick start and TRL's test in docs/testing.md (they import nothing but torch and kl-bench) run and
    pass; the other libraries' snippets import the library, and are mirrored by the tests above."""
    runnable = [b for b in _doc_blocks() if "import" in b and not any(
        lib in b for lib in ("verl", "openrlhf", "nemo_rl")) and "kl_case" not in b]
    assert len(runnable) == 2
    for block in runnable:
        namespace: dict = {}
        exec(compile(block, "docs/testing.md", "exec"), namespace)
        tests = [f for name, f in namespace.items() if name.startswith("test_")]
        assert tests
        for test in tests:
            test()
