"""A results folder from Python (issue 25, item 9): kl_bench.load_results, a notebook's view, and the
gate's verdict as JSON and JUnit XML for CI."""
import json
import xml.etree.ElementTree as ET

import pytest
import torch
from typer.testing import CliRunner

import kl_bench
from kl_bench.cli import app

runner = CliRunner()

SPEC = {"spec_version": 1,
        "experiment": {"name": "lr", "draws": 20_000, "batches": 20, "device": "cpu", "estimators": ["k1", "k3"]},
        "case": [{"name": "g", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0}, "p": {"mean": 0.5, "std": 1.0}}]}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    res = kl_bench.run(SPEC)
    return res, res.write(tmp_path_factory.mktemp("r") / "lr")


def test_load_results_gives_back_the_tables_and_the_advice_of_the_run(written):
    res, folder = written
    back = kl_bench.load_results(folder)
    assert back.summary.equals(res.summary)
    assert back.envelope["spec_sha256"] == res.envelope["spec_sha256"]
    assert back.descriptions() == res.descriptions()
    assert [a.text for a in back.recommendations()] == [a.text for a in res.recommendations()]
    assert back.draws == res.draws == 20_000
    assert "path=" in repr(back) and "experiment='lr'" in repr(back)


def test_result_advice_is_what_the_command_line_prints(tmp_path):
    """Result.advice() merges the sentences that hold for several cases alike, once, naming them, as `kl-bench
    run` prints them (one line each in a pipe), and so does .recommendations() (issue 44; per_case=True: one
    Advice per case and kind)."""
    spec = {**SPEC, "case": [SPEC["case"][0], {**SPEC["case"][0], "name": "h", "p": {"mean": 0.3, "std": 1.0}}]}
    (tmp_path / "s.toml").write_text(_toml(spec))
    res = kl_bench.run(spec)
    lines = res.advice()
    general = [a for a in res.recommendations(per_case=True) if a.general]
    assert len(general) == 2 and general[0].detail == general[1].detail
    assert f"g, h: {general[0].detail}" in lines and sum(general[0].detail in line for line in lines) == 1
    assert all(a.text in lines for a in res.recommendations(per_case=True) if not a.general)
    assert [str(a) for a in res.recommendations()] == lines
    assert [a.cases for a in res.recommendations() if a.general] == [("g", "h")]
    out = runner.invoke(app, ["run", str(tmp_path / "s.toml"), "--out", str(tmp_path / "o"), "--wide"],
                        env={"COLUMNS": "100000"}).output
    assert all(line in out.splitlines() for line in lines), (lines, out)


def _toml(spec: dict) -> str:
    """The spec as TOML (the few value types SPEC uses)."""
    def value(v):
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return f'"{v}"' if isinstance(v, str) else repr(v)
    out = [f"spec_version = {spec['spec_version']}", "[experiment]"]
    out += [f"{k} = {value(v)}" for k, v in spec["experiment"].items()]
    for case in spec["case"]:
        out += ["[[case]]"] + [f"{k} = {value(v)}" for k, v in case.items()]
    return "\n".join(out) + "\n"


def test_a_loaded_result_writes_the_same_data_files(written, tmp_path):
    _, folder = written
    copy = kl_bench.load_results(folder).write(tmp_path / "copy")
    for name in ("summary.csv", "batches.csv"):
        assert (copy / name).read_bytes() == (folder / name).read_bytes()


def test_load_results_of_a_bad_folder_is_a_spec_error(tmp_path):
    with pytest.raises(kl_bench.SpecError, match="not a results folder"):
        kl_bench.load_results(tmp_path / "nothing")


def test_the_notebook_view_shows_each_case_and_the_advice(written):
    res, _ = written
    html = res._repr_html_()
    assert html.count("<table") == 1 and "bias/true ± se" in html
    assert "g: to log, " in html and "KL(q||p) = 0.125" in html


def test_check_json_and_junit_agree_with_the_report(written, tmp_path):
    _, folder = written
    spec = tmp_path / "lr.toml"
    spec.write_text('spec_version = 1\n[experiment]\nname = "lr"\ndraws = 20_000\nbatches = 20\ndevice = "cpu"\n'
                    'estimators = ["k1", "k3"]\n[[case]]\nname = "g"\nkind = "gaussian"\n'
                    'q = { mean = 0.0, std = 1.0 }\np = { mean = 0.5, std = 1.0 }\n')
    res = runner.invoke(app, ["check", str(spec), "--results", str(folder), "--json", str(tmp_path / "c.json"),
                              "--junit", str(tmp_path / "c.xml"), "-q"])
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "c.json").read_text())
    rep = kl_bench.check(kl_bench.load_results(folder).summary)
    assert doc["passed"] is True and len(doc["comparisons"]) == len(rep.comparisons) > 0
    assert [c["z"] for c in doc["comparisons"]] == pytest.approx(list(rep.table["z"]))
    suite = ET.parse(tmp_path / "c.xml").getroot()
    assert suite.get("tests") == str(len(rep.comparisons)) and suite.get("failures") == "0"


def test_a_failing_comparison_is_a_junit_failure_with_its_sentence(written):
    res, _ = written
    bad = res.summary.copy()
    bad.loc[bad["estimator"] == "k1", "mean"] += 50 * bad.loc[bad["estimator"] == "k1", "se"]
    rep = kl_bench.check(bad)
    assert not rep.passed
    suite = ET.fromstring(rep.to_junit())
    failures = suite.findall("testcase/failure")
    assert suite.get("failures") == str(len(failures)) == str(len(rep.failures)) > "0"
    assert failures[0].get("message") == rep.failures[0].sentence()
    doc = json.loads(rep.to_json())
    assert doc["passed"] is False and any("failure" in c for c in doc["comparisons"])


def test_check_json_onto_a_directory_is_one_line_and_exit_2(written, tmp_path):
    _, folder = written
    res = runner.invoke(app, ["check", "experiments/schulman.toml", "--results", str(folder), "--json", str(tmp_path)])
    assert res.exit_code == 2 and res.output.startswith("error:") and len(res.output.strip().splitlines()) == 1


@pytest.mark.parametrize("kw", [
    dict(policy=torch.zeros(2, 3), reference=torch.zeros(3, 2)),
    dict(policy=torch.zeros(2, 3), reference=torch.zeros(2, 3), mask=torch.ones(5)),
    dict(policy=torch.zeros(2, 3), reference=torch.zeros(2, 3), mask=torch.ones(6), aggregation="token-mean"),
])
def test_shape_errors_in_estimate_are_value_errors_with_one_line(kw):
    """Issue 25 item 9: numerical code catches ValueError; the CLI's one line still holds."""
    with pytest.raises(ValueError) as e:
        kl_bench.estimate(**kw)
    assert isinstance(e.value, kl_bench.SpecError) and "\n" not in str(e.value) and "shape" in str(e.value)
