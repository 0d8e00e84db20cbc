"""The regression gate catches real bugs, passes other seeds, keeps its false-alarm rate at or below
the nominal level, and rejects broken baselines clearly."""
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

import kl_bench
from kl_bench import check, run
from kl_bench.core import estimators as est_mod
from kl_bench.analysis.gate import baseline_comparisons
from kl_bench.results.baseline import baseline_bytes, make_baseline, normalize_baseline
from kl_bench.cli import app
from kl_bench.core.estimators import ESTIMATORS
from kl_bench.kinds import GaussianPair
from kl_bench.experiment.spec import parse_spec
from kl_bench.foundation.errors import SpecError

from .conftest import CATEGORICAL, CPU, GAUSS, spec_toml

ROOT = Path(__file__).resolve().parents[1]

runner = CliRunner()

def _spec(draws=20_000, seed=0, estimators=("k1", "k2", "k3", "fwd_k1", "fwd_k3"), cases=(GAUSS, CATEGORICAL)):
    from pathlib import Path
    text = spec_toml({"name": "gate", "draws": draws, "seed": seed, "device": "cpu", "batches": 50,
                      "estimators": list(estimators)}, list(cases))
    return parse_spec(text, Path("gate.toml"))


def _gate(spec, baseline=None, alpha=0.001):
    """The gate as the API runs it: (summary, failed comparisons)."""
    result = run(spec)
    report = check(result, baseline=baseline, alpha=alpha)
    return result.summary, report.failures


def test_clean_run_passes_and_another_seed_passes_against_the_baseline():
    df, failed = _gate(_spec(seed=0))
    assert not failed
    base = _roundtrip(make_baseline(df, _spec(seed=0)))
    _, failed = _gate(_spec(seed=1), baseline=base)
    assert not failed


def _roundtrip(baseline):
    """Through the same bytes and validation as a baseline file."""
    return normalize_baseline(json.loads(baseline_bytes(baseline)))


_restore: list = []


@pytest.fixture(autouse=True)
def _restore_estimators():
    yield
    while _restore:
        name, est = _restore.pop()
        ESTIMATORS.add(name, est, replace=True)


def _patch_estimator(monkeypatch, name, fn):
    """Swap an estimator's function for the test's duration (through the registry's public API)."""
    import dataclasses
    est = ESTIMATORS[name]
    ESTIMATORS.add(name, dataclasses.replace(est, fn=fn), replace=True)
    _restore.append((name, est))


@pytest.mark.parametrize("bug", ["k3-without-minus-1", "logr-sign-flip-gaussian", "logr-sign-flip-categorical",
                                 "forward-reverse-swap"])
def test_injected_bugs_fail_the_gate(bug, monkeypatch):
    """Each bug is injected where the engine computes the quantity, and the failures must come from the
    rows it touches (a patch of a path that nothing calls would leave them passing)."""
    touched = None
    if bug == "k3-without-minus-1":
        _patch_estimator(monkeypatch, "k3", lambda logr: torch.exp(logr) - logr)
    elif bug == "logr-sign-flip-gaussian":
        from kl_bench.kinds import gaussian
        orig = gaussian.GaussianPair.sample          # the one place Gaussian draws are made

        def flipped(self, n, generator, device):
            logr, weight, z = orig(self, n, generator, device)
            return -logr, weight, z
        monkeypatch.setattr(gaussian.GaussianPair, "sample", flipped)
        touched = {"g"}
    elif bug == "logr-sign-flip-categorical":
        import dataclasses

        from kl_bench.kinds.categorical.sampler import CategoricalSampler
        orig_c = CategoricalSampler.batch_sums

        def flipped_c(self, features, tok_rows, device):
            model = self.model
            self.model = dataclasses.replace(model, logr=-model.logr)
            try:
                return orig_c(self, features, tok_rows, device)
            finally:
                self.model = model
        monkeypatch.setattr(CategoricalSampler, "batch_sums", flipped_c)
        touched = {"c"}
    else:
        _patch_estimator(monkeypatch, "fwd_k1", est_mod.k1)
        _patch_estimator(monkeypatch, "k1", est_mod.fwd_k1)
    _, failed = _gate(_spec())
    assert failed, bug
    if touched is not None:
        assert {c.row.split(":")[0] for c in failed} == touched, (bug, [c.row for c in failed])
    assert all("moved from" in c.sentence() for c in failed)


