"""Spec values and options that are wrong: names that are not plain file names, every seed field,
one draw, integers beyond float64, unknown keys and misspelt tables (did you mean), values that would crash
or exit 0, plugins that exit: one line naming the file and the key, exit 2, nothing written."""
from pathlib import Path

import pytest

import kl_bench
from kl_bench.cli import app
from kl_bench.foundation.errors import SpecError

from .helpers import (gauss_spec, gauss_text, one_line,
                      runner)


def test_experiment_names_that_are_not_plain_file_names_are_refused(tmp_path):
    for name in (".", "..", "a/b"):
        path = tmp_path / "n.toml"
        path.write_text(gauss_text(name=name))
        one_line(runner.invoke(app, ["run", str(path), "-q"]), 2, "experiment.name", "plain file name")


def test_a_case_name_in_decomposed_unicode_is_refused_naming_the_composed_spelling(tmp_path):
    """'café' composed (NFC) and 'cafe' + a combining accent (NFD) were two cases that printed identically in
    every table: one spelling per name, the composed one (the Python API's dict specs are checked alike)."""
    case = {"name": "cafe\u0301", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0}, "p": {"mean": 0.3, "std": 1.0}}
    small_spec = {"spec_version": 1, "experiment": {"name": "n", "draws": 1000, "device": "cpu"}, "case": [case]}
    with pytest.raises(SpecError, match=r"composed form \(NFC\), got 'cafe\\u0301': write 'caf\\xe9'"):
        kl_bench.load(small_spec)
    kl_bench.load({**small_spec, "case": [{**case, "name": "caf\u00e9"}]})      # the composed spelling is fine


@pytest.mark.parametrize("value", ["nan", "0", "-1"])
def test_checkpoint_every_must_be_positive(small_spec, tmp_path, value):
    res = runner.invoke(app, ["run", str(small_spec), "--out", str(tmp_path / "o"), "--checkpoint-every", value])
    one_line(res, 2, "--checkpoint-every", "must be > 0")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case, typo, suggestion, also", [
    ('kind = "categorical"\nvocab = 10\nq = { logits = "zipf" }\np = { from = "q", noise = 0.1 }\nsamplr = { top_p = 0.9 }\n',
     "samplr", "sampler", ("precision", "sampling")),
    ('kind = "rollout"\nvocab = 10\nbuckets = 2\nlength = 3\nq = { logits = "zipf" }\np = { from = "q", noise = 0.1 }\n'
     'bucketof = "mod"\n', "bucketof", "bucket_of", ("sampler", "precision")),
])
def test_unknown_key_lists_every_allowed_key_even_ones_not_given(tmp_path, case, typo, suggestion, also):
    """Keys a parser only asks about (sampler, precision, bucket_of) are allowed keys too: the list and
    the suggestion must name them."""
    small_spec = tmp_path / "s.toml"
    small_spec.write_text(f'spec_version = 1\n[experiment]\ndraws = 1000\n[[case]]\nname = "c"\n{case}')
    res = runner.invoke(app, ["run", str(small_spec), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    line = res.output.strip()
    assert f"key '{typo}': unknown key (did you mean '{suggestion}'?)" in line, line
    allowed = line.split("allowed: ")[1].split(", ")
    assert suggestion in allowed and all(a in allowed for a in also), line


@pytest.mark.parametrize("draws, ok", [("1e4", True), ("10_000", True), ("abc", False), ("1.5", False)])
def test_draws_flag_reads_like_the_spec(tmp_path, draws, ok):
    """--draws takes what a spec's draws takes (1e4, 10_000); anything else names the file and the flag."""
    small_spec = tmp_path / "s.toml"
    small_spec.write_text('spec_version = 1\n[experiment]\ndraws = 1000\ndevice = "cpu"\n[[case]]\nname = "g"\n'
                    'kind = "gaussian"\nq = { mean = 0.0, std = 1.0 }\np = { mean = 0.1, std = 1.0 }\n')
    res = runner.invoke(app, ["run", str(small_spec), "--draws", draws, "--out", str(tmp_path / "o"), "-q"])
    if ok:
        assert res.exit_code == 0 and "10000" in (tmp_path / "o" / "run.json").read_text(), res.output
    else:
        assert res.exit_code == 2 and f"key '--draws': must be an integer, got '{draws}'" in res.output, res.output
        assert str(small_spec) in res.output and not (tmp_path / "o").exists()


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
    one_line(res, 2, str(path), f"key '{key}'", needle, *([f"case '{case}'"] if case else []))
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
    one_line(res, 2, "key '--seed'", needle)


@pytest.mark.parametrize("where, key", [("experiment", "experiment.draws"), ("case", "draws"), ("flag", "--draws")])
def test_one_draw_is_refused_naming_draws(tmp_path, where, key):
    """`draws = 1` ran one batch and then said its se was NaN 'overflowing float64', naming no key."""
    exp_draws, case_draws = ("1", "") if where == "experiment" else ("2000", "draws = 1\n" if where == "case" else "")
    path = tmp_path / "d.toml"
    path.write_text(f'spec_version = 1\n[experiment]\ndraws = {exp_draws}\ndevice = "cpu"\n[[case]]\nname = "g"\n'
                    f'kind = "gaussian"\n{case_draws}q = {{ mean = 0.0, std = 1.0 }}\np = {{ mean = 0.1, std = 1.0 }}\n')
    flags = ["--draws", "1"] if where == "flag" else []
    res = runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "o"), "-q", *flags])
    one_line(res, 2, f"key '{key}'", "must be ≥ 2")
    assert not (tmp_path / "o").exists()
    path.write_text(path.read_text().replace("draws = 1\n", "draws = 2\n"))       # two draws: two batches of one
    flags = ["--draws", "2"] if where == "flag" else []
    assert runner.invoke(app, ["run", str(path), "--out", str(tmp_path / "o"), "-q", *flags]).exit_code == 0


