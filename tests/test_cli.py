"""The command line: run/exact/list, results files, determinism, and every kind of bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from kl_bench.cli import app
from kl_bench.core.estimators import DEFAULT_ESTIMATORS, ESTIMATORS
from kl_bench.kinds import CASE_KINDS
from kl_bench.results import COLUMNS


runner = CliRunner()

GOOD = """
spec_version = 1
[experiment]
name = "tiny"
draws = 20000
seed = 1
device = "cpu"
batches = 20

[[case]]
name = "g"
kind = "gaussian"
q = {mean = 0.0, std = 1.0}
p = {mean = 0.3, std = 1.2}

[[case]]
name = "c"
kind = "categorical"
vocab = 500
q = {logits = "zipf", exponent = 1.1, seed = 1}
p = {from = "q", noise = 0.3, seed = 2}
"""


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_run_writes_summary_and_envelope(write_spec, tmp_path):
    spec = write_spec(GOOD)
    out = tmp_path / "out"
    res = invoke("run", spec, "--out", out)
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "summary.csv")
    assert list(df.columns) == COLUMNS
    assert len(df) == 2 * len(DEFAULT_ESTIMATORS)
    assert (df["draws"] == 20000).all() and (df["z"].abs() < 5).all()
    env = json.loads((out / "run.json").read_text())
    for key in ("spec_text", "spec_sha256", "seed", "device", "versions", "git_commit", "wall_seconds",
                "draws_per_second", "files"):
        assert key in env
    assert env["spec_text"] == spec.read_text() and env["device"] == "cpu"
    assert "bias/true" in res.output and "k3" in res.output


def test_same_spec_seed_device_gives_identical_summary(write_spec, tmp_path):
    spec = write_spec(GOOD)
    for d in ("a", "b"):
        assert invoke("run", spec, "--out", tmp_path / d, "--quiet").exit_code == 0
    assert (tmp_path / "a" / "summary.csv").read_bytes() == (tmp_path / "b" / "summary.csv").read_bytes()
    assert invoke("run", spec, "--out", tmp_path / "c", "--quiet", "--seed", "2").exit_code == 0
    assert (tmp_path / "a" / "summary.csv").read_bytes() != (tmp_path / "c" / "summary.csv").read_bytes()


def test_flags_override_the_spec(write_spec, tmp_path):
    res = invoke("run", write_spec(GOOD), "--out", tmp_path / "o", "--draws", "3000", "--quiet")
    assert res.exit_code == 0
    assert (pd.read_csv(tmp_path / "o" / "summary.csv")["draws"] == 3000).all()


def test_default_output_folder_is_runs_name(write_spec, tmp_path, monkeypatch):
    """runs/<name>/, git-ignored: following the README never rewrites the committed results/ (issue 25)."""
    monkeypatch.chdir(tmp_path)
    assert invoke("run", write_spec(GOOD), "--quiet").exit_code == 0
    assert (tmp_path / "runs" / "tiny" / "summary.csv").exists() and not (tmp_path / "results").exists()


def test_exact_prints_and_writes_without_sampling(write_spec, tmp_path):
    res = invoke("exact", write_spec(GOOD), "--out", tmp_path / "exact.csv")
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "exact.csv")
    assert "mean" not in df.columns and df["exact_mean"].notna().all()
    assert "k3" in res.output


def test_list_names_every_estimator_and_kind():
    res = invoke("list")
    assert res.exit_code == 0
    lines = res.output.strip().splitlines()
    for name in ESTIMATORS.names():
        assert any(line.split()[:2] == ["estimator", name] for line in lines)
    for name in CASE_KINDS.names():
        assert any(line.split()[:2] == ["kind", name] for line in lines), name


def test_help_works():
    for cmd in ([], ["run"], ["exact"], ["list"]):
        res = invoke(*cmd, "--help")
        assert res.exit_code == 0 and "Usage" in res.output


def test_every_option_of_every_command_is_described():
    """dump-logits' --seed, --dtype, --batch-size and --device had no help text (the dtypes were only named by
    the error for a bad one): every option and argument of every command has some, read from click's own
    command objects; --dtype names every dtype the models can be loaded in."""
    import typer

    from kl_bench.cli import app
    from kl_bench.kinds.model.lm import DTYPES
    group = typer.main.get_command(app)
    bare = [f"{name} {p.opts[0]}" for name, cmd in group.commands.items() for p in cmd.params
            if not getattr(p, "hidden", False) and not (getattr(p, "help", None) or "").strip()]
    assert bare == [], bare
    dtype = next(p for p in group.commands["dump-logits"].params if p.name == "dtype")
    assert all(d in dtype.help for d in DTYPES), dtype.help


# ----------------------------------------------------------------------------- logits files
def _file_spec(name: str, vocab_line: str = "") -> str:
    return f"""