@pytest.mark.slow
def test_float32_running_accumulator_fails_at_1e8_draws_but_not_at_1e6(monkeypatch):
    """A classic bug: one float32 running total across the whole run. Once the total of (f − c)² passes
    2^24 the additions of O(1) values round away, so the variance (and std) collapse at 10^8 draws."""
    from kl_bench.kinds import gaussian

    def float32_batch_sums(self, features, tok_rows, device):
        state = {}

        def run(batches):
            out = []
            for batch in batches:
                start = state.get("total")
                for n, g in batch.pieces():
                    f = features(self.sample_draws(n, g, device)).numpy().astype(np.float32)
                    total = state.get("total", np.zeros(f.shape[1], dtype=np.float32))
                    # naive sequential float32 adds (numpy's cumsum; torch's accumulates more precisely)
                    state["total"] = np.cumsum(np.concatenate([total[None], f]), axis=0, dtype=np.float32)[-1]
                begin = np.zeros_like(state["total"]) if start is None else start
                out.append(torch.from_numpy((state["total"] - begin).astype(np.float64)))
            return torch.stack(out)
        return run
    monkeypatch.setattr(gaussian.GaussianPair, "batch_sums", float32_batch_sums)
    for draws, should_fail in ((1_000_000, False), (100_000_000, True)):
        _, failed = _gate(_spec(draws=draws, estimators=["k1"], cases=[GAUSS]))
        assert bool(failed) == should_fail, (draws, [c.sentence() for c in failed])


@pytest.mark.slow
def test_false_alarm_rate_is_at_most_nominal_over_many_seeds():
    """At α = 0.05 (Holm, family-wise) over 60 seeds, the number of failing runs stays within the
    binomial range of a 5% rate: ≤ 60·0.05 + 3·√(60·0.05·0.95) ≈ 8.1."""
    alpha, seeds = 0.05, 60
    base_df, _ = _gate(_spec(draws=10_000, seed=1000))
    base = _roundtrip(make_baseline(base_df, _spec(seed=1000)))
    failures = sum(bool(_gate(_spec(draws=10_000, seed=s), baseline=base, alpha=alpha)[1]) for s in range(seeds))
    assert failures <= seeds * alpha + 3 * math.sqrt(seeds * alpha * (1 - alpha))




@pytest.mark.parametrize("damage, needle", [
    ("truncate", "not valid JSON"), ("garbage", "not valid JSON"), ("version", "not a kl-bench baseline"),
    ("no-rows", "has no rows"), ("missing-field", "lacks se"), ("missing-file", "not found")])
def test_broken_baselines_give_one_clear_line(damage, needle, build_spec, write_spec, tmp_path):
    spec = write_spec(build_spec(name="gate"), "gate.toml")
    base = tmp_path / "base.json"
    assert runner.invoke(app, ["baseline", str(spec), "--out", str(base)]).exit_code == 0
    text = base.read_text()
    if damage == "truncate":
        base.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        base.write_bytes(b"\x00\xff garbage")
    elif damage == "version":
        base.write_text(json.dumps({**json.loads(text), "kl_bench_baseline": 99}))
    elif damage == "no-rows":
        base.write_text(json.dumps({**json.loads(text), "rows": []}))
    elif damage == "missing-field":
        data = json.loads(text)
        del data["rows"][2]["se"]
        base.write_text(json.dumps(data))
    else:
        base.unlink()
    res = runner.invoke(app, ["check", str(spec), "--baseline", str(base)])
    assert res.exit_code == 2, res.output
    msg = res.stderr.strip()
    assert len(msg.splitlines()) == 1 and needle in msg and str(base) in msg


