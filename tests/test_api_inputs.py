"""Bad input to the public Python API is one SpecError (a ShapeError for shapes) naming the argument, case
or key, never a torch, pathlib or difflib traceback: dict specs (tensors without data, keys that are not
strings), the folders Result writes, paths and numbers given as something else, estimate's estimator, ids
and logits."""
import math
import os

import numpy as np
import pytest
import torch

import kl_bench
from kl_bench.foundation.errors import SpecError


def _spec(q, p=None):
    return {"spec_version": 1,
            "experiment": {"name": "inputs", "draws": 2000, "batches": 10, "device": "cpu", "estimators": ["k1"]},
            "case": [{"name": "c", "kind": "categorical", "q": q, "p": torch.zeros(3) if p is None else p}]}


@pytest.fixture(scope="module")
def result():
    return kl_bench.run(_spec(torch.tensor([0.0, 0.5, 1.0])))


# ----------------------------------------------------------------------------- dict specs
@pytest.mark.parametrize("fn", ["run", "exact", "load"])
def test_a_meta_tensor_in_a_dict_spec_names_the_case_and_key(fn):
    with pytest.raises(kl_bench.SpecError, match=r"case 'c': key 'q': .*'meta' device has a shape but no data"):
        getattr(kl_bench, fn)(_spec(torch.empty(3, device="meta")))


@pytest.mark.parametrize("q", [torch.zeros(3, requires_grad=True), torch.arange(6.0).view(3, 2).t()[0],
                               torch.tensor([0, 1, 2])], ids=["requires-grad", "non-contiguous", "int"])
def test_unusual_but_valid_tensors_in_a_dict_spec_run(q):
    df = kl_bench.exact(_spec(q))
    assert df["exact_mean"].notna().all()


@pytest.mark.parametrize("q, shape", [(torch.empty(0), "[0]"), (torch.empty(2, 0), "[2, 0]")])
def test_an_empty_tensor_in_a_dict_spec_is_named_with_its_own_shape(q, shape):
    with pytest.raises(kl_bench.SpecError, match=rf"case 'c': key 'q': .*V ≥ 1.*got \{shape}"):
        kl_bench.exact(_spec(q))


@pytest.mark.parametrize("spec, path", [
    ({1: 2}, "1"),
    ({**_spec(torch.zeros(3)), "experiment": {"name": "x", 3: 4}}, "experiment.3"),
    ({**_spec(torch.zeros(3)), "case": [{"name": "c", 7: 1}]}, r"case\[0\].7"),
    ({**_spec(torch.zeros(3)), "case": [{"name": "c", "q": {None: 1}}]}, r"case\[0\].q.None"),
])
def test_a_key_that_is_not_a_string_in_a_dict_spec_names_its_path(spec, path):
    with pytest.raises(kl_bench.SpecError, match=rf"<dict>: key '{path}': a spec's keys must be strings"):
        kl_bench.run(spec)


