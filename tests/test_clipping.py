"""Clipping, truncation and masking of the importance weight ρ = q/b (kl_bench.core.weights, docs/weights.md):
exact expected gradients against autograd of the trainer's per-draw loss summed over every (context,
token), Monte Carlo rows against them, bad options refused with one line."""
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kl_bench.experiment import gradient_rows as G
from kl_bench.cli import app
from kl_bench.core.estimators import ESTIMATORS
from kl_bench.core.modes import GradItem, trainer_loss
from kl_bench.kinds import CategoricalPair
from kl_bench.core.weights import WeightCorrection

from .conftest import CPU

CORRECTIONS = {
    "floor": WeightCorrection(floor=0.9),
    "cap+floor": WeightCorrection(cap=1.1, floor=0.8),
    "icepop": WeightCorrection(mask=(0.7, 1.3)),
    "ppo": WeightCorrection(clip=(0.2, 0.28)),
    "ppo-dual": WeightCorrection(clip=(0.2, 0.2), dual=1.5),
    "ppo+mask": WeightCorrection(clip=(0.1, 0.1), mask=(0.5, 2.0)),      # (a cap or floor with a clip is refused)
}


def _logits(b=2, v=7, seed=3):
    g = torch.Generator().manual_seed(seed)
    zq = torch.randn(b, v, generator=g, dtype=torch.float64) * 1.5
    zp = zq + 0.8 * torch.randn(b, v, generator=g, dtype=torch.float64)
    zb = zq + 0.6 * torch.randn(b, v, generator=g, dtype=torch.float64)    # a stale policy: ρ spans the bands
    return zq, torch.log_softmax(zp, -1), torch.log_softmax(zb, -1)


def _pair(corr, **kw):
    zq, lp, lb = _logits(**kw)
    return CategoricalPair("c", torch.log_softmax(zq, -1), lp, log_b=lb, weights="token", correction=corr)


def _surrogate(est, mode, corr: WeightCorrection, lq, lp, lb):
    """The per-(context, token) loss as verl writes it: max(ρv, clip(ρ)v), min(·, c·v) where v > 0, times
    the detached mask; plain modes: the trainer loss times the detached corrected weight."""
    rho = torch.exp(lq - lb)
    if not corr.clips(mode):
        return corr.detached(rho.detach()) * trainer_loss(est, mode, lq, lp)
    v = est.fn(lp - lq)
    v = v.detach() if mode == "reward" else v
    lo, hi = (1 - corr.clip[0], 1 + corr.clip[1]) if corr.clip else (0.0, float("inf"))
    loss = torch.maximum(rho * v, rho.clamp(lo, hi) * v)
    if corr.dual is not None:
        loss = torch.where(v > 0, torch.minimum(loss, corr.dual * v), loss)
    keep = corr.detached(rho.detach()) > 0 if corr.mask is not None else torch.ones_like(rho, dtype=torch.bool)
    return torch.where(keep, loss, torch.zeros_like(loss))


@pytest.mark.parametrize("name", CORRECTIONS)
@pytest.mark.parametrize("mode", ["reward", "loss_is", "loss"])
@pytest.mark.parametrize("est", ["k1", "k3"])
def test_exact_expected_gradient_equals_autograd_of_the_enumerated_surrogate(name, mode, est):
    corr = CORRECTIONS[name]
    zq, lp, lb = _logits()
    theta = zq.clone().requires_grad_(True)
    lq = torch.log_softmax(theta, -1)
    loss = _surrogate(ESTIMATORS[est], mode, corr, lq, lp, lb)
    (grad,) = torch.autograd.grad((lb.exp() / zq.shape[0] * loss).sum(), theta)     # E over the b-mixture
    pair = _pair(corr)
    ex = pair.gradient_exact(GradItem.of(ESTIMATORS[est], mode), {})
    assert np.abs(ex.mean - grad.reshape(-1).numpy()).max() < 1e-12


def test_the_bands_are_exercised_and_change_the_gradient():
    """The test pair has draws on both sides of every band, so each option moves the exact gradient."""
    zq, lp, lb = _logits()
    rho = torch.exp(torch.log_softmax(zq, -1) - lb)
    assert bool((rho < 0.7).any() and (rho > 1.5).any())
    plain = _pair(WeightCorrection()).gradient_exact(GradItem.of(ESTIMATORS["k3"], "loss_is"), {}).mean
    for corr in CORRECTIONS.values():
        g = _pair(corr).gradient_exact(GradItem.of(ESTIMATORS["k3"], "loss_is"), {}).mean
        assert np.abs(g - plain).max() > 1e-4


def test_clip_leaves_modes_it_does_not_clip_at_the_weighted_gradient():
    item = GradItem.of(ESTIMATORS["k3"], "straight_through")
    a = _pair(CORRECTIONS["ppo"]).gradient_exact(item, {}).mean
    b = _pair(WeightCorrection()).gradient_exact(item, {}).mean
    assert np.array_equal(a, b)


