"""A second new-user probe: dump-logits with models of two vocabularies, estimate's mask, check's spec= for
every kind of results, train's argument types, a report of one folder twice, and a sweep grid's ends."""
import json
import math
import os

import pytest
import torch
from typer.testing import CliRunner

import kl_bench
from kl_bench.cli import app
from kl_bench.experiment.spec import load_spec
from kl_bench.foundation.errors import SpecError

from .conftest import CATEGORICAL, GAUSS, spec_toml

runner = CliRunner()


def _one_line(res, code: int = 2) -> str:
    """The error line of a command that failed with ``code``: one line, no traceback."""
    assert res.exit_code == code, res.output
    text = res.output.strip()
    assert "\n" not in text and "Traceback" not in text, text
    return text


# ----------------------------------------------------------------------------- 1. dump-logits: vocabularies
@pytest.fixture(scope="module")
def wide_reference(tiny_models, tmp_path_factory):
    """A random causal LM with vocabulary 1200 (the tiny policy has 1000), saved locally: no download."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=1200, n_positions=64, n_embd=16, n_layer=1, n_head=1, bos_token_id=0,
                        eos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).eval()
    out = tmp_path_factory.mktemp("wide") / "reference"
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("more", [[], ["--length", "4", "--samples", "32"]])
def test_dump_logits_refuses_models_of_two_vocabularies(tiny_models, wide_reference, tmp_path, more):
    """A reference of vocabulary 1200 beside a policy of 1000 had written [16, 1000] and [16, 1200] tensors
    (exit 0), and with --length 4 stopped with a traceback from the continuation's step."""
    out = tmp_path / "d"
    res = runner.invoke(app, ["dump-logits", "--policy", str(tiny_models / "policy"), "--reference",
                              str(wide_reference), "--prompts", str(tiny_models / "prompts.txt"), "--out", str(out),
                              "--quiet", *more])
    assert _one_line(res) == "error: key '--reference': the reference has vocabulary 1200 but the policy has 1000"
    assert not out.exists()


def test_a_model_case_refuses_models_of_two_vocabularies_as_before(tiny_models, wide_reference, write_spec):
    spec = write_spec(f"""
        spec_version = 1
        [experiment]
        name = "m"
        draws = 64
        device = "cpu"
        [[case]]
        name = "lm"
        kind = "model"
        policy = "{tiny_models / 'policy'}"
        reference = "{wide_reference}"
        prompts = "{tiny_models / 'prompts.txt'}"
    """)
    with pytest.raises(SpecError, match="key 'reference': the reference has vocabulary 1200 but the policy has 1000"):
        kl_bench.run(spec)


# ----------------------------------------------------------------------------- 2. estimate: the mask
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


# ----------------------------------------------------------------------------- 3. check: spec= everywhere
@pytest.fixture(scope="module")
def checked_run(tmp_path_factory):
    """A small run (a live Result), its folder, the folder read back, and another experiment's spec."""
    where = tmp_path_factory.mktemp("check")
    exp = {"draws": 20_000, "seed": 0, "device": "cpu", "batches": 20, "estimators": ["k1", "k3"]}
    mine, other = where / "mine.toml", where / "other.toml"
    mine.write_text(spec_toml({"name": "mine", **exp}, [GAUSS, CATEGORICAL]))
    other.write_text(spec_toml({"name": "other", **exp}, [GAUSS, CATEGORICAL]))
    live = kl_bench.run(mine)
    folder = live.write(where / "results")
    return live, folder, kl_bench.load_results(folder), mine, other


def test_check_of_a_result_read_back_uses_its_recorded_spec(checked_run, tmp_path):
    """A loaded Result has spec None: check() had raised AttributeError: 'NoneType' object has no attribute
    'sha256'. Its run.json's spec_sha256 gives the baseline note."""
    live, folder, loaded, mine, _ = checked_run
    assert kl_bench.check(loaded).passed
    base = tmp_path / "base.json"
    res = runner.invoke(app, ["baseline", str(mine), "--results", str(folder), "--out", str(base)])
    assert res.exit_code == 0, res.output
    doc = {**json.loads(base.read_text()), "spec_sha256": "0" * 64}     # as if made from another spec
    for results in (loaded, live, folder):
        notes = kl_bench.check(results, doc).notes
        assert any(f"{loaded.envelope['spec_sha256'][:12]}… now" in n for n in notes), notes


def test_check_refuses_another_experiments_spec_for_a_result_as_for_a_folder(checked_run):
    """spec= had been ignored unless the results were a folder's path."""
    live, folder, loaded, mine, other = checked_run
    said = []
    for results in (folder, str(folder), loaded, live):
        with pytest.raises(SpecError, match="holds the results of experiment 'mine', not of 'other'") as e:
            kl_bench.check(results, spec=other)
        said.append(str(e.value))
    assert "\n" not in said[-1] and said[0] == said[2]           # a folder and its Result: the same line
    for results in (folder, loaded, live):
        assert kl_bench.check(results, spec=mine).passed


