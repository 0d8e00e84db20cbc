"""A new case kind is one module: a toy two-point kind, registered from this file alone, runs end to end
(summary, exact, check with a baseline, gradients) with nothing else in the package touched. It implements
the protocols of kl_bench.kinds.protocols: CaseParser, Oracle and DrawSampler on Pair's defaults, and (the optional)
GradientOracle through ScoreSampler and ScoreGradientOracle's default accumulator.

q = Bernoulli(q1), p = Bernoulli(p1) over x ∈ {0, 1}; θ = logit(q1), so ∇θ log q(x) = x − q1.
"""
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

import kl_bench
from kl_bench.cli import app
from kl_bench.foundation.typed_toml import Table
from kl_bench.core.draws import Draws
from kl_bench.engine.monte_carlo import run_gradients
from kl_bench.foundation.errors import SpecError
from kl_bench.core.modes import ExactGrad
from kl_bench.kinds import CASE_KINDS, CaseConfig, Pair, register_kind
from kl_bench.kinds.protocols import (CaseParser, GradientOracle, JointMoments, Oracle, DrawSampler, ScoreSampler,
                                      gradient_oracle)
from kl_bench.kinds.defaults import ScoreGradientOracle
from kl_bench.results import read_frame
from kl_bench.core.targets import FORWARD, REVERSE

runner = CliRunner()


@dataclass(frozen=True, kw_only=True)
class TwoPointCase(CaseConfig):
    q1: float
    p1: float


def _prob(v):
    return None if 0 < v < 1 else f"must lie in (0, 1), got {v}"


class TwoPointPair(Pair):
    """No gradient oracles: a kind implements only what it supports."""

    def __init__(self, name: str, q1: float, p1: float):
        self.name, self.q1, self.p1 = name, q1, p1
        self.q = torch.tensor([1 - q1, q1], dtype=torch.float64)
        self.p = torch.tensor([1 - p1, p1], dtype=torch.float64)
        self.logr = torch.log(self.p) - torch.log(self.q)        # [2]: log r of x = 0 and x = 1
        self.score = torch.tensor([-q1, 1 - q1], dtype=torch.float64)   # x − q1

    @classmethod
    def parse(cls, t: Table, common, spec_dir) -> TwoPointCase:
        case = TwoPointCase(q1=t.get("q1", "float", check=_prob), p1=t.get("p1", "float", check=_prob), **common)
        t.finish()
        return case

    @classmethod
    def from_config(cls, case: TwoPointCase) -> "TwoPointPair":
        return cls(case.name, case.q1, case.p1)

    def true_values(self):
        return {REVERSE: float((self.q * -self.logr).sum()), FORWARD: float((self.p * self.logr).sum())}

    def _values(self, est):
        return torch.full((2,), self.kl(), dtype=torch.float64) if est.analytic else est.fn(self.logr)

    def exact_moments(self, est, aggregate=""):
        v = self._values(est)
        mean = float((self.q * v).sum())
        return mean, float((self.q * (v - mean) ** 2).sum())

    def exact_joint(self, aggregate=""):
        a, b = -self.logr, torch.expm1(self.logr)
        ma, mb = float((self.q * a).sum()), float((self.q * b).sum())
        return JointMoments(ma, mb, float((self.q * (a - ma) ** 2).sum()), float((self.q * (b - mb) ** 2).sum()),
                            float((self.q * (a - ma) * (b - mb)).sum()))

    def describe(self):
        return f"q = Bernoulli({self.q1:g}), p = Bernoulli({self.p1:g})"

    def _draw(self, n, generator, device):
        return (torch.rand(n, dtype=torch.float64, generator=generator, device=device) < self.q1).long()

    def sample_draws(self, n, generator, device, tok_rows=()):
        x = self._draw(n, generator, device)
        return Draws(self.logr.to(device)[x], torch.full((n,), self.kl(), dtype=torch.float64, device=device))



class TwoPointGradientPair(ScoreGradientOracle, TwoPointPair):
    """With gradients: θ = logit(q1), one parameter; the accumulator is ScoreGradientOracle's."""
    gradient_params = 1

    def gradient_references(self):
        lo = self.q1 * (1 - self.q1)              # dq1/dθ
        return {REVERSE: np.array([lo * (math.log(self.q1 / self.p1) - math.log((1 - self.q1) / (1 - self.p1)))]),
                FORWARD: np.array([self.q1 - self.p1])}

    def gradient_exact(self, item, directions):
        g = item.coef(self.logr) * self.score              # per-x gradient
        mean = float((self.q * g).sum())
        proj_var = {k: float((self.q * (g * u[0] - mean * u[0]) ** 2).sum()) for k, u in directions.items()}
        return ExactGrad(np.array([mean]), float((self.q * g * g).sum()), proj_var)

    def sample_scores(self, n, generator, device):
        x = self._draw(n, generator, device)       # the default accumulator does the rest
        return self.logr.to(device)[x], None, self.score.to(device)[x][:, None]


