"""Library presets (kl_bench.core.presets): value for value against each library's formula written out here,
in the library's dtype; exact moments against Monte Carlo; verl's straight-through gradients; NeMo-RL's
importance-weighted clamp order (gradient mode loss_is_nemo) against brute-force autograd."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from kl_bench.experiment import gradient_rows as G
from kl_bench.core import modes as M
from kl_bench.foundation.errors import SpecError
from kl_bench.core.estimators import ESTIMATORS, lookup
from kl_bench.sampling.logits import zipf_logits
from kl_bench.core.modes import GradItem
from kl_bench.kinds import CategoricalPair
from kl_bench.core.presets import PRESETS
from kl_bench.core.targets import REVERSE

from .conftest import CPU, mc_frame


def _written_out(name, logprob, ref):
    """Each library's code path, as its source reads (logprob = log q, ref = log p)."""
    if name.endswith("+") and name.startswith("verl.") and name != "verl.mse+":   # kl_penalty's straight-through
        backward_score = 0.5 * (logprob - ref).square()
        return backward_score - backward_score.detach() + _written_out(name[:-1], logprob, ref).detach()
    if name in ("verl.kl", "verl.kl+"):
        return logprob - ref
    if name in ("verl.abs", "verl.abs+"):
        return (logprob - ref).abs()
    if name in ("verl.mse", "verl.mse+"):
        return 0.5 * (logprob - ref).square()
    if name in ("verl.low_var_kl", "verl.low_var_kl+"):
        kl = torch.clamp(ref - logprob, min=-20, max=20)
        ratio = torch.exp(kl)
        return torch.clamp(ratio - kl - 1, min=-10, max=10)
    if name.startswith("openrlhf."):                   # compute_approx_kl, on-policy (log_probs_old = None)
        log_ratio = logprob.float() - ref.float()
        if "k1" in name:
            value = log_ratio
        elif "k2" in name:
            value = log_ratio**2 / 2.0
        else:
            value = (-log_ratio).exp() - 1 + log_ratio
        value = value.clamp(min=-10, max=10)             # float32, as OpenRLHF returns it
        if not name.endswith("+"):
            return value
        w = 1.0                                           # unbiased_gradient with log_probs_old = None
        grad_surrogate = w * (log_ratio**2 / 2.0)
        return value.detach() + grad_surrogate - grad_surrogate.detach()
    if name == "trl.grpo":
        return torch.exp(ref - logprob) - (ref - logprob) - 1
    if name in ("trl.ppo_k1", "trl.ppo_k3"):
        logr = ref - logprob
        return -logr if name == "trl.ppo_k1" else (logr.exp() - 1) - logr
    if name.startswith("nemo."):
        return _nemo_calculate_kl(logprob, ref, name[-2:])
    raise KeyError(name)


def _nemo_calculate_kl(logprobs, logprobs_reference, kl_type, importance_sampling_weights=None):
    """NeMo-RL 7ea279a nemo_rl/algorithms/utils.py:calculate_kl (defaults 20, 10), as its source reads."""
    logr = logprobs_reference - logprobs
    logr_clamped = logr.clamp(min=-20, max=20)
    if importance_sampling_weights is not None:
        importance_sampling_weights = torch.where(logr == logr_clamped, importance_sampling_weights,
                                                  importance_sampling_weights.detach())
    logr = logr_clamped
    kl = {"k1": -logr, "k2": torch.square(logr) / 2, "k3": torch.exp(logr) - 1 - logr}[kl_type]
    if importance_sampling_weights is not None:
        kl = importance_sampling_weights * kl
    return kl.clamp(min=-10, max=10)


