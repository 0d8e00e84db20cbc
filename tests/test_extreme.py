"""Huge and extreme values fail early and clearly (issue 13, item 2): one line naming the file, the case
and the key, exit code 2, no traceback, nothing written; the same SpecError from the Python API. Values
inside the documented bounds give exact values that are right, without numpy warnings."""
from __future__ import annotations

import math
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import kl_bench
import kl_bench.api
from kl_bench.cli import app
from kl_bench.foundation.typed_toml import MAX_DRAWS

GAUSS = '[[case]]\nname = "g"\nkind = "gaussian"\nq = {{ mean = {mq}, std = {sq} }}\np = {{ mean = {mp}, std = {sp} }}\n'


def _spec(tmp_path, body: str, experiment: str = "draws = 20000\nbatches = 20", name: str = "x"):
    path = tmp_path / f"{name}.toml"
    path.write_text(f'spec_version = 1\n[experiment]\nname = "{name}"\ndevice = "cpu"\n{experiment}\n{body}')
    return path


def _gauss(mq=0.0, sq=1.0, mp=0.1, sp=1.0) -> str:
    return GAUSS.format(mq=mq, sq=sq, mp=mp, sp=sp)


def _refused(tmp_path, path, *flags, key: str, case: str | None = "g", words: tuple[str, ...] = ()) -> str:
    """Run `kl-bench run` in tmp_path: one line naming file, case and key; exit 2; nothing written."""
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["run", str(path), "--out", str(out), "--quiet", *flags])
    err = res.stderr.strip()
    assert res.exit_code == 2, (res.exit_code, err, res.exception)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(path) in err and f"key '{key}'" in err, err
    if case is not None:
        assert f"case '{case}'" in err, err
    for w in words:
        assert w in err, err
    assert not out.exists()
    return err


def _dict(case: dict, **experiment) -> dict:
    return {"spec_version": 1, "experiment": {"name": "x", "draws": 20000, "batches": 20, "device": "cpu", **experiment},
            "case": [case]}


# ----------------------------------------------------------------------------- draws
@pytest.mark.parametrize("draws", ["9223372036854775807", "1e300", "1000000000000000000000000000000"])
def test_huge_draws_in_the_spec_are_refused(tmp_path, draws):
    path = _spec(tmp_path, _gauss(), f"draws = {draws}")
    _refused(tmp_path, path, key="experiment.draws", case=None, words=("2^53",))
    case = _spec(tmp_path, _gauss() + f"draws = {draws}\n", name="y")
    _refused(tmp_path, case, key="draws", words=("2^53",))


@pytest.mark.parametrize("draws", [2**63 - 1, 10**30])
def test_huge_draws_flag_and_api(tmp_path, draws):
    path = _spec(tmp_path, _gauss())
    _refused(tmp_path, path, "--draws", str(draws), key="--draws", case=None, words=("2^53",))
    with pytest.raises(kl_bench.SpecError, match="argument 'draws'"):     # the API names its argument, not the flag
        kl_bench.run(str(path), draws=draws)
    with pytest.raises(kl_bench.SpecError, match="experiment.draws"):
        kl_bench.run(_dict({"name": "g", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0},
                            "p": {"mean": 0.1, "std": 1.0}}, draws=draws))
    with pytest.raises(kl_bench.SpecError, match="experiment.draws"):
        kl_bench.run(_dict({"name": "g", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0},
                            "p": {"mean": 0.1, "std": 1.0}}, draws=1e300))


def test_any_batch_size_is_accepted_because_memory_is_one_piece(tmp_path):
    # 2^53 draws in 2 batches: each batch is drawn in pieces of 2^16, so nothing refuses it for memory
    # (it would take long, which the progress bar shows); too many batches are still refused.
    prep = kl_bench.api.prepare(_dict({"name": "g", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0},
                                       "p": {"mean": 0.1, "std": 1.0}}, draws=MAX_DRAWS, batches=2))
    assert prep.spec.experiment.draws == MAX_DRAWS
    _refused(tmp_path, _spec(tmp_path, _gauss(), "draws = 1000\nbatches = 1e12", name="z"), key="experiment.batches",
             case=None, words=("2^20",))