def test_the_toy_kinds_implement_the_protocols_they_claim():
    plain, grad = TwoPointPair("a", 0.3, 0.45), TwoPointGradientPair("b", 0.3, 0.45)
    for cls in (TwoPointPair, TwoPointGradientPair):
        assert isinstance(cls, CaseParser) and issubclass(cls, Oracle) and issubclass(cls, DrawSampler)
    assert gradient_oracle(plain) is None and not isinstance(plain, (GradientOracle, ScoreSampler))
    assert gradient_oracle(grad) is grad and isinstance(grad, ScoreSampler)
    # the engine asks the protocol: a kind without it is refused in one line, not an AttributeError
    with pytest.raises(SpecError, match="has no gradient oracles"):
        run_gradients(plain, [], {}, draws=10, seed=0, batches=1, device=torch.device("cpu"))


@pytest.fixture(scope="module", autouse=True)
def toy_kinds():
    register_kind("two_point", description="toy: q = Bernoulli(q1), p = Bernoulli(p1)")(TwoPointGradientPair)
    register_kind("two_point_nograd", description="toy without gradient oracles")(TwoPointPair)
    yield
    CASE_KINDS.remove("two_point")
    CASE_KINDS.remove("two_point_nograd")


SPEC = """spec_version = 1
[experiment]
name = "toy"
draws = 200_000
batches = 50
device = "cpu"
estimators = ["k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3", "full"]
lambdas = [0.5, "optimal"]
gradients = {gradients}
[[case]]
name = "coin"
kind = "{kind}"
q1 = 0.3
p1 = 0.45
{extra}"""


def _write(tmp_path, kind="two_point", gradients="true", extra=""):
    path = tmp_path / f"{kind}.toml"
    path.write_text(SPEC.format(kind=kind, gradients=gradients, extra=extra))
    return path


def test_toy_kind_runs_end_to_end_through_the_cli(tmp_path):
    spec = _write(tmp_path)
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(spec), "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    df = read_frame(out / "summary.csv")
    q, p = np.array([0.7, 0.3]), np.array([0.55, 0.45])
    kl_rev, kl_fwd = float((q * np.log(q / p)).sum()), float((p * np.log(p / q)).sum())
    assert set(df["kind"]) == {"two_point"}
    assert np.allclose(df.loc[df["target"] == "KL(q||p)", "true_kl"], kl_rev, rtol=1e-14)
    assert np.allclose(df.loc[df["target"] == "KL(p||q)", "true_kl"], kl_fwd, rtol=1e-14)
    assert (df["z"].abs() < 5).all(), df[["estimator", "z"]]
    assert {"cv", "cv_opt"} <= set(df["estimator"]) and (out / "lambda_sweep.csv").exists()
    # the exact table, no sampling
    res = runner.invoke(app, ["exact", str(spec), "--out", str(tmp_path / "exact.csv")])
    assert res.exit_code == 0, res.output
    ex = pd.read_csv(tmp_path / "exact.csv")
    k3 = ex[ex["estimator"] == "k3"].iloc[0]
    assert k3["exact_mean"] == pytest.approx(kl_rev, rel=1e-13) and math.isfinite(k3["n_for_10pct"])
    # the gate: against the exact values, then against a baseline of this run
    assert runner.invoke(app, ["baseline", str(spec), "--results", str(out), "--out",
                               str(tmp_path / "base.json")]).exit_code == 0
    res = runner.invoke(app, ["check", str(spec), "--results", str(out), "--baseline", str(tmp_path / "base.json"), "-q"])
    assert res.exit_code == 0, res.output
    assert "0 failed" in res.output
    # gradients: k2 in the loss follows ∇KL(q‖p), k3 in the loss ∇KL(p‖q), k1 in the loss is zero
    g = read_frame(out / "gradients.csv").set_index(["estimator", "mode"])
    assert g.loc[("k2", "loss"), "equals"] == "reverse" and g.loc[("k3", "loss"), "equals"] == "forward"
    assert g.loc[("k1", "loss"), "equals"] == "zero" and g.loc[("k3", "loss_is"), "equals"] == "reverse"
    assert (g["z_reverse"].abs() < 5).all() and (g["z_trace"].dropna().abs() < 5).all()