def _library_loss(name, logprob, ref):
    """The per-token term each library differentiates in its default gradient mode (Preset.mode), written
    out from its source (logprob = log q requires grad; on-policy, so the old/generation log-probs are
    logprob's values, detached). Its derivative with respect to logprob is the mode's coefficient c."""
    if name.startswith("trl.grpo"):                   # per_token_kl * coef_1 (use_bias_correction_kl = True)
        coef_1 = torch.exp(logprob - logprob.detach())
        return _written_out(name, logprob, ref) * coef_1
    if name.startswith("nemo."):                      # ClippedPGLossFn → calculate_kl with IS weights
        w = torch.nan_to_num(torch.exp(logprob - logprob.detach()), nan=0.0, posinf=0.0, neginf=0.0)
        return _nemo_calculate_kl(logprob, ref, name[-2:], importance_sampling_weights=w)
    if name.startswith("trl.ppo") or name in ("openrlhf.k1", "openrlhf.k2", "openrlhf.k3"):
        return _written_out(name, logprob, ref).detach() * logprob      # in the reward: score function
    return _written_out(name, logprob, ref)          # verl (loss), OpenRLHF unbiased_gradient (loss)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_every_preset_matches_its_library_formula_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    logprob = (-torch.rand(4000, generator=g, dtype=torch.float64) * 30).to(dtype)
    ref = torch.cat([logprob[:1000] + 1e-3 * torch.randn(1000, generator=g, dtype=torch.float64).to(dtype),
                     (-torch.rand(3000, generator=g, dtype=torch.float64) * 30).to(dtype)])
    logr = ref - logprob                      # how every library forms log r (in the same dtype)
    assert {p.name for p in PRESETS} == {n for n in ESTIMATORS.names() if ESTIMATORS[n].source}
    for p in PRESETS:
        got = lookup(p.name).fn(logr)
        want = _written_out(p.name, logprob, ref)
        if p.name.startswith("openrlhf."):
            # OpenRLHF subtracts float32 copies of the log-probs and returns float32. From bf16 (or
            # float32) log-probs that difference is exact, which is what a case with precision
            # estimator = "fp32" hands the preset; from float64 ones the preset rounds the difference once.
            lr = (ref.float() - logprob.float()) if dtype != torch.float64 else logr
            got = lookup(p.name).fn(lr).float()
            if dtype == torch.float64:
                want = _written_out(p.name, (logprob - ref).float(), torch.zeros_like(ref, dtype=torch.float32))
            assert torch.equal(got, want), p.name
            continue
        assert got.dtype == dtype and torch.equal(got, want), p.name
    clamped = lookup("verl.low_var_kl").fn(torch.tensor([-30.0, 30.0], dtype=torch.float64))
    assert clamped.tolist() == [10.0, 10.0]    # both clamps fire: e^−20 + 19 → 10, e^20 − 21 → 10


def test_verl_plus_variants_have_the_value_of_the_base_and_the_gradient_of_k2():
    logprob = torch.tensor([-1.0, -3.0, -0.2, -25.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -0.5, -0.2, -2.0], dtype=torch.float64)
    for name in ("verl.kl", "verl.abs", "verl.low_var_kl"):
        v = lookup(name + "+").fn(ref - logprob)
        assert torch.equal(v.detach(), lookup(name).fn(ref - logprob).detach())
        (grad,) = torch.autograd.grad(v.sum(), logprob)
        assert torch.equal(grad, (logprob - ref).detach())        # d/dlogprob ½(logprob − ref)²
        # the loss-mode coefficient is therefore −log r, the straight-through one
        c = M.coefficient(lookup(name + "+"), "loss")((ref - logprob).detach())
        assert torch.allclose(c, -(ref - logprob).detach(), rtol=0, atol=1e-15)


def test_preset_names_resolve_as_registry_names_not_plug_ins():
    assert lookup("verl.low_var_kl").source.startswith("verl/trainer/ppo/core_algos.py")
    with pytest.raises(SpecError, match="did you mean 'verl.low_var_kl'"):
        lookup("verl.low_var_k")
    with pytest.raises(SpecError, match="cannot be imported"):    # a colon, and only a colon, means a plug-in
        lookup("verl.kl:low_var_kl")


