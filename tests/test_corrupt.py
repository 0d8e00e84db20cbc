"""Corrupt results are detected: `kl-bench report` and `kl-bench check --results` verify the sha256 of
every data file against run.json, the schema and dtypes of every table and the cases, and a baseline's
rows; every problem is one line naming the file, exit code 2, never a traceback, never exit 0."""
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import kl_bench
from kl_bench.cli import app
from kl_bench.foundation.errors import SpecError
from kl_bench.results.baseline import load_baseline, normalize_baseline
from kl_bench.present.report_data import load_results
from kl_bench.results.verify import check_results_match_spec, read_results_folder

runner = CliRunner()

SPEC = """
spec_version = 1
[experiment]
name = "{name}"
draws = 20000
device = "cpu"
batches = 20
estimators = ["k1", "k3"]

[[case]]
name = "{case}"
kind = "gaussian"
q = {{mean = 0.0, std = 1.0}}
p = {{mean = 0.3, std = 1.0}}

[[case]]
name = "cat"
kind = "categorical"
vocab = 200
q = {{logits = "zipf", exponent = 1.1, seed = 1}}
p = {{from = "q", noise = 0.3, seed = 2}}
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A results folder of spec 'corrupt' (with baseline), and the spec of another experiment."""
    root = tmp_path_factory.mktemp("corrupt")
    spec = root / "corrupt.toml"
    spec.write_text(SPEC.format(name="corrupt", case="g"))
    other = root / "other.toml"
    other.write_text(SPEC.format(name="other", case="h"))
    res = runner.invoke(app, ["run", str(spec), "--out", str(root / "good"), "--quiet"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["baseline", str(spec), "--results", str(root / "good"), "--out", str(root / "base.json")])
    assert res.exit_code == 0, res.output
    return {"root": root, "spec": spec, "other": other, "good": root / "good", "base": root / "base.json"}


@pytest.fixture
def folder(made, tmp_path):
    target = tmp_path / "r"
    shutil.copytree(made["good"], target)
    return target


def _rehash(folder: Path) -> None:
    """Record the files' current sha256 in run.json: a folder whose hashes agree but whose contents are bad."""
    env = json.loads((folder / "run.json").read_text())
    env["files"] = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in env["files"]}
    (folder / "run.json").write_text(json.dumps(env))


def _unhash(folder: Path) -> None:
    """As the oldest kl-bench wrote it: no 'files' in run.json, and no format version (every writer that records
    a version records the hashes too: a versioned run.json without them is refused, tests/test_folders.py)."""
    env = json.loads((folder / "run.json").read_text())
    del env["files"], env["kl_bench_run"]
    (folder / "run.json").write_text(json.dumps(env))


def _one_line_error(res, *needles):
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    msg = res.stderr.strip()
    assert len(msg.splitlines()) == 1 and msg.startswith("error: "), msg
    assert "Traceback" not in res.output
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def _report(folder: Path, tmp_path: Path):
    res = runner.invoke(app, ["report", str(folder), "--out", str(tmp_path / "rep")])
    assert not (tmp_path / "rep").exists() or res.exit_code == 0
    return res


def _check(made, folder: Path, spec=None):
    return runner.invoke(app, ["check", str(spec or made["spec"]), "--results", str(folder), "--quiet"])


# ----------------------------------------------------------------------------- sound folders
def test_a_sound_folder_verifies_reports_and_passes_the_gate(made, tmp_path):
    read_results_folder(made["good"])
    assert _report(made["good"], tmp_path).exit_code == 0
    res = _check(made, made["good"])
    assert res.exit_code == 0, res.output


def test_results_of_an_older_version_without_hashes_still_load(made, folder, tmp_path):
    _unhash(folder)
    read_results_folder(folder)
    assert _report(folder, tmp_path).exit_code == 0
    assert _check(made, folder).exit_code == 0


def test_every_committed_results_folder_verifies():
    root = Path(__file__).resolve().parents[1] / "results"
    folders = [p for p in root.iterdir() if (p / "summary.csv").exists()]
    assert len(folders) >= 8
    for p in folders:
        read_results_folder(p)
    # a training folder (kl-bench train): its files against the sha256 that run.json records
    import hashlib
    import json
    env = json.loads((root / "training" / "run.json").read_text())
    assert env["files"] and all(hashlib.sha256((root / "training" / n).read_bytes()).hexdigest() == h
                                for n, h in env["files"].items())