spec_version = 1
[experiment]
draws = 20000
device = "cpu"
batches = 20
[[case]]
name = "f"
kind = "categorical"
{vocab_line}
q = {{file = "{name}"}}
p = {{from = "q", noise = 0.2, seed = 1}}
"""


@pytest.mark.parametrize("fmt", ["npy-1d", "npy-2d", "pt-bf16", "pt-dict"])
def test_logits_files_from_a_model_just_work(fmt, tmp_path, write_spec):
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)) * 3
    if fmt == "npy-1d":
        np.save(tmp_path / "l.npy", logits[0].numpy())
        name = "l.npy"
    elif fmt == "npy-2d":
        np.save(tmp_path / "l.npy", logits.numpy())
        name = "l.npy"
    elif fmt == "pt-bf16":
        torch.save(logits.to(torch.bfloat16), tmp_path / "l.pt")
        name = "l.pt"
    else:
        torch.save({"logits": logits}, tmp_path / "l.pt")
        name = "l.pt"
    res = invoke("run", write_spec(_file_spec(name)), "--out", tmp_path / "o", "--quiet")
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "o" / "summary.csv")
    assert (df["z"].abs() < 5).all()


# ----------------------------------------------------------------------------- bad input
def _bad(tmp_path: Path, fmt=None) -> None:
    (tmp_path / "nan.npy").write_bytes(b"")
    np.save(tmp_path / "nan.npy", np.array([0.0, np.nan, 1.0]))
    np.save(tmp_path / "v10.npy", np.zeros(10))
    np.save(tmp_path / "v3d.npy", np.zeros((2, 2, 2, 5)))     # [B, T, V] is valid (trainer logits); 4-D is not
    (tmp_path / "garbage.npy").write_bytes(b"\x93NUMPY garbage that is not an array")
    (tmp_path / "l.txt").write_text("1 2 3")


def _sub(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


BAD = {
    # name: (spec text, substrings the one-line message must contain)
    "toml-syntax": (GOOD.replace("[experiment]", "[experiment"), ["TOML syntax error"]),
    "unknown-top-key": (GOOD.replace("spec_version = 1", "spec_version = 1\nexperimnt = 3"),
                        ["experimnt", "did you mean 'experiment'"]),
    "unknown-experiment-key": (_sub(GOOD, "seed = 1", "sed = 1"), ["experiment.sed", "did you mean 'seed'"]),
    "unknown-case-key": (_sub(GOOD, 'kind = "gaussian"', 'kind = "gaussian"\nqq = 1'),
                         ["case 'g'", "qq", "did you mean 'q'"]),
    "unknown-param-key": (_sub(GOOD, "{mean = 0.0, std = 1.0}", "{mean = 0.0, sdt = 1.0}"),
                          ["case 'g'", "q.sdt", "did you mean 'std'"]),
    "wrong-type": (_sub(GOOD, "draws = 20000", 'draws = "many"'), ["experiment.draws", "integer"]),
    "wrong-type-mean": (_sub(GOOD, "{mean = 0.0, std = 1.0}", '{mean = "zero", std = 1.0}'),
                        ["case 'g'", "q.mean", "number"]),
    "missing-draws": (_sub(GOOD, "draws = 20000\n", ""), ["experiment.draws", "missing"]),
    "missing-p": (_sub(GOOD, "p = {mean = 0.3, std = 1.2}\n", ""), ["case 'g'", "'p'", "missing"]),
    "missing-kind": (_sub(GOOD, 'kind = "gaussian"\n', ""), ["case 'g'", "kind", "missing"]),
    "std-zero": (_sub(GOOD, "std = 1.2", "std = 0.0"), ["case 'g'", "p.std", "> 0"]),
    "std-negative": (_sub(GOOD, "std = 1.2", "std = -1"), ["case 'g'", "p.std", "> 0"]),
    "shape-mismatch": (_sub(GOOD, "{mean = 0.0, std = 1.0}", "{mean = [0.0, 1.0], std = [1.0, 1.0, 1.0]}"),
                       ["case 'g'", "lengths"]),
    "draws-zero": (_sub(GOOD, "draws = 20000", "draws = 0"), ["experiment.draws", "> 0"]),
    "draws-negative": (_sub(GOOD, "draws = 20000", "draws = -5"), ["experiment.draws", "> 0"]),
    "unknown-estimator": (_sub(GOOD, "batches = 20", 'batches = 20\nestimators = ["k1", "k4"]'),
                          ["experiment.estimators", "'k4'", "did you mean"]),
    "unknown-kind": (_sub(GOOD, 'kind = "gaussian"', 'kind = "gausian"'), ["case 'g'", "did you mean 'gaussian'"]),
    "bad-device": (_sub(GOOD, 'device = "cpu"', 'device = "gpu"'), ["experiment.device"]),
    "bad-generator": (_sub(GOOD, 'logits = "zipf"', 'logits = "zipfian"'), ["case 'c'", "q.logits", "zipf"]),
    "derived-from-self": (_sub(GOOD, 'from = "q"', 'from = "p"'), ["case 'c'", "p.from"]),
    "vocab-zero": (_sub(GOOD, "vocab = 500", "vocab = 0"), ["case 'c'", "vocab", "> 0"]),
    "spec-version": (_sub(GOOD, "spec_version = 1", "spec_version = 2"), ["spec_version", "unsupported"]),
    "no-cases": (GOOD.split("[[case]]")[0], ["case", "at least one"]),
    "duplicate-case": (GOOD.replace('name = "c"', 'name = "g"'), ["duplicate case name"]),
    "file-missing": (_file_spec("nope.npy"), ["case 'f'", "q.file", "not found"]),
    "file-nan": (_file_spec("nan.npy"), ["case 'f'", "NaN"]),
    "file-vocab-mismatch": (_file_spec("v10.npy", "vocab = 12"), ["case 'f'", "vocab", "10", "12"]),
    "file-bad-shape": (_file_spec("v3d.npy"), ["case 'f'", "shape"]),
    "file-corrupt": (_file_spec("garbage.npy"), ["case 'f'", "cannot read"]),
    "file-wrong-suffix": (_file_spec("l.txt"), ["case 'f'", ".npy, .pt or .safetensors"]),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_clear_line_exit_2_and_nothing_written(name, tmp_path, write_spec):
    _bad(tmp_path)
    text, needles = BAD[name]
    spec = write_spec(text)
    out = tmp_path / "results"
    out.mkdir()
    (out / "summary.csv").write_text("an earlier run\n")
    res = invoke("run", spec, "--out", out, "--quiet")
    assert res.exit_code == 2, res.output
    msg = res.stderr.strip()
    assert len(msg.splitlines()) == 1, msg
    assert msg.startswith(f"error: {spec}"), msg
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert "Traceback" not in res.output
    assert sorted(p.name for p in out.iterdir()) == ["summary.csv"]
    assert (out / "summary.csv").read_text() == "an earlier run\n"


def test_missing_spec_file_and_bad_flags(tmp_path, write_spec):
    res = invoke("run", tmp_path / "none.toml")
    assert res.exit_code == 2 and "spec file not found" in res.stderr
    spec = write_spec(GOOD)
    res = invoke("run", spec, "--draws", "0")
    assert res.exit_code == 2 and "--draws" in res.stderr
    res = invoke("run", spec, "--device", "tpu")
    assert res.exit_code == 2 and "--device" in res.stderr


def test_bad_input_through_the_real_console_script(tmp_path, write_spec):
    """A real process: exit code 2, one line on stderr, no traceback."""
    spec = write_spec(_sub(GOOD, "std = 1.2", "std = -1"))
    proc = subprocess.run([sys.executable, "-m", "kl_bench", "run", str(spec), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr and "p.std" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_per_case_draws_and_the_flag_that_overrides_them(write_spec, tmp_path):
    spec = write_spec(GOOD.replace('name = "c"\nkind = "categorical"', 'name = "c"\nkind = "categorical"\ndraws = 3000'))
    assert invoke("run", spec, "--out", tmp_path / "a", "--quiet").exit_code == 0
    df = pd.read_csv(tmp_path / "a" / "summary.csv")
    assert set(df.loc[df.case == "g", "draws"]) == {20000} and set(df.loc[df.case == "c", "draws"]) == {3000}
    assert invoke("run", spec, "--out", tmp_path / "b", "--quiet", "--draws", "5000").exit_code == 0
    assert set(pd.read_csv(tmp_path / "b" / "summary.csv")["draws"]) == {5000}
    res = invoke("run", write_spec(GOOD.replace('name = "c"\nkind = "categorical"',
                                                'name = "c"\nkind = "categorical"\ndraws = 0')), "--quiet")
    assert res.exit_code == 2 and "case 'c'" in res.stderr and "draws" in res.stderr


# Every integer option of every command, with the arguments that reach its parsing.
_INT_OPTIONS = [("run", "--seed"), ("run", "--batch"), ("exact", "--batch"), ("check", "--seed"),
                ("baseline", "--seed"), ("train", "--seed"), ("report", "--batch"), ("audit", "--tile"),
                ("audit", "--chunk"), ("dump-logits", "--length"), ("dump-logits", "--samples"),
                ("dump-logits", "--seed"), ("dump-logits", "--eos"), ("dump-logits", "--batch-size")]
_FLOAT_OPTIONS = [("run", "--tolerance"), ("run", "--checkpoint-every"), ("exact", "--tolerance"),
                  ("report", "--tolerance"), ("check", "--alpha")]


def _usage_line(capsys, *args) -> tuple[int, str]:
    from kl_bench import cli
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(a) for a in args])
    return exit_.value.code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("command, option", _INT_OPTIONS + _FLOAT_OPTIONS)
def test_a_bad_number_option_is_one_line_naming_the_option_and_the_value(write_spec, capsys, command, option):
    """`--batch 1.5e0` said "Input should be a valid integer, unable to parse string as an integer": neither
    the option's value nor what a whole number may look like. Every integer and number option of every
    command: one line naming the option and echoing the value, exit 2."""
    spec = write_spec(GOOD)
    value = "1.5e0" if (command, option) in _INT_OPTIONS else "1.2.3"
    head = {"dump-logits": ["dump-logits", "--policy", "p", "--reference", "r", "--prompts", "x", "--out", "o"],
            "report": ["report", spec.parent], "audit": ["audit", spec.parent]}.get(command, [command, spec])
    code, err = _usage_line(capsys, *head, option, value)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"'{option}'" in err and f"'{value}'" in err, err


def test_integer_options_take_what_draws_takes(write_spec, tmp_path, capsys):
    """--draws took 1e3 and 1_000 (as a spec writes draws) but --batch and --seed refused them; exact
    integers only (1.5e0 is refused, above), read exactly (no float rounding)."""
    from kl_bench.cli.common import int_flag
    spec = write_spec(GOOD)
    assert invoke("exact", spec, "--batch", "1e3", "-q").exit_code == 0
    assert invoke("run", spec, "--seed", "2e0", "--batch", "1_000", "--draws", "2e4", "--out", tmp_path / "o",
                  "-q").exit_code == 0
    assert json.loads((tmp_path / "o" / "run.json").read_text())["seed"] == 2
    assert int_flag("12345678901234567891") == 12345678901234567891
    assert int_flag("1.2345678901234567891e19") == 12345678901234567891
    for bad in ("nan", "inf", "1e99999999", "٣", "", "0x10", "_1000", "1__000", "1000_"):   # TOML's underscores only
        with pytest.raises(Exception, match="must be a whole number"):
            int_flag(bad)


@pytest.mark.parametrize("args,needle", [(["run", "--seed", "abc", "x.toml"], "Invalid value for '--seed'"),
                                         (["run"], "Missing argument 'SPEC'"), (["nosuch"], "No such command"),
                                         (["run", "x.toml", "--bogus"], "No such option")])
def test_flag_errors_are_one_line(args, needle, handlers, capsys):
    """The console script's main (called here in this process; test_bad_input_through_the_real_console_script
    runs the real one): click's usage errors are one line, exit 2."""
    from kl_bench.cli import main
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and needle in err, (e.value.code, err)


