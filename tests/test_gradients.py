"""Gradients: known answers, reference gradients against autograd on exact KLs, exact expected gradients
against brute force, what each mode equals (docs/gradients.md's table), Monte Carlo against exact."""
import math

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kl_bench.experiment import gradient_rows as G
from kl_bench.core import modes as M
from kl_bench.core.modes import GradItem
from kl_bench.core.targets import FORWARD, REVERSE
from kl_bench.cli import app
from kl_bench.core.estimators import ESTIMATORS, make_cv
from kl_bench.kinds import CategoricalPair, GaussianPair
from kl_bench.kinds.categorical.gradients import exact_gradient_of_table

from .conftest import CPU

ESTS = [ESTIMATORS[n] for n in ("k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3")] + [make_cv(0.5)]


def n_rows(names, exact_poly: bool = False) -> int:
    """The gradient rows of these estimators on one draw (no token aggregate), from the mode table (M.MODES): one
    per mode each gets (M.modes_for); ``exact_poly``: only those whose coefficient is a polynomial (a Gaussian's
    exact expected gradient needs one). A new Mode(...) changes the count here, not in the tests."""
    ests = [ESTIMATORS[n] for n in names]
    return sum(1 for e in ests for m in M.modes_for(e) if not exact_poly or M.coefficient_poly(e, m) is not None)


def test_known_answers_for_the_mean_of_q():
    """q = N(0.3, 1), p = N(−0.2, 1.3²): E[∇μ k2] = d/σp² and E[∇μ k3] = d/σq², d = μq − μp."""
    pair = GaussianPair("g", [0.3], [1.0], [-0.2], [1.3])
    d = 0.5
    k2 = pair.gradient_exact(GradItem.of(ESTIMATORS["k2"], "loss"), {}).mean
    k3 = pair.gradient_exact(GradItem.of(ESTIMATORS["k3"], "loss"), {}).mean
    assert k2[0] == pytest.approx(d / 1.3**2, rel=1e-12) and k3[0] == pytest.approx(d / 1.0**2, rel=1e-12)


def test_gaussian_reference_gradients_against_autograd():
    mu, logs = torch.tensor([0.3, -0.1], dtype=torch.float64, requires_grad=True), \
        torch.tensor([0.0, 0.2], dtype=torch.float64, requires_grad=True)
    mp, sp = torch.tensor([-0.2, 0.4], dtype=torch.float64), torch.tensor([1.3, 0.8], dtype=torch.float64)
    sq = logs.exp()
    rev = (torch.log(sp / sq) + (sq**2 + (mu - mp) ** 2) / (2 * sp**2) - 0.5).sum()
    fwd = (torch.log(sq / sp) + (sp**2 + (mu - mp) ** 2) / (2 * sq**2) - 0.5).sum()
    g_rev = torch.cat(torch.autograd.grad(rev, (mu, logs), retain_graph=True)).numpy()
    g_fwd = torch.cat(torch.autograd.grad(fwd, (mu, logs))).numpy()
    pair = GaussianPair("g", [0.3, -0.1], [1.0, math.exp(0.2)], [-0.2, 0.4], [1.3, 0.8])
    r, f = _refs(pair)
    assert np.allclose(r, g_rev, rtol=1e-12) and np.allclose(f, g_fwd, rtol=1e-12)


def _refs(pair):
    refs = pair.gradient_references()
    return refs[REVERSE], refs[FORWARD]


def _cat(b=3, v=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(b, v, generator=g, dtype=torch.float64) * 1.5, -1)
    lp = torch.log_softmax(lq + 0.5 * torch.randn(b, v, generator=g, dtype=torch.float64), -1)
    return CategoricalPair("c", lq, lp)


