"""The ``ukl`` gradient target (issue 21 item 5): ∇θ UKL(q_S‖p), the unnormalised KL
Σ_{x∈S} q log(q/p) − q + p over S, what a truncating sampler can draw (RPG, Zhang et al. 2505.17508).

Each check computes UKL by its definition, written out here (a sum over the vocabulary, or over every
sequence), and differentiates it with autograd: nothing is shared with the package's formulas.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from kl_bench.experiment import gradient_rows as G
from kl_bench.core.estimators import lookup
from kl_bench.kinds import CategoricalPair
from kl_bench.kinds.rollout import RolloutPair, brute_force_sequences
from kl_bench.sampling.mismatch import SamplerSpec
from kl_bench.core.targets import REVERSE

from .conftest import CPU

K1, K2, K3 = (lookup(n) for n in ("k1", "k2", "k3"))


def _logits(b, v, seed):
    g = torch.Generator().manual_seed(seed)
    zq = torch.randn(b, v, generator=g, dtype=torch.float64)
    return zq, zq + 0.7 * torch.randn(b, v, generator=g, dtype=torch.float64)


def _categorical(top_k=None, weights="token", b=2, v=12, seed=3):
    zq, zp = _logits(b, v, seed)
    lq, lp = torch.log_softmax(zq, -1), torch.log_softmax(zp, -1)
    if top_k is None:
        return CategoricalPair("c", lq, lp), zq, lp
    sp = SamplerSpec(top_k=top_k, weights=weights)
    return CategoricalPair("c", lq, lp, log_b=sp.logprobs(lq, lp), weights=weights,
                           sampler_label=sp.describe()), zq, lp


def _ukl_by_definition(zq, lp, inside):
    """Autograd of (1/B) Σ_b Σ_{x∈S_b} q log(q/p) − q + p, θ = q's logits [B, V]."""
    theta = zq.clone().requires_grad_(True)
    lq = torch.log_softmax(theta, -1)
    q = lq.exp()
    terms = torch.where(inside, q * (lq - lp) - q + lp.exp(), torch.zeros_like(q))
    (g,) = torch.autograd.grad(terms.sum() / zq.shape[0], theta)
    return g.reshape(-1).numpy()


def test_categorical_ukl_by_definition_and_what_follows_it_under_top_k():
    pair, zq, lp = _categorical(top_k=5)
    want = _ukl_by_definition(zq, lp, pair.model.log_b > -torch.inf)
    got = pair.gradient_ukl()
    rev = pair.gradient_references()[REVERSE]
    assert np.abs(got - want).max() <= 1e-15 * 10 * np.abs(want).max()
    assert np.linalg.norm(got - rev) > 0.05 * np.linalg.norm(rev)        # truncation moves it off ∇KL
    vectors: dict = {}
    rows = pd.DataFrame(G.gradient_rows(pair, [K1, K2, K3], draws=200_000, seed=4, batches=50, device=CPU,
                                        vectors=vectors))
    eq = rows.set_index(["estimator", "mode"])["equals"]
    # RPG: k1 as a reward, and k3 with its weight differentiated (loss_is), are UKL's gradient on S; k3 in
    # the reward and k1 in loss_is (an extra Σ_S q·s, not zero once S misses mass) are not.
    assert eq[("k1", "reward")] == "ukl" and eq[("k3", "loss_is")] == "ukl"
    assert eq[("k3", "reward")] == "other" and eq[("k1", "loss_is")] == "other"
    assert (rows["z_reverse"].abs() < 5).all() and (rows["z_forward"].abs() < 5).all()
    assert np.array_equal(vectors["c|reference|ukl"], got)


def test_without_truncation_ukl_is_the_reverse_gradient():
    """S holds all of q's mass (no sampler, or a sampler with full support): Σ_x ∇q_x = 0, ukl = reverse."""
    for pair, zq, lp in (_categorical(), _categorical(top_k=12)):
        rev = pair.gradient_references()[REVERSE]
        ukl = pair.gradient_ukl()
        assert np.abs(ukl - rev).max() <= 1e-14 * np.abs(rev).max()
        assert np.abs(_ukl_by_definition(zq, lp, torch.ones_like(zq, dtype=torch.bool)) - rev).max() \
            <= 1e-14 * np.abs(rev).max()
        rows = pd.DataFrame(G.gradient_rows(pair, [K1], draws=2_000, seed=4, batches=4, device=CPU))
        assert rows.set_index("mode")["equals"]["reward"] == "reverse"      # reverse wins where they coincide


