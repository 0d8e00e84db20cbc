"""kl_bench.testing (issue 45): every kl-bench estimator and library preset passes its own exact check, and
each mutant of a correct formula fails with a first line that names what is wrong."""
import time

import pytest
import torch

from kl_bench.core import modes as M
from kl_bench.core.estimators import ESTIMATORS
from kl_bench.core.presets import PRESETS, verl_low_var_kl
from kl_bench.testing import KLCheck, assert_kl_function, value_grid
from kl_bench.testing.checks import SYMBOL, check_values, expected_gradient, follows
from kl_bench.testing.cases import CASES, PLACEMENTS, Placement
from kl_bench.testing.formulas import F64, NAMED, lookalikes, reference
from kl_bench.testing.goldens import FOLLOWS as GOLDEN_FOLLOWS

pytestmark = pytest.mark.testing


def of_logr(f):
    """A function of log r as a trainer's fn(logprobs, ref_logprobs)."""
    return lambda lq, lp: f(lp - lq)


def trl_k3(lq, lp):
    """TRL GRPO's per_token_kl as documented: exp(ref − π) − (ref − π) − 1 (grpo_trainer.py)."""
    return torch.exp(lp - lq) - (lp - lq) - 1


# Every estimator of the registry the check can name (a formula Σ c r^s (log r)^k, or its |·|; a function of log r
# alone; not a library preset, which PRESET_CHECKS checks as its base estimator and clamps): a new one is checked here.
PRESET_NAMES = {p.name for p in PRESETS}
CHECKABLE = [n for n, e in ESTIMATORS.items() if n not in PRESET_NAMES and not e.needs_logq and not e.analytic
             and (e.poly is not None or e.abs_poly is not None)]
GRADIENT_CASES = [c for c in CASES if c.gradients]


def test_the_checkable_estimators_include_those_a_diagnosis_names():
    assert set(NAMED) <= set(CHECKABLE) and {"k1", "k2", "k3"} <= set(GOLDEN_FOLLOWS)


