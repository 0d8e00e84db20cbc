"""Rollout gradients: references and exact expected gradients against enumeration of every sequence,
the per-draw |g|² formula against explicit vectors, Monte Carlo against exact (|z| < 5), T = 1 against
the categorical benchmark, and determinism."""
import itertools
import math

import numpy as np
import pandas as pd
import pytest
import torch

from kl_bench.experiment import gradient_rows as G
from kl_bench.core import modes as M
from kl_bench.engine.monte_carlo import run_gradients
from kl_bench.core.modes import GradItem
from kl_bench.kinds.rollout.accumulator import SortedPaths
from kl_bench.kinds.rollout.sampler import simulate
from kl_bench.core.targets import FORWARD, REVERSE
from kl_bench.core.estimators import make_cv, lookup
from kl_bench.kinds import CategoricalPair
from kl_bench.kinds.rollout import RolloutPair, brute_force_sequences
from kl_bench.cli import app

from .conftest import CPU
from .helpers import runner

ESTS = [lookup(n) for n in ("k1", "k2", "k3", "abs", "fwd_k3")] + [make_cv(0.5)]


def _roll(c=2, v=5, t=3, eos=4, seed=0, noise=0.6):
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(c, v, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(lq + noise * torch.randn(c, v, generator=g, dtype=torch.float64), -1)
    return RolloutPair("r", lq, lp, torch.arange(v) % c, t, eos)


def _items(ests=ESTS, aggs=("seq", "tok")):
    return [(e, m, a) for a in aggs for e in ests for m in M.modes_for(e, token=a != "seq")]


def _n_exact(ests=ESTS, aggs=("seq", "tok")) -> int:
    """How many of :func:`_items` have an exact expected gradient, from the mode table (M.MODES): every token
    row; a sequence row where its coefficient is a polynomial of the sequence log-ratio (kl_bench.core.modes.Mode
    .poly), which no token-only estimator has (|L| is not a polynomial in (R, L)). A new Mode(...) changes the
    count here, not in the tests."""
    return len(_exact_items(ests, aggs))


def _exact_items(ests=ESTS, aggs=("seq", "tok")):
    """:func:`_items` that have an exact expected gradient (:func:`_n_exact`)."""
    return [(e, m, a) for e, m, a in _items(ests, aggs) if a != "seq" or _seq_exact(e, m)]


def _seq_exact(est, mode) -> bool:
    return not est.token_only and M.coefficient_poly(est, mode) is not None


def _refs(pair):
    refs = pair.gradient_references()
    return refs[REVERSE], refs[FORWARD]


def _exact(pair, est, mode, agg=""):
    ex = pair.gradient_exact(GradItem.of(est, mode, agg), {})
    return None if ex is None else ex.mean


def _enumerate(pair: RolloutPair):
    """Every sequence the sampler can draw: (b-probability, [(bucket, token)], per-token capped q/b);
    b = q without a sampler, EOS suppressed in the first phase when min_length asks."""
    step_lb = [lb.numpy() for lb, steps in pair.model.phases for _ in range(steps)]
    lq = pair.model.log_q.numpy()
    out = []

    def rec(c, prob, path, wts):
        t = len(path)
        if t == pair.model.length:
            out.append((prob, path, wts))
            return
        for x in range(pair.model.vocab):
            pb = math.exp(step_lb[t][c, x])
            if pb == 0:
                continue
            w = math.exp(lq[c, x] - step_lb[t][c, x])
            w = min(w, pair.model.weight_cap) if pair.model.weight_cap is not None else w
            step = (path + [(c, x)], wts + [w])
            if pair.model.eos is not None and x == pair.model.eos:
                out.append((prob * pb, *step))
            else:
                rec(int(pair.model.bucket[x]), prob * pb, *step)
    rec(0, 1.0, [], [])
    return out


def _brute(pair: RolloutPair, est, mode: str, agg: str) -> tuple[np.ndarray, float]:
    """(E[g], E|g|²) of one row by enumerating every sequence, with explicit per-step score vectors and
    the sampler's importance weights (per token or per sequence)."""
    c = M.coefficient(est, mode)
    q, gt = pair.model.log_q.exp().numpy(), pair.model.logr_table.numpy()
    # f and c of every (bucket, token), once: a path's tokens look them up
    f_tab, c_tab = est.fn(pair.model.logr_table).numpy(), c(pair.model.logr_table).numpy()
    mean, second = np.zeros(q.size), 0.0
    for prob, path, wts in _enumerate(pair):
        big_w = math.prod(wts) if pair.weights != "none" else 1.0
        tok_w = wts if pair.weights == "token" else [1.0] * len(wts)
        seq_only = big_w if pair.weights == "sequence" else 1.0
        steps = []
        for cb, x in path:
            s = np.zeros(q.shape)
            s[cb] -= q[cb]
            s[cb, x] += 1
            steps.append((s.reshape(-1), f_tab[cb, x], c_tab[cb, x]))
        if agg == "seq":
            big_l = torch.tensor([sum(gt[cb, x] for cb, x in path)], dtype=torch.float64)
            g = big_w * float(c(big_l)[0]) * sum(s for s, _, _ in steps)
        else:
            g = seq_only * _token_gradient(M.MODES[mode].token, steps, tok_w) / (len(steps) if agg == "tok_mean" else 1)
        mean += prob * g
        second += prob * float(g @ g)
    return mean, second


def _token_gradient(form: str, steps, tok_w) -> np.ndarray:
    """One path's token-row gradient written out per form (kl_bench.core.modes.TOKEN_FORMS), from the steps'
    (score vector, f, c) and token weights."""
    f = [ft for _, ft, _ in steps]
    cs = [ct for _, _, ct in steps]
    steps = [(s, None) for s, _, _ in steps]
    score = sum(s for s, _ in steps)
    if form == "local":
        return sum(w * ct * s for w, ct, (s, _) in zip(tok_w, cs, steps))
    if form == "to_go":
        return sum(w * sum(f[t:]) * s for t, (w, (s, _)) in enumerate(zip(tok_w, steps)))
    out = sum(w * ft for w, ft in zip(tok_w, f)) * score
    if form == "score+local":
        out = out + sum(w * (ct - ft) * s for w, ct, ft, (s, _) in zip(tok_w, cs, f, steps))
    return out


def _reference_by_enumeration(pair: RolloutPair) -> tuple[np.ndarray, np.ndarray]:
    theta = pair.model.log_q.clone().requires_grad_(True)
    lq = torch.log_softmax(theta, -1)
    rev = fwd = 0
    for _, path in brute_force_sequences(pair.model):
        lq_s = sum(lq[c, x] for c, x in path)
        lp_s = sum(pair.model.log_p[c, x] for c, x in path)
        rev = rev + lq_s.exp() * (lq_s - lp_s)
        fwd = fwd + lp_s.exp() * (lp_s - lq_s)
    g_rev = torch.autograd.grad(rev, theta, retain_graph=True)[0]
    g_fwd = torch.autograd.grad(fwd, theta)[0]
    return g_rev.reshape(-1).numpy(), g_fwd.reshape(-1).numpy()


@pytest.mark.parametrize("kw", [dict(), dict(eos=None, t=3), dict(c=3, v=6, t=2, eos=0, seed=4)],
                         ids=["eos", "no-eos", "eos-first"])
def test_references_and_exact_means_against_enumeration(kw):
    pair = _roll(**kw)
    rev, fwd = _refs(pair)
    b_rev, b_fwd = _reference_by_enumeration(pair)
    scale = np.abs(b_rev).max()
    assert np.allclose(rev, b_rev, rtol=0, atol=1e-12 * scale) and np.allclose(fwd, b_fwd, rtol=0, atol=1e-12 * scale)
    checked = 0
    for est, mode, agg in _items(aggs=("seq", "tok", "tok_mean")):
        ex = _exact(pair, est, mode, agg)
        if agg == "seq" and not _seq_exact(est, mode):
            assert ex is None               # |L| is not a polynomial in (R, L): no exact value
            continue
        want, _ = _brute(pair, est, mode, agg)
        assert np.allclose(ex, want, rtol=0, atol=1e-12 * scale), (est.name, mode, agg)
        checked += 1
    assert checked == _n_exact(aggs=("seq", "tok", "tok_mean"))     # today seq 25, tok 35, tok_mean 30
    assert checked >= 90                # the modes table may grow, not lose rows with an exact value unnoticed


def test_what_each_mode_equals_on_a_multi_token_rollout():
    """Sequence-level rows follow the categorical table; per-token rows in the loss only see each
    token's own distribution (the path held fixed), so on T > 1 they equal neither KL gradient."""
    pair = _roll(t=3)
    rev, fwd = _refs(pair)
    got = {(e.name, m, a): G.equals(_exact(pair, e, m, a), rev, fwd) for e, m, a in _exact_items()}
    want = {("k1", "loss", "seq"): "zero", ("k1", "reward", "seq"): "reverse", ("k2", "loss", "seq"): "reverse",
            ("k3", "loss", "seq"): "forward", ("k3", "loss_is", "seq"): "reverse",
            ("k3", "straight_through", "seq"): "reverse", ("fwd_k3", "loss_is", "seq"): "forward",
            ("k1", "loss", "tok"): "zero", ("k1", "reward", "tok"): "reverse", ("k2", "loss", "tok"): "other",
            ("k3", "loss", "tok"): "other", ("k3", "loss_is", "tok"): "other", ("k1", "loss_is", "tok"): "other"}
    for key, w in want.items():
        assert got[key] == w, (key, got[key])


def test_one_token_rollout_is_the_categorical_benchmark():
    """T = 1: the rollout gradients are the categorical ones of bucket 0 (other buckets' rows are 0)."""
    pair = _roll(c=3, v=7, t=1, eos=None, seed=2)
    cat = CategoricalPair("c", pair.model.log_q[:1], pair.model.log_p[:1])
    rev, fwd = _refs(pair)
    c_rev, c_fwd = _refs(cat)
    assert np.allclose(rev[:7], c_rev, atol=1e-14) and np.abs(rev[7:]).max() == 0
    assert np.allclose(fwd[:7], c_fwd, atol=1e-14)
    for est, mode, agg in _exact_items([lookup(n) for n in ("k1", "k2", "k3")]):
        ex = _exact(pair, est, mode, agg)
        c_ex = _exact(cat, est, mode)
        assert np.allclose(ex[:7], c_ex, atol=1e-14) and np.abs(ex[7:]).max() < 1e-15, (est.name, mode, agg)


def test_squared_norm_of_a_path_gradient_against_explicit_vectors():
    """|Σ_t w_t s_t|² from sorted runs equals the explicit vector's squared norm, with repeated
    (bucket, token) pairs, repeated buckets and steps after the end (w = 0)."""
    c, v, t, n = 3, 4, 9, 50
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(c, v, generator=g, dtype=torch.float64), -1)
    keys = torch.randint(0, c * v, (n, t), generator=g)
    w = torch.randn(n, t, generator=g, dtype=torch.float64) * (torch.rand(n, t, generator=g) > 0.2)
    got = SortedPaths.of(keys, q.reshape(-1), (q * q).sum(-1), v).sq_norm(w)
    for i in range(n):
        vec = torch.zeros(c, v, dtype=torch.float64)
        for k, wt in zip(keys[i].tolist(), w[i].tolist()):
            vec[k // v] -= wt * q[k // v]
            vec[k // v, k % v] += wt
        assert float(got[i]) == pytest.approx(float((vec * vec).sum()), rel=1e-12, abs=1e-12)


def test_monte_carlo_against_exact_within_five_standard_errors():
    pair = _roll(t=4, noise=0.8, seed=1)
    rows = pd.DataFrame(G.gradient_rows(pair, ESTS, draws=30_000, seed=5, batches=60, device=CPU))
    exact = rows[rows["equals"] != ""]
    # today seq: 5 estimators with an exact value × 3 modes + k3's straight_through; tok: 6 × 6 + 1 (53)
    assert len(exact) == _n_exact() and (rows["aggregate"].isin(["seq", "tok"])).all()
    assert (exact["z_reverse"].abs() < 5).all() and (exact["z_forward"].abs() < 5).all(), \
        exact[["estimator", "mode", "aggregate", "z_reverse", "z_forward"]]
    assert rows["exact_trace_cov"].isna().all() and rows["z_trace"].isna().all()
    # The measured per-draw E|g|² against enumeration (no exact second moments in production).
    items = [(it.est, it.mode, it.aggregate) for it in G.gradient_items(pair, ESTS)]   # the rows' order
    assert len(items) == len(rows) and ("abs", "seq") not in {(e.name, a) for e, _, a in items}
    rev, fwd = _refs(pair)
    mc = run_gradients(pair, [GradItem.of(*it) for it in items], {"reverse": G.unit(rev), "forward": G.unit(fwd)},
                       draws=30_000, seed=5, batches=60, device=CPU)
    n_k = mc.sizes
    for j, item in enumerate(items):
        mean, second = _brute(pair, *item)
        m = mc.sq[:, j].sum() / n_k.sum()
        se = math.sqrt(float(((mc.sq[:, j] / n_k - m) ** 2).sum()) / (len(n_k) - 1) / len(n_k))
        assert abs(m - second) / se < 5, (item[0].name, item[1], item[2], m, second)
        assert rows.iloc[j]["trace_cov"] == pytest.approx(mc.sq[:, j].sum() / n_k.sum() - float(
            (mc.total[j] / n_k.sum()) @ (mc.total[j] / n_k.sum())))
        assert np.linalg.norm(mc.total[j] / n_k.sum() - mean) < 10 * math.sqrt(second / n_k.sum())


def test_rollout_gradients_are_deterministic():
    pair = _roll(t=3)
    a = pd.DataFrame(G.gradient_rows(pair, ESTS[:3], draws=5000, seed=2, batches=10, device=CPU))
    b = pd.DataFrame(G.gradient_rows(_roll(t=3), ESTS[:3], draws=5000, seed=2, batches=10, device=CPU))
    pd.testing.assert_frame_equal(a, b)


def _sampled(weights: str, cap=None, min_length=0, temperature=1.4):
    """A rollout drawn by a tempered q (EOS suppressed for ``min_length`` tokens)."""
    base = _roll(c=2, v=5, t=3, eos=4, seed=3)
    lb = torch.log_softmax(base.model.log_q / temperature, -1)
    return RolloutPair("rs", base.model.log_q, base.model.log_p, base.model.bucket, 3, 4, log_b=lb, min_length=min_length,
                       weights=weights, weight_cap=cap, sampler_label="temperature")


@pytest.mark.parametrize("kw", [dict(weights="none"), dict(weights="token"), dict(weights="sequence"),
                                dict(weights="token", cap=1.2, min_length=1), dict(weights="none", min_length=2)],
                         ids=["none", "token", "sequence", "token-capped-minlen", "minlen"])
def test_sampler_expected_gradients_against_enumeration_and_monte_carlo(kw):
    pair = _sampled(**kw)
    rev, _ = _refs(pair)
    scale = np.abs(rev).max()
    ests = [lookup(n) for n in ("k1", "k2", "k3")]
    for est, mode, agg in _exact_items(ests):
        want, _ = _brute(pair, est, mode, agg)
        got = _exact(pair, est, mode, agg)
        assert np.allclose(got, want, rtol=0, atol=1e-12 * scale), (est.name, mode, agg)
    rows = pd.DataFrame(G.gradient_rows(pair, ests, draws=40_000, seed=1, batches=40, device=CPU))
    assert (rows["sampler"] == "temperature").all()
    exact = rows[rows["equals"] != ""]          # every row today; a sequence row of a non-polynomial mode has none
    assert len(exact) == _n_exact(ests) and (exact["z_reverse"].abs() < 5).all() and \
        (exact["z_forward"].abs() < 5).all(), exact[["estimator", "mode", "aggregate", "z_reverse", "z_forward"]]


def test_sequence_weights_undo_the_sampler():
    """Full-support sampler, uncapped sequence weights: E_b[W F S] = E_q[F S] for every seq row; per-token
    weights undo it for the local tok rows (each token's own expectation)."""
    pair, plain = _sampled("sequence"), _roll(c=2, v=5, t=3, eos=4, seed=3)
    tok = _sampled("token")
    for est, mode, agg in _exact_items([lookup(n) for n in ("k1", "k2", "k3")]):
        want = _exact(plain, est, mode, agg)
        assert np.allclose(_exact(pair, est, mode, agg), want, atol=1e-13), (est.name, mode, agg)
        if agg == "tok" and mode != "reward" and np.abs(want).max() > 1e-9:     # k1's loss rows are zero
            got = _exact(tok, est, mode, agg)
            assert not np.allclose(got, want, atol=1e-6)   # the bucket visits still follow b


def test_per_draw_weights_match_autograd_of_the_trainer_losses():
    """On sampled paths, the per-step weights behind every row (seq: c(L) on every step; tok reward:
    Σ_t f_t; tok local: c(log r_t)) give the same gradient as autograd of the trainer's loss."""
    pair = _roll(c=2, v=5, t=4, eos=4, seed=6)
    rec: list = []
    simulate(pair.model, [6], [torch.Generator().manual_seed(0)], CPU, record=rec)
    keys, alive = torch.stack([r[0] for r in rec], 1), torch.stack([r[1] for r in rec], 1)
    q = pair.model.log_q.exp()
    for est, mode, agg in _items([lookup(n) for n in ("k1", "k2", "k3")] + [make_cv(0.3)]):
        c = M.coefficient(est, mode)
        for i in range(keys.shape[0]):
            theta = pair.model.log_q.clone().requires_grad_(True)
            lq = torch.log_softmax(theta, -1).reshape(-1)
            lp = pair.model.log_p.reshape(-1)
            lq_t, lp_t, a = lq[keys[i]], lp[keys[i]], alive[i]
            logr_t = (lp_t - lq_t) * a
            if agg == "seq":
                big_lq, big_lp = (lq_t * a).sum(), (lp_t * a).sum()
                loss = M.trainer_loss(est, mode, big_lq, big_lp)
            elif mode == "reward":
                loss = (est.fn(logr_t.detach()) * a).sum() * (lq_t * a).sum()
            else:
                loss = (M.trainer_loss(est, mode, lq_t, lp_t) * a).sum()
            (g,) = torch.autograd.grad(loss, theta)
            # the same gradient from the per-step weights used by RolloutGradients.add
            lr = (pair.model.logr_table.reshape(-1)[keys[i]] * a)
            if agg == "seq":
                w = c(lr.sum().reshape(1)) * a
            elif mode == "reward":
                w = (est.fn(lr) * a).sum() * a
            else:
                w = c(pair.model.logr_table.reshape(-1)[keys[i]]) * a
            want = torch.zeros(pair.model.buckets * pair.model.vocab, dtype=torch.float64).index_add_(0, keys[i], w)
            want = want.reshape(q.shape)
            want = want - want.sum(-1, keepdim=True) * q
            assert torch.allclose(g, want, rtol=1e-12, atol=1e-13), (est.name, mode, agg, i)



@pytest.mark.parametrize("b,shape", [(2, dict(c=2, v=4, t=3, eos=3, seed=3)), (3, dict(c=2, v=3, t=2, eos=2, seed=5))])
def test_token_mean_batch_gradients_against_enumeration_of_groups(b, shape):
    """tok_batch rows: the gradient of one group's token-mean Σ_i Σ_t c_t s_t / Σ_i |y_i| (local forms),
    exact against enumeration of every B-tuple of sequences, and the Monte Carlo pass (one gradient per
    group; batches of 1,001 rollouts leave draws in no whole group) within 5 SE of it: its mean along
    both KL gradients and its per-group E|G|²."""
    base = _roll(noise=0.7, **shape)
    pair = RolloutPair("r", base.model.log_q, base.model.log_p, base.model.bucket, base.model.length, base.model.eos, token_mean_batch=b)
    q = pair.model.log_q.exp().numpy()
    paths = brute_force_sequences(pair.model)
    probs = np.array([p for p, _ in paths])
    lengths = np.array([len(path) for _, path in paths], dtype=float)
    items = [it for it in G.gradient_items(pair, ESTS[:3]) if it.aggregate == "tok_batch"]
    # the modes whose tokens each carry their own term (today loss, loss_is, straight_through, reward_partial)
    assert {it.mode for it in items} == {m for e in ESTS[:3] for m in M.modes_for(e, token=True)
                                         if M.MODES[m].token == "local"} >= {"loss", "loss_is", "reward_partial"}
    rev, fwd = _refs(pair)
    dirs = {"reverse": G.unit(rev), "forward": G.unit(fwd)}
    mc = run_gradients(pair, items, dirs, draws=40_040, seed=3, batches=40, device=CPU)
    for j, it in enumerate(items):
        c = M.coefficient(it.est, it.mode)
        vecs = np.zeros((len(paths), q.size))          # Σ_t c(log r_t) s_t of each sequence
        for i, (_, path) in enumerate(paths):
            for cb, x in path:
                ct = float(c(pair.model.logr_table[cb, x].reshape(1))[0])
                vecs[i, cb * q.shape[1]:(cb + 1) * q.shape[1]] -= ct * q[cb]
                vecs[i, cb * q.shape[1] + x] += ct
        mean, second = np.zeros(q.size), 0.0
        for group in itertools.product(range(len(paths)), repeat=b):
            idx = list(group)
            g = vecs[idx].sum(0) / lengths[idx].sum()
            prob = probs[idx].prod()
            mean += prob * g
            second += prob * float(g @ g)
        ex = pair.gradient_exact(it, dirs).mean
        assert np.allclose(ex, mean, rtol=0, atol=1e-12 * np.abs(rev).max()), (it.est.name, it.mode)
        n_k = mc.sizes
        for stat, want in ((mc.proj[:, j, 0], float(mean @ dirs["reverse"])), (mc.proj[:, j, 1], float(mean @ dirs["forward"])),
                           (mc.sq[:, j], second)):
            m = stat.sum() / n_k.sum()
            se = math.sqrt(float(((stat / n_k - m) ** 2).sum()) / (len(n_k) - 1) / len(n_k))
            assert abs(m - want) / se < 5, (it.est.name, it.mode, m, want, se)


def test_k3_in_the_loss_on_tokens_stays_finite_where_r_overflows():
    """The local token row of k3 in the loss is Σ_t (1 − r_t) s_t with E[N(c, x)]·(1 − r): where log q(x|c)
    falls 709 below log p, r = inf and E[N] ≈ 0, a NaN that made a rollout training trajectory 'diverge' at
    lr = 300. On-policy E[N(c, x)] = visits(c)·q(x|c) (checked on an ordinary model), so the row takes
    visits(c)·(q − p) there: finite, and equal to that closed form."""
    from kl_bench.core.modes import GradItem
    from kl_bench.kinds.rollout import gradients as rg
    item = GradItem.of(lookup("k3"), "loss", "tok")
    g = torch.Generator().manual_seed(3)
    lq = torch.log_softmax(torch.randn(3, 8, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(torch.randn(3, 8, generator=g, dtype=torch.float64), -1)
    ordinary = RolloutPair("r", lq, lp, torch.arange(8) % 3, 4, 7).model
    counts = rg.count_moment(ordinary, ordinary.sequence_weight, rg._ones, [1.0])
    assert torch.allclose(counts, counts.sum(-1, keepdim=True) * lq.exp(), rtol=1e-12, atol=0)
    cold = lq.clone()
    cold[0, 2] = cold[1, 5] = -800.0                       # q ≈ 0 (e^-800 underflows): r = p/q = inf
    cold = torch.log_softmax(cold, -1)
    model = RolloutPair("r", cold, lp, torch.arange(8) % 3, 4, 7).model
    got = rg._local_counts(model, item)
    assert torch.isfinite(got).all()
    visits = rg.count_moment(model, model.sequence_weight, rg._ones, [1.0]).sum(-1, keepdim=True)
    closed = visits * (cold.exp() - lp.exp())
    for c, x in ((0, 2), (1, 5)):
        assert got[c, x] == pytest.approx(float(closed[c, x]), rel=1e-12) and got[c, x] < 0
    assert rg.exact_mean(model, item) is not None and np.isfinite(rg.exact_mean(model, item)).all()


def test_gradients_of_a_rollout_with_p_equal_to_q_are_computed(tmp_path):
    """p = q (noise = 0, KL = 0) with per-token rows: the references' scale was 0/0, a ZeroDivisionError."""
    path = tmp_path / "r.toml"
    path.write_text('spec_version = 1\n[experiment]\nname = "r"\ndraws = 2000\nbatches = 10\ndevice = "cpu"\n'
                    'estimators = ["k1", "k3"]\ngradients = true\n[[case]]\nname = "T4"\nkind = "rollout"\nvocab = 8\n'
                    'buckets = 2\nlength = 4\neos = 7\nper_sequence_mean = true\n'
                    'q = { logits = "zipf", exponent = 1.0, seed = 1 }\np = { from = "q", noise = 0.0, seed = 2 }\n')
    res = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "o"), "-q"])
    assert res.exit_code == 0, res.output
