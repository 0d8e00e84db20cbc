"""The device rule in the rollout kind: every tensor its parts make is made on the device of their inputs.

Two checks. (1) The model, the dynamic program, the exact oracles and the gradient algebra run on ``meta``
tensors (shapes and dtypes, no values): a table made on the host would meet a meta tensor in some operation
and raise. Meta has no generators, no .item() and no data-dependent shapes, so the sampler, Vose's alias
construction, the token-mean FFTs (on the host by design) and the final host conversions are left out; the
host conversions of the oracles go through one function (kl_bench.kinds.rollout.dp.to_host), replaced here.
(2) A lint over the sources of the kind (and of kl_bench.core.rollout_dp and kl_bench.sampling.alias): every tensor
factory call names its device.
"""
import ast
import math
from pathlib import Path

import pytest
import torch

from kl_bench.core.estimators import ESTIMATORS, FULL, make_cv
from kl_bench.core.modes import MODES, GradItem, modes_for
from kl_bench.kinds.rollout import dp, gradients
from kl_bench.kinds.rollout.accumulator import SortedPaths
from kl_bench.kinds.rollout.aggregates import ROLLOUT_AGGREGATES
from kl_bench.kinds.rollout.model import RolloutModel
from kl_bench.kinds.rollout.oracle import RolloutOracle
from kl_bench.core.rejection import CRITERIA, Criterion, Rejection
from kl_bench.core.weights import WeightCorrection

META = torch.device("meta")
C, V, T, EOS = 3, 7, 5, 6
F64 = dict(dtype=torch.float64, device=META)
ESTS = [ESTIMATORS[n] for n in ("k1", "k2", "k3", "fwd_k3")] + [FULL, make_cv(0.5)]
# The gradient algebra reads an estimator through its polynomial's terms Σ a r^s (log r)^k (each term the same
# path through the dynamic program, whatever s and k) and through the modes it declares: k3 (the one with
# straight_through) and fwd_k3 (the r·log r term) take every path that k1, k2 and cv do. Each op on meta tensors
# runs a Python meta kernel (~0.4 ms): all six estimators took 5 s a variant, these two take 2 s.
GRAD_ESTS = [ESTIMATORS[n] for n in ("k3", "fwd_k3")]
OPTIONS = {
    "on-policy": {},
    "token-capped-minlen": dict(behaviour=True, min_length=2, weights="token", weight_cap=2.0),
    "sequence-means": dict(behaviour=True, weights="sequence", per_sequence_mean=True),
    "geometric": dict(behaviour=True, weights="geometric"),
    "floor-mask-clip": dict(behaviour=True, weights="token",
                            correction=WeightCorrection(floor=0.5, mask=(0.1, 5.0), clip=(0.2, 0.2), dual=2.0)),
    "rejection": dict(behaviour=True, weights="sequence",
                      rejection=Rejection((Criterion(next(k for k in CRITERIA if k.endswith("max_k3")), 2.0),))),
}


def _model(options: dict) -> RolloutModel:
    kw = dict(options)
    log_b = torch.empty(C, V, **F64) if kw.pop("behaviour", False) else None
    return RolloutModel.build(torch.empty(C, V, **F64), torch.empty(C, V, **F64),
                              torch.empty(V, dtype=torch.int64, device=META), T, EOS, log_b=log_b, **kw)


@pytest.fixture
def seen(monkeypatch):
    """The host conversions of the oracles: NaNs of the right shape, and the devices they were asked on."""
    devices = []

    def to_host(t):
        devices.append(t.device)
        return math.nan if t.dim() == 0 else [math.nan] * t.shape[0]
    monkeypatch.setattr(dp, "to_host", to_host)
    monkeypatch.setattr(gradients, "host_vector", lambda t: t)
    return devices


def _on_meta(*tensors):
    assert all(t.device == META for t in tensors), [t.device for t in tensors]


@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
def test_the_model_and_the_program_run_on_meta_tensors(options):
    model = _model(OPTIONS[options])
    _on_meta(model.logr_table, model.kl_ctx, model.bucket, *(lb for lb, _ in model.phases))
    for lb, _ in model.phases:
        _on_meta(model.token_weight(lb), model.token_log_weight(lb), model.keep_table(lb), model.sequence_weight(lb))
    g = model.logr_table
    assert dp.sampled(model, torch.ones_like, lambda lb: g, 4).shape == (5,)
    assert dp.by_length(model, model.token_weight, lambda lb: g, 2).shape == (T, 3)
    assert dp.length_law(model).shape == (T,) and dp.under_q(model, torch.ones_like(g), g, 2).shape == (3,)
    theta = model.log_q.clone().requires_grad_(True)
    lq = torch.log_softmax(theta, -1)
    _on_meta(dp.path_moments(model, theta, torch.ones_like(g), model.log_p - lq, 1),
             dp.path_by_length(model, theta, torch.ones_like(g), model.log_p - lq, 1))