# ----------------------------------------------------------------------------- damaged data files
def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * 0.6)])


@pytest.mark.parametrize("hashes", ["recorded", "old-version"])
@pytest.mark.parametrize("name", ["summary.csv", "batches.csv"])
def test_a_truncated_table_is_one_line_exit_2(made, folder, tmp_path, name, hashes):
    _truncate(folder / name)
    if hashes == "old-version":
        _unhash(folder)
    needle = "sha256 mismatch" if hashes == "recorded" else "truncated"
    _one_line_error(_report(folder, tmp_path), str(folder / name), needle)
    _one_line_error(_check(made, folder), str(folder / name), needle)


@pytest.mark.parametrize("hashes", ["consistent", "old-version"])
@pytest.mark.parametrize("name, column, value", [("summary.csv", "mean", "abc"), ("summary.csv", "draws", "many"),
                                                 ("summary.csv", "se", "0.1.2"), ("batches.csv", "batch_mean", "x")])
def test_a_non_numeric_cell_is_one_line_exit_2(made, folder, tmp_path, name, column, value, hashes):
    lines = (folder / name).read_text().splitlines(keepends=True)
    header = lines[0].rstrip("\n").split(",")
    cells = lines[3].rstrip("\n").split(",")
    cells[header.index(column)] = value
    lines[3] = ",".join(cells) + "\n"
    (folder / name).write_text("".join(lines))
    _rehash(folder) if hashes == "consistent" else _unhash(folder)
    for res in (_report(folder, tmp_path), _check(made, folder)):
        _one_line_error(res, str(folder / name), f"'{column}'", "row 3")


def test_an_edited_number_with_hashes_recorded_is_caught_before_the_gate(made, folder):
    text = (folder / "summary.csv").read_text()
    (folder / "summary.csv").write_text(text.replace("0.", "0.9", 1))
    _one_line_error(_check(made, folder), "sha256 mismatch", str(folder / "summary.csv"))


@pytest.mark.parametrize("name", ["summary.csv", "batches.csv", "reservoir.npz"])
def test_any_changed_byte_of_a_recorded_file_is_detected(made, folder, name):
    data = bytearray((folder / name).read_bytes())
    rng = np.random.default_rng(0)
    for pos in rng.integers(0, len(data), 5):
        damaged = bytearray(data)
        damaged[pos] ^= 0x01
        (folder / name).write_bytes(bytes(damaged))
        with pytest.raises(SpecError, match="sha256 mismatch"):
            load_results(folder)
    (folder / name).write_bytes(bytes(data))
    load_results(folder)


@pytest.mark.parametrize("damage", ["missing-column", "header-only", "empty", "binary", "empty-case", "no-newline",
                                    "negative-draws"])
def test_schema_damage_without_hashes(made, folder, tmp_path, damage):
    p = folder / "summary.csv"
    text = p.read_text()
    lines = text.splitlines(keepends=True)
    if damage == "missing-column":
        import pandas as pd
        pd.read_csv(p).drop(columns=["se"]).to_csv(p, index=False)
        needle = "missing columns se"
    elif damage == "header-only":
        p.write_text(lines[0])
        needle = "no rows"
    elif damage == "empty":
        p.write_text("")
        needle = "empty"
    elif damage == "binary":
        p.write_bytes(b"\xff\xfe\x00garbage" * 10)
        needle = "corrupted"
    elif damage == "empty-case":
        lines[2] = "," + lines[2].split(",", 1)[1]
        p.write_text("".join(lines))
        needle = "'case' is empty"
    elif damage == "no-newline":
        p.write_text(text.rstrip("\n"))
        needle = "truncated"
    else:
        header = lines[0].split(",")
        cells = lines[1].split(",")
        cells[header.index("draws")] = "-5"
        lines[1] = ",".join(cells)
        p.write_text("".join(lines))
        needle = "'draws'"
    _unhash(folder)
    _one_line_error(_report(folder, tmp_path), str(p), needle)


def test_a_corrupt_reservoir_is_one_line_exit_2(made, folder, tmp_path):
    (folder / "reservoir.npz").write_bytes(b"PK\x03\x04 not a zip")
    _unhash(folder)
    _one_line_error(_report(folder, tmp_path), "reservoir.npz")