def _rollout(top_k=2, weights="sequence", seed=1):
    c, v, t, eos = 2, 5, 3, 4
    zq, zp = _logits(c, v, seed)
    lq, lp = torch.log_softmax(zq, -1), torch.log_softmax(zp, -1)
    sp = SamplerSpec(top_k=top_k, weights=weights)
    lb = sp.logprobs(lq, lp)
    return RolloutPair("r", lq, lp, torch.arange(v) % c, t, eos, log_b=lb, weights=weights,
                       sampler_label=sp.describe()), zq, lb


def _rollout_ukl_by_enumeration(pair, zq, lb):
    """Autograd of Σ_{y∈S} q(y)(log q(y)/p(y) − 1) + p(y) over every sequence y (q_S: q restricted to
    the sequences whose every token b can draw, not renormalised)."""
    theta = zq.clone().requires_grad_(True)
    lq = torch.log_softmax(theta, -1)
    total = 0
    for _, path in brute_force_sequences(pair.model):
        if any(lb[c, x] == -torch.inf for c, x in path):
            continue
        lq_s = sum(lq[c, x] for c, x in path)
        lp_s = sum(pair.model.log_p[c, x] for c, x in path)
        total = total + lq_s.exp() * (lq_s - lp_s - 1) + lp_s.exp()
    (g,) = torch.autograd.grad(total, theta)
    return g.reshape(-1).numpy()


def test_rollout_ukl_by_enumeration_and_the_rows_that_follow_it():
    pair, zq, lb = _rollout()
    want = _rollout_ukl_by_enumeration(pair, zq, lb)
    got = pair.gradient_ukl()
    rev = pair.gradient_references()[REVERSE]
    assert np.abs(got - want).max() <= 1e-13 * np.abs(want).max()
    assert np.linalg.norm(got - rev) > 0.05 * np.linalg.norm(rev)
    rows = pd.DataFrame(G.gradient_rows(pair, [K1, K3], draws=30_000, seed=2, batches=30, device=CPU))
    eq = rows.set_index(["estimator", "aggregate", "mode"])["equals"]
    # With the sequence weight W = q(y)/b(y): E_b[W·(−L)·S] = Σ_{y∈S} q(y) log(q/p)(y) ∇log q(y).
    for key in (("k1", "seq", "reward"), ("k3", "seq", "loss_is"), ("k1", "tok", "reward")):
        assert eq[key] == "ukl", key
    assert (rows["z_reverse"].abs() < 5).all() and (rows["z_forward"].abs() < 5).all()


def test_rollout_without_truncation_ukl_is_reverse():
    pair, _, _ = _rollout(top_k=5)
    rev = pair.gradient_references()[REVERSE]
    assert np.abs(pair.gradient_ukl() - rev).max() <= 1e-13 * np.abs(rev).max()


def test_rpg_claim_on_the_papers_spec():
    """experiments/papers_rpg.toml: under top-k and top-p with token weights (categoricals) and top-k with
    sequence weights (a rollout), k1 in the reward and k3 in loss_is follow ∇UKL(q_S‖p), a different
    vector from ∇KL(q‖p) (the README's numbers)."""
    from kl_bench.experiment.spec import load_spec
    from kl_bench.core.modes import GradItem
    for case in load_spec("experiments/papers_rpg.toml").cases:
        kind = RolloutPair if case.kind == "rollout" else CategoricalPair
        pair = kind.from_config(case)
        rev, ukl = pair.gradient_references()[REVERSE], pair.gradient_ukl()
        agg = "seq" if case.kind == "rollout" else ""
        for est, mode in ((K1, "reward"), (K3, "loss_is")):
            g = pair.gradient_exact(GradItem.of(est, mode, agg), {}).mean
            assert np.linalg.norm(g - ukl) <= 1e-12 * np.linalg.norm(ukl), (case.name, est.name, mode)
        assert np.linalg.norm(ukl - rev) > 0.02 * np.linalg.norm(rev), case.name
