"""The precision of log-probs (kl_bench.precision): a figure computed by hand, exact rounded moments
against Monte Carlo (categorical and rollout), the truth unchanged, and the spec's errors."""
import math
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from kl_bench.cli import app
from kl_bench.estimators import lookup
from kl_bench.engine import as_rows
from kl_bench.logits import zipf_logits
from kl_bench.pairs import CategoricalPair, RolloutPair
from kl_bench.precision import Precision, rounded_logr

from .conftest import CPU, mc_frame

Q_LOGITS = [0.1, 0.2, 0.3, -1.7]
P_LOGITS = [0.15, 0.1, 0.33, -1.1]


def _bf16_by_hand(x: float) -> float:
    """Round to bfloat16 (8 significant bits, round half to even), independently of torch."""
    m, e = math.frexp(x)                 # x = m·2^e, 0.5 ≤ |m| < 1
    return round(m * 256) / 256 * 2.0**e  # Python's round() is half-to-even


def _log_softmax(z):
    top = max(z)
    lse = top + math.log(sum(math.exp(v - top) for v in z))
    return [v - lse for v in z]


def test_bf16_logits_bias_of_k1_by_hand():
    """bf16 logits, float64 log-softmax and estimator: the exact mean of k1 is Σ q(x)(log q̃ − log p̃) with
    q the exact policy; 0.1 → 0.10009765625 (205/2048), 0.15 → 0.150390625, and so on."""
    assert _bf16_by_hand(0.1) == 0.10009765625 and _bf16_by_hand(0.15) == 0.150390625
    # kl-bench rounds the normalised log-probs (kl_bench.precision); so does the hand figure
    lq, lp = _log_softmax(Q_LOGITS), _log_softmax(P_LOGITS)
    lq_r, lp_r = _log_softmax([_bf16_by_hand(v) for v in lq]), _log_softmax([_bf16_by_hand(v) for v in lp])
    kl = sum(math.exp(a) * (a - b) for a, b in zip(lq, lp))
    k1_mean = sum(math.exp(a) * (ar - br) for a, ar, br in zip(lq, lq_r, lp_r))
    pair = CategoricalPair("tiny", torch.tensor([lq], dtype=torch.float64), torch.tensor([lp], dtype=torch.float64),
                           precision=Precision(logits="bfloat16"))
    mean, _ = pair.exact_moments(pair.adapt(lookup("k1")))
    assert pair.kl() == pytest.approx(kl, rel=1e-13)              # the truth stays the float64 KL
    assert mean == pytest.approx(k1_mean, rel=1e-12, abs=1e-15)
    assert abs(mean - kl) > 1e-4 * kl                              # and rounding moved the mean