# ----------------------------------------------------------------------------- folders and paths
@pytest.mark.parametrize("folder", [".", "..", ""])
@pytest.mark.parametrize("method", ["write", "report"])
def test_result_write_and_report_refuse_dot_folders_as_the_cli_does(result, tmp_path, monkeypatch, folder, method):
    """'.' had been an OSError (EBUSY), and '..' swapped the parent folder for the results."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    with pytest.raises(kl_bench.SpecError, match=r"key 'directory': must name a results folder \(not '', '.' or '..'\)"):
        getattr(result, method)(folder)
    assert sorted(os.listdir(tmp_path)) == ["work"] and sorted(os.listdir(work)) == ["keep.txt"]


def test_a_report_is_not_written_over_its_results_folder(result, tmp_path):
    stored = kl_bench.load_results(result.write(tmp_path / "res"))
    with pytest.raises(kl_bench.SpecError, match="key 'directory': is a results folder this report reads"):
        stored.report(tmp_path / "res")
    assert (tmp_path / "res" / "summary.csv").is_file()


@pytest.mark.parametrize("call, key", [
    (lambda r: r.write(None), "directory"), (lambda r: r.write(5), "directory"),
    (lambda r: r.report(5), "directory"), (lambda r: r.write_files(5), "directory"),
    (lambda r: kl_bench.load_results(5), "folder"), (lambda r: kl_bench.load_results(b"x"), "folder"),
    (lambda r: kl_bench.check(5), "results"), (lambda r: kl_bench.check(r, baseline=5), "baseline"),
    (lambda r: kl_bench.check(r.summary, spec_sha256=5), "spec_sha256"),
    (lambda r: kl_bench.api.run_to_folder(_spec(torch.zeros(3)), 5), "out"),   # the API's argument, not --out
])
def test_a_path_argument_that_is_not_a_path_is_named(result, call, key):
    with pytest.raises(kl_bench.SpecError, match=rf"(key|argument) '{key}': must be"):
        call(result)


# ----------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("alpha", ["x", True, None, float("nan"), [0.1]])
def test_check_alpha_must_be_a_number(result, alpha):
    with pytest.raises(kl_bench.SpecError, match="key 'alpha': must be a number"):
        kl_bench.check(result, alpha=alpha)


def test_check_alpha_may_be_a_numpy_scalar(result):
    assert kl_bench.check(result, alpha=np.float64(0.01)).alpha == 0.01


@pytest.mark.parametrize("kw, key", [(dict(batch="x"), "batch"), (dict(batch=0), "batch"),
                                     (dict(tolerance="x"), "tolerance")])
def test_recommendation_options_are_spec_errors(result, kw, key):
    with pytest.raises(kl_bench.SpecError, match=key):
        result.recommendations(**kw)


def test_api_errors_name_the_api_arguments_never_a_cli_flag(tmp_path):
    """Issue 44: `kl_bench.run(spec, draws=1.5)` said "key '--draws'", a flag the caller never typed; the command
    line still names its flag (SpecError.as_flags)."""
    with pytest.raises(kl_bench.SpecError) as e:
        kl_bench.run(_spec(torch.zeros(3)), draws=1.5)
    assert "argument 'draws': must be an integer" in str(e.value) and "--" not in str(e.value)
    assert "key '--draws': must be an integer" in str(e.value.as_flags())
    with pytest.raises(kl_bench.SpecError) as e:
        kl_bench.api.run_to_folder(_spec(torch.zeros(3)), tmp_path / "o", device=5)
    assert "argument 'device'" in str(e.value) and "--" not in str(e.value)


def test_run_to_folder_checkpoint_every_must_be_a_number(tmp_path):
    with pytest.raises(kl_bench.SpecError, match="argument 'checkpoint_every': must be a number"):
        kl_bench.api.run_to_folder(_spec(torch.zeros(3)), tmp_path / "o", checkpoint_every="30")


# ----------------------------------------------------------------------------- estimate
A = torch.zeros(2, 5)


@pytest.mark.parametrize("estimator", [3, None, lambda x: x, 1.5])
def test_an_estimator_that_is_no_name_or_estimator_is_named(estimator):
    with pytest.raises(kl_bench.SpecError, match="key 'estimator': must be an estimator's name"):
        kl_bench.estimate(policy=A, reference=A, estimator=estimator)


@pytest.mark.parametrize("ids, got", [(torch.tensor([0, 7]), "7"), (torch.tensor([0, -1]), "-1")])
def test_ids_outside_the_vocabulary_name_ids_and_v(ids, got):
    with pytest.raises(kl_bench.SpecError, match=rf"key 'ids': token ids must lie in \[0, V\) = \[0, 5\).*got {got}"):
        kl_bench.estimate(policy_logits=A, reference_logits=A, ids=ids)


@pytest.mark.parametrize("kw, err, match", [
    (dict(ids=torch.tensor([0.0, 1.0])), kl_bench.SpecError, "key 'ids': must hold integer token ids"),
    (dict(ids="ab"), kl_bench.SpecError, "key 'ids': must be a tensor"),
    (dict(ids=torch.tensor([0, 1, 2])), kl_bench.ShapeError, "ids must have the logits' shape"),
    (dict(ids=torch.empty(2, dtype=torch.long, device="meta")), kl_bench.SpecError, "key 'ids': .*meta"),
])
def test_bad_ids_are_named(kw, err, match):
    with pytest.raises(err, match=match):
        kl_bench.estimate(policy_logits=A, reference_logits=A, **kw)


def test_ids_with_log_probs_are_refused_not_ignored():
    with pytest.raises(kl_bench.SpecError, match="key 'ids': ids= goes with policy_logits="):
        kl_bench.estimate(policy=A, reference=A, ids=torch.tensor([0, 1]))


@pytest.mark.parametrize("estimator", ["k3", "full"])
@pytest.mark.parametrize("bad, what", [(float("nan"), "NaN"), (float("inf"), r"\+inf")])
def test_non_finite_logits_are_refused_naming_the_argument(estimator, bad, what):
    lq = A.clone()
    lq[1, 2] = bad
    ids = None if estimator == "full" else [0, 1]
    with pytest.raises(kl_bench.SpecError, match=rf"key 'reference_logits': logits contain {what} \(at index \[1, 2\]\)"):
        kl_bench.estimate(policy_logits=A, reference_logits=lq, ids=ids, estimator=estimator)


def test_a_logits_row_all_minus_inf_is_refused():
    lq = A.clone()
    lq[0] = -float("inf")
    with pytest.raises(kl_bench.SpecError, match="key 'policy_logits': a row of logits is all −inf"):
        kl_bench.estimate(policy_logits=lq, reference_logits=A, ids=[0, 1])


@pytest.mark.parametrize("estimator, ids", [("full", None), ("k3", [0, 0])])
def test_an_empty_vocabulary_is_a_shape_error(estimator, ids):
    z = torch.zeros(2, 0)
    with pytest.raises(kl_bench.ShapeError, match=r"policy_logits must be \[..., V\] with a vocabulary V ≥ 1, got \[2, 0\]"):
        kl_bench.estimate(policy_logits=z, reference_logits=z, ids=ids, estimator=estimator)


def test_mismatched_logits_name_the_logits_arguments():
    with pytest.raises(kl_bench.ShapeError, match="policy_logits and reference_logits must have one shape"):
        kl_bench.estimate(policy_logits=A, reference_logits=torch.zeros(2, 4), ids=[0, 1])


@pytest.mark.parametrize("kw, key", [(dict(policy="a", reference="b"), "policy"),
                                     (dict(policy=A, reference=A, mask="x"), "mask"),
                                     (dict(policy=A, reference=A, mask=torch.ones(2, 5), aggregation=3), "aggregation")])
def test_arguments_of_the_wrong_type_are_named(kw, key):
    with pytest.raises(kl_bench.SpecError, match=f"key '{key}': must be"):
        kl_bench.estimate(**kw)


def test_valid_inputs_still_give_values():
    """Integer logits, numpy arrays, lists of ids, a bool mask: what worked works, with the same values."""
    lq, lp = torch.tensor([[0, 1, 2]]), torch.tensor([[2, 1, 0]])
    got = kl_bench.estimate(policy_logits=lq, reference_logits=lp, ids=[1], estimator="k1")
    want = kl_bench.estimate(policy_logits=lq.double(), reference_logits=lp.double(), ids=torch.tensor([1]),
                             estimator="k1")
    assert torch.allclose(got, want)
    v = kl_bench.estimate(policy=np.zeros((1, 3)), reference=np.full((1, 3), -0.5), mask=np.array([[True, False, True]]))
    assert v[0, 1] == 0 and v[0, 0] > 0


# ----------------------------------------------------------------------------- position_values
def test_position_values_takes_arrays_and_one_name_and_refuses_what_has_no_kl():
    """An ndarray was "'numpy.ndarray' object has no attribute 'to'", estimators="k1" was the estimators 'k'
    and '1', an empty vocabulary returned KL 0 and NaN logits returned NaN, all silently."""
    from kl_bench.foundation.errors import ShapeError, SpecError
    g = np.random.default_rng(0)
    a, b = g.standard_normal((3, 7)), g.standard_normal((3, 7))
    as_arrays = kl_bench.position_values(a, b, "k1")
    as_tensors = kl_bench.position_values(torch.as_tensor(a), torch.as_tensor(b), ("k1",))
    assert torch.equal(as_arrays.kl, as_tensors.kl) and torch.equal(as_arrays.mean_q, as_tensors.mean_q)
    exact = (torch.softmax(torch.as_tensor(a), -1) * (torch.log_softmax(torch.as_tensor(a), -1)
                                                        - torch.log_softmax(torch.as_tensor(b), -1))).sum(-1)
    assert torch.allclose(as_arrays.kl, exact, rtol=1e-12, atol=0)
    with pytest.raises(ShapeError, match="V must be ≥ 1"):
        kl_bench.position_values(torch.zeros(1, 0), torch.zeros(1, 0))
    bad = torch.as_tensor(a).clone()
    bad[1, 2] = float("nan")
    with pytest.raises(SpecError, match=r"key 'policy': logits contain NaN \(at index \[1, 2\]\)"):
        kl_bench.position_values(bad, b)
    with pytest.raises(SpecError, match="key 'reference': a row of logits is all −inf"):
        kl_bench.position_values(a, torch.full((3, 7), -float("inf")))
    with pytest.raises(SpecError, match="key 'policy': must be a tensor \\(or an ndarray, or nested lists of numbers\\), got str"):
        kl_bench.position_values("x", b)


# ----------------------------------------------------------------------------- a spec inside --out
@pytest.mark.parametrize("command, name", [("run", "run.json"), ("run", "summary.csv"), ("train", "run.json"),
                                           ("train", "train.csv")])
def test_a_spec_at_a_name_its_results_folder_writes_is_not_replaced(tmp_path, command, name):
    """A spec saved as DIR/run.json (or DIR/summary.csv, DIR/train.csv) and run with --out DIR was replaced by
    the results, exit 0: refused before any work in one line, the spec kept byte for byte."""
    from typer.testing import CliRunner

    from kl_bench.cli import app
    text = ('spec_version = 1\n[experiment]\nname = "t"\ndraws = 1000\ndevice = "cpu"\nbatches = 10\n'
            '[train]\noptimizer = "sgd"\nlr = 0.5\nsteps = 2\nbeta = 0.5\nreward = { random = 1.0 }\n'
            'combinations = ["k1/reward"]\n[[case]]\nname = "c"\nkind = "categorical"\nvocab = 12\n'
            'q = { logits = "zipf", exponent = 1.1, seed = 1 }\np = { from = "q", noise = 0.5, seed = 2 }\n')
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / name).write_text(text)
    res = CliRunner().invoke(app, [command, str(folder / name), "--out", str(folder)])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and f"would replace the spec ({folder / name})" in lines[0], res.output
    assert (folder / name).read_text() == text and sorted(os.listdir(folder)) == [name]


@pytest.mark.parametrize("bad", ["yes", 0.5, 1, [True]])
def test_progress_is_a_switch_in_run_and_train(bad, tmp_path):
    """run and train take progress = True, False or None; anything else is one SpecError naming it, before
    any work (run had taken "yes" and 0.5 as true)."""
    spec = {"spec_version": 1, "experiment": {"name": "p", "draws": 2000, "seed": 0, "device": "cpu"},
            "case": [{"name": "g", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0}, "p": {"mean": 0.1, "std": 1.0}}]}
    for call in (lambda: kl_bench.run(spec, progress=bad), lambda: kl_bench.train(spec, progress=bad)):
        with pytest.raises(kl_bench.SpecError, match="must be True, False or None") as e:
            call()
        assert e.value.key == "progress"
    assert kl_bench.run(spec, progress=False).summary is not None


LOGQ, LOGP = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])


@pytest.mark.parametrize("mask, shown", [([[1, -1]], "-1"), ([[1.0, 0.5]], "0.5"), ([[1.0, math.nan]], "nan"),
                                         ([[2, 0]], "2"), ([[1.0, -0.0], [1.0, 3.0]], "3")])
@pytest.mark.parametrize("aggregation", [None, "token-mean", "seq-mean-token-sum"])
def test_a_mask_that_is_not_bool_or_0_1_is_refused(mask, shown, aggregation):
    """mask [[1, -1]] gave 1.5 with aggregation="token-mean" (−1 weighed the second token by −1) while the
    per-token values read it as bool."""
    n = len(mask)
    with pytest.raises(SpecError) as e:
        kl_bench.estimate(policy=LOGQ.expand(n, 2), reference=LOGP.expand(n, 2), estimator="k1",
                          mask=torch.tensor(mask), aggregation=aggregation)
    text = str(e.value)
    assert text.startswith("key 'mask': must be bool or hold only 0 and 1") and f"got {shown} at index" in text
    assert "\n" not in text


@pytest.mark.parametrize("mask", [torch.tensor([[True, False]]), torch.tensor([[1, 0]]), torch.tensor([[1.0, 0.0]]),
                                  torch.tensor([[1, 0]], dtype=torch.uint8), [[1, 0]]])
def test_a_bool_or_0_1_mask_gives_one_answer(mask):
    values = kl_bench.estimate(policy=LOGQ, reference=LOGP, estimator="k1", mask=mask)
    assert values.tolist() == [[0.5, 0.0]]
    mean = kl_bench.estimate(policy=LOGQ, reference=LOGP, estimator="k1", mask=mask, aggregation="token-mean")
    assert float(mean) == 0.5