@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
def test_the_exact_oracles_run_on_meta_tensors(options, seen):
    model = _model(OPTIONS[options])
    oracle = RolloutOracle(model)
    for name, agg in ROLLOUT_AGGREGATES.items():
        if name == "tok_batch" or not agg.enabled(model):
            continue                        # the token-mean of B sequences convolves on the host (FFT)
        for est in ESTS:
            mean, var = agg.exact(oracle, est)
            assert isinstance(mean, float) and isinstance(var, float), (name, est.name)
    oracle.true_values(), oracle.mean_length(), oracle.kurtosis_proxy(ESTS[3])
    oracle.joint_seq(), oracle.joint_tok(), oracle.inverse_length()
    assert seen and set(seen) == {META}


def _items(model: RolloutModel) -> list[GradItem]:
    aggs = [a for a, agg in ROLLOUT_AGGREGATES.items() if agg.gradients and agg.enabled(model)]
    return [GradItem.of(est, mode, agg) for agg in aggs for est in GRAD_ESTS
            for mode in modes_for(est, token=agg != "seq") if MODES[mode].off_policy or not model.has_sampler]


@pytest.mark.parametrize("options", [o for o in OPTIONS if o != "geometric"], ids=[o for o in OPTIONS if o != "geometric"])
def test_the_gradient_algebra_runs_on_meta_tensors(options, seen):
    model = _model(OPTIONS[options])
    oracle = RolloutOracle(model)
    rev, fwd = gradients.reference(model)
    _on_meta(rev, fwd)
    items = _items(model)
    assert items
    for item in items:
        agg = ROLLOUT_AGGREGATES[item.aggregate]
        gamma = oracle.inverse_length() if agg.length_factor is not None else None   # tok_batch's γ needs the host
        counts = gradients.expected_counts(model, item, gamma)
        if counts is not None:
            _on_meta(gradients.score_part(model, counts))
        own = gradients.self_gradient(model, item, agg.self_value)
        if own is not None:
            _on_meta(own)
        for table in gradients.local_tables(model, item):
            _on_meta(table)


def test_sorted_paths_run_on_meta_tensors():
    keys = torch.empty(4, T, dtype=torch.int64, device=META)
    srt = SortedPaths.of(keys, torch.empty(C * V, **F64), torch.empty(C, **F64), V)
    _on_meta(srt.sq_norm(torch.empty(4, T, **F64)))


# ----------------------------------------------------------------------------- the lint
ROOT = Path(__file__).resolve().parents[1] / "kl_bench"
SOURCES = sorted((ROOT / "kinds" / "rollout").glob("*.py")) + [ROOT / "core" / "rollout_dp.py", ROOT / "sampling" / "alias.py"]
# torch functions that make a tensor (or a generator) from nothing: each call must say where. The *_like
# functions and Tensor.new_* methods take their input's device, and are fine.
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "eye", "linspace", "logspace",
             "rand", "randn", "randint", "randperm", "Generator", "from_numpy"}


def factory_calls_without_device(source: str) -> list[str]:
    """`torch.<factory>(...)` calls in ``source`` without a ``device=`` keyword (torch.from_numpy has none: it
    is always the host, so it is listed wherever it appears)."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            bad.append(f"{node.lineno}: {ast.unparse(node)}")
    return bad


@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_every_tensor_factory_in_the_rollout_kind_names_its_device(path):
    bad = factory_calls_without_device(path.read_text(encoding="utf-8"))
    assert not bad, f"{path.relative_to(ROOT.parent)}: tensor factories without device=:\n" + "\n".join(bad)


def test_the_lint_can_fail():
    src = "import torch\nx = torch.zeros(3, dtype=torch.float64)\ny = torch.ones_like(x)\nz = torch.arange(3, device=x.device)\n"
    assert factory_calls_without_device(src) == ["2: torch.zeros(3, dtype=torch.float64)"]