def test_categorical_reference_gradients_against_autograd_on_the_exact_kl():
    pair = _cat()
    z = pair.model.log_q.clone().requires_grad_(True)
    lq = torch.log_softmax(z, -1)
    rev = (lq.exp() * (lq - pair.model.log_p)).sum(-1).mean()
    fwd = (pair.model.log_p.exp() * (pair.model.log_p - lq)).sum(-1).mean()
    g_rev = torch.autograd.grad(rev, z, retain_graph=True)[0].reshape(-1).numpy()
    g_fwd = torch.autograd.grad(fwd, z)[0].reshape(-1).numpy()
    r, f = _refs(pair)
    assert np.allclose(r, g_rev, rtol=1e-10, atol=1e-15) and np.allclose(f, g_fwd, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("mode", M.MODES)
def test_categorical_expected_gradient_against_brute_force(mode):
    pair = _cat(b=2, v=15, seed=1)
    for est in ESTS:
        if mode not in M.modes_for(est):
            continue
        c = M.coefficient(est, mode)
        ex = exact_gradient_of_table(pair.model, c(pair.model.logr), {}).mean.reshape(2, 15)
        q = pair.model.log_q.exp().numpy()
        brute = np.zeros((2, 15))
        for b in range(2):
            for x in range(15):
                lr = torch.tensor([float(pair.model.log_p[b, x] - pair.model.log_q[b, x])], dtype=torch.float64)
                s = -q[b].copy()
                s[x] += 1
                brute[b] += 0.5 * q[b, x] * float(c(lr)[0]) * s
        assert np.allclose(ex, brute, rtol=1e-10, atol=1e-15), (est.name, mode)


# docs/gradients.md's table, row by row: what each estimator's expected gradient equals in each mode.
EXPECTED = {("k1", "loss"): "zero", ("k1", "reward"): "reverse", ("k2", "loss"): "reverse",
            ("k3", "loss"): "forward", ("k3", "reward"): "other", ("k3", "loss_is"): "reverse",
            ("k3", "straight_through"): "reverse", ("fwd_k3", "loss_is"): "forward"}


@pytest.mark.parametrize("pair", [GaussianPair("g", [0.3], [1.0], [-0.2], [1.3]), _cat(b=2, v=500, seed=2)],
                         ids=["gaussian", "categorical"])
def test_what_each_mode_equals_and_monte_carlo_agrees(pair):
    rows = pd.DataFrame(G.gradient_rows(pair, ESTS, draws=100_000, seed=3, batches=100, device=CPU))
    got = {(r["estimator"], r["mode"]): r["equals"] for _, r in rows.iterrows()}
    for key, want in EXPECTED.items():
        assert got[key] == want, (key, got[key])
    checked = rows[rows["exact_cos_reverse"].notna() | (rows["equals"] == "zero")]
    assert len(checked) >= 15
    assert (checked["z_reverse"].abs() < 5).all() and (checked["z_forward"].abs() < 5).all(), \
        checked[["estimator", "mode", "z_reverse", "z_forward"]]
    # z_trace exists exactly where E|g|⁴ < ∞ (all categorical rows; Gaussian rows without an r term)
    light = checked[checked["z_trace"].notna()]
    assert len(light) >= 5 and (isinstance(pair, CategoricalPair) or len(light) < len(checked))
    assert (light["z_trace"].abs() < 5).all(), light[["estimator", "mode", "z_trace"]]
    # k3 times q/sg(q) repairs the forward gradient of plain k3 in the loss
    k3 = rows.set_index(["estimator", "mode"])
    assert k3.loc[("k3", "loss_is"), "exact_relerr_reverse"] < 1e-9 < k3.loc[("k3", "loss"), "exact_relerr_reverse"]


def test_categorical_trace_and_n_for_cos90_hold_up_in_simulation():
    """Batches of n_for_cos90 draws: the batch-mean gradient (e_x − q weighted by c, averaged) has cosine
    ≥ 0.9 with ∇KL(q‖p) in at least 95% of 2000 simulated batches (within binomial noise)."""
    pair = _cat(b=1, v=200, seed=4)
    k2 = ESTIMATORS["k2"]
    r = pd.DataFrame(G.gradient_rows(pair, [k2], draws=400_000, seed=1, batches=100, device=CPU)).set_index("mode").loc["loss"]
    assert abs(r["z_trace"]) < 5                       # the measured E|g|² against its exact value
    n, trials = int(r["n_for_cos90"]), 2000
    rev, _ = _refs(pair)
    q = pair.model.log_q.exp()[0]
    ids = pair.sampler.sample_ids(n * trials, torch.Generator().manual_seed(11), CPU).view(trials, n)
    c = M.coefficient(k2, "loss")(pair.model.logr[ids])                                   # [trials, n]
    grads = torch.zeros(trials, 200, dtype=torch.float64).scatter_add_(1, pair.model.support[ids], c) / n
    grads -= q[None] * c.mean(1, keepdim=True)                                       # mean of c (e_x − q)
    g = grads.numpy()
    cos = (g @ rev) / (np.linalg.norm(g, axis=1) * np.linalg.norm(rev))
    frac = float((cos >= 0.9).mean())
    assert frac >= 0.95 - 5 * math.sqrt(0.95 * 0.05 / trials), (n, frac)


def test_gradients_through_the_cli(write_spec, tmp_path):
    spec = write_spec("""
spec_version = 1
[experiment]
draws = 20000
device = "cpu"
batches = 20
estimators = ["k1", "k3"]
gradients = true
[[case]]
name = "g"
kind = "gaussian"
q = {mean = 0.3, std = 1.0}
p = {mean = -0.2, std = 1.3}
""")
    res = CliRunner().invoke(app, ["run", str(spec), "--out", str(tmp_path / "o"), "--report"])
    assert res.exit_code == 0, res.output
    g = pd.read_csv(tmp_path / "o" / "gradients.csv")
    assert list(g.columns) == list(G.GRAD_SCHEMA) and len(g) == n_rows(["k1", "k3"])
    assert "gradients: what each estimator optimises" in res.output
    assert (tmp_path / "o" / "report" / "figures" / "gradient_cosine_g.png").exists()
    bad = write_spec(spec.read_text().replace("gradients = true", 'gradients = "yes"'), "bad.toml")
    res = CliRunner().invoke(app, ["run", str(bad), "--out", str(tmp_path / "b")])
    assert res.exit_code == 2 and "experiment.gradients" in res.stderr and "true or false" in res.stderr


@pytest.mark.parametrize("weights,cap", [("none", None), ("token", None), ("token", 1.5)])
def test_categorical_sampler_gradients_against_brute_force_and_monte_carlo(weights, cap):
    """x ~ b = tempered q; the score stays q's and weights multiply by the detached (capped) q/b."""
    base = _cat(b=2, v=30, seed=5)
    lb = torch.log_softmax(base.model.log_q / 1.5, -1)
    pair = CategoricalPair("s", base.model.log_q, base.model.log_p, log_b=lb, weights=weights, weight_cap=cap,
                           sampler_label="temperature=1.5")
    q, b = base.model.log_q.exp().numpy(), lb.exp().numpy()
    rows = pd.DataFrame(G.gradient_rows(pair, ESTS[:3], draws=200_000, seed=2, batches=100, device=CPU))
    rev, fwd = _refs(pair)
    for j, (est, mode) in enumerate((e, m) for e in ESTS[:3] for m in M.modes_for(e)):
        c = M.coefficient(est, mode)
        brute = np.zeros((2, 30))
        for ctx in range(2):
            for x in range(30):
                w = 1.0 if weights == "none" else min(q[ctx, x] / b[ctx, x], cap or math.inf)
                s = -q[ctx].copy()
                s[x] += 1
                lr = torch.tensor([float(pair.model.log_p[ctx, x] - pair.model.log_q[ctx, x])], dtype=torch.float64)
                brute[ctx] += 0.5 * b[ctx, x] * w * float(c(lr)[0]) * s
        got = pair.gradient_exact(GradItem.of(est, mode), {}).mean
        assert np.allclose(got, brute.reshape(-1), rtol=1e-10, atol=1e-15), (est.name, mode)
        assert G.compare(brute.reshape(-1), rev, fwd)["cos_reverse"] == pytest.approx(
            rows.iloc[j]["exact_cos_reverse"], abs=1e-12) or rows.iloc[j]["equals"] == "zero"
    assert (rows["sampler"] == "temperature=1.5").all()
    assert (rows["z_reverse"].abs() < 5).all() and (rows["z_trace"].abs() < 5).all(), rows[["estimator", "mode",
                                                                                            "z_reverse", "z_trace"]]
    # uncapped token weights undo the sampler: the categorical table of what each mode equals holds
    if weights == "token" and cap is None:
        got = {(r["estimator"], r["mode"]): r["equals"] for _, r in rows.iterrows()}
        assert got[("k2", "loss")] == "reverse" and got[("k3", "loss")] == "forward"


@pytest.mark.parametrize("weights", ["none", "token"])
def test_gaussian_sampler_gradients_against_quadrature_and_monte_carlo(weights):
    """b = N(μq, (1.3σq)²): the tilted-Gaussian expected gradient against 1-D quadrature of
    E_b[w c(log r) (z/σ, z² − 1)], and the Monte Carlo against it."""
    from scipy import integrate
    pair = GaussianPair("gs", [0.3], [1.0], [-0.2], [1.3], std_scale=1.3, weights=weights, sampler_label="std×1.3")
    rows = pd.DataFrame(G.gradient_rows(pair, ESTS[:3], draws=400_000, seed=4, batches=100, device=CPU))
    for j, (est, mode) in enumerate((e, m) for e in ESTS[:3] for m in M.modes_for(e)):
        c = M.coefficient(est, mode)
        exact = pair.gradient_exact(GradItem.of(est, mode), {})
        assert (exact is None) == (M.coefficient_poly(est, mode) is None), (est.name, mode)
        if exact is None:               # a mode whose coefficient is no polynomial: no Gaussian oracle
            continue
        ex = exact.mean

        def integrand(x, comp):
            lq = -0.5 * (x - 0.3) ** 2
            lp = -0.5 * ((x + 0.2) / 1.3) ** 2 - math.log(1.3)
            lb = -0.5 * ((x - 0.3) / 1.3) ** 2 - math.log(1.3)
            w = math.exp(lq - lb) if weights == "token" else 1.0
            z = x - 0.3
            v = float(c(torch.tensor([lp - lq], dtype=torch.float64))[0]) * w * (z if comp == 0 else z * z - 1)
            return v * math.exp(lb) / math.sqrt(2 * math.pi)
        quad = [integrate.quad(integrand, -40, 40, args=(k,), epsabs=1e-13, limit=200)[0] for k in (0, 1)]
        assert np.allclose(ex, quad, rtol=1e-8, atol=1e-12), (est.name, mode, ex, quad)
    ok = rows[rows["z_reverse"].notna()]
    assert len(ok) == n_rows(["k1", "k2", "k3"], exact_poly=True)
    assert (ok["z_reverse"].abs() < 5).all() and (ok["z_forward"].abs() < 5).all()
    if weights == "token":           # E_b[w ·] = E_q[·]: the table of what each mode equals is back
        got = {(r["estimator"], r["mode"]): r["equals"] for _, r in rows.iterrows()}
        assert got[("k2", "loss")] == "reverse" and got[("k3", "loss")] == "forward"


@pytest.mark.parametrize("mode", M.MODES)
def test_coefficients_match_autograd_of_the_trainer_losses(mode):
    """c(log r)·(e_x − q) equals autograd of the loss as written in a trainer, for every token, also
    for a clamped k3 (the clamps are active on part of this vocabulary)."""
    pair = _cat(b=1, v=12, seed=7)
    from kl_bench.core.estimators import resolve_estimator
    from kl_bench.core.estimators import EstimatorOption
    clamped = resolve_estimator(EstimatorOption("k3", "k3 clamped", logr_clamp=0.5, clamp=0.3))
    for est in ESTS + [clamped]:
        if mode not in M.modes_for(est):
            continue
        for x in range(12):
            theta = pair.model.log_q[0].clone().requires_grad_(True)
            lq = torch.log_softmax(theta, -1)
            (g,) = torch.autograd.grad(M.trainer_loss(est, mode, lq[x], pair.model.log_p[0, x]), theta)
            s = -pair.model.log_q[0].exp()
            s[x] += 1
            c = M.coefficient(est, mode)(pair.model.log_p[0, x:x + 1] - pair.model.log_q[0, x:x + 1])
            assert torch.allclose(g, c * s, rtol=1e-12, atol=1e-14), (est.name, mode, x)


def test_self_target_of_categoricals_and_gaussians():
    """∇θ E_q[f] against autograd of Σ_x q_θ(x) f(log p − log q_θ) (categoricals; also under a sampler,
    which does not move the target), and against loss_is on-policy for Gaussians; a row that equals
    it and no KL gradient is labelled `self` (k2 in loss_is)."""
    pair = _cat()
    lb = torch.log_softmax(pair.model.log_q / 1.5, -1)
    sampled = CategoricalPair("s", pair.model.log_q, pair.model.log_p, log_b=lb, weights="token")
    for est in ESTS:
        theta = pair.model.log_q.clone().requires_grad_(True)
        lq = torch.log_softmax(theta, -1)
        (want,) = torch.autograd.grad((lq.exp() * est.fn(pair.model.log_p - lq)).sum(-1).mean(), theta)
        for pr in (pair, sampled):
            got = pr.gradient_self(GradItem.of(est, "loss"))
            assert np.allclose(got, want.reshape(-1).numpy(), rtol=0, atol=1e-13), est.name
    rows = pd.DataFrame(G.gradient_rows(pair, ESTS, draws=1_000, seed=0, batches=10, device=CPU))
    got = {(r["estimator"], r["mode"]): r["equals"] for _, r in rows.iterrows()}
    assert got[("k2", "loss_is")] == "self" and got[("k3", "loss_is")] == "reverse"
    gauss = GaussianPair("g", [0.0], [1.0], [0.3], [1.2])
    k2 = GradItem.of(ESTIMATORS["k2"], "loss_is")
    assert np.array_equal(gauss.gradient_self(k2), gauss.gradient_exact(k2, {}).mean)


def test_gradients_npz_holds_the_exact_vectors_of_categoricals(write_spec, tmp_path):
    """gradients.npz: every categorical row's exact expected gradient, its self target and the KL
    gradients (reverse, forward, ukl), float64, equal to the oracle's; recorded in run.json and verified when read."""
    spec = write_spec("""
spec_version = 1
[experiment]
draws = 4000
device = "cpu"
batches = 10
estimators = ["k1", "k2", "k3"]
gradients = true
[[case]]
name = "c"
kind = "categorical"
vocab = 50
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.3, seed = 2 }
""")
    from kl_bench import load_results
    from kl_bench.results.verify import read_results_folder
    from kl_bench.experiment.spec import load_spec
    res = CliRunner().invoke(app, ["run", str(spec), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    vec = np.load(tmp_path / "o" / "gradients.npz")
    pair = CategoricalPair.from_config(load_spec(spec).cases[0])
    refs = pair.gradient_references()
    assert np.array_equal(vec["c|reference|reverse"], refs[REVERSE]) and vec["c|reference|forward"].dtype == np.float64
    for it in G.gradient_items(pair, [ESTIMATORS[n] for n in ("k1", "k2", "k3")]):
        assert np.array_equal(vec[G.vector_key("c", "exact", it)], pair.gradient_exact(it, {}).mean), it.mode
    assert np.array_equal(vec["c|self|k2"], pair.gradient_self(GradItem.of(ESTIMATORS["k2"], "loss")))
    assert np.array_equal(vec["c|reference|ukl"], pair.gradient_ukl())       # = reverse here (no sampler)
    # the three reference gradients, one exact vector per row, one self target per estimator
    assert len(vec.files) == 3 + n_rows(["k1", "k2", "k3"]) + 3
    read_results_folder(tmp_path / "o")
    load_results(tmp_path / "o")
    (tmp_path / "o" / "gradients.npz").write_bytes(b"PK\x03\x04 not an archive")
    res = CliRunner().invoke(app, ["report", str(tmp_path / "o")])
    assert res.exit_code == 2 and "gradients.npz" in res.stderr, res.stderr
