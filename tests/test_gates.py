"""Gates with exact rates (issue 42 items 2 and 5): every exact rate against Monte Carlo draws of tokens and of
rollouts (|z| < 5), against brute-force enumeration on a tiny rollout, ATR-GRPO's band, the spec key, gates.csv
and the advice."""
import math

import pytest
import torch

from kl_bench.cli import app
from kl_bench.core.estimators import k3
from kl_bench.core.gates import gate, k3_band
from kl_bench.core.topk import topk_union_divergences
from kl_bench.kinds import CategoricalPair, RolloutPair
from kl_bench.kinds.rollout import brute_force_sequences
from kl_bench.kinds.rollout.sampler import paths
from kl_bench.sampling.logits import zipf_logits

from .helpers import CAT_SPEC, GAUSS_SPEC, one_line, runner

F64 = torch.float64
CASES = [("bin_kl", 0.002), ("bin_tv", 0.02), ("k3", 0.02), ("ratio", 0.3), ("topk_kl@3", 0.02), ("topk_tv@2", 0.1),
         ("kl", 0.1)]


def _tables(v=40, c=3, seed=1, noise=0.5):
    lq = torch.log_softmax(zipf_logits(v, 1.1, seed, c), -1)
    g = torch.Generator().manual_seed(seed + 7)
    lp = torch.log_softmax(lq + noise * torch.randn(lq.shape, generator=g, dtype=F64), -1)
    return lq, lp


def _z(values: torch.Tensor, exact: float) -> float:
    """(mean − exact) / SE of i.i.d. per-draw values; 0 where every value equals the exact one."""
    se = float(values.std()) / math.sqrt(values.numel())
    d = float(values.mean()) - exact
    return d / se if se > 0 else (0.0 if d == 0 else math.inf)


def test_topk_divergences_against_coarsening_by_hand():
    lq, lp = _tables(v=12, c=4)
    for k in (1, 3, 12):
        kl, tv = topk_union_divergences(lq, lp, k)
        for c in range(4):
            keep = set(torch.topk(lq[c], k).indices.tolist()) | set(torch.topk(lp[c], k).indices.tolist())
            rest = [x for x in range(12) if x not in keep]
            qs = [float(lq[c, x].exp()) for x in keep] + ([sum(float(lq[c, x].exp()) for x in rest)] if rest else [])
            ps = [float(lp[c, x].exp()) for x in keep] + ([sum(float(lp[c, x].exp()) for x in rest)] if rest else [])
            assert float(kl[c]) == pytest.approx(sum(a * math.log(a / b) for a, b in zip(qs, ps)), rel=1e-12)
            assert float(tv[c]) == pytest.approx(sum(abs(a - b) for a, b in zip(qs, ps)) / 2, rel=1e-12)
    full_kl = (lq.exp() * (lq - lp)).sum(-1)
    assert torch.allclose(topk_union_divergences(lq, lp, 12)[0], full_kl, rtol=1e-13)
    assert bool((topk_union_divergences(lq, lp, 2)[0] <= full_kl * (1 + 1e-12)).all())     # coarsening: ≤


def test_atr_grpo_band_is_the_papers():
    # ATR-GRPO (arXiv 2602.05494): δ = 0.02 → w ∈ [0.813, 1.214]; both ends solve w − 1 − log w = δ.
    lo, hi = k3_band(0.02)
    assert (round(lo, 3), round(hi, 3)) == (0.813, 1.214)
    for w in (lo, hi):
        assert w - 1 - math.log(w) == pytest.approx(0.02, rel=1e-12)


