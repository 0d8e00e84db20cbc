"""Hardening: filesystem errors are input errors (one line, exit 2, earlier results intact, nothing left
behind), signals at any phase are one line (no sleeps: the process signals itself at a named phase),
flag errors are one line, progress and timing tell the truth, and `run` ends with a recommendation."""
import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kl_bench.foundation import atomic
from kl_bench.results import checkpoint
from kl_bench.cli import app

runner = CliRunner()

SPEC = """spec_version = 1
[experiment]
name = "{name}"
draws = 20_000
batches = 20
device = "cpu"
estimators = ["k1", "k3"]
[[case]]
name = "g"
kind = "gaussian"
q = {{ mean = 0.0, std = 1.0 }}
p = {{ mean = 0.3, std = 1.1 }}
"""


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "h.toml"
    path.write_text(SPEC.format(name="h"))
    return path


def _one_line_error(res, *needles):
    err = res.stderr.strip()
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and (".staging-" in p.name
                                                                               or p.name.endswith(".lock")))


@pytest.mark.parametrize("out,needle", [("file", "exists and is not a folder"), ("under-file", "is a file"),
                                        ("/dev/null", "exists and is not a folder"), ("/proc/kl-bench-x", "cannot"),
                                        ("", "must name a results folder"), (".", "must name a results folder"),
                                        ("..", "must name a results folder")])
def test_bad_out_folders_are_one_line_and_write_nothing(spec, tmp_path, out, needle):
    (tmp_path / "afile").write_text("keep")
    target = {"file": str(tmp_path / "afile"), "under-file": str(tmp_path / "afile" / "r")}.get(out, out)
    before = sorted(os.listdir(tmp_path))
    res = runner.invoke(app, ["run", str(spec), "--out", target, "-q"])
    _one_line_error(res, needle, "--out")
    assert sorted(os.listdir(tmp_path)) == before and (tmp_path / "afile").read_text() == "keep"