def test_a_recorded_file_that_is_missing_and_an_unrecorded_one(made, folder, tmp_path):
    (folder / "batches.csv").unlink()
    _one_line_error(_report(folder, tmp_path), "batches.csv is missing but run.json records it")
    shutil.copy(made["good"] / "batches.csv", folder / "batches.csv")
    shutil.copy(made["good"] / "summary.csv", folder / "lambda_sweep.csv")
    _one_line_error(_report(folder, tmp_path), "not recorded in run.json", "lambda_sweep.csv")


# ----------------------------------------------------------------------------- damaged run.json
@pytest.mark.parametrize("content, needle", [
    (b"[]", "JSON object, not a list"), (b"null", "JSON object, not null"), (b"3", "JSON object, not a number"),
    (bytes(np.random.default_rng(5).integers(0, 256, 300, dtype=np.uint8)), "run.json"),
    (b'{"files": [1, 2]}', "'files' must be an object"),
    (b'{"files": {"summary.csv": "00"}}', "no valid sha256"),
    (b'{"cases": "g"}', "'cases' must be an object"),
    (b'{"kl_bench_run": 1', "not valid JSON")])
def test_a_damaged_run_json_is_one_line_exit_2(made, folder, tmp_path, content, needle):
    (folder / "run.json").write_bytes(content)
    for res in (_report(folder, tmp_path), _check(made, folder)):
        _one_line_error(res, str(folder), needle)


def test_cases_of_summary_and_run_json_must_agree(made, folder, tmp_path):
    env = json.loads((folder / "run.json").read_text())
    env["cases"]["ghost"] = {"kind": "gaussian"}
    (folder / "run.json").write_text(json.dumps(env))
    _one_line_error(_report(folder, tmp_path), "disagree on the cases", "ghost")


def test_api_check_of_a_damaged_folder_raises_spec_error(folder):
    _truncate(folder / "summary.csv")
    with pytest.raises(SpecError, match="sha256 mismatch"):
        kl_bench.check(folder)


# ----------------------------------------------------------------------------- another experiment's folder
def test_check_results_match_spec(made, tmp_path):
    good = load_results(made["good"])
    check_results_match_spec(good, kl_bench.load(made["spec"]))
    check_results_match_spec(made["good"], kl_bench.load(made["spec"]))   # a folder's path works too
    with pytest.raises(SpecError, match="experiment 'corrupt', not of 'other'") as e:
        check_results_match_spec(good, kl_bench.load(made["other"]))
    assert len(str(e.value).splitlines()) == 1 and str(made["good"]) in str(e.value)
    # same experiment name, different cases
    renamed = tmp_path / "corrupt.toml"
    renamed.write_text(SPEC.format(name="corrupt", case="h"))
    with pytest.raises(SpecError, match="lacks the spec's case 'h' and holds case 'g' that the spec lacks"):
        check_results_match_spec(good, kl_bench.load(renamed))
    fewer = tmp_path / "fewer.toml"
    fewer.write_text(SPEC.format(name="corrupt", case="g").split("[[case]]\nname = \"cat\"")[0])
    with pytest.raises(SpecError, match="holds case 'cat' that the spec lacks"):
        check_results_match_spec(good, kl_bench.load(fewer))


def test_cli_check_refuses_another_experiments_folder(made):
    _one_line_error(_check(made, made["good"], spec=made["other"]), str(made["good"]), "experiment 'corrupt'")


# ----------------------------------------------------------------------------- baselines
def _baseline(made) -> dict:
    return json.loads(made["base"].read_text())


@pytest.mark.parametrize("damage, needle", [
    ("null-row", "baseline row 2 is null"), ("list-row", "baseline row 2 is not an object"),
    ("string-row", "baseline row 2 is not an object"), ("null-rows", "has no rows"),
    ("rows-dict", "has no rows"), ("text-mean", "baseline row 2 (g: k3): mean is not a number: 'abc'"),
    ("dict-se", "se is not a number"), ("bool-std", "std is not a number"), ("null-draws", "draws is null"),
    ("null-case", "case must be a non-empty string"), ("int-aggregate", "aggregate must be a string or null"),
    ("missing-key", "baseline row 2 lacks mean"), ("fractional-draws", "draws must be a whole number"),
    ("negative-se", "must be ≥ 0"), ("duplicate", "baseline row 2 (g: k1) repeats row 1"),
    ("top-level-list", "not a kl-bench baseline"), ("bool-version", "not a kl-bench baseline")])
