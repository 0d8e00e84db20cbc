"""Optimisation trajectories (kl_bench.training): exact trajectories against independent implementations,
the optimum q* reached, sampled trajectories around the exact one, determinism, and bad [train] input."""
import math

import numpy as np
import pytest
import torch

from kl_bench.training import (CategoricalProblem, Optimizer, RolloutProblem, parse_combination, run_trajectory,
                               trajectory)

STEPS = 60


def _logits(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(scale * torch.randn(*shape, dtype=torch.float64, generator=g), -1)


def _categorical(b=3, v=12, beta=0.7, reward=True):
    r = torch.randn(b, v, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) if reward \
        else torch.zeros(b, v, dtype=torch.float64)
    return CategoricalProblem("c", _logits((b, v), 1), _logits((b, v), 2), r, beta)


def _thetas(pb, label, opt, steps=STEPS):
    combo = parse_combination(label, ())
    return [th for _, th, _ in trajectory(pb.theta0, opt, steps, lambda th, t: pb.expected_update(th, combo))]


def _objective(pb, theta):
    """J(θ) written independently: mean over contexts of E_q[reward] − β KL(q‖p)."""
    lq = torch.log_softmax(theta, -1)
    q = lq.exp()
    return ((q * pb.reward).sum(-1) - pb.beta * (q * (lq - pb.log_p)).sum(-1)).mean()


def _autograd_sgd(pb, lr, steps):
    theta, out = pb.theta0.clone(), []
    for _ in range(steps + 1):
        out.append(theta.clone())
        th = theta.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(_objective(pb, th), th)
        theta = theta + lr * g
    return out


def _autograd_adam(pb, lr, steps):
    # torch.optim.Adam on a local parameter: an independent Adam (its state lives in this optimiser only).
    th = torch.nn.Parameter(pb.theta0.clone())
    opt = torch.optim.Adam([th], lr=lr, maximize=True)
    out = []
    for _ in range(steps + 1):
        out.append(th.detach().clone())
        opt.zero_grad()
        _objective(pb, th).backward()
        opt.step()
    return out


@pytest.mark.parametrize("label", ["k1/reward", "k2/loss", "k3/loss_is"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_correct_modes_follow_autograd_of_the_true_objective(label, optimizer):
    pb = _categorical()
    lr = 0.5 if optimizer == "sgd" else 0.05
    ours = _thetas(pb, label, Optimizer(optimizer, lr))
    ref = (_autograd_sgd if optimizer == "sgd" else _autograd_adam)(pb, lr, STEPS)
    assert len(ours) == STEPS + 1
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)
    assert float((ours[-1] - ours[0]).abs().max()) > 0.1         # the policy did move


def _independent_kl_gradient(label, lq, lp):
    """∇θ of the KL term as each biased combination's expectation, written from the closed forms
    (DESIGN.md gradient table): k3 loss → ∇KL(p‖q) = q − p; k3 reward → E[k3 s]; k1 loss → 0. Per context."""
    q, p = lq.exp(), lp.exp()
    if label == "k3/loss":
        return q - p
    if label == "k3/reward":
        k3 = torch.expm1(lp - lq) - (lp - lq)
        return q * (k3 - (q * k3).sum(-1, keepdim=True))
    assert label == "k1/loss"
    return torch.zeros_like(q)


@pytest.mark.parametrize("label", ["k3/loss", "k3/reward", "k1/loss"])
def test_biased_modes_follow_their_closed_form(label):
    pb = _categorical()
    lr = 0.3
    ours = _thetas(pb, label, Optimizer("sgd", lr))
    theta = pb.theta0.clone()
    b = theta.shape[0]
    for t in range(STEPS + 1):
        assert torch.allclose(ours[t], theta, rtol=0, atol=1e-10)
        lq = torch.log_softmax(theta, -1)
        q = lq.exp()
        g_r = q * (pb.reward - (q * pb.reward).sum(-1, keepdim=True))
        theta = theta + lr * (g_r - pb.beta * _independent_kl_gradient(label, lq, pb.log_p)) / b


def test_k1_in_the_loss_never_moves_the_policy():
    pb = _categorical(reward=False)
    ours = _thetas(pb, "k1/loss", Optimizer("adam", 0.1))
    assert all(torch.equal(th, pb.theta0) for th in ours)


@pytest.mark.parametrize("label", ["k1/reward", "k2/loss"])
def test_categorical_optimum_is_reached(label):
    pb = _categorical(b=2, v=6, beta=1.0)
    combo = parse_combination(label, ())
    tr = run_trajectory(pb, Optimizer("sgd", 8.0), 150, 150, lambda th, t: pb.expected_update(th, combo))
    assert tr["kl_opt"][0] > 0.1
    assert tr["kl_opt"][-1] < 1e-12
    # At q*, KL(q*‖q*) = 0 and J = β log Z: the identity the rollout kind uses for its distance.
    log_z = torch.logsumexp(pb.log_p + pb.reward / pb.beta, -1).mean()
    assert abs(tr["objective"][-1] - pb.beta * float(log_z)) < 1e-10


def test_k3_in_the_loss_is_mass_covering():
    pb = _categorical(reward=True)
    fin = {}
    for label in ("k1/reward", "k2/loss", "k3/loss"):
        combo = parse_combination(label, ())
        tr = run_trajectory(pb, Optimizer("adam", 0.1), 150, 150, lambda th, t: pb.expected_update(th, combo))
        fin[label] = (tr["kl_rev"][-1], tr["kl_fwd"][-1])
    for other in ("k1/reward", "k2/loss"):
        assert fin["k3/loss"][1] < fin[other][1] and fin["k3/loss"][0] > fin[other][0]


# ----------------------------------------------------------------------------- rollouts
def _rollout(c=2, v=6, t=3, eos=0, beta=0.8):
    bucket = torch.arange(v) % c
    r = torch.randn(c, v, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    return RolloutProblem("r", _logits((c, v), 3), _logits((c, v), 4), r, beta, bucket, t, eos)


def _rollout_objective(pb, theta):
    """J(θ) by brute-force enumeration of every sequence (independent of the dynamic program)."""
    lq = torch.log_softmax(theta, -1)
    total = theta.new_zeros(())

    def rec(c, logq, logp, rew, depth):
        nonlocal total
        for x in range(lq.shape[1]):
            a, b, r = logq + lq[c, x], logp + pb.log_p[c, x], rew + pb.reward[c, x]
            if depth + 1 == pb.length or x == pb.eos:
                total = total + a.exp() * (r - pb.beta * (a - b))
            else:
                rec(int(pb.bucket[x]), a, b, r, depth + 1)
    rec(0, theta.new_zeros(()), theta.new_zeros(()), theta.new_zeros(()), 0)
    return total


def test_rollout_values_and_true_gradient_match_brute_force():
    pb = _rollout()
    theta = pb.theta0 + 0.3 * _logits(pb.theta0.shape, 7)
    values, grad_j = pb.evaluate(theta)
    th = theta.clone().requires_grad_(True)
    j = _rollout_objective(pb, th)
    (g,) = torch.autograd.grad(j, th)
    assert abs(values["objective"] - float(j.detach())) < 1e-12
    assert torch.allclose(grad_j, g, rtol=0, atol=1e-12)
    assert values["kl_opt"] > 0


def _rollout_follows_autograd(label, steps):
    """seq rows of the correct modes and the per-token score-function sum have E[update] = ∇J: the exact
    trajectory (expected gradients by the counting dynamic program) equals SGD on autograd of J."""
    pb = _rollout()
    combo = parse_combination(label, ("tok", "seq"))
    lr = 0.5
    ours = [th for _, th, _ in trajectory(pb.theta0, Optimizer("sgd", lr), steps,
                                          lambda th, t: pb.expected_update(th, combo))]
    theta = pb.theta0.clone()
    for t in range(steps + 1):
        assert torch.allclose(ours[t], theta, rtol=0, atol=1e-10)
        _, g = pb.evaluate(theta)
        theta = theta + lr * g


@pytest.mark.parametrize("label", ["k1/reward/seq", "k3/loss_is/seq", "k1/reward/tok"])
def test_rollout_correct_modes_follow_autograd_of_the_true_objective(label):
    _rollout_follows_autograd(label, 8)


@pytest.mark.slow
@pytest.mark.parametrize("label", ["k1/reward/seq", "k2/loss/seq", "k3/loss_is/seq", "k1/reward/tok"])
def test_rollout_correct_modes_follow_autograd_over_50_steps(label):
    _rollout_follows_autograd(label, 50)


def test_rollout_k1_in_the_loss_never_moves_the_policy():
    pb = _rollout()
    pb = RolloutProblem(pb.name, pb.theta0, pb.log_p, torch.zeros_like(pb.reward), pb.beta, pb.bucket, pb.length,
                        pb.eos)
    combo = parse_combination("k1/loss/tok", ("tok", "seq"))
    # E[Σ_t s_t] = 0 exactly; the counting dynamic program leaves rounding of ~1e-17 (SGD here: Adam
    # would divide that rounding by its own scale and take steps of ~lr·1e-9).
    run = list(trajectory(pb.theta0, Optimizer("sgd", 1.0), 50, lambda th, t: pb.expected_update(th, combo)))
    assert max(float(g.abs().max()) for _, _, g in run) < 1e-14
    assert max(float((th - pb.theta0).abs().max()) for _, th, _ in run) < 1e-12
