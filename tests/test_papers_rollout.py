"""Gradient claims about sequences (experiments/papers_rollout.toml), against enumeration of every
sequence with explicit score vectors (tests/test_rollout_gradients.py's brute force) and the engine's
Monte Carlo rows:

- Tang & Munos (arXiv 2506.09477): k1 in the reward with reward-to-go is unbiased for ∇KL(q‖p), like the
  whole-sequence score function, with a lower variance; the partial per-token form is biased.
- Shah et al., "A Comedy of Estimators" (arXiv 2512.21852): k1 and k3 in the reward and in the loss
  (reward+loss) are unbiased; k3 in the reward alone is not.
"""
import numpy as np
import pandas as pd
import torch

from kl_bench.experiment import gradient_rows as G
from kl_bench.core.estimators import ESTIMATORS
from kl_bench.core.modes import GradItem
from kl_bench.kinds.rollout import RolloutPair, brute_force_sequences
from kl_bench.experiment.spec import load_spec
from kl_bench.core.targets import REVERSE

from .conftest import CPU
from .test_rollout_gradients import _brute, _roll

K1, K3 = ESTIMATORS["k1"], ESTIMATORS["k3"]


def _two_token() -> RolloutPair:
    case = next(c for c in load_spec("experiments/papers_rollout.toml").cases if c.name == "two-token")
    return RolloutPair.from_config(case)


def _second(pair, est, mode) -> float:
    """Exact E|g|² by enumeration, minus |E g|²: the trace of the per-draw gradient's covariance."""
    mean, second = _brute(pair, est, mode, "tok")
    return second - float(mean @ mean)


def test_reward_to_go_is_unbiased_with_lower_variance():
    for pair in (_two_token(), _roll(c=2, v=5, t=4, eos=4, seed=3, noise=0.8)):
        rev = pair.gradient_references()[REVERSE]
        for mode in ("reward", "reward_to_go"):
            mean, _ = _brute(pair, K1, mode, "tok")
            assert np.allclose(mean, rev, rtol=0, atol=1e-12 * np.abs(rev).max()), mode
        whole, to_go = _second(pair, K1, "reward"), _second(pair, K1, "reward_to_go")
        assert to_go < whole, (to_go, whole)
        partial, _ = _brute(pair, K1, "reward_partial", "tok")   # drops the later tokens' KL: biased
        assert np.linalg.norm(partial - rev) > 1e-3 * np.linalg.norm(rev)


def test_reward_plus_loss_is_unbiased_and_k3_in_the_reward_is_not():
    pair = _two_token()
    rev = pair.gradient_references()[REVERSE]
    for est in (K1, K3):
        mean, _ = _brute(pair, est, "reward+loss", "tok")
        assert np.allclose(mean, rev, rtol=0, atol=1e-12 * np.abs(rev).max()), est.name
    k3_reward, _ = _brute(pair, K3, "reward", "tok")
    assert np.linalg.norm(k3_reward - rev) > 0.1 * np.linalg.norm(rev)


def test_the_rows_of_the_experiment_say_so():
    """The gradient rows of the two-token case: `equals` as claimed, Monte Carlo within 5 SE of exact,
    and the measured spread of reward-to-go below the whole-sequence form's."""
    pair = _two_token()
    rows = pd.DataFrame(G.gradient_rows(pair, [K1, K3], draws=40_000, seed=1, batches=40, device=CPU))
    tok = rows[rows["aggregate"] == "tok"].set_index(["estimator", "mode"])
    assert tok.loc[("k1", "reward_to_go"), "equals"] == "reverse"
    assert tok.loc[("k1", "reward+loss"), "equals"] == "reverse"
    assert tok.loc[("k3", "reward+loss"), "equals"] == "reverse"
    assert tok.loc[("k3", "reward"), "equals"] == "other"
    assert tok.loc[("k1", "reward_partial"), "equals"] == "other"
    assert (rows[["z_reverse", "z_forward"]].abs() < 5).all().all()
    exact_ratio = _second(pair, K1, "reward") / _second(pair, K1, "reward_to_go")
    measured = tok.loc[("k1", "reward"), "trace_cov"] / tok.loc[("k1", "reward_to_go"), "trace_cov"]
    assert exact_ratio > 1.2 and measured > 1.1, (exact_ratio, measured)


def test_self_target_against_autograd_of_enumeration():
    """∇θ E_q[v] of each row's value by autograd over every sequence (θ in q(y) and in log r), for tok,
    tok_mean and seq; reward+loss rows equal it where it is not a KL gradient."""
    pair = _roll(c=2, v=4, t=3, eos=3, seed=2, noise=0.7)
    for est in (K1, ESTIMATORS["k2"], K3):
        for agg in ("tok", "tok_mean", "seq"):
            theta = pair.model.log_q.clone().requires_grad_(True)
            lq = torch.log_softmax(theta, -1)
            total = 0
            for _, path in brute_force_sequences(pair.model):
                lr = [pair.model.log_p[c, x] - lq[c, x] for c, x in path]
                q_y = torch.exp(-sum(lr) + sum(pair.model.log_p[c, x] for c, x in path))
                if agg == "seq":
                    v = est.fn(torch.stack([sum(lr)]))[0]
                else:
                    v = est.fn(torch.stack(lr)).sum() / (len(path) if agg == "tok_mean" else 1)
                total = total + q_y * v
            (want,) = torch.autograd.grad(total, theta)
            got = pair.gradient_self(GradItem.of(est, "loss", agg))
            assert np.allclose(got, want.reshape(-1).numpy(), rtol=0, atol=1e-12), (est.name, agg)
    rows = pd.DataFrame(G.gradient_rows(pair, [ESTIMATORS["k2"]], draws=2_000, seed=0, batches=10, device=CPU))
    assert set(rows.loc[rows["mode"] == "reward+loss", "equals"]) == {"self"}