@pytest.mark.parametrize("name,delta", CASES)
def test_categorical_rates_against_drawn_tokens(name, delta):
    lq, lp = _tables()
    rates = CategoricalPair("c", lq, lp).gate_rates(gate(name), delta)
    assert 0 < rates.tokens_masked < 1                      # the test can fail both ways
    n, gen = 200_000, torch.Generator().manual_seed(3)
    ctx = torch.randint(0, lq.shape[0], (n,), generator=gen)
    x = torch.multinomial(lq.exp()[ctx], 1, generator=gen).squeeze(1)
    logq, logp = lq[ctx, x], lp[ctx, x]
    logr = logp - logq
    masked = (gate(name).table(lq, lp)[ctx, x] > delta).to(F64)
    kl = float((lq.exp() * (lq - lp)).sum(-1).mean())
    assert abs(_z(masked, rates.tokens_masked)) < 5
    assert abs(_z(masked * k3(logr) / kl, rates.kl_unseen)) < 5
    assert abs(_z(-masked * -logr / kl, rates.k1_bias)) < 5
    assert abs(_z(-masked * logr.exp(), rates.weight_bias)) < 5     # E_q[r·1{kept}] − 1 = −E_q[r·1{masked}]
    assert rates.k3_bias == -rates.kl_unseen and math.isnan(rates.seq_masked)
    # The worst context's share is one context's sum, and at least the mean share.
    per_ctx = [float((lq[c].exp() * (gate(name).table(lq, lp)[c] > delta)).sum()) for c in range(3)]
    assert rates.worst_context == pytest.approx(max(per_ctx), rel=1e-12)
    assert rates.worst_context >= rates.tokens_masked


@pytest.mark.parametrize("name,delta", CASES)
def test_rollout_rates_against_enumeration(name, delta):
    lq, lp = _tables(v=5, c=2, noise=0.6)
    pair = RolloutPair("r", lq, lp, torch.arange(5) % 2, 4, 4)
    rates = pair.gate_rates(gate(name), delta)
    table = gate(name).table(lq, lp)
    masked_tok = tokens = unseen = k1_part = weight = seq = seq_kl = seq_p = 0.0
    kl = pair.kl()
    for prob, path in brute_force_sequences(pair.model):
        m = [float(table[c, x] > delta) for c, x in path]
        tokens += prob * len(path)
        masked_tok += prob * sum(m)
        unseen += prob * sum(mi * float(k3(lp[c, x] - lq[c, x])) for mi, (c, x) in zip(m, path))
        k1_part += prob * sum(mi * float(lq[c, x] - lp[c, x]) for mi, (c, x) in zip(m, path))
        weight += prob * sum(mi * float((lp[c, x] - lq[c, x]).exp()) for mi, (c, x) in zip(m, path))
        seq += prob * (max(m) > 0)
        if max(m) > 0:                 # the whole sequence masked: its KL parts and its p-probability
            seq_kl += prob * sum(float(k3(lp[c, x] - lq[c, x])) for c, x in path)
            seq_p += math.exp(sum(float(lp[c, x]) for c, x in path))
    assert rates.tokens_masked == pytest.approx(masked_tok / tokens, rel=1e-12)
    assert rates.kl_unseen == pytest.approx(unseen / kl, rel=1e-12)
    assert rates.k1_bias == pytest.approx(-k1_part / kl, rel=1e-10, abs=1e-15)
    assert rates.weight_bias == pytest.approx(-weight / tokens, rel=1e-12)
    assert rates.seq_masked == pytest.approx(seq, rel=1e-12)
    assert rates.seq_kl_unseen == pytest.approx(seq_kl / kl, rel=1e-10)
    assert rates.seq_weight_bias == pytest.approx(-seq_p, rel=1e-10, abs=1e-14)


def test_rollout_rates_against_drawn_paths():
    lq, lp = _tables(v=30, c=3)
    pair = RolloutPair("r", lq, lp, torch.arange(30) % 3, 8, 29)
    rates = pair.gate_rates(gate("bin_tv"), 0.02)
    got = paths(pair.model, 40_000, torch.Generator().manual_seed(5), torch.device("cpu"))
    m = (gate("bin_tv").table(lq, lp).reshape(-1)[got.keys] > 0.02).to(F64) * got.alive
    # per-sequence counts over E|y|: a ratio estimator, its SE by the delta method
    lengths, masked = got.alive.sum(1), m.sum(1)
    share = float(masked.sum() / lengths.sum())
    resid = (masked - share * lengths) / float(lengths.mean())
    assert abs((share - rates.tokens_masked) / (float(resid.std()) / math.sqrt(len(lengths)))) < 5
    assert abs(_z((masked > 0).to(F64), rates.seq_masked)) < 5