def _clamps_fire(vocab=400, temperature=0.2):
    """p = q at a low temperature (as experiments/mismatch.toml's clamps-fire): log r < −20 on tail tokens
    (12% of q's mass at V = 400, T = 0.2)."""
    lq = torch.log_softmax(zipf_logits(vocab, 1.1, 1, 1), -1)
    lp = torch.log_softmax(zipf_logits(vocab, 1.1, 1, 1) / temperature, -1)
    return CategoricalPair("clamps", lq, lp)


def test_preset_exact_moments_against_monte_carlo_where_clamps_fire():
    pair = _clamps_fire()
    assert float((pair.model.log_p - pair.model.log_q).min()) < -20         # the log-ratio clamp fires on some tokens
    names = [p.name for p in PRESETS]
    df = mc_frame(pair, names, draws=200_000, seed=5, batches=100)
    assert len(df) == len(names) and df["exact_mean"].notna().all()
    assert (df["z"].abs() < 5).all(), df[["estimator", "z"]]
    by = df.set_index("estimator")
    # the ±10 output clamp lowers k3 below the truth; the unclamped TRL GRPO k3 is unbiased
    assert by.loc["verl.low_var_kl", "exact_mean"] < pair.kl() - 0.5
    assert by.loc["trl.grpo", "exact_mean"] == pytest.approx(pair.kl(), rel=1e-9)


def _brute_force_expected_gradient(pair, est, mode):
    """Σ_x sg(q(x)) ∇θ loss_x(θ), θ = q's logits [V] (one context), by autograd of the trainer's own
    expression (kl_bench.core.modes.trainer_loss): independent of the coefficient tables."""
    theta = pair.model.log_q[0].clone().requires_grad_(True)
    log_q = torch.log_softmax(theta, -1)
    loss = M.trainer_loss(est, mode, log_q, pair.model.log_p[0])
    (g,) = torch.autograd.grad((log_q.exp().detach() * loss).sum(), theta)
    return g.numpy()


def test_nemo_order_gives_clamped_tokens_zero_gradient_unlike_clamp_then_weight():
    pair = _clamps_fire()
    est = lookup("nemo.k3")
    assert {"loss", "loss_is", "loss_is_nemo"} <= set(M.modes_for(est)) and "straight_through" not in M.modes_for(est)
    nemo = pair.gradient_exact(GradItem.of(est, "loss_is_nemo"), {}).mean
    plain = pair.gradient_exact(GradItem.of(est, "loss_is"), {}).mean
    assert np.allclose(nemo, _brute_force_expected_gradient(pair, est, "loss_is_nemo"), rtol=1e-10, atol=1e-14)
    assert np.allclose(plain, _brute_force_expected_gradient(pair, est, "loss_is"), rtol=1e-10, atol=1e-14)
    # Where no clamp fires both coefficients are f − f′; where one fires NeMo's is 0, clamp(f)·w's is ±10.
    fired = ~M.nemo_active(est, pair.model.logr)
    c_nemo = M.coefficient(est, "loss_is_nemo")(pair.model.logr)
    c_plain = M.coefficient(est, "loss_is")(pair.model.logr)
    assert bool(fired.any()) and bool((c_nemo[fired] == 0).all()) and torch.equal(c_nemo[~fired], c_plain[~fired])
    assert bool((c_plain[fired].abs() >= 10).all())


def test_nemo_order_against_clamp_then_weight_on_the_vocab50k_clamps_fire_pair():
    """The README's figure: on experiments/mismatch.toml's clamps-fire pair (V = 50257, p = q at
    temperature 0.3), the exact expected gradient of nemo.k3 in NeMo's order has cosine 0.923 with
    ∇KL(q‖p), against 0.996 for clamp(f)·w: 0.073 apart (exact sums over the vocabulary)."""
    pair = _clamps_fire(50257, 0.3)
    est = lookup("nemo.k3")
    rev = pair.gradient_references()[REVERSE]
    cos_nemo = G.compare(pair.gradient_exact(GradItem.of(est, "loss_is_nemo"), {}).mean, rev, rev)["cos_reverse"]
    cos_plain = G.compare(pair.gradient_exact(GradItem.of(est, "loss_is"), {}).mean, rev, rev)["cos_reverse"]
    assert round(cos_nemo, 3) == 0.923 and round(cos_plain, 3) == 0.996