def test_a_damaged_baseline_is_one_line_naming_file_and_row(made, tmp_path, damage, needle):
    data = _baseline(made)
    rows = data["rows"]
    edits = {
        "null-row": lambda: rows.__setitem__(1, None), "list-row": lambda: rows.__setitem__(1, [1, 2]),
        "string-row": lambda: rows.__setitem__(1, "row"), "null-rows": lambda: data.__setitem__("rows", None),
        "rows-dict": lambda: data.__setitem__("rows", {"a": 1}),
        "text-mean": lambda: rows[1].__setitem__("mean", "abc"), "dict-se": lambda: rows[1].__setitem__("se", {}),
        "bool-std": lambda: rows[1].__setitem__("std", True), "null-draws": lambda: rows[1].__setitem__("draws", None),
        "null-case": lambda: rows[1].__setitem__("case", None),
        "int-aggregate": lambda: rows[1].__setitem__("aggregate", 3), "missing-key": lambda: rows[1].pop("mean"),
        "fractional-draws": lambda: rows[1].__setitem__("draws", 10.5),
        "negative-se": lambda: rows[1].__setitem__("se", -1.0), "duplicate": lambda: rows.__setitem__(1, dict(rows[0])),
        "top-level-list": lambda: None, "bool-version": lambda: data.__setitem__("kl_bench_baseline", True)}
    edits[damage]()
    path = tmp_path / "base.json"
    path.write_text(json.dumps(rows if damage == "top-level-list" else data))
    with pytest.raises(SpecError, match=None) as e:
        load_baseline(path)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and str(path) in msg and needle in msg, msg
    res = runner.invoke(app, ["check", str(made["spec"]), "--results", str(made["good"]), "--baseline", str(path)])
    _one_line_error(res, str(path), needle)


def test_a_baseline_of_random_bytes_or_nulls(made, tmp_path):
    path = tmp_path / "base.json"
    for content in (bytes(np.random.default_rng(1).integers(0, 256, 200, dtype=np.uint8)), b"null", b"[]",
                    b'{"kl_bench_baseline": 1, "rows": [null, null]}'):
        path.write_bytes(content)
        res = runner.invoke(app, ["check", str(made["spec"]), "--results", str(made["good"]), "--baseline", str(path)])
        _one_line_error(res, str(path))


def test_a_sound_baseline_still_normalises(made):
    data = normalize_baseline(_baseline(made), "b")
    assert all(isinstance(r["mean"], float) for r in data["rows"])
    data = _baseline(made)                 # a row whose estimates are infinite: mean and std inf, se null
    data["rows"][0]["mean"] = data["rows"][0]["std"] = "inf"
    data["rows"][0]["se"] = None
    r = normalize_baseline(data, "b")["rows"][0]
    assert r["std"] == float("inf") and r["se"] != r["se"]
    data["rows"][0]["mean"] = 0.1          # a finite mean needs its se: a null one is a damaged baseline
    with pytest.raises(SpecError, match="se and std must be numbers"):
        normalize_baseline(data, "b")


# ----------------------------------------------------------------------------- files that are not files
@pytest.mark.parametrize("name", ["run.json", "summary.csv", "batches.csv", "reservoir.npz"])
@pytest.mark.parametrize("thing, needle", [("fifo", "is a FIFO (named pipe), not a regular"),
                                           ("device", "is a character device, not a regular"),
                                           ("folder", "is a folder, not a regular"),
                                           ("dangling", "(a dangling symbolic link)")])
def test_a_results_file_that_is_not_a_file_is_said_as_such(made, folder, tmp_path, name, thing, needle):
    """run.json or summary.csv as a FIFO, a device or a dangling link was "missing"; nothing is opened."""
    import os
    (folder / name).unlink()
    {"fifo": lambda p: os.mkfifo(p), "device": lambda p: p.symlink_to("/dev/zero"), "folder": lambda p: p.mkdir(),
     "dangling": lambda p: p.symlink_to(tmp_path / "nowhere")}[thing](folder / name)
    for res in (_report(folder, tmp_path), _check(made, folder)):
        _one_line_error(res, str(folder / name), needle)


