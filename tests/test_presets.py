"""Library presets (kl_bench.presets): value for value against each library's formula written out here,
in the library's dtype; exact moments against Monte Carlo; verl's straight-through gradients; NeMo-RL's
importance-weighted clamp order (gradient mode loss_is_nemo) against brute-force autograd."""

import numpy as np
import pandas as pd
import pytest
import torch

from kl_bench import gradients as G
from kl_bench import modes as M
from kl_bench.errors import SpecError
from kl_bench.estimators import ESTIMATORS, lookup
from kl_bench.logits import zipf_logits
from kl_bench.modes import GradItem
from kl_bench.pairs import CategoricalPair
from kl_bench.presets import PRESETS
from kl_bench.targets import REVERSE

from .conftest import CPU, mc_frame


def _written_out(name, logprob, ref):
    """Each library's code path, as its source reads (logprob = log q, ref = log p)."""
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
    if name.startswith("openrlhf."):
        log_ratio = logprob.float() - ref.float()
        if name.endswith("k2"):
            log_ratio = log_ratio**2 / 2.0
        elif name.endswith("k3"):
            log_ratio = -log_ratio
            log_ratio = log_ratio.exp() - 1 - log_ratio
        return log_ratio.clamp(min=-10, max=10)          # float32, as OpenRLHF returns it
    if name == "trl.grpo":
        return torch.exp(ref - logprob) - (ref - logprob) - 1
    if name in ("trl.ppo_k1", "trl.ppo_k3"):
        logr = ref - logprob
        return -logr if name == "trl.ppo_k1" else (logr.exp() - 1) - logr
    if name.startswith("nemo."):
        logr = (ref - logprob).clamp(min=-20, max=20)
        kl = {"k1": -logr, "k2": torch.square(logr) / 2, "k3": torch.exp(logr) - 1 - logr}[name[-2:]]
        return kl.clamp(min=-10, max=10)
    raise KeyError(name)


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
    assert float((pair.log_p - pair.log_q).min()) < -20         # the log-ratio clamp fires on some tokens
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
    expression (kl_bench.modes.trainer_loss): independent of the coefficient tables."""
    theta = pair.log_q[0].clone().requires_grad_(True)
    log_q = torch.log_softmax(theta, -1)
    loss = M.trainer_loss(est, mode, log_q, pair.log_p[0])
    (g,) = torch.autograd.grad((log_q.exp().detach() * loss).sum(), theta)
    return g.numpy()


def test_nemo_order_gives_clamped_tokens_zero_gradient_unlike_clamp_then_weight():
    pair = _clamps_fire()
    est = lookup("nemo.k3")
    assert M.modes_for(est) == ["loss", "reward", "loss_is", "loss_is_nemo"]
    nemo = pair.gradient_exact(GradItem.of(est, "loss_is_nemo"), {}).mean
    plain = pair.gradient_exact(GradItem.of(est, "loss_is"), {}).mean
    assert np.allclose(nemo, _brute_force_expected_gradient(pair, est, "loss_is_nemo"), rtol=1e-10, atol=1e-14)
    assert np.allclose(plain, _brute_force_expected_gradient(pair, est, "loss_is"), rtol=1e-10, atol=1e-14)
    # Where no clamp fires both coefficients are f − f′; where one fires NeMo's is 0, clamp(f)·w's is ±10.
    fired = ~M.nemo_active(est, pair.support_logr)
    c_nemo = M.coefficient(est, "loss_is_nemo")(pair.support_logr)
    c_plain = M.coefficient(est, "loss_is")(pair.support_logr)
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


def test_nemo_mode_is_refused_under_a_sampler():
    pair = _clamps_fire()
    sampled = CategoricalPair("s", pair.log_q, pair.log_p, log_b=torch.log_softmax(pair.log_q * 0.9, -1))
    modes = {it.mode for it in G.gradient_items(sampled, [lookup("nemo.k3")])}
    assert "loss_is_nemo" not in modes and "loss_is" in modes


def test_presets_on_rollout_token_rows_match_the_dynamic_program():
    from kl_bench.experiment import run_experiment_case
    from kl_bench.pairs import RolloutPair
    from kl_bench.spec import Experiment
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
    from kl_bench.spec import load_spec
    spec = tmp_path / "s.toml"
    spec.write_text('spec_version = 1\n[experiment]\ndraws = 1000\nestimators = ["nemo.k4"]\n'
                    '[[case]]\nname = "g"\nkind = "gaussian"\nq = {mean = 0.0, std = 1.0}\np = {mean = 0.1, std = 1.0}\n')
    with pytest.raises(SpecError, match="did you mean 'nemo.k"):
        load_spec(spec)