def test_cli_check_exit_codes_and_changed_spec_notice(build_spec, write_spec, tmp_path):
    spec = write_spec(build_spec(name="gate"), "gate.toml")
    base = tmp_path / "base.json"
    assert runner.invoke(app, ["baseline", str(spec), "--out", str(base)]).exit_code == 0
    ok = runner.invoke(app, ["check", str(spec), "--baseline", str(base), "--seed", "3"])
    assert ok.exit_code == 0, ok.output
    assert "0 failed" in ok.output and "mean vs baseline" in ok.output and "std vs exact" in ok.output
    changed = write_spec(build_spec(name="gate").replace("mean = 1.0", "mean = 1.3"), "gate.toml")
    res = runner.invoke(app, ["check", str(changed), "--baseline", str(base)])
    assert "the spec changed since the baseline" in res.output
    assert res.exit_code == 1 and "FAIL g: k1: the mean moved from" in res.output
    res = runner.invoke(app, ["check", str(spec), "--alpha", "2"])
    assert res.exit_code == 2 and "--alpha" in res.stderr


def test_check_reads_an_existing_results_folder(build_spec, write_spec, tmp_path):
    spec = write_spec(build_spec(name="gate"), "gate.toml")
    assert runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "r"), "--quiet"]).exit_code == 0
    df = pd.read_csv(tmp_path / "r" / "summary.csv")
    df.loc[df["estimator"] == "k3", "mean"] *= 1.5                    # tamper with a stored number
    df.to_csv(tmp_path / "r" / "summary.csv", index=False)
    # an edited file no longer matches the sha256 in run.json (that alone is exit 2): record the new hash
    import hashlib
    env = json.loads((tmp_path / "r" / "run.json").read_text())
    env["files"]["summary.csv"] = hashlib.sha256((tmp_path / "r" / "summary.csv").read_bytes()).hexdigest()
    (tmp_path / "r" / "run.json").write_text(json.dumps(env))
    res = runner.invoke(app, ["check", str(spec), "--results", str(tmp_path / "r"), "--quiet"])
    assert res.exit_code == 1 and "k3: the mean moved" in res.output


def test_patches_of_the_injected_bugs_are_undone():
    """Runs after test_injected_bugs_fail_the_gate: the estimators are the registered originals again and
    Gaussian draws are q's again, E_q[−log r] = KL = 0.5 within 5 standard errors (a leaked sign flip
    gives −0.5), and a clean run passes the gate (a leaked patch of any of them fails it)."""
    assert all(ESTIMATORS[n].fn is getattr(est_mod, n) for n in ("k1", "k3", "fwd_k1"))
    pair = GaussianPair("g", [0.0], [1.0], [1.0], [1.0])
    logr, _, _ = pair.sample(100_000, torch.Generator().manual_seed(0), CPU)
    k1 = -logr.double()
    assert abs(float(k1.mean()) - pair.kl()) < 5 * float(k1.std()) / math.sqrt(k1.numel())
    _, failed = _gate(_spec())
    assert not failed, [c.sentence() for c in failed]


def test_few_batches_use_student_t_and_keep_the_false_alarm_rate():
    """z = mean/SE from K = 12 batch means is Student-t with 11 degrees of freedom: 4000 null runs at
    α = 0.01 reject about 1% (binomial SE 0.16%) with the t p-value; a normal p-value would reject
    P(|t₁₁| > 2.576) ≈ 2.6%."""
    from kl_bench.analysis.gate import _dof, _tail
    from kl_bench.core.stats import batch_means_se
    g = np.random.default_rng(4)
    k, runs, alpha = 12, 4000, 0.01
    means = g.standard_normal((runs, k))                   # batch means of equal batches
    z = means.mean(1) / batch_means_se(means - means.mean(1, keepdims=True), np.full(k, 1 / k))
    dof = _dof((1.0, k))
    assert dof == k - 1 and _dof((1.0, k), (1.0, k)) == 2 * (k - 1) and math.isinf(_dof((1.0, math.nan)))
    rate = np.mean([_tail(float(v), dof) < alpha for v in z])
    normal_rate = np.mean([_tail(float(v), math.inf) < alpha for v in z])
    se = math.sqrt(alpha * (1 - alpha) / runs)
    assert abs(rate - alpha) < 5 * se and normal_rate > alpha + 5 * se, (rate, normal_rate)


