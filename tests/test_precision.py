"""The precision of log-probs (kl_bench.core.precision): a figure computed by hand, exact rounded moments
against Monte Carlo (categorical and rollout), the truth unchanged, and the spec's errors."""
import math
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from kl_bench.cli import app
from kl_bench.core.estimators import lookup
from kl_bench.engine.monte_carlo import as_rows
from kl_bench.sampling.logits import zipf_logits
from kl_bench.kinds import CategoricalPair, RolloutPair
from kl_bench.core.precision import Precision, rounded_logr

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
    # a pair built from log-probs alone is given those: it rounds them (as of = "logprobs" does)
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


def test_bf16_logits_as_given_by_hand_and_the_logprobs_choice():
    """of = "logits" rounds the source's raw logits (0.1 → 205/2048, …) before log-softmax; of = "logprobs"
    rounds the normalised log-probs. Both exact means follow their rounding, the truth is the float64 KL,
    and the two differ (log-softmax is invariant to a shift, rounding is not)."""
    from kl_bench.sampling.logits import TensorLogits
    from kl_bench.kinds.categorical import CategoricalCase
    lq, lp = _log_softmax(Q_LOGITS), _log_softmax(P_LOGITS)
    kl = sum(math.exp(a) * (a - b) for a, b in zip(lq, lp))
    want = {"logits": (Q_LOGITS, P_LOGITS), "logprobs": (lq, lp)}
    means = {}
    for of, (zq, zp) in want.items():
        lq_r, lp_r = _log_softmax([_bf16_by_hand(v) for v in zq]), _log_softmax([_bf16_by_hand(v) for v in zp])
        k1_mean = sum(math.exp(a) * (ar - br) for a, ar, br in zip(lq, lq_r, lp_r))
        case = CategoricalCase(name="c", vocab=None, q=TensorLogits.of(torch.tensor(Q_LOGITS, dtype=torch.float64)),
                               p=TensorLogits.of(torch.tensor(P_LOGITS, dtype=torch.float64)),
                               precision=Precision(logits="bfloat16", of=of))
        pair = CategoricalPair.from_config(case)
        means[of], _ = pair.exact_moments(pair.adapt(lookup("k1")))
        assert pair.kl() == pytest.approx(kl, rel=1e-13)
        assert means[of] == pytest.approx(k1_mean, rel=1e-12, abs=1e-15)
        meta = pair.metadata()["precision"]
        assert meta["of"] == of and meta["max_rounded"]["q"] == max(zq)
        assert (("as given" in pair.describe()) == (of == "logits"))
    assert means["logits"] != means["logprobs"]


def test_zipf_offset_moves_only_the_rounding_of_the_logits_as_given(tmp_path):
    """A generator's offset is the top logit: float64 results do not depend on it, bf16 logits as given do
    (steps of 2^-3 near 20 against 2^-9 or finer below 1), normalised rounding (of = "logprobs") does not."""
    from kl_bench.experiment.spec import load_spec
    from kl_bench.kinds import build_pair

    def mean_k1(offset, precision):
        case = (f'name = "c"\nkind = "categorical"\nvocab = 2000\n'
                f'q = {{logits = "zipf", exponent = 1.1, seed = 1, offset = {offset}}}\n'
                f'p = {{from = "q", noise = 0.05, seed = 2}}\n' + (f"precision = {precision}\n" if precision else ""))
        spec = load_spec(_spec(tmp_path, case))
        pair = build_pair(spec.cases[0])
        return pair.exact_moments(pair.adapt(lookup("k1")))[0], pair
    m0, p0 = mean_k1(0.0, None)
    m20, p20 = mean_k1(20.0, None)
    assert m0 == pytest.approx(m20, rel=1e-12) and "offset 20" in p20.describe()
    lp0, _ = mean_k1(0.0, '{logits = "bf16", of = "logprobs"}')
    lp20, _ = mean_k1(20.0, '{logits = "bf16", of = "logprobs"}')
    assert lp0 == pytest.approx(lp20, rel=1e-12)
    g0, _ = mean_k1(0.0, '{logits = "bf16"}')
    g20, pair = mean_k1(20.0, '{logits = "bf16"}')
    assert pair.metadata()["precision"]["max_rounded"]["q"] == 20.0
    assert abs(g20 - m0) > 3 * abs(g0 - m0) > 0       # coarser steps at 20: a larger rounding bias


def _zipf_pair(precision, vocab=3000, noise=0.05):
    lq = torch.log_softmax(zipf_logits(vocab, 1.1, 1, 1), -1)
    g = torch.Generator().manual_seed(2)
    lp = torch.log_softmax(lq + noise * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    return CategoricalPair("c", lq, lp, precision=precision)


def test_rounded_log_ratios_are_representable_in_the_estimator_dtype():
    pair = _zipf_pair(None)
    for name in ("float32", "bfloat16", "float16"):
        t = rounded_logr(pair.model.log_q, pair.model.log_p, Precision(name, "float32", name))
        assert torch.equal(t, t.to(getattr(torch, name)).to(torch.float64))
    exact = rounded_logr(pair.model.log_q, pair.model.log_p, Precision())
    assert torch.allclose(exact, pair.model.log_p - pair.model.log_q, rtol=0, atol=1e-14)


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
    (CAT + 'precision = {logits = "bf16", of = "probs"}', "key 'precision.of': must be \"logits\""),
    (CAT.replace("seed = 1}", "seed = 1, offset = nan}"), "key 'q.offset': must be finite"),
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

    from kl_bench.experiment import gradient_rows as G
    from kl_bench.core.modes import GradItem
    prec = Precision("bfloat16", "float32", "bfloat16")
    pair, ref = _zipf_pair(prec, vocab=500), _zipf_pair(None, vocab=500)
    rows = G.gradient_rows(pair, [lookup("k3")], draws=50_000, seed=1, batches=50, device=CPU)
    assert all(abs(r["z_reverse"]) < 5 and abs(r["z_forward"]) < 5 for r in rows), rows
    g_r = pair.gradient_exact(GradItem.of(pair.adapt(lookup("k3")), "loss"), {}).mean
    g_0 = ref.gradient_exact(GradItem.of(lookup("k3"), "loss"), {}).mean
    assert np.linalg.norm(g_r - g_0) > 1e-3 * np.linalg.norm(g_0)


def test_monte_carlo_matches_the_exact_moments_of_logits_rounded_at_offset_20():
    """Raw logits whose top is 20 (a model's scale), rounded to bf16 as given: the measured means agree
    with the exact rounded sums, and the rounding bias exceeds that of the normalised log-probs."""
    ref = _zipf_pair(None)
    lq, lp = ref.model.log_q, ref.model.log_p
    given = CategoricalPair("g", lq, lp, precision=Precision("bfloat16", "float32", "float32"),
                            logits=(lq - lq.max() + 20, lp - lq.max() + 20))
    normalised = CategoricalPair("n", lq, lp, precision=Precision("bfloat16", "float32", "float32", of="logprobs"),
                                 logits=(lq - lq.max() + 20, lp - lq.max() + 20))
    df = mc_frame(given, [given.adapt(lookup(n)) for n in ("k1", "k3")], draws=200_000, seed=6, batches=50)
    assert (df["z"].abs() < 5).all(), df[["estimator", "z"]]
    k3 = lookup("k3")
    exact = ref.exact_moments(k3)[0]
    bias_given = given.exact_moments(given.adapt(k3))[0] - exact
    bias_norm = normalised.exact_moments(normalised.adapt(k3))[0] - exact
    assert abs(bias_given) > 2 * abs(bias_norm) > 0
