"""The Python API: run/Result/exact/check/estimate, specs as dicts with tensors, the estimator mapping, and
the docstring examples (run as doctests here). The CLI is a thin layer over it: same bytes."""
import doctest
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

import kl_bench
from kl_bench.cli import app
from kl_bench.foundation.registry import UnknownName
from kl_bench.results import frame_to_csv_bytes, read_frame

runner = CliRunner()

SPEC = """spec_version = 1
[experiment]
name = "api"
draws = 60_000
batches = 30
device = "cpu"
lambdas = [0.5, "optimal"]
[[case]]
name = "g"
kind = "gaussian"
q = { mean = 0.0, std = 1.0 }
p = { mean = 0.4, std = 1.2 }
[[case]]
name = "c"
kind = "categorical"
vocab = 300
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.4, seed = 2 }
[[case]]
name = "r"
kind = "rollout"
vocab = 40
buckets = 4
length = 5
eos = 39
draws = 20_000
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.3, seed = 2 }
"""


@pytest.fixture
def spec_path(tmp_path):
    path = tmp_path / "api.toml"
    path.write_text(SPEC)
    return path


def test_estimators_is_a_mapping_with_did_you_mean():
    k3 = kl_bench.ESTIMATORS["k3"]
    assert k3.name == "k3" and k3.fn(torch.tensor([0.0])).item() == 0.0
    assert "k3" in kl_bench.ESTIMATORS and len(kl_bench.ESTIMATORS) >= 6 and "k1" in list(kl_bench.ESTIMATORS)
    with pytest.raises(KeyError) as e:
        kl_bench.ESTIMATORS["k4"]
    assert isinstance(e.value, UnknownName) and "did you mean 'k3'" in str(e.value)
    assert kl_bench.ESTIMATORS.get("k4") is None


def test_run_summary_equals_the_cli_summary_csv_and_write_gives_the_same_folder(spec_path, tmp_path):
    cli_out = tmp_path / "cli"
    res = runner.invoke(app, ["run", str(spec_path), "--out", str(cli_out), "--draws", "40000", "--seed", "3", "-q"])
    assert res.exit_code == 0, res.output
    result = kl_bench.run(spec_path, draws=40_000, seed=3)
    pd.testing.assert_frame_equal(result.summary, read_frame(cli_out / "summary.csv"))
    assert frame_to_csv_bytes(result.summary) == (cli_out / "summary.csv").read_bytes()
    api_out = result.write(tmp_path / "api")
    for name in ("summary.csv", "batches.csv", "reservoir.npz", "lambda_sweep.csv"):
        assert (api_out / name).read_bytes() == (cli_out / name).read_bytes(), name
    a, b = (json.loads((d / "run.json").read_text()) for d in (api_out, cli_out))
    assert a.keys() == b.keys() and a["files"] == b["files"] and a["cases"].keys() == b["cases"].keys()
    assert a["draws_per_case"] == b["draws_per_case"] == {"g": 40_000, "c": 40_000, "r": 40_000}
    assert result.lambda_sweep is not None and result.gradients is None
    assert list(result.lambda_sweep.columns) == list(read_frame(cli_out / "lambda_sweep.csv").columns)


def test_a_dict_spec_with_tensor_logits_equals_the_same_spec_with_files(tmp_path):
    g = torch.Generator().manual_seed(0)
    lq = torch.randn(3, 50, generator=g, dtype=torch.float64)
    lp = lq + 0.5 * torch.randn(3, 50, generator=g, dtype=torch.float64)
    np.save(tmp_path / "q.npy", lq.numpy())
    np.save(tmp_path / "p.npy", lp.numpy())
    exp = {"name": "t", "draws": 30_000, "batches": 20, "device": "cpu"}
    with_files = {"spec_version": 1, "experiment": exp,
                  "case": [{"name": "m", "kind": "categorical", "q": {"file": "q.npy"}, "p": {"file": "p.npy"}}]}
    with_tensors = {"spec_version": 1, "experiment": exp,
                    "case": [{"name": "m", "kind": "categorical", "q": lq, "p": lp.numpy()}]}
    a = kl_bench.run(_with_base(with_files, tmp_path))
    b = kl_bench.run(with_tensors)
    num = a.summary.select_dtypes("number").columns
    pd.testing.assert_frame_equal(a.summary[num], b.summary[num])
    assert (b.summary["z"].abs() < 5).all()
    # a tensor on the other side of a derived one, and a bad tensor
    derived = {"spec_version": 1, "experiment": exp,
               "case": [{"name": "m", "kind": "categorical", "q": lq, "p": {"from": "q", "noise": 0.3}}]}
    assert kl_bench.run(derived).summary["true_kl"].iloc[0] > 0
    bad = {"spec_version": 1, "experiment": exp,
           "case": [{"name": "m", "kind": "categorical", "q": torch.full((2, 3, 4), 0.0), "p": {"from": "q"}}]}
    with pytest.raises(kl_bench.SpecError, match=r"case 'm': key 'q': logits must have shape \[V\] or \[B, V\]"):
        kl_bench.run(bad)