def test_gradient_rows_of_every_preset_match_their_exact_expected_gradients():
    pair = _clamps_fire()
    rows = pd.DataFrame(G.gradient_rows(pair, [lookup(p.name) for p in PRESETS], draws=100_000, seed=2,
                                        batches=50, device=CPU))
    assert set(rows["estimator"]) == {p.name for p in PRESETS} and rows["equals"].ne("").all()
    nemo = rows[rows["mode"] == "loss_is_nemo"]
    assert set(nemo["estimator"]) == {"nemo.k1", "nemo.k2", "nemo.k3"}
    assert (rows[["z_reverse", "z_forward"]].abs() < 5).all().all(), rows[["estimator", "mode", "z_reverse"]]
    # the straight-through variants follow ∇KL(q‖p) exactly in the loss, as k2 does
    plus = rows[rows["estimator"].str.endswith("+") & (rows["mode"] == "loss")]
    assert (plus["equals"] == "reverse").all(), plus[["estimator", "equals"]]


def _nemo_under_sampler_brute_force(pair, kl_type, approximation):
    """Σ_x b(x) ∇θ loss_x(θ), θ = q's logits, loss_x = NeMo-RL's calculate_kl with its ClippedPGLossFn
    weight written out: exp(curr − gen) with gen = log b (use_on_policy_kl_approximation) or
    exp(curr − sg curr) (the default), nan_to_num'd as NeMo-RL does."""
    theta = pair.model.log_q[0].clone().requires_grad_(True)
    curr = torch.log_softmax(theta, -1)
    gen = pair.model.log_b[0]
    w = torch.exp(curr - gen) if approximation else torch.exp(curr - curr.detach())
    w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
    loss = _nemo_calculate_kl(curr, pair.model.log_p[0], kl_type, importance_sampling_weights=w)
    (g,) = torch.autograd.grad((gen.exp() * loss).sum(), theta)
    return g.numpy()


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_nemo_order_under_a_sampler_categorical(kl_type):
    """Under a stale sampler b: weights = "token" is NeMo's use_on_policy_kl_approximation (w = q/b, not
    detached, inside the output clamp), weights = "none" its default weight; both exact expected gradients
    equal autograd of NeMo's expression summed over b, and the approximation's clamp test sees w·f."""
    base = _clamps_fire()
    log_b = torch.log_softmax(base.model.log_q * 0.9, -1)
    est = lookup(f"nemo.{kl_type}")
    for weights, approximation in (("token", True), ("none", False)):
        pair = CategoricalPair("s", base.model.log_q, base.model.log_p, log_b=log_b, weights=weights)
        assert "loss_is_nemo" in {it.mode for it in G.gradient_items(pair, [est])}
        got = pair.gradient_exact(GradItem.of(est, "loss_is_nemo"), {}).mean
        want = _nemo_under_sampler_brute_force(pair, kl_type, approximation)
        assert np.allclose(got, want, rtol=1e-10, atol=1e-14), (kl_type, weights)
    # the clamp's test sees w·f: on this pair some k1 and k3 tokens are clamped at w = 1 and not at
    # w = q/b, or the reverse (k2's values sit far from the bound 10 there)
    w = torch.exp(pair.model.log_q - log_b).reshape(-1)[pair.model.support]
    wc = est.weighted
    differ = int((wc.active(pair.model.logr, w) != wc.active(pair.model.logr)).sum())
    assert differ == {"k1": 1, "k2": 0, "k3": 2}[kl_type]


