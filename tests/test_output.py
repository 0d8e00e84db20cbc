"""Issue 31 item 2: every number readable as what it is. The SE beside a bias is the one its z uses (logged
data: the log's own, never the resampling SE), n ±10% only where an exact bias supports it, KL = 0 as a case
(exact zeros), degenerate importance weights as unknown (their effective sample size shown, no zero SE, the
gate saying it skips them), rounding printed as 0, one vocabulary of counts and words."""
import io
import math
import tomllib

import pandas as pd
import pytest
import torch
from rich.console import Console

import kl_bench
import kl_bench.api as api
from kl_bench.present.case_tables import compact_frame, heading
from kl_bench.present.tables import print_tables
from kl_bench.foundation.formatting import ROUNDING, count, fmt, measured_cells, plural
from kl_bench.core.stats import HeavyTail, kish_ess

from .conftest import logged_logprobs
from .conftest import spec_toml as _spec_text


def spec_toml(experiment: dict, cases: list[dict]) -> dict:
    """A spec as the API takes it (a dict), written as a spec file would be."""
    return tomllib.loads(_spec_text(experiment, cases))



ZIPF = {"logits": "zipf", "exponent": 1.1, "seed": 1}
NOISY = {"from": "q", "noise": 0.3, "seed": 2}


# ----------------------------------------------------------------------------- logged data: one SE
def test_logged_data_bias_se_and_z_are_the_logs_own_and_agree(tmp_path):
    """Issue 31 item 2: a logprobs case (512 logged sequences, 100,000 draws) showed the resampling SE of
    the draws beside z computed with the log's own SE. Now the row's bias against Σ kl_full is the log's
    (exact over its sequences), its SE std/√B over them, and z = bias / SE: what is printed agrees."""
    log = logged_logprobs(512, 16)
    torch.save(log, tmp_path / "log.pt")
    res = kl_bench.run(spec_toml({"name": "lp", "draws": 100_000, "seed": 0, "device": "cpu", "batches": 100,
                                  "estimators": ["k1", "k2", "k3", "full"]},
                                 [{"name": "log", "kind": "logprobs", "file": str(tmp_path / "log.pt")}]))
    df = res.summary.set_index(["estimator", "aggregate"])
    full = (log["mask"] * log["kl_full"]).sum(-1)
    b = full.shape[0]
    logr = (log["mask"] * (log["logp_ref"] - log["logp_policy"])).sum(-1)
    seq = {"k1": -logr, "k2": 0.5 * logr**2, "k3": torch.expm1(logr) - logr}
    shown = compact_frame(res.summary, "log").set_index(["estimator"])
    for name, f in seq.items():                              # the oracle: means over the log, by hand
        d = f - full
        r = df.loc[(name, "seq")]
        assert r["ref_diff"] == pytest.approx(float(d.mean()), rel=1e-12, abs=1e-15)
        assert r["ref_diff_se"] == pytest.approx(float(d.std(correction=1)) / math.sqrt(b), rel=1e-12)
        assert r["z_ref"] == pytest.approx(r["ref_diff"] / r["ref_diff_se"], rel=1e-9)
        ref = float(full.mean())
        cell = shown.loc[f"seq {name}"]
        bias, se, _ = measured_cells(100 * r["ref_diff"] / ref, 100 * r["ref_diff_se"] / ref, sign=True, unit="%")
        assert cell["bias/true ± se"] == f"{bias} ± {se}"
        assert cell["z"] == fmt(r["z_ref"], 2) and cell["n ±10%"] == "—" and cell["exact"] == ""
        # the resampling SE is far smaller here (100,000 draws of 512 sequences): it must not be the one shown
        assert r["se"] < r["ref_diff_se"] / 3
    assert shown.loc["tok full", "bias/true ± se"] == "reference"
    assert df["n_for_10pct"].isna().all() and df["rmse_b64"].isna().all()     # no truth: nothing planned
    assert "Monte Carlo reference" in heading(res.summary, "log", "logged")