def _with_base(data, base):
    from kl_bench.experiment.spec import spec_from_dict
    return spec_from_dict(data, base_dir=base)


def test_exact_fills_the_planning_columns_as_run_does(spec_path):
    ex = kl_bench.exact(spec_path)
    run = kl_bench.run(spec_path, draws=20_000).summary
    assert {"n_for_10pct", "rmse_b64", "rmse_b1024", "rmse_b16384"} <= set(ex.columns)
    assert "mean" not in ex.columns and len(ex) == len(run[run["estimator"] != "cv_opt"])
    merged = ex.merge(run, on=["case", "estimator", "lambda", "aggregate"], suffixes=("", "_run"))
    finite = merged[np.isfinite(merged["exact_mean"]) & np.isfinite(merged["exact_std"])]
    assert len(finite) > 10
    for col in ("n_for_10pct", "rmse_b64", "rmse_b1024"):
        assert np.allclose(finite[col], finite[f"{col}_run"], rtol=0, equal_nan=True), col


def test_check_passes_a_clean_run_and_fails_a_moved_one(spec_path):
    result = kl_bench.run(spec_path, draws=30_000)
    report = kl_bench.check(result)
    assert report.passed and not report.failures and len(report.table) == len(report.comparisons) > 20
    assert "0 failed" in report.verdict
    from kl_bench.results.baseline import make_baseline
    base = make_baseline(result.summary, result.spec)
    assert kl_bench.check(kl_bench.run(spec_path, draws=30_000, seed=9), baseline=base).passed
    moved = result.summary.copy()
    moved.loc[moved["estimator"] == "k3", "mean"] *= 1.05
    report = kl_bench.check(moved)
    assert not report.passed and all("k3" in c.row for c in report.failures)
    with pytest.raises(kl_bench.SpecError, match="alpha"):
        kl_bench.check(result, alpha=2.0)


def test_report_from_a_result(spec_path, tmp_path, unrendered_figures):
    """Result.report writes the report's files (its figures built, not rendered: tests/test_report.py renders)."""
    result = kl_bench.run(spec_path, draws=20_000)
    out = result.report(tmp_path / "rep")
    assert (out / "report.html").exists() and (out / "table.tex").exists()
    assert len(list((out / "figures").glob("*.png"))) >= 6


def test_estimate_on_trainer_tensors():
    g = torch.Generator().manual_seed(0)
    logq = torch.log_softmax(torch.randn(4, 7, 11, generator=g, dtype=torch.float64), -1)[..., 0]   # [B, T]
    logp = torch.log_softmax(torch.randn(4, 7, 11, generator=g, dtype=torch.float64), -1)[..., 0]
    logr = logp - logq
    want = {"k1": -logr, "k2": 0.5 * logr**2, "k3": torch.expm1(logr) - logr, "abs": logr.abs(),
            "fwd_k1": logr.exp() * logr, "fwd_k3": logr.exp() * logr - torch.expm1(logr)}
    for name, w in want.items():
        got = kl_bench.estimate(policy=logq.double(), reference=logp.double(), estimator=name)
        assert got.shape == logp.shape and torch.allclose(got, w, rtol=1e-12, atol=1e-15), name
    # computed in the input dtype, as a trainer would; gradients flow
    lq16 = logq.to(torch.bfloat16).requires_grad_(True)
    v = kl_bench.estimate(policy=lq16, reference=logp.to(torch.bfloat16), estimator="k3")
    assert v.dtype == torch.bfloat16
    v.sum().backward()
    assert lq16.grad is not None and lq16.grad.dtype == torch.bfloat16
    # the mask zeroes padding, even where the padded log-probs are -inf
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[:, 5:] = False
    lp = logp.clone()
    lp[:, 5:] = -math.inf
    out = kl_bench.estimate(policy=logq, reference=lp, estimator="k3", mask=mask)
    assert (out[:, 5:] == 0).all() and torch.isfinite(out).all()
    with pytest.raises(kl_bench.SpecError, match="full next-token distributions"):
        kl_bench.estimate(policy=logq, reference=logp, estimator="full")
    with pytest.raises(kl_bench.SpecError, match="one shape"):
        kl_bench.estimate(policy=logq[:, :3], reference=logp, estimator="k3")
    with pytest.raises(KeyError, match="did you mean"):
        kl_bench.estimate(policy=logq, reference=logp, estimator="k33")


