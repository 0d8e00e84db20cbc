"""Every stored folder goes through kl_bench.results.folders (issue 34 item 2): run, train and audit folders
are described once, written with a strict run.json, verified on read (their sha256 too), and
``kl-bench report`` dispatches on the kind run.json records."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kl_bench.cli import app
from kl_bench.foundation.errors import SpecError
from kl_bench.results import folders

runner = CliRunner()
TRAIN = {"spec_version": 1, "experiment": {"name": "t", "draws": 200, "seed": 3, "device": "cpu"},
         "train": {"optimizer": "sgd", "lr": 0.5, "steps": 3, "beta": 0.5, "reward": {"random": 1.0},
                   "combinations": ["k1/reward", "k3/loss"]},
         "case": [{"name": "cat", "kind": "categorical", "vocab": 12,
                   "q": {"logits": "zipf", "exponent": 1.1, "seed": 1}, "p": {"from": "q", "noise": 0.5, "seed": 2}}]}
RUN = {"spec_version": 1, "experiment": {"name": "r", "draws": 2000, "batches": 4, "device": "cpu",
                                         "estimators": ["k1", "k3"]},
       "case": [{"name": "g", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0}, "p": {"mean": 0.3, "std": 1.0}}]}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A run folder, a training folder and an audit folder, each written by its own writer."""
    import kl_bench.api as api
    from kl_bench.audit import AuditLog, StepAudit
    from kl_bench.results.schema import AUDIT_COLUMNS
    root = tmp_path_factory.mktemp("folders")
    api.run(RUN).write(root / "run")
    api.train(TRAIN).write(root / "train")
    log = AuditLog()
    for step in range(3):
        values = {c: 0.0 for c in AUDIT_COLUMNS}
        values.update(step=step, source="loss", estimator="k3", aggregation="token-mean", sequences=2, tokens=8,
                      logged=0.1 + step, exact=0.1, se=0.05)
        log.add(StepAudit(**values))
    log.write(root / "audit", trainer="test")
    return root


def _copy(made, kind, tmp_path) -> Path:
    import shutil
    shutil.copytree(made / kind, tmp_path / kind)
    return tmp_path / kind


@pytest.mark.parametrize("kind, table", [("run", "summary.csv"), ("train", "train.csv"), ("audit", "audit.csv")])
def test_each_writer_records_its_kind_version_and_hashes(made, kind, table):
    fmt = folders.FORMATS[kind]
    env = json.loads((made / kind / "run.json").read_text())
    assert env[fmt.version_key] == fmt.version and next(iter(env)) == fmt.version_key
    assert folders.kind_of(made / kind) == kind
    stored = folders.read(made / kind, kind)
    assert set(stored.files) == set(env["files"]) and table in stored.files


@pytest.mark.parametrize("kind", ["run", "train", "audit"])
def test_every_envelope_field_is_described_in_the_schema(made, kind):
    """run.json's fields, as each writer writes them, are exactly the ones kl_bench.results.schema describes
    (audit: the TRL callback's settings are described too; a folder gets those it was given)."""
    env = json.loads((made / kind / "run.json").read_text())
    described = folders.FORMATS[kind].envelope
    assert set(env) <= set(described), sorted(set(env) - set(described))
    if kind != "audit":                   # all but "dropped", which only a slimmed copy has (folders.drop)
        assert set(described) - set(env) == {"dropped"}, sorted(set(described) - set(env))


def test_the_trl_callbacks_settings_are_described():
    """The settings KLAudit writes into its folder's run.json (read from its source: TRL need not be here)."""
    import ast
    src = (Path(folders.__file__).parents[1] / "integrations" / "trl.py").read_text()
    calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "write"
             and "log" in ast.unparse(n.func)]
    assert calls and all({k.arg for k in c.keywords} <= set(folders.FORMATS["audit"].envelope) for c in calls)


