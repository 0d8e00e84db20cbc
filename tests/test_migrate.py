"""Older results folders still load: kl_bench.results.migrate brings each format version to today's, after
the files were verified; a newer format is one line."""
import hashlib
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

import kl_bench
from kl_bench.foundation.errors import SpecError
from kl_bench.results import COLUMNS, read_frame
from kl_bench.results.migrate import MIGRATIONS
from kl_bench.results.schema import FORMAT_VERSION
from kl_bench.results.verify import read_results_folder

ROOT = Path(__file__).resolve().parents[1]


def _rewrite(folder: Path, name: str, data: bytes, **envelope) -> None:
    """Replace a data file and record its hash in run.json (an older writer's folder, not damage)."""
    (folder / name).write_bytes(data)
    env = json.loads((folder / "run.json").read_text())
    env["files"][name] = hashlib.sha256(data).hexdigest()
    env.update(envelope)
    (folder / "run.json").write_text(json.dumps(env))


def test_every_version_has_its_migration():
    assert sorted(MIGRATIONS) == list(range(1, FORMAT_VERSION))


def test_a_folder_written_before_the_format_was_versioned_loads_with_the_same_numbers(tmp_path):
    """tests/data/schulman-v1: results/schulman as the code before this format wrote it (kl_bench_run = 1;
    its reservoir left out of this copy, run.json recording it under "dropped")."""
    folder = tmp_path / "old"
    shutil.copytree(ROOT / "tests" / "data" / "schulman-v1", folder)
    assert json.loads((folder / "run.json").read_text())["kl_bench_run"] == 1
    got = read_results_folder(folder)
    assert got.envelope["kl_bench_run"] == FORMAT_VERSION and got.envelope["migrated_from"] == 1
    raw = read_frame(folder / "summary.csv")
    pd.testing.assert_frame_equal(got.summary[list(raw.columns)], raw)
    assert kl_bench.load_results(folder).summary[list(raw.columns)].shape == raw.shape


def test_columns_an_older_version_lacked_are_filled_in(tmp_path):
    folder = tmp_path / "older"
    shutil.copytree(ROOT / "results" / "schulman", folder)
    raw = read_frame(folder / "summary.csv")
    dropped = ["heavy_tail", "n_for_10pct", "z_var"]
    _rewrite(folder, "summary.csv", raw.drop(columns=dropped).to_csv(index=False).encode())
    got = read_results_folder(folder).summary
    assert list(got.columns[:len(COLUMNS)]) == COLUMNS
    assert (got["heavy_tail"] == "").all() and got["n_for_10pct"].isna().all()
    pd.testing.assert_series_equal(got["mean"], raw["mean"])


def test_a_folder_written_today_needs_no_migration(tmp_path, build_spec, write_spec):
    res = kl_bench.run(write_spec(build_spec(draws=2000, batches=4)))
    res.write(tmp_path / "new")
    env = json.loads((tmp_path / "new" / "run.json").read_text())
    assert env["kl_bench_run"] == FORMAT_VERSION
    got = read_results_folder(tmp_path / "new")
    assert "migrated_from" not in got.envelope and list(got.summary.columns[:len(COLUMNS)]) == COLUMNS


@pytest.mark.parametrize("version, needle", [(FORMAT_VERSION + 1, "newer kl-bench"), ("2", "not a results format"),
                                             (0, "not a results format"), (True, "not a results format")])
def test_a_newer_or_unknown_format_is_one_line(tmp_path, version, needle):
    folder = tmp_path / "f"
    shutil.copytree(ROOT / "results" / "schulman", folder)
    env = json.loads((folder / "run.json").read_text())
    env["kl_bench_run"] = version
    (folder / "run.json").write_text(json.dumps(env))
    with pytest.raises(SpecError, match=needle) as e:
        read_results_folder(folder)
    assert "\n" not in str(e.value)


def test_a_new_summary_column_is_one_schema_entry(tmp_path):
    """Adding a summary column is one entry in kl_bench.results.schema.SCHEMA (its value computed in
    kl_bench.experiment.rows): a folder of today's version written before the column existed reads with it
    empty, in the schema's order, and reports (a fresh process, the schema extended before anything reads it)."""
    import subprocess
    import sys
    # The report's figures are built but not rendered (as tests/conftest.py's unrendered_figures): the column,
    # not the drawing, is what this test is about (tests/test_report.py renders every figure)
    code = ("import kl_bench.results.schema as s\n"
            "s.SCHEMA['abs_z'] = '|z|'; s.COLUMNS.append('abs_z')\n"
            "import matplotlib.pyplot as plt; from kl_bench.present import report as rp\n"
            "rp.figure_bytes = lambda fig, formats=None: (plt.close(fig), {f: b'' for f in (formats or rp.FIGURE_FORMATS)})[1]\n"
            "import kl_bench\n"
            f"r = kl_bench.load_results({str(ROOT / 'results' / 'schulman')!r})\n"
            "print(list(r.summary.columns)[-1], bool(r.summary['abs_z'].isna().all()))\n"
            f"print(r.report({str(tmp_path / 'rep')!r}).name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["abs_z", "True", "rep"]