def test_nemo_under_a_sampler_monte_carlo_rows():
    base = _clamps_fire()
    pair = CategoricalPair("s", base.model.log_q, base.model.log_p, log_b=torch.log_softmax(base.model.log_q * 0.9, -1),
                           weights="token")
    rows = pd.DataFrame(G.gradient_rows(pair, [lookup("nemo.k3")], draws=100_000, seed=4, batches=50, device=CPU))
    assert "loss_is_nemo" in set(rows["mode"])
    assert (rows[["z_reverse", "z_forward"]].abs() < 5).all().all(), rows[["mode", "z_reverse", "z_forward"]]


def test_nemo_mode_is_refused_under_a_sampler_on_rollouts():
    from kl_bench.kinds import RolloutPair
    lq = torch.log_softmax(zipf_logits(30, 1.1, 1, 2), -1)
    lp = torch.log_softmax(zipf_logits(30, 1.1, 1, 2) / 0.5, -1)
    pair = RolloutPair("r", lq, lp, torch.arange(30) % 2, 4, 29, log_b=torch.log_softmax(lq * 0.9, -1),
                       weights="token")
    modes = {it.mode for it in G.gradient_items(pair, [lookup("nemo.k3")])}
    assert "loss_is_nemo" not in modes and "loss_is" in modes


def test_presets_on_rollout_token_rows_match_the_dynamic_program():
    from kl_bench.experiment.case import run_experiment_case
    from kl_bench.kinds import RolloutPair
    from kl_bench.experiment.spec_experiment import Experiment
    lq = torch.log_softmax(zipf_logits(300, 1.1, 1, 3), -1)
    lp = torch.log_softmax(zipf_logits(300, 1.1, 1, 3) / 0.5, -1)
    pair = RolloutPair("r", lq, lp, torch.arange(300) % 3, 6, 299)
    names = ("verl.low_var_kl", "openrlhf.k3", "nemo.k3", "trl.grpo", "verl.kl+")
    exp = Experiment(name="t", draws=100_000, seed=3, batches=50, estimators=names)
    df = pd.DataFrame(run_experiment_case(pair, exp, CPU).rows)
    assert set(df[df["aggregate"] == "tok"]["estimator"]) == set(names)
    assert set(df[df["aggregate"] == "seq"]["estimator"]) == {"trl.grpo"}      # the only polynomial one
    assert df["exact_mean"].notna().all() and (df["z"].abs() < 5).all(), df[["estimator", "aggregate", "z"]]


def test_unknown_preset_in_a_spec_is_one_line(tmp_path):
    from kl_bench.experiment.spec import load_spec
    spec = tmp_path / "s.toml"
    spec.write_text('spec_version = 1\n[experiment]\ndraws = 1000\nestimators = ["nemo.k4"]\n'
                    '[[case]]\nname = "g"\nkind = "gaussian"\nq = {mean = 0.0, std = 1.0}\np = {mean = 0.1, std = 1.0}\n')
    with pytest.raises(SpecError, match="did you mean 'nemo.k"):
        load_spec(spec)


def _library_grad(name, logprob, ref):
    lp = logprob.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(_library_loss(name, lp, ref).sum(), lp)
    return g


def _grad_points():
    """(logprob, ref) in float64: ordinary tokens, tokens where ±20 / ±10 clamps fire, and p(x) = 0."""
    g = torch.Generator().manual_seed(3)
    logprob = -torch.rand(600, generator=g, dtype=torch.float64) * 25
    ref = torch.cat([logprob[:200] + 0.3 * torch.randn(200, generator=g, dtype=torch.float64),
                     -torch.rand(400, generator=g, dtype=torch.float64) * 60])
    return logprob, ref


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_gradient_in_its_library_mode_matches_the_library_expression(preset):
    """d/dlogprob of the library's own per-token expression (autograd, written out above) equals the
    coefficient c(log r) of the preset's library mode (kl_bench.core.modes), token for token."""
    logprob, ref = _grad_points()
    est = lookup(preset.name)
    assert est.library_mode == preset.mode and preset.mode in M.modes_for(est)
    want = _library_grad(preset.name, logprob, ref)
    got = M.coefficient(est, preset.mode)((ref - logprob).to(torch.float64))
    # OpenRLHF rounds both log-probs (|·| < 64 here) to float32 before subtracting: up to 2 half-ulps
    # of 2^-18 each in log r, then one float32 rounding of c.
    f32 = preset.name.startswith("openrlhf")
    assert torch.allclose(got, want.to(torch.float64), rtol=1e-6 if f32 else 1e-12, atol=1e-5 if f32 else 1e-12), \
        preset.name