# ----------------------------------------------------------------------------- tables
@pytest.mark.parametrize("body,key", [
    ('vocab = 1e13\nq = { logits = "zipf" }\np = { from = "q", noise = 0.1 }\n', "vocab"),
    ('vocab = 1000\nq = { logits = "zipf", contexts = 100_000_000_000 }\np = { from = "q", noise = 0.1 }\n',
     "q.contexts"),
    ('vocab = 9223372036854775807\nq = { logits = "zipf" }\np = { from = "q", temperature = 0.5 }\n', "vocab"),
])
def test_categorical_tables_that_would_not_fit_are_refused(tmp_path, body, key):
    path = _spec(tmp_path, f'[[case]]\nname = "c"\nkind = "categorical"\n{body}')
    _refused(tmp_path, path, key=key, case="c", words=("memory", "contexts × vocab"))
    with pytest.raises(kl_bench.SpecError, match="memory"):
        kl_bench.exact(str(path))


@pytest.mark.parametrize("sizes,key", [("vocab = 1e12\nbuckets = 32\nlength = 8", "vocab"),
                                       ("vocab = 100_000_000\nbuckets = 100_000_000\nlength = 8", "vocab"),
                                       ("vocab = 1000\nbuckets = 8\nlength = 9223372036854775807", "length")])
def test_rollout_tables_and_lengths_beyond_bounds_are_refused(tmp_path, sizes, key):
    body = f'[[case]]\nname = "r"\nkind = "rollout"\n{sizes}\nq = {{ logits = "zipf" }}\np = {{ from = "q", noise = 0.1 }}\n'
    path = _spec(tmp_path, body)
    _refused(tmp_path, path, key=key, case="r", words=("2^20",) if key == "length" else ("memory",))


# ----------------------------------------------------------------------------- λ
def test_huge_lambda_is_refused_at_parse_time(tmp_path):
    path = _spec(tmp_path, _gauss(), "draws = 20000\nbatches = 20\nlambdas = [0.5, 1e308]")
    _refused(tmp_path, path, key="experiment.lambdas", case=None, words=("1e+308",))
    with pytest.raises(kl_bench.SpecError, match="lambdas"):
        kl_bench.run(_dict({"name": "g", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0},
                            "p": {"mean": 0.1, "std": 1.0}}, lambdas=[-1e308]))


def test_lambda_at_the_bound_gives_a_sensible_sweep():
    spec = _dict({"name": "c", "kind": "categorical", "vocab": 200, "q": {"logits": "zipf", "seed": 1},
                  "p": {"from": "q", "noise": 0.3, "seed": 2}}, lambdas=[-1e3, 0.5, 1e3, "optimal"],
                 estimators=["k1", "k3"])
    res = kl_bench.run(spec)
    cv = res.summary[res.summary["estimator"] == "cv"]
    assert np.isfinite(cv[["exact_mean", "exact_std", "mean", "std"]].to_numpy(dtype=float)).all()
    sweep = res.lambda_sweep
    fine = sweep[(sweep["lambda"] >= -0.5) & (sweep["lambda"] <= 1.5)]
    assert len(fine) >= 401                          # the far λs do not stretch the fine grid
    assert {-1e3, 1e3} <= set(sweep["lambda"])
    assert np.isfinite(sweep["exact_std"]).all()


# ----------------------------------------------------------------------------- Gaussians
@pytest.mark.parametrize("params,key", [
    (dict(sq=1e-200), "q.std"), (dict(sq=1e-320), "q.std"), (dict(sq=1e308), "q.std"),
    (dict(sp=1e-200), "p.std"), (dict(sp=1e308), "p.std"), (dict(mq=1e308), "q.mean"), (dict(mp=-1e308), "p.mean"),
    (dict(sq=1e-20, sp=1.0), "p.std"), (dict(mq=0.0, mp=1e20), "p.mean"),
])
def test_extreme_gaussians_are_refused_in_one_line(tmp_path, params, key):
    path = _spec(tmp_path, _gauss(**params))
    _refused(tmp_path, path, key=key)
    res = CliRunner().invoke(app, ["exact", str(path)])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1 and f"key '{key}'" in res.stderr