def test_baselines_without_batches_still_load_and_compare_with_a_normal_tail():
    """Baselines written before the batches field was stored: loaded, compared with dof = inf."""
    row = {"case": "c", "estimator": "k3", "lambda": None, "aggregate": "", "target": "KL(q||p)", "draws": 1000,
           "mean": 1.0, "std": 1.0, "se": 0.01, "std_se": 0.01, "exact_mean": 1.0, "exact_std": 1.0,
           "heavy_tail": ""}
    base = normalize_baseline({"kl_bench_baseline": 1, "rows": [dict(row)]})
    assert math.isnan(base["rows"][0]["batches"])
    run = pd.DataFrame([{**row, "lambda": math.nan, "mean": 1.05, "batches": 12}])
    (mean_cmp, *_), _ = baseline_comparisons(run, base)
    assert math.isinf(mean_cmp.dof)
    with_k = normalize_baseline({"kl_bench_baseline": 1, "rows": [{**row, "batches": 12}]})
    (mean_cmp, *_), _ = baseline_comparisons(run, with_k)
    assert mean_cmp.dof == pytest.approx(22.0)


def test_results_of_another_version_of_the_spec_are_refused_but_run_settings_may_differ(tmp_path, build_spec):
    """`check SPEC --results DIR` gates DIR's numbers: a folder made from another version of the spec (a
    case's distribution or the estimators changed since) held the old numbers and passed; it is one line,
    exit 2, naming what changed. Comments, run settings (draws, a case's draws, seed, batches, device,
    gradients), the estimators' order and a [train] table may differ: the numbers are still this spec's (a
    note says the text differs)."""
    runner = CliRunner()
    spec = tmp_path / "s.toml"
    spec.write_text(build_spec(cases=[GAUSS], estimators=["k1", "k2", "k3"]))
    assert runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "r"), "-q"]).exit_code == 0
    changed = {"mean": build_spec(cases=[{**GAUSS, "p": {"mean": 0.5, "std": 2.0}}], estimators=["k1", "k2", "k3"]),
               "estimators": build_spec(cases=[GAUSS], estimators=["k1", "k3"]),
               "case": build_spec(cases=[GAUSS, {**GAUSS, "name": "g2"}], estimators=["k1", "k2", "k3"])}
    needles = {"mean": "case 'g'.p.mean, case 'g'.p.std changed since", "estimators": "experiment.estimators",
               "case": "lacks the spec's case 'g2'"}
    for what, text in changed.items():
        spec.write_text(text)
        res = runner.invoke(app, ["check", str(spec), "--results", str(tmp_path / "r"), "-q"])
        lines = [x for x in res.output.splitlines() if x.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and needles[what] in lines[0], (what, res.output)
    spec.write_text("# edited\n" + build_spec(cases=[{**GAUSS, "draws": 30_000}], estimators=["k3", "k2", "k1"],
                                              draws=40_000, seed=3, gradients=False)
                    + "[train]\nlr = 0.1\nsteps = 3\nbeta = 0.5\ncombinations = [\"k1/reward\"]\n")
    res = runner.invoke(app, ["check", str(spec), "--results", str(tmp_path / "r"), "-q"])
    assert res.exit_code == 0 and "was produced by a different version" in res.output, res.output
    # A run.json without its spec text (edited, or cut short) cannot show that the change is harmless.
    env = json.loads((tmp_path / "r" / "run.json").read_text())
    del env["spec_text"]
    (tmp_path / "r" / "run.json").write_text(json.dumps(env))
    res = runner.invoke(app, ["check", str(spec), "--results", str(tmp_path / "r"), "-q"])
    assert res.exit_code == 2 and "holds no spec text to compare" in res.output, res.output


_SAME_SPEC = """
spec_version = 1
[experiment]
name = "same"
draws = 20000
device = "cpu"
batches = 20
estimators = {est}

[[case]]
name = "file"
kind = "categorical"
q = {{ file = "{path}" }}
p = {{ file = "p.npy" }}{sampling}

[[case]]
name = "z"
kind = "categorical"
vocab = 50
q = {{ logits = "zipf", exponent = 1.1, seed = 1 }}
p = {{ from = "q", noise = 0.3, seed = 2 }}

[[sweep]]
case = "z"
p.noise = {noise}
"""


def test_the_same_spec_in_other_words_passes_and_a_real_change_in_them_is_refused(tmp_path):
    """Equivalent spellings were refused as another version of the spec (the text comparison): "./q.npy" for
    "q.npy", a default written out (sampling = "auto", the default estimators), a sweep's values in another
    order. The parsed specs decide; a change among the same respellings is still one line, exit 2."""
    from kl_bench.core.estimators import DEFAULT_ESTIMATORS
    runner = CliRunner()
    g = np.random.default_rng(0)
    for name in ("q", "p", "q2"):
        np.save(tmp_path / f"{name}.npy", g.standard_normal(40))
    spec = tmp_path / "s.toml"
    fill = {"est": json.dumps(list(DEFAULT_ESTIMATORS)), "path": "q.npy", "sampling": "", "noise": "[0.1, 0.3]"}
    spec.write_text(_SAME_SPEC.format(**fill))
    assert runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "r"), "-q"]).exit_code == 0
    same = {"path": "./q.npy", "sampling": '\nsampling = "auto"', "noise": "[0.3, 0.1]"}
    spec.write_text(_SAME_SPEC.format(**{**fill, **same}).replace("estimators = ", "# defaults\n# estimators = "))
    res = runner.invoke(app, ["check", str(spec), "--results", str(tmp_path / "r"), "-q"])
    assert res.exit_code == 0 and "was produced by a different version" in res.output, res.output
    changes = {"path": "q2.npy", "sampling": '\nsampling = "tokens"', "noise": "[0.3, 0.2]"}
    needles = {"path": "case 'file'.q.file", "sampling": "case 'file'.sampling", "noise": "lacks the spec's case 'z[p.noise=0.2]'"}
    for key, value in changes.items():
        spec.write_text(_SAME_SPEC.format(**{**fill, **same, key: value}))
        res = runner.invoke(app, ["check", str(spec), "--results", str(tmp_path / "r"), "-q"])
        lines = [x for x in res.output.splitlines() if x.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and needles[key] in lines[0], (key, res.output)


def test_a_baseline_of_another_experiment_is_refused(tmp_path, build_spec):
    """Another experiment's baseline made every row read as moved (exit 1, ten FAIL lines): one line, exit 2."""
    runner = CliRunner()
    for name in ("a", "b"):
        (tmp_path / f"{name}.toml").write_text(build_spec(cases=[GAUSS], name=name))
    assert runner.invoke(app, ["run", str(tmp_path / "b.toml"), "--out", str(tmp_path / "rb"), "-q"]).exit_code == 0
    assert runner.invoke(app, ["baseline", str(tmp_path / "b.toml"), "--results", str(tmp_path / "rb"), "--out",
                               str(tmp_path / "b.json")]).exit_code == 0
    res = runner.invoke(app, ["check", str(tmp_path / "a.toml"), "--baseline", str(tmp_path / "b.json"), "-q"])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "is the baseline of experiment 'b', not of 'a'" in lines[0] and "key '--baseline'" in lines[0]


@pytest.mark.parametrize("command", ["check", "baseline"])
def test_run_options_with_results_are_refused_and_the_baseline_records_the_runs_seed(tmp_path, build_spec, command):
    """--seed, --draws and --device with --results changed nothing (the numbers are read), and `baseline`
    recorded the flag's seed, not the one the results were drawn with: one line naming them, exit 2, nothing
    written. A baseline of a results folder records that run's seed (run.json), not the spec's."""
    spec = tmp_path / "s.toml"
    spec.write_text(build_spec(cases=[GAUSS], name="s", seed=0))
    assert runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "r"), "--seed", "7", "-q"]).exit_code == 0
    out = ["--out", str(tmp_path / "b.json")] if command == "baseline" else []
    for flags, said in ((["--seed", "9"], "--seed has"), (["--draws", "1e3"], "--draws has"),
                        (["--device", "cuda"], "--device has"),
                        (["--draws", "5", "--seed", "4", "--device", "cpu"], "--draws, --seed and --device have")):
        res = runner.invoke(app, [command, str(spec), "--results", str(tmp_path / "r"), *out, *flags, "-q"])
        lines = [x for x in res.output.splitlines() if x.strip()]
        assert res.exit_code == 2 and len(lines) == 1, (flags, res.output)
        assert f"{said} no effect with --results" in lines[0], lines[0]
        assert not (tmp_path / "b.json").exists()
    if command == "baseline":
        assert runner.invoke(app, ["baseline", str(spec), "--results", str(tmp_path / "r"), *out, "-q"]).exit_code == 0
        base = json.loads((tmp_path / "b.json").read_text())
        run_json = json.loads((tmp_path / "r" / "run.json").read_text())
        assert base["seed"] == 7 and base["spec_sha256"] == run_json["spec_sha256"]