# ----------------------------------------------------------------------------- KL = 0
def test_kl_zero_is_a_case_exact_zeros_no_nan_no_never():
    """p = q (every trainer's step 0): KL = 0 said in the heading, absolute bias and std, exact zeros, n 1,
    and an advice sentence instead of "+nan% biased"."""
    spec = spec_toml({"name": "z", "draws": 10_000, "seed": 0, "device": "cpu", "batches": 10,
                      "estimators": ["k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3", "full"]},
                     [{"name": "step0", "kind": "categorical", "vocab": 300, "q": ZIPF, "p": {"from": "q"}}])
    res = kl_bench.run(spec)
    df = res.summary
    assert (df["true_kl"] == 0).all() and (df["mean"] == 0).all() and (df["se"] == 0).all()
    assert (df["n_for_10pct"] == 1).all()
    frame = compact_frame(df, "step0")
    assert list(frame.columns)[2:5] == ["bias ± se", "exact", "std"]
    assert (frame["bias ± se"] == "0 ± 0").all() and (frame["std"] == "0").all() and (frame["n ±10%"] == "1").all()
    buf = io.StringIO()
    print_tables(Console(file=buf, width=80, force_terminal=True, color_system=None), df, res.descriptions())
    text = buf.getvalue()
    assert "KL(q||p) = 0, KL(p||q) = 0" in text and "KL = 0" in text
    assert "nan" not in text and "never" not in text
    value = [a for a in res.recommendations() if a.use == "value"][0]
    assert "KL(q||p) = 0" in value.text and "nan" not in value.text
    exact = api.exact(spec)
    assert "nan" not in "".join(a.text for a in kl_bench.analysis.advice.recommendations(exact))


# ----------------------------------------------------------------------------- degenerate weights
def test_kish_effective_sample_size():
    assert kish_ess(10.0, 10.0) == 10.0                           # ten equal weights of 1
    assert kish_ess(3.0, 5.0) == pytest.approx(1.8)               # weights 1, 2: (1 + 2)² / (1 + 4)
    assert kish_ess(0.0, 0.0) == 0.0                              # every weight underflowed: nothing counts
    assert kish_ess(1.0, math.inf) == 0.0 and math.isnan(kish_ess(math.nan, 1.0))


def test_the_effective_sample_size_agrees_with_its_exact_expectation():
    """The engine's ΣW and ΣW² give Kish's ESS; with token weights w = q/b on a categorical, ESS/N tends to
    (E_b w)²/E_b w² = 1/Σ q²/b, and its SE follows by the delta method from the exact E_b w^k (k ≤ 4)."""
    n = 400_000
    spec = spec_toml({"name": "w", "draws": n, "seed": 3, "device": "cpu", "batches": 50, "estimators": ["k1"]},
                     [{"name": "t", "kind": "categorical", "vocab": 300, "q": ZIPF, "p": NOISY,
                       "sampler": {"temperature": 1.3, "weights": "token"}}])
    res = kl_bench.run(spec)
    ess = float(res.summary["ess"].iloc[0])
    pair = res.pairs[0]
    lq, lb = pair.model.log_q[0], pair.model.log_b[0]                    # [V]: one context
    m = [float((lb.exp() * torch.exp(k * (lq - lb))).sum()) for k in range(5)]       # E_b w^k, exact
    assert m[1] == pytest.approx(1.0, rel=1e-12)
    want = 1 / m[2]
    cov = torch.tensor([[m[2] - 1, m[3] - m[2]], [m[3] - m[2], m[4] - m[2] ** 2]], dtype=torch.float64)
    grad = torch.tensor([2 / m[2], -1 / m[2] ** 2], dtype=torch.float64)
    se = math.sqrt(float(grad @ cov @ grad) / n)
    assert abs(ess / n - want) / se < 5, (ess / n, want, se)
    assert want < 0.99                                       # the weights are uneven: the test can fail


DEGENERATE = {"name": "stale-T32", "kind": "rollout", "vocab": 20, "buckets": 4, "length": 32, "q": ZIPF,
              "p": NOISY, "sampler": {"behavior": {"from": "q", "noise": 2.0, "seed": 3}, "weights": "sequence"}}


@pytest.fixture(scope="module")
def degenerate():
    spec = spec_toml({"name": "deg", "draws": 4_000, "seed": 0, "device": "cpu", "batches": 40,
                      "estimators": ["k1", "k3"]}, [DEGENERATE])
    return spec, kl_bench.run(spec)