def test_exact_out_at_a_folder_or_under_a_file(spec, tmp_path):
    (tmp_path / "afile").write_text("keep")
    _one_line_error(runner.invoke(app, ["exact", str(spec), "--out", str(tmp_path)]), "is a folder")
    _one_line_error(runner.invoke(app, ["exact", str(spec), "--out", str(tmp_path / "afile" / "x.csv")]), "is a file")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_disk_or_read_only_mount_keeps_earlier_results(spec, tmp_path, monkeypatch, code):
    out = tmp_path / "res"
    assert runner.invoke(app, ["run", str(spec), "--out", str(out), "-q"]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail(fh, data):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(atomic, "_write_file", fail)
    res = runner.invoke(app, ["run", str(spec), "--out", str(out), "-q", "--seed", "5"])
    _one_line_error(res, os.strerror(code), str(out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _leftovers(tmp_path) == [] and not list(out.glob(".tmp-*"))
    res = runner.invoke(app, ["exact", str(spec), "--out", str(tmp_path / "e.csv")])
    _one_line_error(res, os.strerror(code))
    assert not (tmp_path / "e.csv").exists() and not list(tmp_path.glob(".tmp-*"))


def test_experiment_names_that_are_not_plain_file_names_are_refused(tmp_path):
    for name in (".", "..", "a/b"):
        path = tmp_path / "n.toml"
        path.write_text(SPEC.format(name=name))
        _one_line_error(runner.invoke(app, ["run", str(path), "-q"]), "experiment.name", "plain file name")


def test_a_case_name_in_decomposed_unicode_is_refused_naming_the_composed_spelling(tmp_path):
    """'café' composed (NFC) and 'cafe' + a combining accent (NFD) were two cases that printed identically in
    every table: one spelling per name, the composed one (the Python API's dict specs are checked alike)."""
    import kl_bench
    from kl_bench.foundation.errors import SpecError
    case = {"name": "cafe\u0301", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0}, "p": {"mean": 0.3, "std": 1.0}}
    spec = {"spec_version": 1, "experiment": {"name": "n", "draws": 1000, "device": "cpu"}, "case": [case]}
    with pytest.raises(SpecError, match=r"composed form \(NFC\), got 'cafe\\u0301': write 'caf\\xe9'"):
        kl_bench.load(spec)
    kl_bench.load({**spec, "case": [{**case, "name": "caf\u00e9"}]})      # the composed spelling is fine


@pytest.mark.parametrize("value", ["nan", "0", "-1"])
def test_checkpoint_every_must_be_positive(spec, tmp_path, value):
    res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o"), "--checkpoint-every", value])
    _one_line_error(res, "--checkpoint-every", "must be > 0")
    assert not (tmp_path / "o").exists()


def test_symlinked_out_is_refused_and_nothing_is_left_behind(spec, tmp_path):
    """kl-bench never writes through a link (the results used to land where it pointed): one line naming
    the link, the link and its folder untouched."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    res = runner.invoke(app, ["run", str(spec), "--out", str(link), "-q"])
    _one_line_error(res, "--out", "symbolic link")
    assert link.is_symlink() and list(real.iterdir()) == [] and _leftovers(tmp_path) == []


def test_resume_with_nothing_to_resume_writes_nothing(spec, tmp_path):
    out = tmp_path / "deep" / "res"
    res = runner.invoke(app, ["run", str(spec), "--out", str(out), "--resume"])
    _one_line_error(res, "nothing to resume")
    assert not (tmp_path / "deep").exists()


def _cli(*args, env=None):
    # kl_bench._test_hooks: the console script with the test hooks the environment asks for (KL_BENCH_SELF_SIGNAL)
    return subprocess.run([sys.executable, "-m", "kl_bench._test_hooks", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("phase,sig", [("start", "SIGINT"), ("write", "SIGINT"),
                                       pytest.param("start", "SIGTERM", marks=pytest.mark.slow),
                                       pytest.param("pairs", "SIGINT", marks=pytest.mark.slow),
                                       pytest.param("pairs", "SIGTERM", marks=pytest.mark.slow)])
def test_a_signal_at_any_phase_is_one_line_and_keeps_earlier_results(spec, tmp_path, phase, sig):
    out = tmp_path / "res"
    assert _cli("run", spec, "--out", out, "-q").returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = _cli("run", spec, "--out", out, "-q", "--seed", "3", env={"KL_BENCH_SELF_SIGNAL": f"{phase}:{sig}"})
    err = proc.stderr.strip()
    assert proc.returncode == 130 and len(err.splitlines()) == 1 and "Traceback" not in err, (proc.returncode, err)
    assert "interrupted" in err and ("while writing" in err) == (phase == "write")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and _leftovers(tmp_path) == []


@pytest.mark.parametrize("args,needle", [(["run", "--seed", "abc", "x.toml"], "Invalid value for '--seed'"),
                                         (["run"], "Missing argument 'SPEC'"), (["nosuch"], "No such command"),
                                         (["run", "x.toml", "--bogus"], "No such option")])
def test_flag_errors_are_one_line(args, needle):
    proc = _cli(*args)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and needle in err, (proc.returncode, err)


def test_progress_names_the_phase_and_shows_the_rate(monkeypatch):
    from rich.console import Console

    from kl_bench.foundation import progress as P
    monkeypatch.setattr(P, "PROGRESS_AFTER_S", -1.0)
    bar = P.LazyProgress(3_000_000, enabled=True, console=Console(file=io.StringIO(), force_terminal=True))
    bar.label("noise0.3 (gradients)")
    bar.advance(1_234_567)
    fields = bar.bar.tasks[0].fields
    bar.close()
    assert fields["label"] == "noise0.3 (gradients)" and fields["count"] == "1,234,567/3,000,000 draws"
    assert fields["rate"].endswith(" draws/s") and "," in fields["rate"]


def test_run_prints_a_recommendation_and_a_rate_that_matches_its_time(spec, tmp_path):
    import json
    res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0
    assert "g: to log, k3 (RMSE" in res.output and "±10% with 95% probability needs a batch of" in res.output
    env = json.loads((tmp_path / "o" / "run.json").read_text())
    # the rate is draws over the sampling time that is stated (run.json rounds the time to 1 ms)
    # sampling_seconds is rounded to the millisecond (off by ≤ 0.0005 s, times the rate) and draws_per_second
    # to an integer (off by ≤ ½, times the seconds): a slow or descheduled run makes the second term count
    assert abs(env["draws_per_second"] * env["sampling_seconds"] - 20_000) <= \
        env["draws_per_second"] * 0.0005 + 0.5 * env["sampling_seconds"] + 1
    assert f"draws sampled in {env['sampling_seconds']:.1f} s" in res.output


def test_a_checkpoint_with_the_wrong_number_of_batches_is_refused(spec, tmp_path):
    import torch

    from kl_bench.api import prepare
    out = tmp_path / "res"
    out.mkdir()
    prep = prepare(spec)
    identity = checkpoint.checkpoint_identity(prep.spec, prep.device, prep.spec.case_draws())
    checkpoint.save_checkpoint(out, identity, {"g": torch.zeros(21, 12, dtype=torch.float64)})    # the run has 20
    _one_line_error(runner.invoke(app, ["run", str(spec), "--out", str(out), "--resume"]),
                    "checkpoint holds 21 batches of case 'g' but the run has 20")
    checkpoint.save_checkpoint(out, identity, {"other": torch.zeros(3, 12, dtype=torch.float64)})
    _one_line_error(runner.invoke(app, ["run", str(spec), "--out", str(out), "--resume"]), "no such case")
    (out / checkpoint.CHECKPOINT).write_bytes(b"not a checkpoint")
    _one_line_error(runner.invoke(app, ["run", str(spec), "--out", str(out), "--resume"]), "checkpoint is unreadable")


@pytest.mark.parametrize("case, typo, suggestion, also", [
    ('kind = "categorical"\nvocab = 10\nq = { logits = "zipf" }\np = { from = "q", noise = 0.1 }\nsamplr = { top_p = 0.9 }\n',
     "samplr", "sampler", ("precision", "sampling")),
    ('kind = "rollout"\nvocab = 10\nbuckets = 2\nlength = 3\nq = { logits = "zipf" }\np = { from = "q", noise = 0.1 }\n'
     'bucketof = "mod"\n', "bucketof", "bucket_of", ("sampler", "precision")),
])
def test_unknown_key_lists_every_allowed_key_even_ones_not_given(tmp_path, case, typo, suggestion, also):
    """Keys a parser only asks about (sampler, precision, bucket_of) are allowed keys too: the list and
    the suggestion must name them."""
    spec = tmp_path / "s.toml"
    spec.write_text(f'spec_version = 1\n[experiment]\ndraws = 1000\n[[case]]\nname = "c"\n{case}')
    res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    line = res.output.strip()
    assert f"key '{typo}': unknown key (did you mean '{suggestion}'?)" in line, line
    allowed = line.split("allowed: ")[1].split(", ")
    assert suggestion in allowed and all(a in allowed for a in also), line


@pytest.mark.parametrize("draws, ok", [("1e4", True), ("10_000", True), ("abc", False), ("1.5", False)])
def test_draws_flag_reads_like_the_spec(tmp_path, draws, ok):
    """--draws takes what a spec's draws takes (1e4, 10_000); anything else names the file and the flag."""
    spec = tmp_path / "s.toml"
    spec.write_text('spec_version = 1\n[experiment]\ndraws = 1000\ndevice = "cpu"\n[[case]]\nname = "g"\n'
                    'kind = "gaussian"\nq = { mean = 0.0, std = 1.0 }\np = { mean = 0.1, std = 1.0 }\n')
    res = runner.invoke(app, ["run", str(spec), "--draws", draws, "--out", str(tmp_path / "o"), "-q"])
    if ok:
        assert res.exit_code == 0 and "10000" in (tmp_path / "o" / "run.json").read_text(), res.output
    else:
        assert res.exit_code == 2 and f"key '--draws': must be an integer, got '{draws}'" in res.output, res.output
        assert str(spec) in res.output and not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- every seed, every number
CAT_CASE = ('[[case]]\nname = "c"\nkind = "categorical"\nvocab = 50\nq = {{ logits = "zipf", seed = {q} }}\n'
            'p = {{ from = "q", noise = 0.3, seed = {p} }}\n{extra}')
SAMPLER = 'sampler = {{ behavior = {{ from = "q", noise = 0.1, seed = {b} }}, weights = "token" }}\n'
TRAIN_TABLE = ('[train]\noptimizer = "sgd"\nlr = 0.5\nsteps = 3\nbeta = 0.5\nreward = {{ random = 1.0, seed = {r} }}\n'
               'combinations = ["k1/reward"]\n')


def _seed_spec(tmp_path, where: str, value: str) -> Path:
    seeds = {"experiment": "0", "q": "1", "p": "2", "behavior": "3", "reward": "4"}
    seeds[where] = value
    text = (f'spec_version = 1\n[experiment]\nname = "s"\ndraws = 2000\nbatches = 10\ndevice = "cpu"\n'
            f'seed = {seeds["experiment"]}\nestimators = ["k1", "k3"]\n'
            + TRAIN_TABLE.format(r=seeds["reward"])
            + CAT_CASE.format(q=seeds["q"], p=seeds["p"], extra=SAMPLER.format(b=seeds["behavior"])))
    path = tmp_path / "seeds.toml"
    path.write_text(text)
    return path


SEED_KEYS = {"experiment": (None, "experiment.seed"), "q": ("c", "q.seed"), "p": ("c", "p.seed"),
             "behavior": ("c", "sampler.behavior.seed"), "reward": (None, "train.reward.seed")}


@pytest.mark.parametrize("value, needle", [("18446744073709551616", "must be < 2^64"), ("-1", "must be ≥ 0"),
                                           ("1.5", "must be an integer"), ("true", "must be an integer"),
                                           ('"7"', "must be an integer"), ("1" + "0" * 400, "must be < 2^64")])
@pytest.mark.parametrize("where", list(SEED_KEYS))
def test_every_seed_field_is_checked_and_named(tmp_path, where, value, needle):
    """A seed of 2^64 in a case's q or p table was a 70-line traceback (torch's manual_seed overflowed)."""
    path = _seed_spec(tmp_path, where, value)
    res = runner.invoke(app, ["train" if where == "reward" else "exact", str(path), "--out", str(tmp_path / "o")])
    case, key = SEED_KEYS[where]
    _one_line_error(res, str(path), f"key '{key}'", needle, *([f"case '{case}'"] if case else []))
    assert not (tmp_path / "o").exists()


def test_the_largest_seed_runs(tmp_path):
    for where in ("experiment", "q", "p", "behavior"):
        path = _seed_spec(tmp_path, where, str(2**64 - 1))
        assert runner.invoke(app, ["run", str(path), "--out", str(tmp_path / where), "-q"]).exit_code == 0


@pytest.mark.parametrize("command, value, needle", [("run", "18446744073709551616", "must be < 2^64"),
                                                    ("run", "-1", "must be ≥ 0"),
                                                    ("train", "18446744073709551616", "must be < 2^64")])
def test_seed_flags_are_checked(tmp_path, command, value, needle):
    path = _seed_spec(tmp_path, "experiment", "0")
    res = runner.invoke(app, [command, str(path), "--seed", value, "--out", str(tmp_path / "o")])
    _one_line_error(res, "key '--seed'", needle)


@pytest.mark.parametrize("where, key", [("experiment", "experiment.draws"), ("case", "draws"), ("flag", "--draws")])
def test_one_draw_is_refused_naming_draws(tmp_path, where, key):
    """`draws = 1` ran one batch and then said its se was NaN 'overflowing float64', naming no key."""
    exp_draws, case_draws = ("1", "") if where == "experiment" else ("2000", "draws = 1\n" if where == "case" else "")
    path = tmp_path / "d.toml"
    path.write_text(f'spec_version = 1\n[experiment]\ndraws = {exp_draws}\ndevice = "cpu"\n[[case]]\nname = "g"\n'
                    f'kind = "gaussian"\n{case_draws}q = {{ mean = 0.0, std = 1.0 }}\np = {{ mean = 0.1, std = 1.0 }}\n')
    flags = ["--draws", "1"] if where == "flag" else []
    res = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "o"), "-q", *flags])
    _one_line_error(res, f"key '{key}'", "must be ≥ 2")
    assert not (tmp_path / "o").exists()
    path.write_text(path.read_text().replace("draws = 1\n", "draws = 2\n"))       # two draws: two batches of one
    flags = ["--draws", "2"] if where == "flag" else []
    assert runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "o"), "-q", *flags]).exit_code == 0