def test_the_exact_kurtosis_of_a_gaussian_row_flags_a_clamp_whose_tail_the_draws_never_reach():
    """GaussianPair.kurtosis_proxy = E_b[f⁴]/E_b[f²]²: the closed form (a polynomial estimator) equals 1-D
    quadrature of the same function (an Estimator without its polynomial); k3 with log r clamped at ±20,
    N(0, 1) against N(0, 1.2²) drawn from N(0, 1.5²) (results/mismatch), puts E_b[f²] in draws of
    probability ~1e-14: its kurtosis is far beyond 10^7 draws, so the row is 'kurtosis > draws' (it was
    'unstable batches', whose std the gate then compared: 100 standard errors), while k1 and unclamped-free
    rows keep theirs."""
    from kl_bench.core.estimators import EstimatorOption, resolve_estimator
    from kl_bench.core.stats import HeavyTail
    pair = GaussianPair("g", [0.0], [1.0], [0.3], [1.1])
    k2 = ESTIMATORS["k2"]
    poly = pair.kurtosis_proxy(k2)
    bare = est_mod.Estimator("k2 bare", k2.fn, k2.target, False, True, "½(log r)²")       # no polynomial
    quad = pair.kurtosis_proxy(bare)
    assert math.isfinite(poly) and poly > 1 and abs(quad - poly) <= 1e-6 * poly, (poly, quad)
    assert math.isnan(pair.kurtosis_proxy(est_mod.lookup("full")))
    wide = GaussianPair("m", [0.0], [1.0], [0.0], [1.2], std_scale=1.5)
    clamped = resolve_estimator(EstimatorOption("k3", "k3 logr±20", logr_clamp=20.0))
    kurt = wide.kurtosis_proxy(clamped)
    assert kurt > 1e7, kurt
    assert wide.kurtosis_proxy(ESTIMATORS["k1"]) < 100
    # E_b[f²] beyond 1e154 (p 20 σ from q): its square overflows, and the ratio is inf, not inf/inf = NaN
    far = GaussianPair("far", [0.0], [1.0], [20.0], [1.0])
    assert math.isfinite(far.exact_moments(ESTIMATORS["k3"])[1]) and far.kurtosis_proxy(ESTIMATORS["k3"]) == math.inf
    df = pd.read_csv(ROOT / "results" / "mismatch" / "summary.csv", keep_default_na=False)
    row = df[(df["case"] == "gauss-std1.5") & (df["estimator"] == "k3 logr±20")].iloc[0]
    assert row["heavy_tail"] == HeavyTail.KURTOSIS.value