# ----------------------------------------------------------------------------- everything correct passes
@pytest.mark.parametrize("name", CHECKABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_estimator_passes_its_own_check(name, dtype):
    assert_kl_function(of_logr(ESTIMATORS[name].fn), name, dtypes=(dtype,))


# preset → (base estimator, output clamp, input clamp, follows); placement from the preset's library mode.
# Straight-through presets (verl's "+", OpenRLHF's unbiased_gradient) take k2's gradient: ∇KL(q‖p) in the loss.
PRESET_CHECKS = {
    "verl.kl": ("k1", None, None, None), "verl.abs": ("abs", None, None, None), "verl.mse": ("k2", None, None, None),
    "verl.low_var_kl": ("k3", 10, 20, None), "verl.kl+": ("k1", None, None, "KL(q||p)"),
    "verl.abs+": ("abs", None, None, "KL(q||p)"), "verl.mse+": ("k2", None, None, None),
    "verl.low_var_kl+": ("k3", 10, 20, "KL(q||p)"),
    "openrlhf.k1": ("k1", 10, None, None), "openrlhf.k2": ("k2", 10, None, None), "openrlhf.k3": ("k3", 10, None, None),
    "openrlhf.k1+": ("k1", 10, None, "KL(q||p)"), "openrlhf.k2+": ("k2", 10, None, "KL(q||p)"),
    "openrlhf.k3+": ("k3", 10, None, "KL(q||p)"),
    "trl.grpo": ("k3", None, None, "KL(q||p)"), "trl.ppo_k1": ("k1", None, None, None),
    "trl.ppo_k3": ("k3", None, None, None),
    "nemo.k1": ("k1", 10, 20, None), "nemo.k2": ("k2", 10, 20, None), "nemo.k3": ("k3", 10, 20, None),
}
PLACEMENT_OF_MODE = {"loss": "loss", "reward": "reward", "loss_is": "loss_is", "loss_is_nemo": "loss_is"}


def test_the_preset_table_covers_every_preset():
    assert set(PRESET_CHECKS) == {p.name for p in PRESETS}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_library_preset_passes_its_own_check(preset):
    est, clamp, input_clamp, want = PRESET_CHECKS[preset.name]
    assert_kl_function(of_logr(preset.fn), est, clamp=clamp, input_clamp=input_clamp,
                       placement=PLACEMENT_OF_MODE[preset.mode], follows=want, dtypes=(torch.float32, torch.bfloat16))


# ----------------------------------------------------------------------------- mutants
def _first_line(fn, estimator="k3", **declared) -> str:
    with pytest.raises(AssertionError) as info:
        assert_kl_function(fn, estimator, **declared)
    return str(info.value).splitlines()[0]


MUTANTS = {
    "direction swapped": (lambda lq, lp: trl_k3(lp, lq), {}, "direction swapped (logprobs and ref_logprobs exchanged"),
    "the −1 of k3 dropped": (lambda lq, lp: torch.exp(lp - lq) - (lp - lq), {}, "off by a constant (the −1 of k3 dropped?)"),
    "sign flipped": (lambda lq, lp: -trl_k3(lq, lp), {}, "the values are −k3: sign flipped"),
    "k1 passed off as k3": (lambda lq, lp: lq - lp, {}, "k1 passed off as k3"),
    "undeclared clamp": (of_logr(verl_low_var_kl), {}, "a clamp that was not declared (declare it, e.g. clamp=(-10, 10))"),
    "overflow to inf": (lambda lq, lp: lp.exp() / lq.exp() - 1 - (lp - lq), {},
                        "value at log r = 50: got inf, expected 5.18471e+21 (overflow from finite input)"),
    "NaN at a masked position": (trl_k3, {"masked": "-inf"}, "masked position (logprobs = -inf, ref_logprobs = -0.5): got nan"),
    "bf16 cast in the middle": (lambda lq, lp: trl_k3(lq, lq + (lp - lq).to(torch.bfloat16).to(lq.dtype)), {},
                                "a cast to bfloat16 in the middle?"),
    "k3 in the loss said to follow the reverse KL": (trl_k3, {"placement": "loss", "follows": "KL(q||p)"},
                                                     "follows ∇KL(p‖q), expected ∇KL(q‖p) (direction swapped; relative difference"),
    "k3 called a forward-KL estimator (TRL #7096)": (trl_k3, {"target": "KL(p||q)"},
                                                    "E_q[f] is KL(q‖p): the function estimates the reverse KL"),
    "value detached in the loss": (lambda lq, lp: trl_k3(lq, lp).detach(), {"placement": "loss"},
                                   "follows 0, expected ∇KL(p‖q) (no gradient: is the value detached"),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_each_mutant_fails_with_a_first_line_naming_the_mistake(mutant):
    fn, declared, words = MUTANTS[mutant]
    first = _first_line(fn, **declared)
    assert first.startswith("k3 check failed: ") and words in first, first


def _lookalike_mutant(alt):
    """A function that computes the lookalike's formula (in float64, returned in the inputs' format)."""
    return lambda lq, lp: alt.value(lp.to(F64) - lq.to(F64)).to(lq.dtype)


@pytest.mark.parametrize("clamps", [{}, {"clamp": 10, "input_clamp": 20}], ids=["plain", "clamped"])
@pytest.mark.parametrize("name", NAMED)
def test_every_diagnosed_lookalike_fails_and_is_named(name, clamps):
    """Each mistake kl_bench.testing.formulas.lookalikes diagnoses, made for real (a function computing it): it fails
    the check of the estimator it looks like, and the first line names it, or an earlier lookalike of the same
    values (k1's sign flip is k1 of −log r); a lookalike that equals the formula on the grid (k2 of −log r) is no
    mistake and passes. A new diagnosis is checked here without a mutant of its own."""
    ref = reference(name, clamps.get("clamp"), clamps.get("input_clamp"))
    lq, lp = value_grid()
    logr = lp - lq
    alts = lookalikes(ref)
    for k, alt in enumerate(alts):
        v = alt.value(logr)
        # in float32, or in float64 where the mistake's values overflow float32 (then the check says overflow)
        dtype = torch.float32 if float(v.abs().max()) < torch.finfo(torch.float32).max else torch.float64
        u = torch.finfo(dtype).eps / 2
        same = lambda other: bool(((v - other.value(logr)).abs() <= other.tolerance(logr, u)).all())  # noqa: E731
        # the value check, where a diagnosis is made (the tests above show its line is the AssertionError's first)
        found = check_values(_lookalike_mutant(alt), ref, dtype, allow_inf=False)
        if same(ref):
            assert found == [], (alt.what, found)
            continue
        named = next(a.what for a in alts[:k + 1] if same(a))
        assert found and found[0].first.startswith("value at log r = ") and found[0].first.endswith(
            f"; {named} [{str(dtype)[6:]}]"), (alt.what, found)


def test_the_masked_check_sees_zero_filled_reference_overflowing():
    """NeMo-RL #4218's shape: a zero-filled reference next to a policy log-prob of −100 gives r = e^100,
    inf in float32, and inf·0 = NaN after the mask; verl's clamped formula passes."""
    first = _first_line(trl_k3, masked="zero")
    assert "masked position (logprobs = -100, ref_logprobs = 0): got nan" in first, first
    assert_kl_function(of_logr(verl_low_var_kl), "k3", clamp=10, input_clamp=20, masked="zero")
    assert_kl_function(of_logr(verl_low_var_kl), "k3", clamp=10, input_clamp=20, masked="-inf", mask_by="where")


def test_where_masking_still_fails_on_a_nan_gradient():
    """torch.where hides a NaN value but not its gradient: 0·(∂ NaN) in the backward."""
    first = _first_line(lambda lq, lp: torch.exp(lp - lq) - (lp - lq) - 1, masked="zero", mask_by="where")
    assert "the gradient through the mask (torch.where(mask, kl, 0))" in first and "not finite" in first, first


def test_declared_overflow_is_accepted():
    f = lambda lq, lp: lp.exp() / lq.exp() - 1 - (lp - lq)     # noqa: E731
    with pytest.raises(AssertionError, match="NaN from finite input|out-of-tolerance"):
        assert_kl_function(f, "k3", allow_inf=True)       # inf is declared; the 0/0 = NaN at −110 is not


def test_options_are_checked_and_frozen():
    with pytest.raises(ValueError, match="placement must be one of"):
        KLCheck(placement="lost")
    with pytest.raises(ValueError, match="follows must be one of"):
        KLCheck(follows="KL(q|p)")
    with pytest.raises(ValueError, match="no polynomial form"):
        assert_kl_function(trl_k3, "verl.low_var_kl")
    with pytest.raises(AttributeError):
        KLCheck().estimator = "k1"


def test_a_wrong_shape_is_one_assertion():
    with pytest.raises(AssertionError, match="must return per-token values of the inputs' shape"):
        assert_kl_function(lambda lq, lp: trl_k3(lq, lp).sum(), "k3")


# ----------------------------------------------------------------------------- the gradient references
def mode_gradient(name: str, placement: str, case) -> torch.Tensor:
    """The exact expected gradient [V] of estimator ``name`` placed as ``placement``, from kl-bench's own table of
    gradient modes (kl_bench.core.modes, tested against trainers' losses in tests/test_gradients.py), not from
    the placement's objective: Σ_x q(x)·c(log r(x))·(e_x − q), float64."""
    q, logr = case.log_q().exp(), case.log_p() - case.log_q()
    qc = q * M.coefficient(ESTIMATORS[name], placement)(logr)
    return qc - q * qc.sum()


def placement_gives_its_mode(placement: str, name: str, case) -> bool:
    """Whether the placement's objective (cases.PLACEMENTS, through checks.expected_gradient) gives the gradient of
    the mode of its name."""
    g = expected_gradient(of_logr(ESTIMATORS[name].fn), case, placement, F64)
    want = mode_gradient(name, placement, case)
    return bool((g - want).norm() <= 1e-12 * max(float(want.norm()), 1e-3))


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_every_placement_gives_the_gradient_of_its_mode(placement):
    """Each placement of kl_bench.testing (cases.PLACEMENTS) is a gradient mode of kl_bench.core.modes, and its
    objective gives that mode's exact expected gradient, for every estimator a check can name, on every case."""
    assert placement in M.MODES, f"placement '{placement}' is no gradient mode of kl_bench.core.modes"
    names = [n for n in CHECKABLE if placement in M.modes_for(ESTIMATORS[n], token=True)]
    assert names, f"no estimator a check can name has the mode '{placement}'"
    for name in names:
        for case in CASES:
            assert placement_gives_its_mode(placement, name, case), (name, case.name)


def test_the_placement_check_can_fail(monkeypatch):
    """A reward placement that forgot to detach f does not give the reward mode's gradient."""
    assert placement_gives_its_mode("reward", "k3", CASES[1])
    monkeypatch.setitem(PLACEMENTS, "reward", Placement("reward", "in the reward, f not detached",
                                                        lambda q, f, lq: (q * f * lq).sum()))
    assert not placement_gives_its_mode("reward", "k3", CASES[1])


def _golden(label: str) -> str:
    """A label of checks.follows as the goldens write it ("none of ..." is "neither")."""
    return "neither" if label.startswith("none of") else label.replace("∇", "").replace("‖", "||").replace("−", "-")


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_the_goldens_say_which_gradient_each_placement_follows(placement):
    """FOLLOWS of kl_bench/testing/goldens.py (the goldens' gradient_follows) has every placement, and says what
    the mode's exact gradient follows on every gradient case (a new placement is checked once it is there)."""
    for name, by_placement in GOLDEN_FOLLOWS.items():
        assert placement in by_placement, f"goldens.FOLLOWS['{name}'] has no entry for placement '{placement}'"
        for case in GRADIENT_CASES:
            label = follows(mode_gradient(name, placement, case), case.kl_gradients(), 1e-9)
            assert _golden(label) == by_placement[placement], (name, placement, case.name, label)


def test_the_gradient_table_of_docs_gradients_is_reproduced():
    """k1: loss 0, reward ∇KL(q‖p); k2: loss ∇KL(q‖p); k3: loss ∇KL(p‖q), reward the difference, loss_is
    ∇KL(q‖p) (docs/gradients.md), on every gradient case in float64; and the goldens say the same. The
    placements a new entry adds are checked above, against kl_bench.core.modes."""
    want = {("k1", "loss"): "0", ("k1", "reward"): "∇KL(q‖p)", ("k1", "loss_is"): "∇KL(q‖p)",
            ("k2", "loss"): "∇KL(q‖p)", ("k3", "loss"): "∇KL(p‖q)", ("k3", "reward"): "∇KL(q‖p) − ∇KL(p‖q)",
            ("k3", "loss_is"): "∇KL(q‖p)"}
    for case in GRADIENT_CASES:
        for (name, placement), label in want.items():
            g = expected_gradient(of_logr(ESTIMATORS[name].fn), case, placement, torch.float64)
            assert follows(g, case.kl_gradients(), 1e-9) == label, (case.name, name, placement)
            assert _golden(label) == GOLDEN_FOLLOWS[name][placement], (name, placement)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_declared_direction_passes_where_true_and_fails_where_not(placement):
    """For each estimator of the goldens, in each placement: declaring the direction the goldens give passes; declaring
    another of ∇KL(q‖p), ∇KL(p‖q), 0 fails on the gradient, in words that name the placement."""
    for name, by_placement in GOLDEN_FOLLOWS.items():
        truth = by_placement[placement]
        for declared in ("KL(q||p)", "KL(p||q)", "0"):
            check = dict(placement=placement, follows=declared, dtypes=(torch.float64,))
            if declared == truth:
                assert_kl_function(of_logr(ESTIMATORS[name].fn), name, **check)
                continue
            first = _first_line(of_logr(ESTIMATORS[name].fn), name, **check)
            expected = SYMBOL.get(declared, declared)
            assert first.startswith(f"{name} check failed: gradient {PLACEMENTS[placement].words} on case ") and \
                f"expected {'∇' + expected if declared != '0' else '0'} (" in first, (name, declared, first)


def test_one_check_runs_under_a_second():
    """Measured, not asserted as a time (the machine is shared): the whole check of one function, every
    part on (two dtypes, masked positions, both placements)."""
    start = time.perf_counter()
    assert_kl_function(of_logr(verl_low_var_kl), "k3", clamp=10, input_clamp=20, masked="zero",
                       dtypes=(torch.float32, torch.bfloat16))
    print(f"one check: {time.perf_counter() - start:.3f} s")


def test_float32_arithmetic_declared_as_float64_is_named():
    """OpenRLHF computes in float32 whatever its inputs: declared exact in float64, the check says which
    format its errors fit."""
    from kl_bench.core.presets import openrlhf_k3
    first = _first_line(of_logr(openrlhf_k3), clamp=10, placement="reward", dtypes=(torch.float64,))
    assert "the errors are within float32's rounding bound" in first and first.endswith("[float64]"), first


def test_the_gradient_runs_in_float32_at_least():
    """With bfloat16 alone declared, the gradient's direction is still checked (in float32): k3 in the loss
    declared to follow the reverse KL fails."""
    first = _first_line(trl_k3, placement="loss", follows="KL(q||p)", dtypes=(torch.bfloat16,))
    assert "follows ∇KL(p‖q), expected ∇KL(q‖p)" in first and first.endswith("[float32]"), first


def test_the_docs_show_the_mutants_first_lines_as_they_are():
    """docs/testing.md's table of mutants holds the first lines of real runs: each shown line is one a mutant
    prints now, and every mutant of the issue's list is shown."""
    import re
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[1] / "docs" / "testing.md").read_text()
    shown = re.findall(r"^\| [^|]+ \| `(k3 check failed: .*)` \|$", doc, flags=re.M)
    printed = {_first_line(fn, **declared) for fn, declared, _ in MUTANTS.values()}
    assert shown and set(shown) <= printed, set(shown) - printed
    assert len(shown) == len(MUTANTS)


def test_a_detached_function_is_checked_for_masked_values_without_an_error():
    """No gradient to take through the mask: the masked check looks at the values only, and the gradient
    check names the detachment."""
    first = _first_line(lambda lq, lp: trl_k3(lq, lp).detach(), placement="loss", masked="-inf")
    assert "masked position (logprobs = -inf, ref_logprobs = -0.5): got nan" in first, first
    first = _first_line(lambda lq, lp: trl_k3(lq, lp).detach(), placement="loss")
    assert "follows 0, expected ∇KL(p‖q) (no gradient" in first, first