def _zipf_pair(precision, vocab=3000, noise=0.05):
    lq = torch.log_softmax(zipf_logits(vocab, 1.1, 1, 1), -1)
    g = torch.Generator().manual_seed(2)
    lp = torch.log_softmax(lq + noise * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    return CategoricalPair("c", lq, lp, precision=precision)


def test_rounded_log_ratios_are_representable_in_the_estimator_dtype():
    pair = _zipf_pair(None)
    for name in ("float32", "bfloat16", "float16"):
        t = rounded_logr(pair.log_q, pair.log_p, Precision(name, "float32", name))
        assert torch.equal(t, t.to(getattr(torch, name)).to(torch.float64))
    exact = rounded_logr(pair.log_q, pair.log_p, Precision())
    assert torch.allclose(exact, pair.log_p - pair.log_q, rtol=0, atol=1e-14)


@pytest.mark.parametrize("prec", [
    Precision("bfloat16", "float32", "float32"),
    pytest.param(Precision("bfloat16", "bfloat16", "bfloat16"), marks=pytest.mark.slow),
    pytest.param(Precision("float16", "float32", "float16"), marks=pytest.mark.slow)])
def test_categorical_monte_carlo_matches_the_exact_rounded_moments(prec):
    pair, ref = _zipf_pair(prec), _zipf_pair(None)
    df = mc_frame(pair, [pair.adapt(lookup(n)) for n in ("k1", "k2", "k3")], draws=200_000, seed=4, batches=50)
    assert (df["z"].abs() < 5).all() and (df["z_var"].abs() < 5).all(), df[["estimator", "z", "z_var"]]
    assert (df["true_kl"] == ref.kl()).all()
    exact_ref = {n: ref.exact_moments(lookup(n))[0] for n in ("k1", "k2", "k3")}
    moved = [abs(r["exact_mean"] - exact_ref[r["estimator"]]) for _, r in df.iterrows()]
    assert min(moved) > 0                                     # every estimator's mean moved by rounding


def test_rollout_token_rows_keep_the_dynamic_program_under_rounding():
    lq = torch.log_softmax(zipf_logits(300, 1.1, 1, 3), -1)
    g = torch.Generator().manual_seed(2)
    lp = torch.log_softmax(lq + 0.2 * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    prec = Precision("bfloat16", "bfloat16", "bfloat16")
    pair = RolloutPair("r", lq, lp, torch.arange(300) % 3, 6, 299, precision=prec)
    plain = RolloutPair("r", lq, lp, torch.arange(300) % 3, 6, 299)
    df = mc_frame(pair, as_rows([pair.adapt(lookup(n)) for n in ("k1", "k3", "full")], pair), draws=40_000,
                  seed=3, batches=40)
    assert set(df["aggregate"]) == {"tok"}            # a rounded estimator is not a polynomial in R and L
    assert (df["z"].abs() < 5).all(), df[["estimator", "z"]]
    assert pair.kl() == pytest.approx(plain.kl(), rel=1e-14)
    assert pair.kl_forward() == pytest.approx(plain.kl_forward(), rel=1e-14)


def _spec(tmp_path, case: str) -> str:
    path = tmp_path / "bad.toml"
    path.write_text(f"spec_version = 1\n[experiment]\ndraws = 1000\nestimators = [\"k1\"]\n[[case]]\n{case}\n")
    return str(path)


CAT = 'name = "c"\nkind = "categorical"\nvocab = 10\nq = {logits = "zipf", exponent = 1.1, seed = 1}\n' \
      'p = {from = "q", noise = 0.1, seed = 2}\n'


@pytest.mark.parametrize("case, message", [
    (CAT + 'precision = {logits = "bf17"}', "key 'precision.logits': must be one of float64"),
    (CAT + 'precision = {logit = "bf16"}', "key 'precision.logit': unknown key (did you mean 'logits'?)"),
    (CAT + 'precision = "bf16"', "key 'precision': must be a table"),
])
def test_bad_precision_keys_are_one_line_and_exit_2(tmp_path, case, message):
    res = CliRunner().invoke(app, ["run", _spec(tmp_path, case), "--out", str(tmp_path / "o"), "--quiet"])
    assert res.exit_code == 2 and message in res.output and len(res.output.strip().splitlines()) == 1, res.output


def test_precision_on_a_gaussian_is_refused_by_the_command_line_in_one_line(tmp_path):
    case = 'name = "g"\nkind = "gaussian"\nq = {mean = 0.0, std = 1.0}\np = {mean = 0.1, std = 1.0}\n' \
           'precision = {logits = "bf16"}'
    out = subprocess.run([sys.executable, "-m", "kl_bench", "run", _spec(tmp_path, case), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "case 'g': key 'precision'" in lines[0], lines
    assert "no exact oracle on a Gaussian" in lines[0] and not (tmp_path / "o").exists()


def test_categorical_gradients_use_the_rounded_log_ratio():
    """c(log r̃) in the estimator dtype times the exact score: Monte Carlo against the exact sums, and the
    rounding visibly moves the expected gradient of k3 in the loss."""
    import numpy as np

    from kl_bench import gradients as G
    from kl_bench.modes import GradItem
    prec = Precision("bfloat16", "float32", "bfloat16")
    pair, ref = _zipf_pair(prec, vocab=500), _zipf_pair(None, vocab=500)
    rows = G.gradient_rows(pair, [lookup("k3")], draws=50_000, seed=1, batches=50, device=CPU)
    assert all(abs(r["z_reverse"]) < 5 and abs(r["z_forward"]) < 5 for r in rows), rows
    g_r = pair.gradient_exact(GradItem.of(pair.adapt(lookup("k3")), "loss"), {}).mean
    g_0 = ref.gradient_exact(GradItem.of(lookup("k3"), "loss"), {}).mean
    assert np.linalg.norm(g_r - g_0) > 1e-3 * np.linalg.norm(g_0)