@pytest.mark.parametrize("typo, meant", [("[experiments]", "experiment"), ("[[cases]]", "case"),
                                         ("[[sweeps]]", "sweep"), ("[Train]", "train"), ("[experimnt]", "experiment")])
def test_a_misspelt_top_level_table_gets_did_you_mean(tmp_path, typo, meant):
    """`[experiments]` was "key 'experiment': missing required key", `[[cases]]` "needs at least one [[case]]"."""
    text = SPEC.format(name="t")
    if meant == "experiment":
        text = text.replace("[experiment]", typo)
    elif meant == "case":
        text = text.replace("[[case]]", typo)
    else:
        text += f'{typo}\ncase = "g"\n'
    path = tmp_path / "t.toml"
    path.write_text(text)
    _one_line_error(runner.invoke(app, ["exact", str(path)]), f"key '{typo.strip('[]')}'",
                    f"unknown top-level key (did you mean '{meant}'?)")


def test_a_misspelt_required_table_inside_a_case_gets_did_you_mean(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(SPEC.format(name="t").replace("q = {", "qq = {"))
    _one_line_error(runner.invoke(app, ["exact", str(path)]), "case 'g'", "key 'qq'", "did you mean 'q'")


@pytest.mark.parametrize("key, line", [("draws", "draws = 1" + "0" * 400), ("vocab", "vocab = 1" + "0" * 400),
                                       ("contexts", "contexts = 1" + "0" * 400)])
def test_integers_beyond_float64_are_one_line(tmp_path, key, line):
    """Messages formatted these with float(): OverflowError tracebacks."""
    case = CAT_CASE.format(q="1", p="2", extra="")
    if key == "vocab":
        case = case.replace("vocab = 50", line)
    elif key == "contexts":
        case = case.replace('seed = 1 }', 'seed = 1, ' + line + ' }')
    exp_draws = line.split(" = ")[1] if key == "draws" else "2000"
    path = tmp_path / "n.toml"
    path.write_text(f'spec_version = 1\n[experiment]\ndraws = {exp_draws}\ndevice = "cpu"\n' + case)
    _one_line_error(runner.invoke(app, ["exact", str(path)]), str(path), key)


def test_gradients_of_a_rollout_with_p_equal_to_q_are_computed(tmp_path):
    """p = q (noise = 0, KL = 0) with per-token rows: the references' scale was 0/0, a ZeroDivisionError."""
    path = tmp_path / "r.toml"
    path.write_text('spec_version = 1\n[experiment]\nname = "r"\ndraws = 2000\nbatches = 10\ndevice = "cpu"\n'
                    'estimators = ["k1", "k3"]\ngradients = true\n[[case]]\nname = "T4"\nkind = "rollout"\nvocab = 8\n'
                    'buckets = 2\nlength = 4\neos = 7\nper_sequence_mean = true\n'
                    'q = { logits = "zipf", exponent = 1.0, seed = 1 }\np = { from = "q", noise = 0.0, seed = 2 }\n')
    res = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "o"), "-q"])
    assert res.exit_code == 0, res.output
