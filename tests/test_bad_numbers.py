"""No bad number passes: a summary, batches table, baseline or checkpoint holding an impossible
value is one line (exit 2), a NaN statistic fails the gate and is never written, a gate that compared nothing
fails, and spec values that would overflow are refused up front naming the case and the key."""
import json
from pathlib import Path

import pytest
import torch

import kl_bench.api as api
from kl_bench.api import CheckReport
from kl_bench.analysis.gate import exact_comparisons, holm
from kl_bench.cli import app
from kl_bench.foundation.errors import SpecError
from kl_bench.results import checkpoint
from kl_bench.results.baseline import load_baseline

from .helpers import (CAT_SPEC, gauss_spec, gauss_text, one_line,
                      rehash, runner, save_checkpoint)


def _edit_summary(gauss_folder: Path, edit) -> None:
    lines = (gauss_folder / "summary.csv").read_text().splitlines()
    header = lines[0].split(",")
    lines = edit(header, lines)
    (gauss_folder / "summary.csv").write_text("\n".join(lines) + "\n")
    rehash(gauss_folder)


def _set_cell(column: str, value: str, row: int = 1):
    def edit(header, lines):
        cells = lines[row].split(",")
        cells[header.index(column)] = value
        lines[row] = ",".join(cells)
        return lines
    return edit


# ============================================================================ 1. the gate never passes a bad number
@pytest.mark.parametrize("damage, needle", [
    (_set_cell("mean", ""), "'mean' must hold a number"),
    (_set_cell("mean", "nan"), "'mean' must hold a number"),
    (_set_cell("se", "-0.01"), "'se' must be ≥ 0"),
    (_set_cell("std", "-1"), "'std' must be ≥ 0"),
    (_set_cell("draws", "-5"), "'draws' must be a whole number ≥ 0, but row 1 (line 2) (case 'g') has -5"),
    (lambda header, lines: lines + [lines[1]], "repeats an earlier row's key"),
])
def test_check_and_baseline_refuse_a_summary_with_a_bad_number(gauss_results, gauss_folder, tmp_path, damage, needle):
    _edit_summary(gauss_folder, damage)
    res = runner.invoke(app, ["check", str(gauss_results["spec"]), "--results", str(gauss_folder), "-q"])
    one_line(res, 2, needle, "summary.csv")
    res = runner.invoke(app, ["baseline", str(gauss_results["spec"]), "--results", str(gauss_folder), "--out", str(tmp_path / "b.json")])
    one_line(res, 2, needle)
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize("column, value, needle", [("batch_mean", "", "'batch_mean' must hold a number"),
                                                   ("draws", "-3", "'draws' must be a whole number"),
                                                   (None, None, "repeats an earlier row's key")])
def test_batches_csv_values_are_validated(gauss_results, gauss_folder, column, value, needle):
    lines = (gauss_folder / "batches.csv").read_text().splitlines()
    if column is None:                            # a duplicated batch
        lines.insert(2, lines[1])
    else:
        header, cells = lines[0].split(","), lines[1].split(",")
        cells[header.index(column)] = value
        lines[1] = ",".join(cells)
    (gauss_folder / "batches.csv").write_text("\n".join(lines) + "\n")
    rehash(gauss_folder)
    res = runner.invoke(app, ["report", str(gauss_folder), "--out", str(gauss_folder.parent / "rep")])
    one_line(res, 2, needle, "batches.csv")


def test_a_baseline_with_a_nan_mean_or_negative_spread_is_refused(gauss_results, tmp_path):
    data = json.loads(gauss_results["base"].read_text())
    for field, value, needle in (("mean", None, "mean is null"), ("se", -1.0, "must be ≥ 0"),
                                 ("std_se", -1.0, "must be ≥ 0"), ("batches", 0.5, "batches must be")):
        bad = json.loads(json.dumps(data))
        bad["rows"][0][field] = value
        path = tmp_path / "b.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(SpecError, match=needle):
            load_baseline(path)
        res = runner.invoke(app, ["check", str(gauss_results["spec"]), "--results", str(gauss_results["res"]), "--baseline", str(path)])
        one_line(res, 2, str(path))


def test_a_nan_statistic_fails_the_gate(gauss_results):
    from kl_bench.present.report_data import load_results
    df = load_results(gauss_results["res"]).summary.copy()
    df.loc[df.index[0], "mean"] = float("nan")
    comps = holm(exact_comparisons(df), 0.001)
    bad = [c for c in comps if c.value != c.value]
    assert bad and not any(c.passed for c in bad)
    rep = api.check(df)
    assert not rep.passed and rep.failures


def test_a_gate_that_compared_nothing_fails(gauss_results):
    rep = CheckReport([], 0.001)
    assert not rep.passed and "nothing was compared" in rep.verdict
    from kl_bench.present.report_data import load_results
    df = load_results(gauss_results["res"]).summary.copy()
    df["exact_mean"] = float("nan")
    df["exact_std"] = float("nan")
    rep = api.check(df)
    assert rep.comparisons == [] and not rep.passed


