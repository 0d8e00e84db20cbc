"""Estimator plug-ins: a function of log r named in a spec ('package.module:function'), registered with
@kl_bench.register_estimator, or found through the `kl_bench.estimators` entry-point group. A plug-in
gets the same engine, exact moments where they are computable for any function (categorical sums,
the rollout dynamic program for token rows, 1-D quadrature for Gaussians), report and gate; a broken
one is one line naming it, exit 2."""
import math
import textwrap

import pytest
import torch
from typer.testing import CliRunner

import kl_bench
from kl_bench.cli import app
from kl_bench.results import read_frame

runner = CliRunner()

PLUGIN = '''
import torch

def half_k3(logr):
    """½ k3: unbiased for ½ KL(q‖p)."""
    return 0.5 * (torch.expm1(logr) - logr)

def raises(logr):
    raise ValueError("boom")

def wrong_shape(logr):
    return logr.sum()

def makes_nan(logr):
    return torch.where(logr > 0.5, torch.full_like(logr, float("nan")), logr)

def not_differentiable(logr):
    return torch.as_tensor(logr.detach().numpy() ** 2)

def late_nan(logr):
    """Fine on the probe, NaN on any larger tensor: only the run can catch it."""
    return torch.full_like(logr, float("nan")) if logr.numel() > 100 else -logr

NOT_CALLABLE = 3
'''

SPEC = """spec_version = 1
[experiment]
name = "plug"
draws = 80_000
batches = 40
device = "cpu"
estimators = ["k3", "{est}"]
gradients = {gradients}
[[case]]
name = "g"
kind = "gaussian"
q = {{ mean = 0.0, std = 1.0 }}
p = {{ mean = 0.3, std = 1.1 }}
[[case]]
name = "c"
kind = "categorical"
vocab = 200
q = {{ logits = "zipf", exponent = 1.1, seed = 1 }}
p = {{ from = "q", noise = 0.4, seed = 2 }}
[[case]]
name = "r"
kind = "rollout"
vocab = 30
buckets = 3
length = 4
eos = 29
draws = 20_000
q = {{ logits = "zipf", exponent = 1.1, seed = 1 }}
p = {{ from = "q", noise = 0.3, seed = 2 }}
{extra}"""


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "kl_plug_test.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _spec(tmp_path, est, gradients="false", extra=""):
    path = tmp_path / "plug.toml"
    path.write_text(SPEC.format(est=est, gradients=gradients, extra=extra))
    return path