def _heavy_row(mean: float, std: float, exact_std: float, heavy: str) -> dict:
    """A summary row of 10^6 draws in 200 batches whose exact mean is 10."""
    se = std / 1000.0
    return {"case": "c", "estimator": "k3", "lambda": float("nan"), "aggregate": "seq", "target": "KL(q||p)",
            "true_kl": 10.0, "draws": 10**6, "batches": 200, "mean": mean, "std": std, "se": se,
            "std_se": se * 10, "exact_mean": 10.0, "exact_std": exact_std, "heavy_tail": heavy}


def test_a_heavy_tailed_mean_is_compared_at_the_exact_spread():
    """A row the exact analysis flags (kurtosis > draws: its measured std, and the batch-means SE made of it,
    usually far too low) is compared with its SE scaled to the exact std (se · exact_std / std), and its
    std not at all, with a note; the same numbers without the flag fail; a flagged row whose measured std
    is the exact one is still caught 10 SEs off."""
    from kl_bench.analysis.gate import exact_comparisons, holm, skipped_notes
    shortfall = pd.DataFrame([_heavy_row(5.0, 1000.0, 2.0e6, "kurtosis > draws")])   # 5 SEs low, measured
    comps = holm(exact_comparisons(shortfall), 0.001)
    assert [c.statistic for c in comps] == ["mean vs exact"] and comps[0].passed
    assert comps[0].se == pytest.approx(2.0e6 / 1000.0)
    assert skipped_notes(shortfall) == ["c: seq k3: std not compared; mean's SE taken at the exact std "
                                        "(up to ×2e+03) (kurtosis > draws)"]
    unflagged = pd.DataFrame([_heavy_row(5.0, 1000.0, 2.0e6, "")])
    assert not all(c.passed for c in holm(exact_comparisons(unflagged), 0.001))
    honest = pd.DataFrame([_heavy_row(10.0 - 10 * 2.0, 2000.0, 2000.0, "kurtosis > draws")])   # 10 SEs low
    comps = holm(exact_comparisons(honest), 0.001)
    assert [c.statistic for c in comps] == ["mean vs exact"] and not comps[0].passed
    # every draw alike (a cold sampler's argmax each time): std and SE 0, widened to exact_std/√draws
    alike = pd.DataFrame([_heavy_row(5.0, 0.0, 2.0e6, "kurtosis > draws")])
    comps = holm(exact_comparisons(alike), 0.001)
    assert comps[0].se == pytest.approx(2.0e6 / 1000.0) and comps[0].passed
    assert "every draw alike: its SE was 0" in skipped_notes(alike)[0]