@pytest.mark.parametrize("edit, needle", [
    (lambda s: s.__setitem__((0, 0), float("nan")), "NaN"),
    (lambda s: s.__setitem__((1, 1), float("inf")), "infinite sums"),
    (lambda s: s.__setitem__((2, 4), -1.0), "count of negative"),
    (lambda s: s.__setitem__((2, 5), 1001.0), "count of negative"),
    (lambda s: s.__setitem__((0, 2), -4.0), "negative sum of squares"),
])
def test_resume_refuses_a_checkpoint_with_impossible_sums(tmp_path, edit, needle):
    spec = gauss_spec(tmp_path, "ck")
    out = tmp_path / "out"
    save_checkpoint(spec, out, edit)
    res = runner.invoke(app, ["run", str(spec), "--out", str(out), "-q", "--resume"])
    one_line(res, 2, needle)
    assert not (out / "summary.csv").exists()


def test_a_sound_checkpoint_still_resumes(tmp_path):
    spec = gauss_spec(tmp_path, "ck")
    out = tmp_path / "out"
    save_checkpoint(spec, out, lambda s: None)
    assert runner.invoke(app, ["run", str(spec), "--out", str(out), "-q", "--resume"]).exit_code == 0


@pytest.mark.parametrize("q, p, extra, key", [
    ('{ logits = "zipf", exponent = 1.1, seed = 1 }', '{ from = "q", noise = 1e308, seed = 2 }', "", "p.noise"),
    ('{ logits = "zipf", exponent = 1.1, seed = 1 }', '{ from = "q", temperature = 1e-310 }', "", "p.temperature"),
    ('{ logits = "zipf", exponent = 1.1, seed = 1 }', '{ from = "q", temperature = 1e-300 }', "", "p.temperature"),
    ('{ logits = "zipf", exponent = 1.1, seed = 1 }', '{ from = "q", noise = 0.3, seed = 2 }',
     "sampler = { temperature = 1e-320 }", "sampler.temperature"),
])
def test_overflowing_values_are_refused_up_front_naming_case_and_key(tmp_path, q, p, extra, key):
    spec = gauss_spec(tmp_path, text=CAT_SPEC.format(q=q, p=p, extra=extra))
    res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o"), "-q"])
    one_line(res, 2, "case 'c'", f"key '{key}'")
    assert not (tmp_path / "o").exists()


def test_a_logprobs_log_ratio_of_1e308_is_refused(tmp_path):
    logq = torch.full((4, 3), -1.0, dtype=torch.float64)
    logp = logq.clone()
    logp[0, 0] = -1e308
    torch.save({"logp_policy": logq, "logp_ref": logp}, tmp_path / "lp.pt")
    text = gauss_text(name="lp", seed=0, more="", extra="").split("[[case]]")[0] + \
        '[[case]]\nname = "l"\nkind = "logprobs"\nfile = "lp.pt"\n'
    spec = gauss_spec(tmp_path, text=text)
    res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o"), "-q"])
    one_line(res, 2, "case 'l'", "lp.pt", "log-ratio")
    logp[0, 0] = -5.0                         # a plausible file runs
    torch.save({"logp_policy": logq, "logp_ref": logp}, tmp_path / "lp.pt")
    assert runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o"), "-q"]).exit_code == 0


def test_a_nan_statistic_is_never_written(tmp_path, monkeypatch):
    """The last line of defence: whatever overflowed, an empty mean is one line naming case and row."""
    from kl_bench.results.verify import refuse_undefined_statistics
    res = api.run(str(gauss_spec(tmp_path, "n")))
    df = res.summary.copy()
    df.loc[df.index[1], "mean"] = float("nan")
    with pytest.raises(SpecError, match="case 'g'.*mean of k3 is NaN"):
        refuse_undefined_statistics(df, "spec.toml")
    monkeypatch.setattr(res, "summary", df)
    with pytest.raises(SpecError, match="no results were written"):
        res.write(tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_a_checkpoint_with_the_wrong_number_of_batches_is_refused(small_spec, tmp_path):
    import torch

    from kl_bench.api import prepare
    out = tmp_path / "res"
    out.mkdir()
    prep = prepare(small_spec)
    identity = checkpoint.checkpoint_identity(prep.spec, prep.device, prep.spec.case_draws())
    checkpoint.save_checkpoint(out, identity, {"g": torch.zeros(21, 12, dtype=torch.float64)})    # the run has 20
    one_line(runner.invoke(app, ["run", str(small_spec), "--out", str(out), "--resume"]), 2,
                    "checkpoint holds 21 batches of case 'g' but the run has 20")
    checkpoint.save_checkpoint(out, identity, {"other": torch.zeros(3, 12, dtype=torch.float64)})
    one_line(runner.invoke(app, ["run", str(small_spec), "--out", str(out), "--resume"]), 2, "no such case")
    (out / checkpoint.CHECKPOINT).write_bytes(b"not a checkpoint")
    one_line(runner.invoke(app, ["run", str(small_spec), "--out", str(out), "--resume"]), 2, "checkpoint is unreadable")