def test_degenerate_importance_weights_are_unknown_not_a_zero_se(degenerate):
    """A long rollout under a stale sampler with product weights: a handful of draws carry the whole sum,
    and the batch means gave an SE near 0 and z of −10^12 beside "infinite variance". Now such rows say
    "degenerate IS weights", their ESS is shown, and their SE and z are empty, never 0 or 10^12."""
    _, res = degenerate
    df = res.summary
    weighted = df[df["aggregate"].isin(["seq", "tok"])]
    assert (weighted["heavy_tail"] == HeavyTail.DEGENERATE.value).all()
    assert (weighted["ess"] < weighted["batches"]).all() and (weighted["ess"] > 0).all()
    for c in ("se", "z", "std_se", "z_var"):
        assert weighted[c].isna().all(), c
    frame = compact_frame(df, "stale-T32")
    assert (frame.loc[frame["estimator"].str.startswith(("seq", "tok k")), "bias/true ± se"] == "unknown").all()
    buf = io.StringIO()
    print_tables(Console(file=buf, width=80, force_terminal=True, color_system=None), df, res.descriptions())
    text = buf.getvalue()
    assert "effective sample size of" in text and "e+12" not in text and "e+11" not in text


def test_the_gate_neither_passes_nor_fails_degenerate_rows_in_silence(degenerate, tmp_path):
    _, res = degenerate
    rep = api.check(res)
    rows = {c.row for c in rep.comparisons}
    assert not any(r.endswith((": seq k1", ": tok k1", ": seq k3", ": tok k3")) for r in rows)
    note = [n for n in rep.notes if "not compared" in n]
    assert len(note) == 1 and "degenerate importance weights" in note[0] and "effective sample size" in note[0]
    res.write(tmp_path / "r")                               # written, verified and read back: empty SEs allowed
    back = kl_bench.load_results(tmp_path / "r").summary
    assert back["se"].isna().sum() == res.summary["se"].isna().sum()
    # a baseline stores them (an empty SE is no corruption here), and the baseline comparisons skip them too
    import json

    from kl_bench.results.baseline import baseline_bytes, make_baseline
    base = json.loads(baseline_bytes(make_baseline(res.summary, res.spec)))
    with_base = api.check(res, base)
    assert {c.row for c in with_base.comparisons} == rows and any("not compared" in n for n in with_base.notes)


# ----------------------------------------------------------------------------- words and numbers
def test_numbers_below_the_rounding_floor_print_as_zero():
    assert fmt(6.51e-17, scale=0.149, sign=True) == "0" and fmt(0.00269, scale=0.149, sign=True) == "+0.00269"
    assert fmt(2 * ROUNDING * 0.149, scale=0.149) != "0"      # just above the floor: a number, not rounding
    assert fmt(3.51e-16) == "3.51e-16"                        # without a scale nothing is assumed


def test_one_vocabulary_for_counts():
    assert count(1_439) == "1,439" and count(2_100_000) == "2,100,000" and count(math.inf) == "never"
    assert count(math.nan) == ""
    assert plural(1, "figure") == "1 figure" and plural(2, "figure") == "2 figures"
    assert plural(1, "step") == "1 step" and plural(1_000, "step") == "1,000 steps"


def test_n_for_10pct_is_marked_where_no_exact_bias_is_known():
    from kl_bench.present.case_tables import n_cell
    base = {"true_kl": 0.1, "exact_mean": 0.1, "n_for_10pct": 1_234.0}
    assert n_cell(base) == "1,234"
    assert n_cell({**base, "n_for_10pct": math.inf}) == "never"
    assert n_cell({**base, "exact_mean": math.nan}) == "—"               # only a measured mean
    assert n_cell({**base, "true_kl": math.nan}) == "—"                  # no truth at all


def test_the_summary_schema_is_self_consistent_after_the_new_columns():
    from kl_bench.results import COLUMNS
    for c in ("ess", "ref_diff", "ref_diff_se"):
        assert c in COLUMNS
    assert pd.Index(COLUMNS).is_unique



def test_the_weight_sums_resume_byte_for_byte_and_a_corrupt_one_is_refused():
    """ΣW and ΣW² ride at the end of every batch's sums: a run resumed from a checkpoint of a weighted case
    gives the very sums of one uninterrupted run, and an impossible (negative) weight sum is refused."""
    from kl_bench.api import prepare
    from kl_bench.engine.monte_carlo import run_case
    from kl_bench.foundation.errors import SpecError
    pair = prepare(spec_toml({"name": "w", "draws": 4_000, "seed": 0, "device": "cpu", "batches": 10,
                              "estimators": ["k1", "k3"]}, [{**DEGENERATE, "length": 8}])).pairs[0]
    cpu = torch.device("cpu")
    args = dict(draws=4_000, seed=0, batches=10, chunk=1, device=cpu, joint=True)
    whole = run_case(pair, ["k1", "k3"], **args)
    assert torch.equal(run_case(pair, ["k1", "k3"], resume=whole.sums[:4], **args).sums, whole.sums)
    assert whole.weight_sums() is not None and whole.sums.shape[1] == 3 * len(whole.rows) + 5 * 2 + 2
    bad = whole.sums[:4].clone()
    bad[0, -1] = -1.0
    with pytest.raises(SpecError, match="negative sum of importance weights"):
        run_case(pair, ["k1", "k3"], resume=bad, **args)