def test_nemo_on_policy_kl_approximation_is_loss_is_nemo_on_policy():
    """use_on_policy_kl_approximation: w = exp(curr − gen), not detached. On-policy the generation
    log-probs are the current ones' values, so its gradient is the default w = exp(curr − sg curr)'s."""
    logprob, ref = _grad_points()
    for kl_type in ("k1", "k2", "k3"):
        lp = logprob.clone().requires_grad_(True)
        gen = logprob.clone()                       # vLLM's log-probs of the same policy
        w = torch.nan_to_num(torch.exp(lp - gen), nan=0.0, posinf=0.0, neginf=0.0)
        (g,) = torch.autograd.grad(_nemo_calculate_kl(lp, ref, kl_type, w).sum(), lp)
        c = M.coefficient(lookup(f"nemo.{kl_type}"), "loss_is_nemo")(ref - logprob)
        assert torch.allclose(g, c, rtol=1e-12, atol=1e-12)


def test_trl_bias_correction_gives_the_k1_score_function_coefficient():
    """TRL's k3 · coef_1 (coef_1 = π_θ/π_old, π_old = sg π_θ on-policy): c = f − f′ = −log r exactly, the
    coefficient of k1 in the reward, whose expectation is ∇KL(q‖p)."""
    logprob, ref = _grad_points()
    # ordinary tokens (|log r| < 2): f − f′ = (e^ℓ − ℓ − 1) − (e^ℓ − 1) cancels e^ℓ, leaving a rounding of
    # a few ulps of e^ℓ (at ℓ = 50 that is 1e7: the identity holds in exact arithmetic only)
    logr = (ref - logprob)[:200]
    c = M.coefficient(lookup("trl.grpo"), "loss_is")(logr)
    assert torch.allclose(c, -logr, rtol=0, atol=1e-14)


_FAR = -1e15       # far enough that exp(ℓ) = 0 and every clamp fires; ℓ² stays finite even in float32


@pytest.mark.parametrize("name", [p.name for p in PRESETS] + ["k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3"])
def test_values_and_gradients_at_log_p_minus_infinity_are_defined_limits(name):
    """At p(x) = 0 every preset's value and every mode's coefficient is the limit as log r → −∞ (never
    NaN): equal to the value at ℓ = −1e15 where finite, the same sign and huge where infinite; and equal to
    what the library's own expression gives wherever that is not NaN."""
    est = lookup(name)
    x = torch.tensor([-torch.inf, _FAR], dtype=torch.float64)
    # OpenRLHF's straight-through value (v + g) − g loses v to absorption once g = ½ℓ² > 2^24·|v| (the
    # library's value tends to 0): at −∞ the preset returns v, the value the flag means to keep.
    absorbed = name.startswith("openrlhf.") and name.endswith("+")
    if absorbed:
        assert torch.equal(est.fn(x[:1]), lookup(name[:-1]).fn(x[:1]))
    checks = [("value", est.fn)] + [(m, M.coefficient(est, m)) for m in M.modes_for(est)]
    for what, fn in [(w, f) for w, f in checks if not (absorbed and w in ("value", "reward"))]:
        at_inf, far = fn(x).tolist()
        assert at_inf == at_inf, (name, what)                         # not NaN
        if math.isfinite(at_inf):
            assert at_inf == pytest.approx(far, rel=1e-12, abs=1e-12), (name, what)
        else:
            assert math.copysign(1, at_inf) == math.copysign(1, far) and abs(far) > 1e14, (name, what)
    preset = next((p for p in PRESETS if p.name == name), None)
    if preset is not None:
        lib = _library_grad(name, torch.tensor([-3.0], dtype=torch.float64),
                            torch.tensor([-torch.inf], dtype=torch.float64))
        mine = M.coefficient(est, preset.mode)(torch.tensor([-torch.inf], dtype=torch.float64))
        if not torch.isnan(lib).any():
            assert torch.equal(mine, lib.to(mine.dtype)), (name, lib, mine)