@pytest.mark.parametrize("mq,sq,mp,sp", [
    (0.0, 1e-30, 0.0, 1e-20), (0.0, 1e30, 0.0, 1e20), (1e30, 1e30, 0.0, 1e20), (0.0, 1.0, 1e10, 1.0),
    (0.0, 1e-10, 0.0, 1.0), (0.0, 1.0, 30.0, 1.0), (1e30, 1.0, 1e30, 1.0),
])
def test_gaussians_inside_the_bounds_are_exact_without_warnings(mq, sq, mp, sp):
    spec = _dict({"name": "g", "kind": "gaussian", "q": {"mean": mq, "std": sq}, "p": {"mean": mp, "std": sp}},
                 lambdas=[0.5, "optimal"],
                 estimators=["k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3", "full", {"name": "k3", "logr_clamp": 20.0}])
    d, rho = (mq - mp) / sp, sq / sp
    kl = math.log(1 / rho) + (rho * rho + d * d) / 2 - 0.5
    table = kl_bench.exact(spec)
    assert table["true_kl"].iloc[0] == pytest.approx(kl, rel=1e-9, abs=1e-12)
    res = kl_bench.run(spec)            # filterwarnings = error: no numpy warning anywhere
    s = res.summary
    finite_truth = s["true_kl"].apply(math.isfinite)
    assert not s.loc[finite_truth, "exact_mean"].isna().any()
    k1 = s[s["estimator"] == "k1"].iloc[0]
    assert k1["exact_mean"] == pytest.approx(kl, rel=1e-9, abs=1e-12)


def test_extreme_gaussian_through_the_real_command(tmp_path):
    path = _spec(tmp_path, _gauss(sq=1e-320))
    proc = subprocess.run([sys.executable, "-m", "kl_bench", "run", str(path), "--draws", "20000", "--quiet",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "key 'q.std'" in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- logits files and tensors
def _write_bad_files(tmp_path) -> dict[str, str]:
    """name → the words its one-line error must hold."""
    torch.save(torch.randn(3, 5, dtype=torch.float64).to_sparse(), tmp_path / "sparse.pt")
    torch.save(torch.randn(3, 5, dtype=torch.float64).to_sparse_csr(), tmp_path / "csr.pt")
    torch.save(torch.randn(3, 5, dtype=torch.complex64), tmp_path / "complex.pt")
    torch.save({"a": torch.randn(5), "b": torch.randn(5)}, tmp_path / "two.pt")
    torch.save({"a": torch.randn(5).to_sparse()}, tmp_path / "onesparse.pt")
    with open(tmp_path / "pickled.pt", "wb") as f:
        pickle.dump({"x": 1}, f, protocol=4)
    torch.save(np.ones(5), tmp_path / "ndarray.pt")
    (tmp_path / "random.pt").write_bytes(np.random.default_rng(0).bytes(1000))
    np.save(tmp_path / "complex.npy", np.ones(5, dtype=np.complex128))
    return {"sparse.pt": "sparse", "csr.pt": "sparse", "complex.pt": "complex", "two.pt": "dict of 2",
            "onesparse.pt": "sparse", "pickled.pt": "not a plain tensor file", "ndarray.pt": "not a plain tensor file",
            "random.pt": "not a plain tensor file", "complex.npy": "complex"}


def test_bad_logits_files_are_one_line_without_torch_warnings(tmp_path):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # torch.save of sparse CSR warns "beta": not under test
        files = _write_bad_files(tmp_path)
    for name, words in files.items():
        body = f'[[case]]\nname = "c"\nkind = "categorical"\nq = {{ file = "{name}" }}\np = {{ from = "q", noise = 0.1 }}\n'
        path = _spec(tmp_path, body, name=name.replace(".", "_"))
        _refused(tmp_path, path, key="q.file", case="c", words=(words, name))
    # And through a real process: stderr is the one line, no warning before it.
    body = '[[case]]\nname = "c"\nkind = "categorical"\nq = { file = "pickled.pt" }\np = { from = "q", noise = 0.1 }\n'
    path = _spec(tmp_path, body, name="proc")
    proc = subprocess.run([sys.executable, "-m", "kl_bench", "exact", str(path)], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Warning" not in proc.stderr and "\x1b" not in proc.stderr


@pytest.mark.parametrize("value,words", [
    (torch.randn(2, 5, dtype=torch.float64).to_sparse(), "sparse"),
    (torch.randn(2, 5, dtype=torch.complex128), "complex"),
    (np.ones((2, 5), dtype=np.complex64), "complex"),
    (np.array([[True, False]]), "bool"),
])
def test_sparse_and_complex_tensors_in_dict_specs_are_refused(value, words):
    spec = _dict({"name": "c", "kind": "categorical", "q": value, "p": {"from": "q", "noise": 0.1}})
    with pytest.raises(kl_bench.SpecError, match=words) as e:
        kl_bench.run(spec)
    assert e.value.case == "c" and e.value.key == "q"
    spec = _dict({"name": "c", "kind": "categorical", "q": {"logits": "zipf"}, "vocab": 5,
                  "p": {"from": "q"}, "sampler": {"behavior": value}})
    with pytest.raises(kl_bench.SpecError, match=words):
        kl_bench.run(spec)