def test_check_of_a_dataframe_with_a_spec_says_it_cannot_be_checked(checked_run):
    live, _, _, mine, other = checked_run
    for spec in (mine, other):
        with pytest.raises(SpecError) as e:
            kl_bench.check(live.summary, spec=spec)
        assert str(e.value).startswith("key 'spec': a summary DataFrame holds no record")
    assert kl_bench.check(live.summary).passed


# ----------------------------------------------------------------------------- 4. train: argument types
TRAIN_SPEC = """spec_version = 1
[experiment]
name = "t"
draws = 10
device = "cpu"
[train]
optimizer = "sgd"
lr = 0.5
steps = 2
beta = 0.5
reward = { random = 1.0 }
combinations = ["k1/reward"]
[[case]]
name = "cat"
kind = "categorical"
vocab = 12
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.5, seed = 2 }
"""


@pytest.mark.parametrize("argument, value", [("ranks", (0, 2)), ("ranks", 5), ("ranks", "0"), ("progress", "yes"),
                                             ("progress", 2), ("console", 3)])
def test_train_refuses_an_argument_of_the_wrong_type_naming_it(tmp_path, argument, value):
    """ranks=(0, 2) had been AttributeError: 'tuple' object has no attribute 'rank' from the training loop."""
    spec = tmp_path / "t.toml"
    spec.write_text(TRAIN_SPEC)
    with pytest.raises(SpecError) as e:
        kl_bench.train(spec, **{argument: value})
    assert str(e.value).startswith(f"key '{argument}': must be") and "\n" not in str(e.value)


def test_train_takes_its_arguments_of_the_right_type(tmp_path):
    from rich.console import Console

    from kl_bench.engine.distributed import Ranks
    spec = tmp_path / "t.toml"
    spec.write_text(TRAIN_SPEC)
    got = kl_bench.train(spec, ranks=Ranks(), progress=False, console=Console(stderr=True))
    assert got is not None and len(got.frame) > 0


# ----------------------------------------------------------------------------- 5. report: one folder twice
def test_a_report_refuses_a_folder_given_twice_by_any_name(checked_run, tmp_path):
    """`kl-bench report D D` had compared a run with itself as if independent (diff 0, z 0)."""
    _, folder, _, _, _ = checked_run
    link = tmp_path / "link"
    os.symlink(folder, link)
    other_spelling = folder.parent / "." / ".." / folder.parent.name / folder.name
    for second, said in ((folder, "is given twice"), (other_spelling, f"is {folder} again"),
                         (link, f"is {folder} again")):
        out = tmp_path / "report"
        res = runner.invoke(app, ["report", str(folder), str(second), "--out", str(out), "--quiet"])
        line = _one_line(res)
        assert line.startswith(f"error: {second}: {said}") and "give each folder once" in line, line
        assert not out.exists()
    from kl_bench.present.report import write_report
    with pytest.raises(SpecError, match="is given twice"):
        write_report([folder, folder], tmp_path / "api")


# ----------------------------------------------------------------------------- 6. sweep grids: the ends
SWEEP_BASE = """
spec_version = 1
[experiment]
name = "sw"
draws = 1000
device = "cpu"
[[case]]
name = "c"
kind = "categorical"
vocab = 50
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.3, seed = 2 }
[[sweep]]
case = "c"
"""


@pytest.mark.parametrize("grid, values", [
    # the last value had been 1.1 + (1e-20 − 1.1) = 0.0: "value 0.0 ... must be > 0"
    ("q.exponent = { linspace = [1.1, 1e-20], num = 2 }", [1.1, 1e-20]),
    ("q.exponent = { linspace = [1.1, 1e-20], num = 3 }", [1.1, 0.55, 1e-20]),
    # ends of more than 4 significant digits had been rounded (1.23456 → 1.235): the values written
    ("q.exponent = { linspace = [1.23456, 2.000001], num = 3 }", [1.23456, 1.617, 2.000001]),
    ("p.noise = { geomspace = [0.012345, 3.14159], num = 3 }", [0.012345, 0.1969, 3.14159]),
    ("p.noise = { geomspace = [3.14159, 0.012345], num = 3 }", [3.14159, 0.1969, 0.012345]),
    ("p.noise = { geomspace = [0.01, 3], num = 4 }", [0.01, 0.06694, 0.4481, 3.0]),
    ("p.noise = [0.123456, 1e-20]", [0.123456, 1e-20]),
])
def test_a_grid_ends_at_the_values_written(write_spec, grid, values):
    sp = load_spec(write_spec(SWEEP_BASE + grid))
    key = grid.split(" = ")[0]
    assert [v[key] for v in sp.sweep_values.values()] == values
    assert getattr(getattr(sp.cases[-1], key.split(".")[0]), key.split(".")[1]) == values[-1]


def test_a_grid_whose_rounded_inner_values_meet_an_end_is_refused(write_spec):
    """0.99995 rounds to 1.0, outside [0.99991, 0.99999]: kept within the ends, it equals one."""
    with pytest.raises(SpecError, match="not all different once the inner ones are rounded"):
        load_spec(write_spec(SWEEP_BASE + "p.noise = { linspace = [0.99991, 0.99999], num = 3 }"))
