"""Modes and aggregates are tables: every registered entry against its own exact maths, and a new mode or
aggregate is one entry registered from this test file (no other module changes), with Monte Carlo rows
that agree with its exact values."""
import math

import numpy as np
import pytest
import torch

from kl_bench.core import modes as M
from kl_bench.core.aggregates import AGGREGATES, Aggregate, register_aggregate
from kl_bench.engine.monte_carlo import as_rows
from kl_bench.core.estimators import ESTIMATORS, make_cv
from kl_bench.experiment.gradient_rows import gradient_items, gradient_rows
from kl_bench.kinds import CategoricalPair, RolloutPair
from kl_bench.core.targets import REVERSE

from .conftest import CPU, mc_frame

ESTS = [ESTIMATORS[n] for n in ("k1", "k2", "k3", "fwd_k1", "fwd_k3")] + [make_cv(0.5)]


def _poly_value(poly, logr: torch.Tensor) -> torch.Tensor:
    return sum(a * torch.exp(s * logr) * logr**k for (s, k), a in poly.items())


@pytest.mark.parametrize("mode", M.MODES)
def test_every_mode_polynomial_form_is_its_coefficient(mode):
    """Where a mode declares c as a polynomial Σ a r^s (log r)^k, it is the coefficient itself."""
    logr = torch.linspace(-3, 2, 41, dtype=torch.float64)
    checked = 0
    for est in ESTS:
        if mode not in M.modes_for(est, token=True):
            continue
        poly = M.coefficient_poly(est, mode)
        if poly is None:
            continue
        assert torch.allclose(_poly_value(poly, logr), M.coefficient(est, mode)(logr), rtol=1e-12, atol=1e-12)
        checked += 1
    assert checked or mode == "loss_is_nemo"


# ----------------------------------------------------------------------------- a toy mode
def _scaled_loss() -> M.Mode:
    """A trainer that puts 2·f in its loss: c = −2 f′ (its maths: one entry)."""
    loss = M.MODES["loss"]
    return M.Mode("toy_double_loss", "2·f in the loss",
                  coefficient=lambda est: (lambda logr, c=loss.coefficient(est): 2 * c(logr)),
                  poly=lambda est: None if loss.poly(est) is None else {k: 2 * v for k, v in loss.poly(est).items()},
                  trainer_loss=lambda est, lq, lp: 2 * est.fn(lp - lq))


@pytest.fixture
def toy_mode():
    mode = M.register_mode(_scaled_loss())
    try:
        yield mode
    finally:
        M.MODES.remove(mode.name)


def _cat(b=2, v=30, seed=4):
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(torch.randn(b, v, generator=g, dtype=torch.float64) * 1.5, -1)
    lp = torch.log_softmax(lq + 0.5 * torch.randn(b, v, generator=g, dtype=torch.float64), -1)
    return CategoricalPair("c", lq, lp)


def test_a_mode_registered_from_a_test_gets_rows_with_exact_and_measured_gradients(toy_mode):
    pair = _cat()
    items = gradient_items(pair, [ESTIMATORS["k1"], ESTIMATORS["k3"]])
    assert [it.mode for it in items if it.est.name == "k3"] == [*M.modes_for(ESTIMATORS["k3"])]
    assert "toy_double_loss" in M.modes_for(ESTIMATORS["k3"])
    # its trainer objective differentiates to its coefficient (d/d log q of the objective is c)
    lq = pair.model.log_q[0].clone().requires_grad_(True)
    (g,) = torch.autograd.grad(M.trainer_loss(ESTIMATORS["k3"], toy_mode.name, lq, pair.model.log_p[0]).sum(), lq)
    assert torch.allclose(g, M.coefficient(ESTIMATORS["k3"], toy_mode.name)(pair.model.log_p[0] - pair.model.log_q[0]),
                          rtol=1e-12)
    rows = gradient_rows(pair, [ESTIMATORS["k3"]], draws=40_000, seed=3, batches=40, device=CPU)
    by_mode = {r["mode"]: r for r in rows}
    toy, loss = by_mode["toy_double_loss"], by_mode["loss"]
    assert toy["exact_norm"] == pytest.approx(2 * loss["exact_norm"], rel=1e-12)
    assert toy["exact_cos_reverse"] == pytest.approx(loss["exact_cos_reverse"], rel=1e-12)
    assert toy["equals"] == "other" and loss["equals"] == "forward"     # k3 in the loss: ∇KL(p‖q)
    assert abs(toy["z_reverse"]) < 5 and abs(toy["z_forward"]) < 5