def test_a_plugin_gets_the_engine_exact_moments_and_the_gate(plugin_dir):
    spec = _spec(plugin_dir, "kl_plug_test:half_k3", gradients="true")
    out = plugin_dir / "out"
    res = runner.invoke(app, ["run", str(spec), "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    df = read_frame(out / "summary.csv")
    plug = df[df["estimator"] == "kl_plug_test:half_k3"]
    k3 = df[(df["estimator"] == "k3")].set_index(["case", "aggregate"])
    # exact moments everywhere they are computable: Gaussian (quadrature), categorical (sum), rollout tok (DP);
    # it is not a polynomial in (R, L), so rollouts give it token rows only
    assert list(zip(plug["case"], plug["aggregate"])) == [("g", ""), ("c", ""), ("r", "tok")]
    for _, r in plug.iterrows():
        ref = k3.loc[(r["case"], r["aggregate"])]
        assert r["exact_mean"] == pytest.approx(0.5 * ref["exact_mean"], rel=1e-8)
        assert r["exact_std"] == pytest.approx(0.5 * ref["exact_std"], rel=1e-7)
        assert abs(r["z"]) < 5
    assert runner.invoke(app, ["check", str(spec), "--results", str(out), "-q"]).exit_code == 0
    g = read_frame(out / "gradients.csv")
    hk = g[(g["estimator"] == "kl_plug_test:half_k3") & (g["case"] == "c")].set_index("mode")
    # ½k3 in loss_is follows ∇E_q[½k3] = ½∇KL(q‖p): its own value's gradient (self), no KL gradient
    assert hk.loc["loss", "equals"] == "other" and hk.loc["loss_is", "equals"] == "self"
    assert abs(hk.loc["loss_is", "exact_cos_reverse"] - 1) < 1e-12      # ½ ∇KL(q‖p): parallel, half as long


def test_register_estimator_decorator_and_entry_points(plugin_dir, monkeypatch):
    @kl_bench.register_estimator("twice_k1_test", unbiased=False, formula="−2 log r")
    def twice_k1(logr):
        return -2 * logr
    try:
        r = kl_bench.run(_spec(plugin_dir, "twice_k1_test"), draws=20_000).summary
        t = r[r["estimator"] == "twice_k1_test"]
        k1 = kl_bench.exact(_spec(plugin_dir, "k1")).set_index(["case", "estimator", "aggregate"])
        assert t["exact_mean"].tolist() == pytest.approx(
            [2 * k1.loc[(c, "k1", a), "exact_mean"] for c, a in zip(t["case"], t["aggregate"])], rel=1e-9)
        assert runner.invoke(app, ["list"]).output.count("twice_k1_test") == 1
    finally:
        kl_bench.ESTIMATORS.remove("twice_k1_test")
    # an installed package can expose estimators through the `kl_bench.estimators` entry-point group
    dist = plugin_dir / "kl_plug_test-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kl-plug-test\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kl_bench.estimators]\nhalf_k3_ep = kl_plug_test:half_k3\n")
    try:
        r = kl_bench.run(_spec(plugin_dir, "half_k3_ep"), draws=20_000).summary
        assert (r.loc[r["estimator"] == "half_k3_ep", "z"].abs() < 5).all()
    finally:
        kl_bench.ESTIMATORS.remove("half_k3_ep")


@pytest.mark.parametrize("ref,needle", [
    ("kl_plug_missing:f", "cannot be imported: ModuleNotFoundError"),
    ("kl_plug_test:nope", "has no attribute 'nope'"),
    ("kl_plug_test:NOT_CALLABLE", "is a int, not a function of log r"),
    ("kl_plug_test:raises", "raised ValueError: boom"),
    ("kl_plug_test:wrong_shape", "must return a tensor of the input's shape"),
    ("kl_plug_test:makes_nan", "returned NaN (first at log r = 1)"),
    ("kl_plug_test:", "must look like 'package.module:object'"),
])
def test_a_broken_plugin_is_one_line_naming_it(plugin_dir, ref, needle):
    res = runner.invoke(app, ["run", str(_spec(plugin_dir, ref)), "--out", str(plugin_dir / "o")])
    assert res.exit_code == 2, res.output
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and needle in err and "experiment.estimators" in err, err
    assert ref.split(":")[0] in err and not (plugin_dir / "o").exists()


def test_a_non_differentiable_plugin_in_gradient_mode_is_one_line(plugin_dir):
    res = runner.invoke(app, ["run", str(_spec(plugin_dir, "kl_plug_test:not_differentiable", gradients="true")),
                              "--out", str(plugin_dir / "o")])
    assert res.exit_code == 2 and "is not differentiable" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_a_plugin_on_a_multivariate_gaussian_is_refused_before_sampling(plugin_dir):
    extra = textwrap.dedent("""
        [[case]]
        name = "g2"
        kind = "gaussian"
        q = { mean = [0.0, 0.1], std = [1.0, 1.0] }
        p = { mean = [0.3, 0.0], std = [1.1, 0.9] }
        """)
    res = runner.invoke(app, ["run", str(_spec(plugin_dir, "kl_plug_test:half_k3", extra=extra)),
                              "--out", str(plugin_dir / "o")])
    assert res.exit_code == 2 and "case 'g2'" in res.stderr and "no exact oracle for kl_plug_test:half_k3" in res.stderr


def test_estimate_accepts_plugins(plugin_dir):
    logr = torch.tensor([-0.5, 0.0, 0.7], dtype=torch.float64)
    got = kl_bench.estimate(policy=torch.zeros(3, dtype=torch.float64), reference=logr, estimator="kl_plug_test:half_k3")
    assert torch.allclose(got, 0.5 * (torch.expm1(logr) - logr))


def test_plugins_are_resolved_on_every_lookup_and_never_cached(plugin_dir):
    import importlib
    est = kl_bench.ESTIMATORS["kl_plug_test:half_k3"]
    assert est.name == "kl_plug_test:half_k3" and "kl_plug_test:half_k3" not in kl_bench.ESTIMATORS
    assert "kl_plug_test:half_k3" not in kl_bench.ESTIMATORS.names()
    (plugin_dir / "kl_plug_test.py").write_text(PLUGIN.replace("0.5 * (", "0.25 * ("))
    importlib.reload(importlib.import_module("kl_plug_test"))
    x = torch.tensor([0.7], dtype=torch.float64)
    assert kl_bench.ESTIMATORS["kl_plug_test:half_k3"].fn(x).item() == pytest.approx(0.25 * (math.expm1(0.7) - 0.7))
    assert kl_bench.ESTIMATORS.get("kl_plug_missing:f") is None and kl_bench.ESTIMATORS.get("k9") is None


def test_a_plugin_that_fails_mid_run_names_the_spec_and_the_case(plugin_dir):
    spec = _spec(plugin_dir, "kl_plug_test:late_nan")
    res = runner.invoke(app, ["run", str(spec), "--out", str(plugin_dir / "o")])
    err = res.stderr.strip()
    assert res.exit_code == 2 and len(err.splitlines()) == 1 and str(spec) in err and "case 'g'" in err, err
    assert "returned NaN" in err and not (plugin_dir / "o").exists()
    assert not list(plugin_dir.glob(".*.lock"))


def test_a_plugin_module_beside_the_spec_is_found_as_the_readme_shows(tmp_path, monkeypatch):
    """Issue 25 item 9: the README's example (mykl.py next to the spec) works as written, from any
    working directory, and leaves the import path as it was."""
    import sys

    from typer.testing import CliRunner

    from kl_bench.cli import app
    mod = f"mykl_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{mod}.py").write_text("import torch\n\ndef half_k3(logr):\n    return 0.5 * (torch.expm1(logr) - logr)\n")
    spec = tmp_path / "my.toml"
    spec.write_text(f'spec_version = 1\n[experiment]\nname = "p"\ndraws = 4000\nbatches = 10\n'
                    f'estimators = ["k3", "{mod}:half_k3"]\n[[case]]\nname = "g"\nkind = "gaussian"\n'
                    'q = { mean = 0.0, std = 1.0 }\np = { mean = 0.3, std = 1.0 }\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    before = list(sys.path)
    res = CliRunner().invoke(app, ["exact", str(spec)])
    assert res.exit_code == 0, res.output
    assert f"{mod}:half_k3" in res.output and sys.path == before


def test_a_lazy_item_whose_module_fails_is_one_error_and_stays_known(tmp_path, monkeypatch):
    """Registry.add_lazy: the module is imported on the first lookup; if it fails, a SpecError naming the
    item and the module, every time (the name stays listed, get() returns the default); once it imports
    and registers, the item is there."""
    import sys

    from kl_bench.foundation.errors import SpecError
    from kl_bench.foundation.registry import Registry
    reg = Registry("thing")
    (tmp_path / "lazy_thing_mod.py").write_text("raise ImportError('no such library')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg.add_lazy("thing", "lazy_thing_mod")
    assert "thing" in reg and reg.names() == ["thing"] and len(reg) == 1
    for _ in range(2):
        with pytest.raises(SpecError, match="thing 'thing' cannot be loaded .*lazy_thing_mod.*no such library"):
            reg["thing"]
    assert reg.get("thing", 7) == 7 and "thing" in reg
    sys.modules.pop("lazy_thing_mod", None)
    (tmp_path / "lazy_thing_mod.py").write_text(
        "import sys\nsys.modules['kl_bench_test_registry'].add('thing', 42)\n")
    monkeypatch.setitem(sys.modules, "kl_bench_test_registry", reg)
    assert reg["thing"] == 42 and reg.names() == ["thing"]


def test_a_lazy_item_whose_module_registers_nothing_of_its_name_is_one_line(tmp_path, monkeypatch):
    """The module imports but registers no item of the declared name: one line naming the module, every time."""
    import sys

    from kl_bench.foundation.errors import SpecError
    from kl_bench.foundation.registry import Registry
    reg = Registry("thing")
    (tmp_path / "lazy_silent_mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_silent_mod", raising=False)
    reg.add_lazy("silent", "lazy_silent_mod")
    for _ in range(2):
        with pytest.raises(SpecError) as e:
            reg["silent"]
        assert str(e.value) == ("thing 'silent': module lazy_silent_mod registers no thing of that name; register "
                                "it as 'silent', the name of its module")
    assert reg.get("silent") is None and reg.names() == ["silent"]
