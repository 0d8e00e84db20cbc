"""``kl_bench.testing``: the exact KL check an RL library runs in its own CI (docs/testing.md).

    from kl_bench.testing import assert_kl_function
    assert_kl_function(lambda lq, lp: kl_penalty(lq, lp, "low_var_kl"), "k3", clamp=(-10, 10), placement="loss")

``fn(logprobs, ref_logprobs)`` returns per-token values of the inputs' shape (verl's ``kl_penalty``,
OpenRLHF's ``compute_approx_kl`` and NeMo-RL's ``calculate_kl`` once their estimator argument is bound);
log r = ref_logprobs − logprobs. Nothing is sampled: values on a grid of log r, expectations and expected
gradients on categoricals enumerated token by token. Imports torch and kl_bench's estimator registry only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cases import CASE_NAMES, CASES, MASK_FILLS, PLACEMENTS, Categorical, value_grid
from .checks import FOLLOWS, Failure, check_expectations, check_gradients, check_masked, check_values
from .formulas import Reference, reference

__all__ = ["assert_kl_function", "KLCheck", "CASES", "CASE_NAMES", "Categorical", "value_grid", "PLACEMENTS",
           "load_goldens"]

TARGETS = {"KL(q||p)": "KL(q||p)", "reverse": "KL(q||p)", "KL(p||q)": "KL(p||q)", "forward": "KL(p||q)"}


@dataclass(frozen=True)
class KLCheck:
    """What the caller declares about its function (the keywords of :func:`assert_kl_function`).

    estimator: the formula, a name in kl-bench's registry ("k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3").
    clamp: (lo, hi) or b (±b) on the value after the formula (verl's low_var_kl: (-10, 10)).
    input_clamp: (lo, hi) or b on log r before the formula (verl, NeMo-RL: 20).
    placement: where the trainer puts the value: "loss" (sample held fixed), "reward" (detached, score
        function), "loss_is" (times q/sg(q), TRL's use_bias_correction_kl); None checks "loss" and "reward".
    follows: the expected gradient's direction: "KL(q||p)" ("reverse"), "KL(p||q)" ("forward") or "0";
        None: the direction the formula itself has in that placement (k3 in the loss: ∇KL(p‖q)).
    target: what E_q[f] must equal: "KL(q||p)" or "KL(p||q)"; None: the estimator's exact E_q[f] (its
        target where it is unbiased and unclamped, else target plus the known bias).
    masked: how padded positions hold their log-probs, "zero" or "-inf" (None: not checked); mask_by:
        how the code masks them afterwards, "multiply" (kl * mask) or "where" (torch.where(mask, kl, 0)).
    dtypes: the formats the function must be exact in (to their rounding): values, masked positions and
        expectations run in each; the gradient check runs in the most precise one, float32 at least.
    allow_inf: ±inf from finite input is accepted (declared overflow) instead of failing.
    """
    estimator: str = "k3"
    clamp: float | tuple[float, float] | None = None
    input_clamp: float | tuple[float, float] | None = None
    placement: str | None = None
    follows: str | None = None
    target: str | None = None
    masked: str | None = None
    mask_by: str = "multiply"
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    allow_inf: bool = False

    def __post_init__(self):
        _one_of("placement", self.placement, (None, *PLACEMENTS))
        _one_of("follows", self.follows, (None, *FOLLOWS))
        _one_of("target", self.target, (None, *TARGETS))
        _one_of("masked", self.masked, (None, *MASK_FILLS))
        _one_of("mask_by", self.mask_by, ("multiply", "where"))
        if not self.dtypes or not all(getattr(d, "is_floating_point", False) for d in self.dtypes):
            raise ValueError(f"dtypes must be floating-point torch dtypes, got {self.dtypes!r}")

    def reference(self) -> Reference:
        return reference(self.estimator, self.clamp, self.input_clamp)


def _one_of(key: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(repr(a) for a in allowed)}; got {value!r}")


def failures(fn, check: KLCheck) -> list[Failure]:
    """Every failure of ``fn`` under ``check``, in the order values, masked positions, expectations (each
    in every declared dtype), gradients (in the most precise declared dtype, float32 at least)."""
    ref = check.reference()
    placements = (check.placement,) if check.placement else ("loss", "reward")
    target = TARGETS[check.target] if check.target else None
    out: list[Failure] = []
    for dtype in check.dtypes:
        out += check_values(fn, ref, dtype, check.allow_inf)
    for dtype in check.dtypes if check.masked else ():
        out += check_masked(fn, check.masked, check.mask_by, dtype, gradients=check.placement != "reward")
    for dtype in check.dtypes:
        out += check_expectations(fn, ref, dtype, target)
    # The expected gradient's direction is a property of the formula and its placement, not of the format:
    # it is checked in the most precise declared format, float32 at least (in bfloat16 the rounding bound
    # of the log-probs alone is as large as the distance between ∇KL(q‖p) and ∇KL(p‖q) on these cases).
    out += check_gradients(fn, ref, placements, check.follows,
                           min((*check.dtypes, torch.float32), key=lambda d: torch.finfo(d).eps))
    return out


def assert_kl_function(fn, estimator: str = "k3", **declared) -> None:
    """Check a per-token KL function exactly, as :func:`torch.testing.assert_close` checks tensors: return
    quietly, or raise one AssertionError whose first line says what differs, where, by how much and the
    exact value, followed by details and the other failures.

    ``fn(logprobs, ref_logprobs)``: per-token values of the inputs' shape (log r = ref_logprobs − logprobs).
    ``estimator`` and the keywords: :class:`KLCheck`. Checks, all exact (no sampling):

    1. values on a grid of finite log r (|log r| ≤ 50, at two heights of the log-probs) against the named
       formula with the declared clamps, evaluated in float64, within the rounding bound of each dtype
       (kl_bench.testing.formulas: u·(condition of the formula at that log r)); inf or NaN from finite
       input fails;
    2. masked positions, where declared (``masked=``, ``mask_by=``);
    3. E_q[f] on small categoricals enumerated token by token against its target or known bias;
    4. the exact expected gradient with respect to q's logits in each placement: which of ∇KL(q‖p),
       ∇KL(p‖q), 0 it follows, against ``follows``.
    """
    check = KLCheck(estimator, **declared)
    found = failures(fn, check)
    if not found:
        return
    label = check.reference().label
    lines = [f"{label} check failed: {found[0].first}", *(f"  {d}" for d in found[0].details)]
    if len(found) > 1:
        lines.append(f"{len(found) - 1} more failure{'s' if len(found) > 2 else ''}:")
        lines += [f"  - {f.first}" for f in found[1:]]
    raise AssertionError("\n".join(lines))


def load_goldens():
    """The shipped exact cases as a dict (kl_bench/testing/data/kl_cases.json; docs/testing.md)."""
    from .goldens import load
    return load()