def test_small_input_slips_are_plain_one_liners(gauss_results, tmp_path):
    """A spec saved with a byte-order mark is read (it was a TOML syntax error at line 1, column 1); --draws in
    another script's digits is refused as a spec's would be; a .npy path holding something else says so
    without quoting the file's first bytes (a link to /etc/passwd had shown its first bytes). (A bad results
    cell is quoted as the number it is, not as numpy's repr: tests/test_probe.py.)"""
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf" + gauss_results["spec"].read_bytes())
    assert runner.invoke(app, ["exact", str(bom), "-q"]).exit_code == 0
    res = runner.invoke(app, ["run", str(gauss_results["spec"]), "--draws", "\u0663", "--out", str(tmp_path / "o"), "-q"])
    assert res.exit_code == 2 and "key '--draws'" in res.output and not (tmp_path / "o").exists(), res.output
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t:x:0:0")
    (tmp_path / "q.npy").symlink_to(secret)
    (tmp_path / "npy.toml").write_text(
        'spec_version = 1\n[experiment]\nname = "n"\ndraws = 1000\n[[case]]\nname = "c"\nkind = "categorical"\n'
        'q = { file = "q.npy" }\np = { from = "q", noise = 0.1, seed = 1 }\n')
    res = runner.invoke(app, ["exact", str(tmp_path / "npy.toml"), "-q"])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "not a .npy file" in lines[0] and "s3cr3t" not in lines[0], res.output
