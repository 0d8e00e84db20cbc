"""[[sweep]] tables: a base case expanded over a grid of key values, cases named after their values,
summary.csv's sweep.* columns, one-line errors naming the sweep and key, and the report's sweep figures."""
import math

import pytest

import kl_bench
from kl_bench.foundation.errors import SpecError
from kl_bench.experiment.spec import load_spec
from kl_bench.experiment.sweeps import MAX_SWEEP_CASES

BASE = """
spec_version = 1
[experiment]
name = "sw"
draws = 20_000
batches = 10
device = "cpu"
estimators = ["k1", "k3"]

[[case]]
name = "g"
kind = "gaussian"
q = { mean = 0.0, std = 1.0 }
p = { mean = 0.5, std = 1.0 }

[[case]]
name = "c"
kind = "categorical"
vocab = 50
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.3, seed = 2 }
"""


def _spec(write_spec, sweep: str):
    return load_spec(write_spec(BASE + sweep))


def _error(write_spec, sweep: str) -> str:
    with pytest.raises(SpecError) as e:
        _spec(write_spec, sweep)
    text = str(e.value)
    assert "\n" not in text
    return text


def test_a_sweep_replaces_its_base_case_by_the_grid_named_after_its_values(write_spec):
    sp = _spec(write_spec, """
        [[sweep]]
        case = "c"
        p.noise = { geomspace = [0.01, 3], num = 4 }
        "sampler.temperature" = [0.8, 1.0]
    """)
    names = [c.name for c in sp.cases]
    assert names[0] == "g" and len(names) == 1 + 8
    assert names[1:3] == ["c[p.noise=0.01;sampler.temperature=0.8]", "c[p.noise=0.01;sampler.temperature=1]"]
    assert [v["p.noise"] for v in sp.sweep_values.values()][::2] == [0.01, 0.06694, 0.4481, 3.0]  # 4 digits
    assert "g" not in sp.sweep_values
    case = sp.cases[-1]
    assert case.p.noise == 3.0 and case.sampler.temperature == 1.0 and case.vocab == 50


def test_several_sweeps_of_one_case_add_their_cases_and_linspace_works(write_spec):
    sp = _spec(write_spec, """
        [[sweep]]
        case = "g"
        "p.mean" = { linspace = [0.0, 1.0], num = 3 }
        [[sweep]]
        case = "g"
        "p.std" = [0.5, 2.0]
    """)
    assert [c.name for c in sp.cases if c.name.startswith("g")] == [
        "g[p.mean=0]", "g[p.mean=0.5]", "g[p.mean=1]", "g[p.std=0.5]", "g[p.std=2]"]
    assert sp.sweep_values["g[p.std=2]"] == {"p.std": 2.0}


@pytest.mark.parametrize("sweep, expect", [
    ('case = "cc"\nnoise = [1.0]', "key 'sweep[1].case': no [[case]] named 'cc' (did you mean 'c'?)"),
    ('case = "c"', "sweeps no key"),
    ('case = "c"\n"p.nosie" = [0.1, 0.2]', "key 'sweep[1].p.nosie'"),
    ('case = "c"\n"p.noise" = [-1.0]', "key 'sweep[1].p.noise': value -1.0"),
    ('case = "c"\n"p.noise" = { geomspace = [0.0, 1.0], num = 3 }', "geomspace needs positive ends"),
    ('case = "c"\n"p.noise" = { logspace = [0.1, 1.0], num = 3 }', "unknown key 'logspace'"),
    ('case = "c"\n"p.noise" = { linspace = [0.1, 1.0] }', "num must be an integer"),
    ('case = "c"\n"p.noise" = 0.3', "must be a list of values"),
    ('case = "c"\nname = ["a", "b"]', "cannot be swept"),
    ('case = "c"\n"p.noise" = [0.1, 0.1]', "key 'sweep[1].p.noise': lists the value 0.1 twice"),
    # values that one rounding makes equal were "the case made twice (two sweeps over the same values?)"
    ('case = "c"\n"p.noise" = { linspace = [1, 1.0001], num = 5 }',
     "key 'sweep[1].p.noise': its 5 values are not all different once the inner ones are rounded to 4 significant digits (1, 1.0001)"),
    ('case = "c"\n"p.noise" = [0.1]\n[[sweep]]\ncase = "c"\n"p.noise" = [0.1]', "makes the case 'c[p.noise=0.1]' twice"),
    (f'case = "c"\n"p.noise" = {{ geomspace = [0.01, 3], num = {MAX_SWEEP_CASES + 1} }}', "more than 1,024"),
    # refused before any value is made (a grid of 10^12 values would fill the memory first)
    ('case = "c"\n"p.noise" = { geomspace = [0.01, 3], num = 1_000_000_000_000 }', "more than 1,024"),
])
def test_bad_sweeps_are_one_line_naming_the_sweep_and_key(write_spec, sweep, expect):
    text = _error(write_spec, "[[sweep]]\n" + sweep)
    assert expect in text, text


def test_swept_values_are_summary_columns(write_spec):
    path = write_spec(BASE + """
        [[sweep]]
        case = "c"
        "p.noise" = [0.1, 1.0]
        "sampler.temperature" = [0.9]
    """)
    df = kl_bench.run(path).summary
    assert list(df.columns[-2:]) == ["sweep.p.noise", "sweep.sampler.temperature"]
    swept = df[df["case"].str.startswith("c[")]
    assert swept["sweep.p.noise"].tolist() == [0.1, 0.1, 1.0, 1.0]
    assert (swept["sweep.sampler.temperature"] == 0.9).all()
    assert df.loc[df["case"] == "g", "sweep.p.noise"].map(math.isnan).all()
    # Without a sweep: no extra column, summary.csv as before.
    plain = kl_bench.run(write_spec(BASE, "plain.toml")).summary
    assert not [c for c in plain.columns if c.startswith("sweep.")]


def test_the_report_plots_each_swept_key_instead_of_a_figure_set_per_case(write_spec, tmp_path):
    from kl_bench.present.report import build_report
    path = write_spec(BASE + """
        [[sweep]]
        case = "c"
        "p.noise" = [0.1, 0.3, 1.0]
    """)
    kl_bench.run(path).write(tmp_path / "out")
    figs = [name for name in build_report([tmp_path / "out"]) if name.startswith("figures/")]
    assert "figures/sweep_p.noise.png" in figs
    assert not [f for f in figs if "c-p.noise" in f or "c[" in f]          # no per-case figures of the grid
    assert "figures/bias_std_g.png" in figs


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
