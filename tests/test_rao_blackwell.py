"""The Rao–Blackwellised gradient row of `full` on rollouts (Amini, Vieira & Cotterell, arXiv 2504.10637; issue 42
item 3): per path Σ_t ∇KL(c_t) + Σ_t s_t Σ_{t'>t} KL(c_t'). Its exact expectation is ∇KL(q‖p) (an independent
program against autograd of the reference), its Monte Carlo sums equal the per-path gradients formed by autograd,
and its measured spread is below k1's reward-to-go's."""
import numpy as np
import pytest
import torch

import kl_bench
from kl_bench.core.estimators import lookup
from kl_bench.core.targets import REVERSE
from kl_bench.experiment import gradient_rows as G
from kl_bench.kinds import RolloutPair
from kl_bench.kinds.rollout import gradients as RG
from kl_bench.kinds.rollout.sampler import paths
from kl_bench.sampling.logits import zipf_logits
from kl_bench.sampling.seeding import BatchStream

from .conftest import CPU

F64 = torch.float64


def _pair(v=12, c=3, t=5, eos=11, sampler=None, **options) -> RolloutPair:
    lq = torch.log_softmax(zipf_logits(v, 1.1, 1, c), -1)
    g = torch.Generator().manual_seed(5)
    lp = torch.log_softmax(lq + 0.4 * torch.randn(lq.shape, generator=g, dtype=F64), -1)
    lb = None if sampler is None else torch.log_softmax(lq / sampler, -1)
    return RolloutPair("r", lq, lp, torch.arange(v) % c, t, eos, log_b=lb, **options)


# Under a sampler (temperature 1.3: it draws every token q draws) whose sequences carry W = Π q/b.
WEIGHTED = {"sampler": 1.3, "weights": "sequence"}


@pytest.mark.parametrize("eos, options", [(None, {}), (11, {}), (11, WEIGHTED)], ids=["no-eos", "eos", "sampler"])
def test_exact_mean_is_the_reverse_kl_gradient(eos, options):
    pair = _pair(eos=eos, **options)
    item = RG.rao_blackwell_item()
    ref = pair.gradient_references()[REVERSE]
    got = pair.gradient_exact(item, {}).mean
    assert np.abs(got - ref).max() <= 1e-12 * np.abs(ref).max()
    if not options:
        assert np.abs(pair.gradient_self(item) - ref).max() <= 1e-12 * np.abs(ref).max()


@pytest.mark.parametrize("options", [{}, WEIGHTED], ids=["on-policy", "sampler"])
def test_monte_carlo_sums_are_the_per_path_gradients_by_autograd(options):
    """Each path's gradient W·(Σ_t ∇KL(c_t) + Σ_t s_t Σ_{t'>t} KL(c_t')) by autograd of its surrogate, W = Π_t q/b
    of its tokens (1 on-policy)."""
    pair = _pair(**options)
    model = pair.model
    item = RG.rao_blackwell_item()
    rev = pair.gradient_references()[REVERSE]
    dirs = {"reverse": G.unit(rev), "other": G.unit(np.arange(rev.size, dtype=float) % 7 - 3.0)}
    acc = pair.gradient_accumulator([item], dirs, CPU)
    batch = BatchStream(0, "rb", 0, 150, CPU)
    got = acc.add(batch)
    us = np.stack(list(dirs.values()))
    proj, sq, total = np.zeros(2), 0.0, np.zeros(rev.size)
    for m, gen in batch.pieces(acc.piece):
        p = paths(model, m, gen, CPU)
        for i in range(m):
            keys = p.keys[i][p.alive[i] > 0]
            theta = model.log_q.clone().requires_grad_(True)
            lq = torch.log_softmax(theta, -1)
            kl = (lq.exp() * (lq - model.log_p)).sum(-1)            # KL_θ(c) per bucket
            c = torch.div(keys, model.vocab, rounding_mode="floor")
            kl_t = kl[c]
            future = (kl_t.flip(0).cumsum(0).flip(0) - kl_t).detach()
            log_b = model.phases[0].log_b.reshape(-1)[keys]          # one phase: the sampler's table at every step
            weight = float(torch.exp((model.log_q.reshape(-1)[keys] - log_b).sum())) if options else 1.0
            surrogate = weight * (kl_t.sum() + (future * lq.reshape(-1)[keys]).sum())
            (g,) = torch.autograd.grad(surrogate, theta)
            g = g.reshape(-1).numpy()
            proj += us @ g
            sq += float(g @ g)
            total += g
    assert np.allclose(got.proj[0], proj, rtol=1e-10, atol=1e-12)
    assert got.sq[0] == pytest.approx(sq, rel=1e-10)
    assert np.allclose(acc.total()[0], total, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sampler", [None, {"temperature": 1.3, "weights": "sequence"}], ids=["on-policy", "sampler"])
def test_a_run_gives_the_row_with_less_spread_than_k1s_reward_to_go(tmp_path, sampler):
    case = {"name": "r", "kind": "rollout", "vocab": 20, "buckets": 3, "length": 6, "eos": 19,
            "q": {"logits": "zipf", "exponent": 1.1, "seed": 1}, "p": {"from": "q", "noise": 0.4, "seed": 2}}
    spec = {"spec_version": 1,
            "experiment": {"name": "rb", "draws": 20_000, "seed": 1, "batches": 50, "device": "cpu",
                           "estimators": ["k1", "full"], "gradients": True},
            "case": [case if sampler is None else {**case, "sampler": sampler}]}
    g = kl_bench.run(spec).gradients.set_index(["estimator", "mode"])
    rb, k1 = g.loc[("full", "rao_blackwell")], g.loc[("k1", "reward_to_go")]
    assert rb["equals"] == "reverse" and abs(rb["z_reverse"]) < 5 and abs(rb["z_forward"]) < 5
    assert rb["trace_cov"] < k1["trace_cov"] and rb["n_for_cos90"] < k1["n_for_cos90"]


def test_no_row_where_w_is_not_the_plain_sequence_weight_nor_without_full():
    """E_b[W·N(c, x)] = E_q[N(c, x)] holds for W = Π_t q/b alone: no row without weights, with token weights,
    or with a cap on q/b (the row would not estimate ∇KL(q‖p))."""
    for options in ({}, {"weights": "token"}, {"weights": "sequence", "weight_cap": 2.0},
                    {"weights": "sequence", "min_length": 2}):       # EOS never drawn at first: b misses q's mass
        assert _pair(sampler=1.3, **options).gradient_pair_rows([lookup("full")]) == [], options
    assert [it.mode for it in _pair(**WEIGHTED).gradient_pair_rows([lookup("full")])] == ["rao_blackwell"]
    assert _pair().gradient_pair_rows([lookup("k1")]) == []
    assert [it.mode for it in _pair().gradient_pair_rows([lookup("full")])] == ["rao_blackwell"]