def test_toy_kind_through_the_python_api():
    spec = {"spec_version": 1, "experiment": {"name": "toy", "draws": 50_000, "batches": 20, "device": "cpu",
                                              "estimators": ["k1", "k3"]},
            "case": [{"name": "coin", "kind": "two_point", "q1": 0.3, "p1": 0.45}]}
    result = kl_bench.run(spec)
    assert list(result.summary["estimator"]) == ["k1", "k3"] and (result.summary["z"].abs() < 5).all()


def test_toy_kind_errors_are_one_line(tmp_path):
    spec = _write(tmp_path, kind="two_point_nograd")
    res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "no gradient oracles" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    # its own keys are checked by its own parser, with the file and case named
    spec = _write(tmp_path, gradients="false", extra="q2 = 0.1\n")
    res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "case 'coin': key 'q2': unknown key (did you mean 'q1'?)" in res.stderr
    # a sampler key the kind does not declare is refused, never ignored
    spec = _write(tmp_path, gradients="false", extra="sampler = { temperature = 0.9 }\n")
    res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "unknown key for a two_point sampler" in res.stderr


class ReverseOnlyPair(TwoPointGradientPair):
    """A kind with an exact value of KL(q‖p) only."""

    def true_values(self):
        return {REVERSE: super().true_values()[REVERSE]}


def test_an_estimator_whose_target_the_kind_has_no_truth_for_is_refused_before_sampling(tmp_path):
    register_kind("two_point_reverse_only", description="toy: reverse KL only")(ReverseOnlyPair)
    try:
        spec = _write(tmp_path, kind="two_point_reverse_only", gradients="false")
        res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o")])
        assert res.exit_code == 2 and not (tmp_path / "o").exists()
        assert "case 'coin': key 'experiment.estimators': estimator 'fwd_k1' estimates KL(p||q), which a " \
               "two_point_reverse_only case has no exact value of" in res.stderr
        text = spec.read_text().replace('"fwd_k1", "fwd_k3", ', "")
        spec.write_text(text.replace("gradients = false", "gradients = true"))
        res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o")])
        assert res.exit_code == 2 and "gradient rows compare with ∇KL(p||q)" in res.stderr
    finally:
        CASE_KINDS.remove("two_point_reverse_only")


def test_a_kind_module_that_registers_another_name_is_one_line_and_list_still_works(tmp_path, monkeypatch):
    """A kind module found by its name (kl_bench/kinds/ declares each module lazily, as here) that registers
    another name: a spec naming it is one line naming the module and the name to register (exit 2), and
    `kl-bench list` lists it with that line, the other kinds too, no traceback."""
    import sys
    from kl_bench.kinds.trainable import trainable_kinds
    (tmp_path / "kl_test_coin.py").write_text(
        "from kl_bench.kinds import Pair, register_kind\n\n\n"
        "@register_kind('toy_coin', description='a coin registered under another name')\n"
        "class CoinPair(Pair):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    CASE_KINDS.add_lazy("kl_test_coin", "kl_test_coin")
    try:
        message = ("case kind 'kl_test_coin': module kl_test_coin registers 'toy_coin' instead; register it as "
                   "'kl_test_coin', the name of its module")
        for _ in range(2):          # the second lookup finds the module imported: the same line
            with pytest.raises(SpecError) as e:
                CASE_KINDS["kl_test_coin"]
            assert str(e.value) == message
        spec = _write(tmp_path, kind="kl_test_coin", gradients="false")
        res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o")])
        assert res.exit_code == 2 and res.stderr.strip().splitlines() == [
            f"error: {spec}: case 'coin': key 'kind': {message}"]
        res = runner.invoke(app, ["list"])
        assert res.exit_code == 0 and res.exception is None, res.output
        text = " ".join(res.output.split())                  # the description column is folded to the width
        assert f"kind kl_test_coin not loaded: {message}" in text and "kind gaussian" in text
        assert "kind toy_coin a coin registered under another name" in text
        assert "kl_test_coin" not in trainable_kinds() and "rollout" in trainable_kinds()
    finally:
        for name in ("kl_test_coin", "toy_coin"):
            CASE_KINDS.remove(name)
        sys.modules.pop("kl_test_coin", None)