@pytest.mark.parametrize("typo, meant", [("[experiments]", "experiment"), ("[[cases]]", "case"),
                                         ("[[sweeps]]", "sweep"), ("[Train]", "train"), ("[experimnt]", "experiment")])
def test_a_misspelt_top_level_table_gets_did_you_mean(tmp_path, typo, meant):
    """`[experiments]` was "key 'experiment': missing required key", `[[cases]]` "needs at least one [[case]]"."""
    text = gauss_text(name="t")
    if meant == "experiment":
        text = text.replace("[experiment]", typo)
    elif meant == "case":
        text = text.replace("[[case]]", typo)
    else:
        text += f'{typo}\ncase = "g"\n'
    path = tmp_path / "t.toml"
    path.write_text(text)
    one_line(runner.invoke(app, ["exact", str(path)]), 2, f"key '{typo.strip('[]')}'",
                    f"unknown top-level key (did you mean '{meant}'?)")


def test_a_misspelt_required_table_inside_a_case_gets_did_you_mean(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(gauss_text(name="t").replace("q = {", "qq = {"))
    one_line(runner.invoke(app, ["exact", str(path)]), 2, "case 'g'", "key 'qq'", "did you mean 'q'")


@pytest.mark.parametrize("option, value, needle", [("--samples", "-1", "--samples"), ("--batch-size", "0", "--batch-size"),
                                                   ("--device", "tpu", "--device"), ("--eos", "-1", "--eos"),
                                                   ("--dtype", "int8", "--dtype"), ("--out", "FILE", "not a folder")])
def test_dump_logits_options_are_one_line_before_any_model_loads(tmp_path, option, value, needle):
    (tmp_path / "afile").write_text("keep")
    args = {"--policy": tmp_path / "none", "--reference": tmp_path / "none", "--prompts": tmp_path / "p.txt",
            "--out": tmp_path / "dump"}
    args[option] = tmp_path / "afile" if value == "FILE" else value
    flat = [str(x) for k, v in args.items() for x in (k, v)]
    one_line(runner.invoke(app, ["dump-logits", *flat]), 2, needle)
    assert (tmp_path / "afile").read_text() == "keep" and not (tmp_path / "dump").exists()


@pytest.mark.parametrize("more, extra, needle", [
    ("", "", "2^64"),
    (', "sys:exit"', "", "standard library"),
    (', "builtins:exit"', "", "standard library"),
    (', "os:_exit"', "", "standard library"),
    ("", "sampler = { std_scale = 1e300 }", "std_scale"),
])
def test_spec_values_that_would_crash_or_exit_0(tmp_path, more, extra, needle):
    spec = gauss_spec(tmp_path, "v", seed=2**64 if needle == "2^64" else 0, more=more, extra=extra)
    one_line(runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o"), "-q"]), 2, needle)
    assert not (tmp_path / "o").exists()


def test_plugins_that_exit_or_require_grad(tmp_path, monkeypatch):
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "bad_plugins.py").write_text(
        "import sys, torch\nW = torch.ones((), requires_grad=True)\n"
        "def exits(logr):\n    sys.exit(0)\n"
        "def grad(logr):\n    return logr * W\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for ref, needle in (("exits_on_import:f", "sys.exit(0)"), ("bad_plugins:exits", "SystemExit"),
                        ("bad_plugins:grad", "requires grad")):
        spec = gauss_spec(tmp_path, "pl", more=f', "{ref}"')
        one_line(runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o"), "-q"]), 2, needle)


def test_a_model_case_batch_size_of_2_63_is_refused(tmp_path):
    text = gauss_text(name="m", seed=0, more="", extra="").split("[[case]]")[0] + (
        '[[case]]\nname = "m"\nkind = "model"\npolicy = "a"\nreference = "b"\nprompts = "p.txt"\n'
        f"batch_size = {2**63}\n")
    one_line(runner.invoke(app, ["run", str(gauss_spec(tmp_path, text=text)), "-q"]), 2, "batch_size", "2^20")


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
    one_line(runner.invoke(app, ["exact", str(path)]), 2, str(path), key)