@pytest.mark.parametrize("name", ["ppo-dual", "icepop"])
def test_monte_carlo_rows_agree_with_the_exact_gradient(name):
    pair = _pair(CORRECTIONS[name], v=30)
    rows = G.gradient_rows(pair, [ESTIMATORS["k1"], ESTIMATORS["k3"]], draws=20_000, seed=1, batches=50,
                           device=CPU)
    z = np.array([[r["z_reverse"], r["z_forward"]] for r in rows if r["mode"] in ("reward", "loss_is")])
    assert len(z) == 4 and np.isfinite(z).all() and (np.abs(z) < 5).all(), z


BASE = """
spec_version = 1
[experiment]
draws = 1000
device = "cpu"
[[case]]
name = "x"
kind = "KIND"
BODY
"""
BODIES = {"categorical": 'vocab = 50\nq = {logits = "zipf", seed = 1}\np = {from = "q", noise = 0.2}',
          "gaussian": "q = {mean = 0.0, std = 1.0}\np = {mean = 0.1, std = 1.0}",
          "rollout": 'vocab = 50\nbuckets = 2\nlength = 4\nq = {logits = "zipf", seed = 1}\np = {from = "q", noise = 0.2}'}


@pytest.mark.parametrize("kind, sampler, needles", [
    ("categorical", "sampler = {temperature = 0.8, clip_low = 0.2}", ["sampler.clip_low", "needs weights"]),
    ("categorical", 'sampler = {temperature = 0.8, weights = "token", clip_low = 1.0}', ["sampler.clip_low", "[0, 1)"]),
    ("categorical", 'sampler = {temperature = 0.8, weights = "token", dual_clip = 0.9}', ["sampler.dual_clip", "> 1"]),
    ("categorical", 'sampler = {temperature = 0.8, weights = "token", clip_high = 0.5, dual_clip = 1.2}',
     ["sampler.dual_clip", "1 + clip_high"]),
    ("categorical", 'sampler = {temperature = 0.8, weights = "token", mask_low = 2.0, mask_high = 1.0}',
     ["sampler.mask_low", "≤ mask_high"]),
    ("categorical", 'sampler = {temperature = 0.8, weights = "token", weight_floor = 2.0, weight_cap = 1.0}',
     ["sampler.weight_floor", "≤ weight_cap"]),
    ("categorical", 'sampler = {temperature = 0.8, weights = "token", weight_cap = 2.0, clip_high = 0.2}',
     ["sampler.weight_cap", "set one"]),
    ("gaussian", 'sampler = {std_scale = 1.2, weights = "token", clip_low = 0.2}', ["sampler.clip_low", "only for categorical"]),
    ("rollout", 'sampler = {temperature = 0.8, weights = "sequence", clip_high = 0.2}', ["needs weights"]),
    ("rollout", 'sampler = {temperature = 0.8, weights = "sequence", mask_high = 2.0}', ["sampler.mask_high", "needs weights"]),
])
def test_bad_correction_options_are_one_line_exit_2(kind, sampler, needles, write_spec, tmp_path):
    text = BASE.replace("KIND", kind).replace("BODY", BODIES[kind] + "\n" + sampler)
    res = CliRunner().invoke(app, ["run", str(write_spec(text)), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    msg = res.stderr.strip()
    assert len(msg.splitlines()) == 1 and "case 'x'" in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert not (tmp_path / "o").exists()


ROLL_CORR = WeightCorrection(floor=0.9, mask=(0.845, 1.9))


def test_rollout_token_floor_and_mask_match_brute_force_over_every_sequence():
    """weights = "token" with a floor and a mask: tok rows weight each token by its corrected q/b, seq
    rows by the product of them (a masked token drops its sequence), exactly as enumerated."""
    from kl_bench.core.estimators import lookup
    from .test_mismatch import _rollout_brute, _tiny_rollout
    pair = _tiny_rollout(weights="token", correction=ROLL_CORR)
    seqs = _rollout_brute(pair, "token")
    ws = [w for _, path in seqs for _, _, w in path]
    assert min(ws) < 0.845 and max(ws) > 1.9 and any(0.845 <= w < 0.9 for w in ws)   # every branch is used
    g = pair.model.logr_table.numpy()
    prob = np.array([p for p, _ in seqs])
    for name in ("k1", "k3"):
        fn = lookup(name).fn
        seq_vals, tok_vals = [], []
        for _, path in seqs:
            cw = [float(ROLL_CORR.detached(torch.tensor(w, dtype=torch.float64))) for _, _, w in path]
            seq_vals.append(np.prod(cw) * float(fn(torch.tensor(sum(g[c, x] for c, x, _ in path)))))
            tok_vals.append(sum(w * float(fn(torch.tensor(g[c, x]))) for (c, x, _), w in zip(path, cw)))
        for agg, vals in (("seq", np.array(seq_vals)), ("tok", np.array(tok_vals))):
            m = float((prob * vals).sum())
            v = float((prob * (vals - m) ** 2).sum())
            em, ev = pair.exact_moments(lookup(name), agg)
            assert em == pytest.approx(m, rel=1e-10, abs=1e-13) and ev == pytest.approx(v, rel=1e-9, abs=1e-13)


def test_rollout_masked_gradient_rows_agree_with_the_dynamic_program():
    from .test_mismatch import _tiny_rollout
    pair = _tiny_rollout(weights="token", correction=ROLL_CORR)
    rows = G.gradient_rows(pair, [ESTIMATORS["k1"], ESTIMATORS["k3"]], draws=4_000, seed=2, batches=20, device=CPU)
    z = np.array([r["z_reverse"] for r in rows if np.isfinite(r["exact_norm"])])
    assert len(z) >= 4 and np.isfinite(z).all() and (np.abs(z) < 5).all(), z


def test_categorical_values_use_the_corrected_weight():
    """summary rows: E_b[ρ'·f] and its variance, ρ' floored, capped and masked, by a sum written out here."""
    corr = WeightCorrection(cap=1.5, floor=0.8, mask=(0.6, 2.0))
    zq, lp, lb = _logits()
    lq = torch.log_softmax(zq, -1)
    rho = torch.exp(lq - lb)
    w = torch.where((rho >= 0.6) & (rho <= 2.0), rho.clamp(0.8, 1.5), torch.zeros_like(rho))
    prob = lb.exp() / lq.shape[0]
    pair = _pair(corr)
    for name in ("k1", "k3"):
        vals = w * ESTIMATORS[name].fn(lp - lq)
        m = float((prob * vals).sum())
        v = float((prob * (vals - m) ** 2).sum())
        em, ev = pair.exact_moments(ESTIMATORS[name])
        assert em == pytest.approx(m, rel=1e-12) and ev == pytest.approx(v, rel=1e-12)


def test_rollout_ppo_clip_of_local_token_rows_against_autograd_over_every_sequence():
    """The PPO clip on rollouts (weights = "token"): each token's surrogate max(ρ_t v_t, clip(ρ_t) v_t)
    (and the dual clip) with ρ_t = q_θ(x_t)/b(x_t), summed over the path with the path held fixed; its
    expected gradient under b, by autograd of every enumerated sequence, equals the exact tok row;
    score-function and sequence rows of the clipped modes are left out; Monte Carlo within 5 SE."""
    from kl_bench.kinds.rollout import RolloutPair
    from kl_bench.kinds.rollout.gradients import exact_mean
    g = torch.Generator().manual_seed(3)
    lq = torch.log_softmax(torch.randn(2, 5, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(lq + 0.7 * torch.randn(2, 5, generator=g, dtype=torch.float64), -1)
    lb = torch.log_softmax(lq + 0.6 * torch.randn(2, 5, generator=g, dtype=torch.float64), -1)
    corr = WeightCorrection(clip=(0.2, 0.2), dual=1.5)
    pair = RolloutPair("r", lq, lp, torch.arange(5) % 2, 3, 4, log_b=lb, weights="token", correction=corr)
    rho = torch.exp(lq - lb)
    assert (rho < 0.8).any() and (rho > 1.5).any()                    # both clips and the dual clip bind
    paths = []

    def rec(c, prob, path):
        if len(path) == pair.model.length or (path and path[-1][1] == pair.model.eos):
            paths.append((prob, path))
            return
        for x in range(5):
            rec(x % 2, prob * float(lb[c, x].exp()), path + [(c, x)])
    rec(0, 1.0, [])
    for est_name in ("k1", "k3"):
        est = ESTIMATORS[est_name]
        for agg in ("tok",):
            theta = lq.clone().requires_grad_(True)
            lqt = torch.log_softmax(theta, -1)
            total = 0
            for prob, path in paths:
                cs, xs = [c for c, _ in path], [x for _, x in path]
                loss = _surrogate(est, "loss_is", corr, lqt[cs, xs], lp[cs, xs], lb[cs, xs]).sum()
                total = total + prob * loss
            (want,) = torch.autograd.grad(total, theta)
            got = exact_mean(pair.model, GradItem.of(est, "loss_is", agg))
            assert np.allclose(got, want.reshape(-1).numpy(), rtol=0, atol=1e-13), (est_name, agg)
    items = G.gradient_items(pair, [ESTIMATORS["k1"]])
    modes = {(it.mode, it.aggregate) for it in items}
    # reward (a clipped mode with a score form) has no rows; modes the surrogate does not clip keep ρ·c
    assert ("loss_is", "tok") in modes and ("reward", "tok") not in modes and ("reward_to_go", "tok") in modes
    assert ("loss", "tok") in modes and ("loss_is", "seq") not in modes
    rows = G.gradient_rows(pair, [ESTIMATORS["k1"], ESTIMATORS["k3"]], draws=20_000, seed=2, batches=20, device=CPU)
    z = np.array([[r["z_reverse"], r["z_forward"]] for r in rows])
    assert np.isfinite(z).all() and (np.abs(z) < 5).all(), z