def test_spec_sweeps_gates_into_gates_csv_and_the_advice(tmp_path):
    spec = tmp_path / "c.toml"
    spec.write_text(CAT_SPEC.format(q='{ logits = "zipf", exponent = 1.1, seed = 1 }',
                                    p='{ from = "q", noise = 0.3, seed = 2 }', extra="")
                    .replace('estimators = ["k1", "k3"]',
                             'estimators = ["k3", "bin_kl"]\n'
                             'gates = { bin_tv = [0.05, 0.001, 0.01], ratio = 0.5, bin_kl = 0.01, "topk_kl@5" = 0.01 }'))
    r = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    import pandas as pd
    g = pd.read_csv(tmp_path / "out" / "gates.csv")
    assert list(g.delta) == [0.001, 0.01, 0.05, 0.5, 0.01, 0.01]
    assert list(g.gate) == ["bin_tv"] * 3 + ["ratio", "bin_kl", "topk_kl@5"]
    s = pd.read_csv(tmp_path / "out" / "summary.csv").set_index("estimator")
    assert g.sees.iloc[4] == pytest.approx(s.exact_mean["bin_kl"] / s.true_kl["bin_kl"], rel=1e-12)
    assert math.isnan(g.sees.iloc[3]) and 0 < g.sees.iloc[5] < 1
    assert (g.tokens_masked.diff().dropna().iloc[:2] <= 0).all()        # a larger δ masks fewer tokens
    assert "gates: a token is masked" in r.stdout and "bin_kl sees" in r.stdout and "topk_kl@5 " in r.stdout
    assert "kl_bench" not in r.stderr
    rep = runner.invoke(app, ["report", str(tmp_path / "out"), "-q"])     # the folder verifies with gates.csv in it
    assert rep.exit_code == 0, rep.output
    md = (tmp_path / "out" / "report" / "report.md").read_text()
    html = (tmp_path / "out" / "report" / "report.html").read_text()
    assert "## Gates" in md and "| c | topk_kl@5 | 0.01 |" in md and "<h2>Gates</h2>" in html
    assert "bin_kl sees" in md                                             # the advice carries the shares


@pytest.mark.parametrize("gates,needle", [
    ('{ bin_k = [0.1] }', "did you mean 'bin_kl'"),
    ('{ bin_kl = [-0.1] }', "> 0"),
    ('{ bin_kl = [] }', "at least one"),
    ('{ bin_kl = [0.1, 0.1] }', "twice"),
    ('[0.1]', "table of gate"),
    ('{ "topk_kl@0" = [0.1] }', "unknown gate"),
    ('{ "topk_kl@51" = [0.1] }', "K must lie in [1, 50]"),
])
def test_bad_gates_are_one_line(tmp_path, gates, needle):
    spec = tmp_path / "c.toml"
    spec.write_text(CAT_SPEC.format(q='{ logits = "zipf", exponent = 1.1, seed = 1 }', p='{ from = "q", noise = 0.3 }',
                                    extra="").replace('estimators = ["k1", "k3"]', f'estimators = ["k3"]\ngates = {gates}'))
    one_line(runner.invoke(app, ["run", str(spec), "-q"]), 2, "experiment.gates", needle)


def test_a_gaussian_case_refuses_gates(tmp_path):
    spec = tmp_path / "g.toml"
    spec.write_text(GAUSS_SPEC.format(name="g", seed=0, more="", extra="").replace(
        'estimators = ["k1", "k3"]', 'estimators = ["k1", "k3"]\ngates = { k3 = [0.02] }'))
    one_line(runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o")]), 2, "gaussian", "gate")
    assert not (tmp_path / "o").exists()