@pytest.mark.parametrize("module", ["kl_bench.api.execution", "kl_bench.api.estimation", "kl_bench.core.estimators"])
def test_docstring_examples_run(module):
    import importlib
    mod = importlib.import_module(module)
    failed, attempted = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert attempted > 0 and failed == 0


def test_bf16_logits_and_numpy_scalars_in_a_dict_spec():
    g = torch.Generator().manual_seed(1)
    lq = torch.randn(2, 64, generator=g)
    spec = {"spec_version": 1, "experiment": {"name": "b", "draws": np.int64(20_000), "batches": 10, "device": "cpu",
                                              "estimators": ["k1", "k3"]},
            "case": [{"name": "m", "kind": "categorical", "q": lq.bfloat16(), "p": (lq + 0.3).half()}]}
    df = kl_bench.run(spec).summary
    assert (df["draws"] == 20_000).all() and (df["z"].abs() < 5).all()
    assert df["true_kl"].iloc[0] > 0          # the bf16-rounded logits differ from the fp16 ones


def test_a_dict_spec_takes_tuples_and_paths(tmp_path):
    """Python's spellings of TOML data in a dict spec: a tuple of estimators and a Path to a logits file
    were refused ("must be a list", "must be a string"); they read as the list and the string, and the run
    equals the one spelled as TOML data."""
    np.save(tmp_path / "q.npy", np.linspace(-1.0, 1.0, 40))
    case = {"name": "c", "kind": "categorical", "q": {"file": tmp_path / "q.npy"}, "p": {"from": "q", "noise": 0.2, "seed": 1}}
    spec = {"spec_version": 1, "experiment": {"name": "t", "draws": 2000, "batches": 10, "device": "cpu",
                                              "estimators": ("k1", "k3")}, "case": [case]}
    plain = {**spec, "experiment": {**spec["experiment"], "estimators": ["k1", "k3"]},
             "case": [{**case, "q": {"file": str(tmp_path / "q.npy")}}]}
    assert kl_bench.run(spec).summary.equals(kl_bench.run(plain).summary)


def test_overrides_are_type_checked(spec_path):
    # the API names its arguments (the CLI turns them back into flags)
    for kw, key in ((dict(draws=1.5), "draws"), (dict(draws="10"), "draws"), (dict(seed=True), "seed"),
                    (dict(device=3), "device")):
        with pytest.raises(kl_bench.SpecError, match=f"{spec_path}: argument '{key}'"):
            kl_bench.run(spec_path, **kw)


def test_estimate_loads_no_case_kind():
    """kl_bench.estimate inside a training loop imports the estimators and torch, not the case kinds, the
    engine or the results (issue 34 item 3): checked in a fresh process."""
    import subprocess
    import sys
    code = ("import sys, torch, kl_bench\n"
            "v = kl_bench.estimate(policy=torch.zeros(3), reference=torch.full((3,), -0.5), estimator='k3')\n"
            "assert abs(float(v[0]) - (2.718281828459045 ** -0.5 - 1 + 0.5)) < 1e-6, v\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('kl_bench'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "kl_bench.api.estimation" in out
    assert not [m for m in out if m.startswith(("kl_bench.kinds", "kl_bench.engine", "kl_bench.results",
                                                 "kl_bench.experiment", "kl_bench.sampling"))], out
    assert {m for m in out if m.startswith("kl_bench.api")} == {"kl_bench.api", "kl_bench.api.estimation"}, out