def test_an_unknown_mode_is_a_one_line_error_with_a_suggestion():
    from kl_bench.foundation.errors import SpecError
    with pytest.raises(SpecError, match="did you mean 'loss_is'"):
        M.GradItem.of(ESTIMATORS["k3"], "loss_iss")


# ----------------------------------------------------------------------------- a toy aggregate
def _twice_tok(col, row, batch):
    return 2 * AGGREGATES["tok"].value(col, row, batch)


def _twice_exact(pair, est):
    mean, var = pair.exact_moments(est, "tok")
    return 2 * mean, 4 * var


@pytest.fixture
def toy_aggregate():
    agg = register_aggregate(Aggregate("tok_x2", "twice the token sum (a KL coefficient of 2)", _twice_tok,
                                       token=True, exact=_twice_exact, applies=lambda s: s.lam is None,
                                       enabled=lambda pair: True))
    try:
        yield agg
    finally:
        AGGREGATES.remove(agg.name)


def _rollout():
    g = torch.Generator().manual_seed(5)
    lq = torch.log_softmax(torch.randn(3, 40, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(lq + 0.4 * torch.randn(3, 40, generator=g, dtype=torch.float64), -1)
    return RolloutPair("r", lq, lp, torch.arange(40) % 3, 6, 39)


def test_an_aggregate_registered_from_a_test_gets_rows_against_its_exact_values(toy_aggregate):
    pair = _rollout()
    rows = as_rows([ESTIMATORS["k3"], make_cv(0.5)], pair)
    assert [r.label for r in rows] == ["seq:k3", "tok:k3", "tok_x2:k3", "seq:cv@0.5", "tok:cv@0.5"]
    df = mc_frame(pair, rows, draws=20_000, seed=2, batches=20).set_index("aggregate")
    toy = df.loc["tok_x2"]
    # the same paths: a value twice the token sum, exactly (doubling is exact in binary floating point)
    tok = df[(df.index == "tok") & (df["estimator"] == "k3")].iloc[0]
    assert toy["mean"] == 2 * tok["mean"] and toy["exact_mean"] == 2 * tok["exact_mean"]
    assert abs(toy["z"]) < 5 and math.isfinite(toy["exact_std"])
    assert toy["exact_std"] == pytest.approx(2 * tok["exact_std"], rel=1e-12)


def test_an_unknown_aggregate_is_refused():
    from kl_bench.core.draws import Row, Draws
    from kl_bench.core.aggregates import row_values
    d = Draws(torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(KeyError, match="unknown aggregate 'tok_mena'.*did you mean 'tok_mean'"):
        row_values(d, [Row(ESTIMATORS["k3"], "tok_mena")])


def test_optional_aggregates_follow_the_case_switches_in_table_order():
    pair = _rollout()
    assert pair.aggregates_for(ESTIMATORS["k3"]) == ("seq", "tok")
    assert pair.aggregates_for(ESTIMATORS["abs"]) == ("tok",)            # not a polynomial: token rows only
    on = RolloutPair("r", pair.model.log_q, pair.model.log_p, pair.model.bucket, 6, 39, per_sequence_mean=True, token_mean_batch=4)
    assert on.aggregates_for(ESTIMATORS["k3"]) == ("seq", "tok", "tok_mean", "tok_batch")
    assert on.aggregates_for(make_cv(0.5)) == ("seq", "tok")
    assert [on.row_group(a) for a in on.aggregates_for(ESTIMATORS["k3"])] == [1, 1, 1, 4]
    assert np.isclose(on.true_value(REVERSE, "tok_mean") * on.oracle.mean_length(), on.kl(), rtol=1e-12)


# ----------------------------------------------------------------------------- sampler options
def test_every_declared_sampler_key_is_an_option_and_every_logit_option_reshapes_b():
    import dataclasses

    from kl_bench.kinds import CASE_KINDS
    from kl_bench.sampling.mismatch import LOGIT_KEYS, SamplerSpec
    fields = {f.name for f in dataclasses.fields(SamplerSpec)}
    for kind in CASE_KINDS.values():
        assert set(kind.sampler_keys) <= fields, kind.name
    example = {"temperature": 0.7, "top_k": 3, "top_p": 0.5}
    assert set(example) == set(LOGIT_KEYS)
    lq = _rollout().model.log_q
    assert not SamplerSpec().reshapes and torch.equal(SamplerSpec().reshape(lq), torch.log_softmax(lq, -1))
    for key, value in example.items():
        sp = SamplerSpec(**{key: value})
        assert sp.reshapes and not torch.allclose(sp.logprobs(lq, lq), lq), key
        assert sp.describe() != SamplerSpec().describe()