@pytest.mark.parametrize("kind, table", [("run", "summary.csv"), ("train", "train.csv"), ("audit", "audit.csv")])
def test_a_changed_byte_is_one_line_in_the_report(made, tmp_path, kind, table):
    """Training and audit folders are verified on read as run folders always were (their sha256 was written
    but never checked)."""
    folder = _copy(made, kind, tmp_path)
    data = bytearray((folder / table).read_bytes())
    data[len(data) // 2] ^= 0x01
    (folder / table).write_bytes(bytes(data))
    res = runner.invoke(app, ["report", str(folder), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 2, res.output
    assert "sha256 mismatch" in res.output and str(folder / table) in res.output and "Traceback" not in res.output
    assert not (tmp_path / "rep").exists()


@pytest.mark.parametrize("kind", ["train", "audit"])
def test_report_dispatches_on_the_envelope_not_on_file_names(made, tmp_path, kind):
    """A train or audit folder that also holds a stray summary.csv is still reported as what run.json says
    (the file is refused as unrecorded: never silently taken for a run)."""
    folder = _copy(made, kind, tmp_path)
    (folder / "summary.csv").write_bytes((made / "run" / "summary.csv").read_bytes())
    res = runner.invoke(app, ["report", str(folder), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "rep" / "report.html").exists()
    title = {"train": "Training trajectories", "audit": "Trainer audit"}[kind]
    assert title in (tmp_path / "rep" / "report.md").read_text()


def test_a_train_or_audit_folder_with_others_is_one_line(made, tmp_path):
    res = runner.invoke(app, ["report", str(made / "run"), str(made / "train"), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 2 and "a train folder has a report of its own" in res.output, res.output


@pytest.mark.parametrize("kind", ["train", "audit"])
def test_a_newer_format_or_an_unrecorded_file_is_one_line(made, tmp_path, kind):
    folder = _copy(made, kind, tmp_path)
    fmt = folders.FORMATS[kind]
    env = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps({**env, fmt.version_key: fmt.version + 1}))
    with pytest.raises(SpecError, match=f"{kind} folder format {fmt.version + 1}.*upgrade kl-bench"):
        folders.read(folder)
    (folder / "run.json").write_text(json.dumps(env))
    if kind == "audit":                    # engine.csv: a data file of the kind, present but not recorded
        (folder / "engine.csv").write_text("step\n1\n")
        with pytest.raises(SpecError, match="engine.csv is not recorded in run.json"):
            folders.read(folder)


def test_a_folder_of_the_wrong_kind_is_named_as_what_it_is(made):
    with pytest.raises(SpecError, match=r"a train folder \(written by kl-bench train\), not an audit folder"):
        folders.read(made / "train", "audit")
    with pytest.raises(SpecError, match="run.json is missing"):
        folders.kind_of(made)
    with pytest.raises(SpecError, match="not a train folder, written by kl-bench train: run.json is missing"):
        folders.read(made, "train")


def test_run_json_is_strict_json():
    """No default=str: a value JSON cannot hold is the writer's bug, named by its key, not a string made of
    it; numpy scalars are their Python values; NaN and inf, which JSON has not, are null."""
    data = folders.envelope_bytes({"a": {"b": [1, np.float64(0.5), np.int64(3), math.nan, -math.inf]}})
    assert json.loads(data, parse_constant=lambda c: pytest.fail(f"{c} in run.json"))["a"]["b"] == [1, 0.5, 3, None, None]
    with pytest.raises(TypeError, match=r"run.json: a.path holds a pathlib.*PosixPath"):
        folders.envelope_bytes({"a": {"path": Path("/x")}})
    with pytest.raises(TypeError, match="not a string"):
        folders.envelope_bytes({"a": {1: 2}})
    with pytest.raises(ValueError, match="a train folder stores train.csv"):
        folders.stored_files("train", {"summary.csv": b"x\n"}, {})


def test_an_older_audit_csv_reads_with_its_defaults(made, tmp_path):
    """audit.csv written before bias_mismatch, sampling_pass and expected_g existed: read with their
    defaults (0, 0 and expected_b's values), through the same verified path."""
    import csv
    import io

    from kl_bench.audit.step import read_audit_folder
    folder = _copy(made, "audit", tmp_path)
    rows = list(csv.DictReader(io.StringIO((folder / "audit.csv").read_text())))
    old = [c for c in rows[0] if c not in ("bias_mismatch", "sampling_pass", "expected_g")]
    buf = io.StringIO()
    w = csv.DictWriter(buf, old, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    (folder / "audit.csv").write_text(buf.getvalue())
    env = json.loads((folder / "run.json").read_text())
    env["files"]["audit.csv"] = __import__("hashlib").sha256((folder / "audit.csv").read_bytes()).hexdigest()
    (folder / "run.json").write_text(json.dumps(env))
    _, steps = read_audit_folder(folder)
    assert [s.sampling_pass for s in steps] == [0, 0, 0] and all(s.expected_g == s.expected_b for s in steps)


def test_a_copy_may_leave_out_the_reservoir_and_says_so(made, tmp_path):
    """folders.drop: the committed results/ keep no per-draw reservoir. The folder still verifies and reports
    (without the ECDF figures); run.json keeps the dropped file's sha256, so a file put back is checked."""
    import kl_bench
    folder = _copy(made, "run", tmp_path)
    reservoir = (folder / "reservoir.npz").read_bytes()
    folders.drop(folder, ["reservoir.npz"])
    env = json.loads((folder / "run.json").read_text())
    assert "reservoir.npz" not in env["files"] and env["dropped"]["reservoir.npz"] and not (folder / "reservoir.npz").exists()
    res = kl_bench.load_results(folder)
    assert len(res.summary) == 2
    figures = {p.name for p in (res.report(tmp_path / "rep") / "figures").glob("*.png")}
    assert figures and not [f for f in figures if f.startswith("distribution")]
    (folder / "reservoir.npz").write_bytes(reservoir)                  # put back: verified, read
    assert kl_bench.load_results(folder).summary.equals(res.summary)
    (folder / "reservoir.npz").write_bytes(reservoir[:-1] + bytes([reservoir[-1] ^ 1]))
    with pytest.raises(SpecError, match="sha256 mismatch"):
        kl_bench.load_results(folder)
    (folder / "reservoir.npz").write_bytes(reservoir)
    with pytest.raises(SpecError, match="summary.csv: a run folder may leave out only reservoir.npz, gradients.npz"):
        folders.drop(folder, ["summary.csv"])
    with pytest.raises(SpecError, match="a train folder may leave out no file"):
        folders.drop(_copy(made, "train", tmp_path), ["train.csv"])


def test_every_stored_file_has_a_size_cap():
    """Each data file of each kind is read up to a cap of its own (kl_bench.foundation.safe_io.CAPS), not the
    half of memory an unnamed file gets."""
    from kl_bench.foundation.safe_io import CAPS
    assert not [n for n in (*folders.DATA_FILES, folders.ENVELOPE) if n not in CAPS]


def test_a_write_leaves_no_data_file_of_an_earlier_one(made, tmp_path):
    """A run without λ written where a run with λ was (or a training where a run was): the earlier data
    files are not carried over (they would be unrecorded, and the folder unreadable); a report stays."""
    import shutil

    import kl_bench.api as api
    folder = _copy(made, "run", tmp_path)
    (folder / "lambda_sweep.csv").write_text("case\nx\n")        # as an earlier run with lambdas left it
    (folder / "notes.txt").write_text("mine")
    api.run({**RUN, "experiment": {**RUN["experiment"], "draws": 1000}}).write(folder)
    assert not (folder / "lambda_sweep.csv").exists() and (folder / "notes.txt").read_text() == "mine"
    assert folders.read(folder, "run").files
    shutil.rmtree(folder / "report", ignore_errors=True)
    api.train(TRAIN).write(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "run.json", "train.csv"]
    assert folders.kind_of(folder) == "train"


@pytest.mark.parametrize("key, value, words", [
    ("cases", None, "'cases' must be an object of objects, not null"),
    ("cases", {"g": "x"}, "'cases' must be an object of objects, not an object holding a string"),
    ("draws_per_case", {"g": "x"}, "'draws_per_case' must be an object of whole numbers"),
    ("restored_draws", "x", "'restored_draws' must be a whole number, not a string"),
    ("draws_per_second", [1], "'draws_per_second' must be a number, not a list"),
    ("files", None, "'files' must be an object, not null")])
def test_a_field_of_the_wrong_type_is_one_line(made, tmp_path, key, value, words):
    folder = _copy(made, "run", tmp_path)
    env = json.loads((folder / "run.json").read_text())
    (folder / "run.json").write_text(json.dumps({**env, key: value}))
    res = runner.invoke(app, ["report", str(folder), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 2 and words in res.output and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("kind", ["run", "train"])
def test_removing_the_hashes_does_not_switch_their_check_off(made, tmp_path, kind):
    """Every versioned writer records 'files'; only a folder from before versions (no version key) may lack it."""
    folder = _copy(made, kind, tmp_path)
    env = json.loads((folder / "run.json").read_text())
    del env["files"]
    (folder / "run.json").write_text(json.dumps(env))
    with pytest.raises(SpecError, match="records no 'files'"):
        folders.read(folder, kind)


@pytest.mark.parametrize("kind, table, column, value, words", [
    ("train", "train.csv", "step", "abc", "column 'step' must hold numbers, but row 2 (line 3) has 'abc'"),
    ("audit", "audit.csv", "logged", "abc", "column 'logged' must hold numbers, but row 2 (line 3) has 'abc'"),
    ("train", "train.csv", None, None, "has a header but no rows"),
    ("audit", "audit.csv", None, None, "has a header but no rows")])
def test_train_and_audit_tables_are_checked_cell_by_cell(made, tmp_path, kind, table, column, value, words):
    import csv
    import hashlib
    import io
    folder = _copy(made, kind, tmp_path)
    rows = list(csv.reader(io.StringIO((folder / table).read_text())))
    if column is None:
        rows = rows[:1]
    else:
        rows[2][rows[0].index(column)] = value
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    (folder / table).write_text(buf.getvalue())
    env = json.loads((folder / "run.json").read_text())
    env["files"][table] = hashlib.sha256((folder / table).read_bytes()).hexdigest()     # not damage: rewritten
    (folder / "run.json").write_text(json.dumps(env))
    res = runner.invoke(app, ["report", str(folder), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 2 and words in res.output and str(folder / table) in res.output, res.output


@pytest.mark.parametrize("command", ["check", "audit"])
def test_a_folder_of_another_kind_is_named_by_every_command(made, tmp_path, command):
    spec = tmp_path / "s.toml"
    spec.write_text('spec_version = 1\n[experiment]\nname = "r"\ndraws = 1000\n[[case]]\nname = "g"\nkind = "gaussian"\n'
                    'q = { mean = 0.0, std = 1.0 }\np = { mean = 0.3, std = 1.0 }\n')
    args = {"check": ["check", str(spec), "--results", str(made / "train")], "audit": ["audit", str(made / "train")]}
    res = runner.invoke(app, args[command])
    want = "not a run folder" if command == "check" else "not an audit folder"
    assert res.exit_code == 2 and "a train folder (written by kl-bench train)" in res.output and want in res.output, \
        res.output