def test_the_committed_results_pass_their_own_gate():
    """Every committed results folder with a spec passes `kl-bench check` against exact values (the gate
    had failed results/mismatch on a clamp's unreachable tail, and results/rollout on a sequence fwd_k3
    whose exact std is 1,800× the measured one)."""
    from kl_bench.present.report_data import load_results
    for folder in sorted((ROOT / "results").iterdir()):
        spec = ROOT / "experiments" / f"{folder.name}.toml"
        if not (folder / "summary.csv").exists() or not spec.exists():
            continue
        rep = check(load_results(folder).summary)
        assert rep.passed, (folder.name, [c.sentence() for c in rep.failures])


def test_check_of_a_result_read_back_uses_its_recorded_spec(checked_run, tmp_path):
    """A loaded Result has spec None: check() had raised AttributeError: 'NoneType' object has no attribute
    'sha256'. Its run.json's spec_sha256 gives the baseline note."""
    live, folder, loaded, mine, _ = checked_run
    assert kl_bench.check(loaded).passed
    base = tmp_path / "base.json"
    res = runner.invoke(app, ["baseline", str(mine), "--results", str(folder), "--out", str(base)])
    assert res.exit_code == 0, res.output
    doc = {**json.loads(base.read_text()), "spec_sha256": "0" * 64}     # as if made from another spec
    for results in (loaded, live, folder):
        notes = kl_bench.check(results, doc).notes
        assert any(f"{loaded.envelope['spec_sha256'][:12]}… now" in n for n in notes), notes


def test_check_refuses_another_experiments_spec_for_a_result_as_for_a_folder(checked_run):
    """spec= had been ignored unless the results were a folder's path."""
    live, folder, loaded, mine, other = checked_run
    said = []
    for results in (folder, str(folder), loaded, live):
        with pytest.raises(SpecError, match="holds the results of experiment 'mine', not of 'other'") as e:
            kl_bench.check(results, spec=other)
        said.append(str(e.value))
    assert "\n" not in said[-1] and said[0] == said[2]           # a folder and its Result: the same line
    for results in (folder, loaded, live):
        assert kl_bench.check(results, spec=mine).passed


def test_check_of_a_dataframe_with_a_spec_says_it_cannot_be_checked(checked_run):
    live, _, _, mine, other = checked_run
    for spec in (mine, other):
        with pytest.raises(SpecError) as e:
            kl_bench.check(live.summary, spec=spec)
        assert str(e.value).startswith("key 'spec': a summary DataFrame holds no record")
    assert kl_bench.check(live.summary).passed