@pytest.mark.parametrize("thing, needle", [("fifo", "it is a FIFO (named pipe)"), ("file", "it is a regular file"),
                                           ("dangling", "it is a dangling symbolic link"),
                                           ("missing", "it does not exist")])
def test_a_results_folder_that_is_not_a_folder_is_said_as_such(made, tmp_path, thing, needle):
    import os
    path = tmp_path / "r"
    {"fifo": lambda: os.mkfifo(path), "file": lambda: path.write_text("x"),
     "dangling": lambda: path.symlink_to(tmp_path / "nowhere"), "missing": lambda: None}[thing]()
    before = sorted(os.listdir(tmp_path))
    for res in (runner.invoke(app, ["report", str(path)]), _check(made, path)):
        _one_line_error(res, str(path), f"not a results folder ({needle}")
    assert sorted(os.listdir(tmp_path)) == before          # the default --out (r/report) was not made


# ----------------------------------------------------------------------------- numbers out of their range
def _set_cells(p: Path, column: str, value: str, rows=(1,)) -> None:
    lines = p.read_text().splitlines(keepends=True)
    header = lines[0].rstrip("\n").split(",")
    for i in rows:
        cells = lines[i].rstrip("\n").split(",")
        cells[header.index(column)] = value
        lines[i] = ",".join(cells) + "\n"
    p.write_text("".join(lines))


@pytest.mark.parametrize("column, value", [("true_kl", "-1"), ("true_kl", "-inf"), ("frac_negative", "1.5"),
                                           ("exact_std", "-0.5"), ("n_for_10pct", "-3")])
def test_a_number_out_of_its_range_is_one_line_exit_2(made, folder, tmp_path, column, value):
    """A KL below 0 (the report drew an error bar of negative length from it), a fraction above 1, a
    negative exact std or batch size, with run.json's hashes agreeing: one line naming the file, the
    column and the row, from the report and from the gate."""
    _set_cells(folder / "summary.csv", column, value, rows=(2,))
    _rehash(folder)
    for res in (_report(folder, tmp_path), _check(made, folder)):
        _one_line_error(res, str(folder / "summary.csv"), f"'{column}'", "row 2")


def test_a_kl_of_zero_or_within_rounding_of_it_is_accepted(made, folder, tmp_path):
    """true_kl = 0 on a case's rows (p = q) is a KL, and so is float64's rounding just below 0: the report
    shows that case's values absolute (tests/test_report.py) rather than divide by 0."""
    rows = [i for i, line in enumerate((folder / "summary.csv").read_text().splitlines()) if line.startswith("g,")]
    _set_cells(folder / "summary.csv", "true_kl", "0.0", rows=rows)
    _set_cells(folder / "summary.csv", "true_kl", "-1e-17", rows=rows[:1])
    _rehash(folder)
    res = _report(folder, tmp_path)
    assert res.exit_code == 0 and res.stderr == "", res.output


def _audit_folder(root: Path) -> Path:
    from tests.test_audit import _gen, _steps
    from kl_bench.audit import AuditLog, Sampler, audit_step
    log = AuditLog()
    for s, (pv, values, mask) in enumerate(_steps(_gen(3), Sampler(top_k=5), 2)):
        log.add(audit_step(pv, values, mask, estimator="trl.grpo", step=s, source="loss"))
    log.write(root / "audit", trainer="test")
    return root / "audit"


@pytest.mark.parametrize("value", ["", "nan", "inf", "1.5", "-1"])
def test_an_audit_step_that_is_not_a_whole_number_is_one_line_exit_2(tmp_path, value):
    """audit.csv's step on the report's axis: a blank, NaN, infinite, fractional or negative step (hashes
    agreeing) is one line naming the file, the column and the line, never int(nan)'s traceback."""
    folder = _audit_folder(tmp_path)
    _set_cells(folder / "audit.csv", "step", value)
    _rehash(folder)
    res = runner.invoke(app, ["report", str(folder), "--out", str(tmp_path / "rep")])
    _one_line_error(res, str(folder / "audit.csv"), "'step'", "line 2")
    assert not (tmp_path / "rep").exists()
    # `kl-bench audit DIR` reads the folder back (its verdicts): the same line, the column named
    _one_line_error(runner.invoke(app, ["audit", str(folder)]), str(folder / "audit.csv"), "'step'", "line 2")