def test_a_forward_kl_without_a_reference_is_unknown_not_the_reverse_one(tmp_path):
    """Issue 44 item 2: logged log-probs (as model continuations) printed "KL(p||q) ≈ 1.56 ± 0.024 (Monte
    Carlo reference)", the reverse KL's reference copied, and divided the fwd rows' std/true by it. The
    reference is KL(q||p)'s alone: a forward row has no ref_kl, its heading says unknown, nothing is /true."""
    log = logged_logprobs(64, 8)
    torch.save(log, tmp_path / "log.pt")
    res = kl_bench.run(spec_toml({"name": "lp", "draws": 20_000, "seed": 0, "device": "cpu", "batches": 20,
                                  "estimators": ["k1", "k3", "fwd_k1", "fwd_k3", "full"]},
                                 [{"name": "log", "kind": "logprobs", "file": str(tmp_path / "log.pt")}]))
    s = res.summary
    forward, reverse = s[s["target"] == "KL(p||q)"], s[s["target"] == "KL(q||p)"]
    assert len(forward) and forward[["ref_kl", "ref_se", "ref_diff", "ref_diff_se", "z_ref"]].isna().all().all()
    assert reverse["ref_kl"].notna().all()
    head = heading(s, "log", "logged")
    assert "KL(p||q) unknown" in head and "KL(p||q) ≈" not in head, head
    shown = compact_frame(s, "log")
    fwd = shown[shown["target"].str.startswith("p||q")]
    assert (fwd["bias/true ± se"] == "").all() and (fwd["std/true"] == "").all(), fwd
    # a folder written before the fix: its forward rows' copied reference is dropped when read
    from kl_bench.results.migrate import without_forward_reference
    import dataclasses
    old = s.copy()
    old.loc[old["target"] == "KL(p||q)", ["ref_kl", "ref_se"]] = [reverse["ref_kl"].iloc[0], reverse["ref_se"].iloc[0]]

    @dataclasses.dataclass
    class Contents:
        summary: object
    fixed = without_forward_reference(Contents(old)).summary
    assert fixed.loc[fixed["target"] == "KL(p||q)", "ref_kl"].isna().all()
    assert fixed.loc[fixed["target"] == "KL(q||p)", "ref_kl"].equals(old.loc[old["target"] == "KL(q||p)", "ref_kl"])


@pytest.mark.parametrize("temperature", [0.01, 0.05, 0.1])
def test_a_near_greedy_sampler_with_weights_is_unknown_never_a_zero_se(temperature):
    """Issue 44: categorical V = 1,000, sampler temperature 0.05, token weights printed "± 0" and
    z = 1.9·10¹¹: every draw is the argmax, the weights are all equal, Kish's ESS is N, and the weights that
    make the sum (q/b where b is tiny) were never drawn. Every temperature: the ESS counts the draws' share of
    the exact variance (0 here), the rows are degenerate, printed unknown with the ESS; never a zero SE."""
    spec = {"spec_version": 1, "experiment": {"name": "cold", "draws": 20_000, "batches": 20, "seed": 0},
            "case": [{"name": "cold", "kind": "categorical", "vocab": 1000,
                      "q": {"logits": "zipf", "exponent": 1.1, "seed": 1}, "p": {"from": "q", "noise": 0.5, "seed": 2},
                      "sampler": {"temperature": temperature, "weights": "token"}}]}
    s = kl_bench.run(spec).summary
    assert (s["heavy_tail"] == HeavyTail.DEGENERATE.value).all(), s[["estimator", "std", "ess", "heavy_tail"]]
    assert s["se"].isna().all() and s["z"].isna().all() and (s["ess"] < s["batches"]).all()
    shown = compact_frame(s, "cold")
    assert (shown["bias/true ± se"] == "unknown").all() and not shown.apply(lambda c: c.str.contains("± 0%")).any().any()
    out = io.StringIO()
    print_tables(Console(file=out, width=100), s, {"cold": "cold"})
    text = " ".join(out.getvalue().split())
    assert "unknown: degenerate importance weights: an effective sample size of" in text and "out of 20,000" in text