def test_straight_through_presets_gave_nan_in_the_library_order_and_are_defined_here():
    """verl's k2 − sg(k2) + sg(f) and OpenRLHF's v + g − sg(g) are ∞ − ∞ = NaN in value at log p = −∞
    (their gradient is +∞ with respect to log q); the presets return the limit value and gradient."""
    logprob = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-torch.inf], dtype=torch.float64)
    for name, limit in (("verl.kl+", math.inf), ("verl.low_var_kl+", 10.0), ("openrlhf.k2+", 10.0)):
        assert math.isnan(float(_written_out(name, logprob, ref).detach()))
        (lib_grad,) = torch.autograd.grad(_written_out(name, logprob, ref).sum(), logprob)
        assert float(lib_grad) == math.inf                            # d/dlogprob ½(logprob − ref)²
        assert float(lookup(name).fn(ref - logprob.detach())) == limit
        assert float(M.coefficient(lookup(name), "loss")(ref - logprob.detach())) == math.inf


def test_trl_geometric_sequence_weight_is_formed_in_log_space():
    """A 4096-token sequence whose token log-ratios sum to 720: TRL's weight is exp(720/4096) = 1.192…,
    finite, where the product Π_t q_t/b_t = e^720 overflows float64 (and e^−720 underflows to 0)."""
    from kl_bench.core.draws import Draws, Row
    from kl_bench.core.aggregates import row_values
    from kl_bench.core.presets import trl_sequence_weight
    n_tok, total = 4096, 720.0
    log_ratio = torch.full((1, n_tok), total / n_tok, dtype=torch.float64)
    mask = torch.ones_like(log_ratio)
    trl = torch.exp((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0))   # TRL's log_importance_weights
    assert torch.equal(trl_sequence_weight(torch.tensor([total], dtype=torch.float64),
                                           torch.tensor([float(n_tok)], dtype=torch.float64)), trl)
    assert float(trl) == pytest.approx(math.exp(720 / 4096), rel=1e-15) and 1.19 < float(trl) < 1.2
    # through the row machinery: tok_gm = (Σ_t f_t) · W^{1/|y|}, with W = e^720 = inf, e^−800 = 0 in float64
    for lw_sum in (total, -800.0):
        lw = torch.tensor([lw_sum], dtype=torch.float64)
        d = Draws(logr=torch.zeros(1, dtype=torch.float64), full=torch.zeros(1, dtype=torch.float64),
                  tok=torch.tensor([[2.5, float(n_tok)]], dtype=torch.float64), weight=torch.exp(lw),
                  log_weight=lw)
        assert float(d.weight[0]) in (math.inf, 0.0)
        est = lookup("k3")
        v = row_values(d, [Row(est, "tok_gm")])
        assert float(v[0, 0]) == pytest.approx(2.5 * math.exp(lw_sum / 4096), rel=1e-14)


def test_rollout_sampler_log_weight_is_the_log_of_its_product_weight():
    from kl_bench.kinds import RolloutPair
    lq = torch.log_softmax(zipf_logits(40, 1.1, 1, 2), -1)
    lp = torch.log_softmax(zipf_logits(40, 1.1, 1, 2) / 0.8, -1)
    lb = torch.log_softmax(lq * 0.7, -1)
    pair = RolloutPair("r", lq, lp, torch.arange(40) % 2, 12, 39, log_b=lb, weights="geometric", weight_cap=3.0)
    d = pair.sample_draws(500, torch.Generator().manual_seed(0), CPU)
    assert d.log_weight is not None and torch.allclose(d.log_weight, torch.log(d.weight), rtol=0, atol=1e-12)


def _off_policy_brute_force(pair, loss_fn):
    """Σ_x b(x) ∇θ loss_x(θ), θ = q's logits, for a library's per-token loss written out with the old
    (behaviour) log-probs = log b."""
    theta = pair.model.log_q[0].clone().requires_grad_(True)
    curr, old = torch.log_softmax(theta, -1), pair.model.log_b[0]
    (g,) = torch.autograd.grad((old.exp() * loss_fn(curr, old, pair.model.log_p[0])).sum(), theta)
    return g.numpy()


def test_off_policy_openrlhf_unbiased_gradient_and_trl_bias_correction():
    """Off-policy, OpenRLHF's unbiased_gradient multiplies ∇½ℓ² by sg(min(q/q_old, 10)): kl-bench's
    openrlhf.kN+ in the loss under weights = "token", weight_cap = 10. TRL's k3 · coef_1 with coef_1 =
    exp(curr − old), not detached: trl.grpo in loss_is under weights = "token", uncapped."""
    base = _clamps_fire()
    log_b = torch.log_softmax(base.model.log_q * 0.2, -1)       # stale enough that q/b exceeds 10 on some tokens
    capped = CategoricalPair("o", base.model.log_q, base.model.log_p, log_b=log_b, weights="token", weight_cap=10.0)
    assert float(torch.exp(base.model.log_q - log_b).max()) > 10

    def openrlhf(curr, old, ref):        # compute_approx_kl(..., log_probs_old=old, unbiased_gradient=True)
        log_ratio = curr.float() - ref.float()
        value = ((-log_ratio).exp() - 1 + log_ratio).clamp(min=-10, max=10)
        w = (curr.float() - old.float()).exp().clamp(max=10.0).detach()
        grad_surrogate = w * (log_ratio**2 / 2.0)
        return value.detach() + grad_surrogate - grad_surrogate.detach()
    got = capped.gradient_exact(GradItem.of(lookup("openrlhf.k3+"), "loss"), {}).mean
    want = _off_policy_brute_force(capped, openrlhf)
    assert np.allclose(got, want, rtol=1e-5, atol=1e-7)     # OpenRLHF's float32 log-ratios

    plain = CategoricalPair("o", base.model.log_q, base.model.log_p, log_b=log_b, weights="token")

    def trl(curr, old, ref):             # per_token_kl * coef_1, use_bias_correction_kl = True
        per_token_kl = torch.exp(ref - curr) - (ref - curr) - 1
        return per_token_kl * torch.exp(curr - old)
    got = plain.gradient_exact(GradItem.of(lookup("trl.grpo"), "loss_is"), {}).mean
    assert np.allclose(got, _off_policy_brute_force(plain, trl), rtol=1e-10, atol=1e-13)


def test_presets_nonnegative_but_for_rounding_are_said_so():
    """Issue 44: `kl-bench list` gave the clamped k3 presets no ≥0. Their (e^ℓ − 1) − ℓ order rounds below 0 near
    log r = 0 (so they are not ``nonnegative``, which the estimator tests check draw by draw), by at most a few
    float32 ulps of 1; everywhere else they are ≥ 0. ``rounding_negative`` says so, and list prints it."""
    import torch

    from kl_bench.core.estimators import ESTIMATORS
    flagged = {n for n, e in ESTIMATORS.items() if e.rounding_negative}
    assert flagged == {"openrlhf.k3", "openrlhf.k3+", "trl.ppo_k3", "nemo.k3"}
    near = torch.linspace(-1e-3, 1e-3, 200_001, dtype=torch.float64)
    wide = torch.linspace(-30, 30, 200_001, dtype=torch.float64)
    for name in flagged:
        e = ESTIMATORS[name]
        assert not e.nonnegative
        assert e.fn(near).min().item() < 0                        # it does round below 0 ...
        assert e.fn(near).min().item() > -8 * torch.finfo(torch.float32).eps    # ... by rounding alone
        assert e.fn(wide).min().item() > -8 * torch.finfo(torch.float32).eps
