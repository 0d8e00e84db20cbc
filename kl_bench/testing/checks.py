"""The four checks of :func:`kl_bench.testing.assert_kl_function`, each returning its failures (first
line, detail lines) instead of raising, so that the assertion can name the first and list the rest.

``fn(logprobs, ref_logprobs) → per-token values``, all of one shape; log r = ref_logprobs − logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cases import CASES, PLACEMENTS, Categorical, masked_rows, value_grid
from .formulas import F64, Reference, diagnose, fmt, unit_roundoff

SYMBOL = {"KL(q||p)": "KL(q‖p)", "KL(p||q)": "KL(p‖q)"}


@dataclass(frozen=True)
class Failure:
    first: str                   # what differs, where, by how much, the exact value
    details: tuple[str, ...] = ()


def _call(fn, lq: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    out = fn(lq, lp)
    if not isinstance(out, torch.Tensor) or out.shape != lq.shape:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise AssertionError(f"fn(logprobs, ref_logprobs) must return per-token values of the inputs' shape "
                             f"{list(lq.shape)}, got {got}")
    return out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ----------------------------------------------------------------------------- values
def check_values(fn, ref: Reference, dtype: torch.dtype, allow_inf: bool) -> list[Failure]:
    """fn on the grid of finite log r (cases.value_grid) in ``dtype``, against the reference evaluated in
    float64 at the same (rounded) inputs, within the rounding bound of ``dtype``."""
    lq, lp = (t.to(dtype) for t in value_grid())
    got = _call(fn, lq, lp).detach().to(F64)
    logr = lp.to(F64) - lq.to(F64)
    want, u = ref.value(logr), unit_roundoff(dtype)
    tol = ref.tolerance(logr, u, torch.finfo(dtype).tiny)
    big = torch.finfo(dtype).max
    # A value beyond the format's largest finite number is correctly rounded to ±inf.
    overflow_ok = (want.abs() > big) & (got == want.sign() * torch.inf)
    finite = torch.isfinite(got)
    bad_inf = ~finite & ~overflow_ok & ~(torch.isinf(got) & torch.tensor(allow_inf, device=got.device))
    wrong = finite & ((got - want).abs() > tol)
    if bool(bad_inf.any()):
        i = int(bad_inf.nonzero()[0])
        why = "NaN from finite input" if torch.isnan(got[i]) else "overflow from finite input"
        first = f"value at log r = {fmt(float(logr[i]))}: got {got[i].item()}, expected {fmt(float(want[i]))} ({why})"
    elif bool(wrong.any()):
        i = int(((got - want).abs() / tol).masked_fill(~wrong, -1).argmax())
        hint = diagnose(ref, logr, got, u, finite)
        first = (f"value at log r = {fmt(float(logr[i]))}: got {fmt(float(got[i]))}, expected {fmt(float(want[i]))} "
                 f"(diff {float(got[i] - want[i]):+.3g}, tolerance {float(tol[i]):.2g})" + (f"; {hint}" if hint else ""))
    else:
        return []
    return [Failure(f"{first} [{_dtype_name(dtype)}]", (
        f"at logprobs = {float(lq[i])!r}, ref_logprobs = {float(lp[i])!r} ({_dtype_name(dtype)}); the exact value "
        f"of {ref.label} there is {float(want[i])!r}",
        f"{int(bad_inf.sum())} non-finite and {int(wrong.sum())} out-of-tolerance values on the grid of "
        f"{logr.numel()} log-ratios (|log r| ≤ {fmt(float(logr.abs().max()))})"))]


# ----------------------------------------------------------------------------- masked positions
def check_masked(fn, fill: str, mask_by: str, dtype: torch.dtype, gradients: bool = True) -> list[Failure]:
    """Padded positions (cases.masked_rows) next to one real one: after the caller's mask (multiplying by
    0, or torch.where), the padded values must be exactly 0 and, where the value is differentiated
    (``gradients``: not in the reward, where it is detached), the gradient with respect to both log-prob
    tensors finite (0·inf and inf − inf give NaN, which the optimiser spreads to every parameter)."""
    for where, a, b in masked_rows(fill):
        out, kept, grads = _masked(fn, a, b, mask_by, dtype)
        how = "multiplied by the mask" if mask_by == "multiply" else "torch.where(mask, kl, 0)"
        v = float(kept.detach()[1])
        if v != 0.0:
            return [Failure(f"masked position (logprobs = {a:g}, ref_logprobs = {b:g}): got {fmt(v)} after the mask "
                            f"({how}), expected 0 (the unmasked value is {fmt(float(out.detach()[1]))}; "
                            f"{'0·inf or NaN·0' if mask_by == 'multiply' else 'NaN'} survives the mask) "
                            f"[{_dtype_name(dtype)}]", (f"padding: {where}",))]
        if gradients and any(not bool(torch.isfinite(g).all()) for g in grads):
            return [Failure(f"masked position (logprobs = {a:g}, ref_logprobs = {b:g}): the gradient through the mask ({how}) is "
                            f"{[float(g[1]) for g in grads]}, not finite (0·inf or NaN in the backward "
                            f"of the masked value) [{_dtype_name(dtype)}]", (f"padding: {where}",))]
    return []


def _masked(fn, a: float, b: float, mask_by: str, dtype: torch.dtype):
    """(fn's values, the values after the mask, their gradients with respect to log q and log p) at a real position
    and a padded one (logprobs ``a``, ref_logprobs ``b``), the padded one masked."""
    # host: the masked check's two positions (kl_bench.testing checks a function on the CPU)
    lq = torch.tensor([-0.7, a], dtype=dtype, requires_grad=True)
    lp = torch.tensor([-0.9, b], dtype=dtype, requires_grad=True)  # host: as lq
    mask = torch.tensor([True, False])  # host: as lq
    out = _call(fn, lq, lp)
    kept = out * mask if mask_by == "multiply" else torch.where(mask, out, torch.zeros_like(out))
    # a function that returns detached values has no gradient to check here (check 4 says so)
    grads = [g for g in torch.autograd.grad(kept.sum(), (lq, lp), allow_unused=True) if g is not None] \
        if kept.requires_grad else []
    return out, kept, grads


# ----------------------------------------------------------------------------- expectations
def expectation(fn, case: Categorical, dtype: torch.dtype) -> float:
    """E_q[fn] = Σ_x q(x)·fn(log q(x), log p(x)), fn in ``dtype``, the sum in float64."""
    lq, lp = case.log_q(), case.log_p()
    return float((lq.exp() * _call(fn, lq.to(dtype), lp.to(dtype)).detach().to(F64)).sum())


def _expected(ref: Reference, case: Categorical, target: str | None) -> tuple[float, str]:
    """What E_q[f] must equal, and its name: the declared target, else the reference's exact E_q[f] named
    by the estimator's target where the estimator is unbiased and unclamped, else as a bias."""
    lq, lp = case.log_q(), case.log_p()
    kl = case.kl()
    exact = float((lq.exp() * ref.value(lp - lq)).sum())
    if target is not None:
        return kl[target], SYMBOL[target]
    if ref.est.unbiased and ref.clamp is None and ref.input_clamp is None:
        return exact, SYMBOL[ref.est.target]
    return exact, f"E_q[{ref.label}] (= {SYMBOL[ref.est.target]} {exact - kl[ref.est.target]:+.6g})"


def _expectation_hint(e: float, case: Categorical, tol: float) -> str:
    for name, value in case.kl().items():
        if abs(e - value) <= tol:
            return f"; E_q[f] is {SYMBOL[name]}: the function estimates {'the reverse' if name == 'KL(q||p)' else 'the forward'} KL"
    return ""


def check_expectations(fn, ref: Reference, dtype: torch.dtype, target: str | None) -> list[Failure]:
    """E_q[fn] on every exact categorical against its target, within Σ_x q·(the rounding bound at x, plus
    the slope times the rounding of the inputs to ``dtype``) and float64's rounding of the sum."""
    u, tiny = unit_roundoff(dtype), torch.finfo(dtype).tiny
    out = []
    for case in CASES:
        lq, lp = case.log_q(), case.log_p()
        q, logr = lq.exp(), lp - lq
        if float(ref.value(logr).abs().max()) > torch.finfo(dtype).max:
            continue        # a token's exact value overflows the format (rare-q-V6 in float16): E_q[f] is inf there
        tol = float((q * (ref.tolerance(logr, u, tiny) + ref.slope_bound(logr) * u * (lq.abs() + lp.abs()))).sum())
        tol += len(q) * unit_roundoff(F64) * float((q * ref.value(logr).abs()).sum())
        want, name = _expected(ref, case, target)
        e = expectation(fn, case, dtype)
        if not abs(e - want) <= tol:
            out.append((abs(e - want) / tol if tol > 0 else float("inf"), Failure(
                f"expectation on case '{case.name}': E_q[f] = {fmt(e)} but {name} = {fmt(want)} (diff {e - want:+.3g}, "
                f"tolerance {tol:.2g}){_expectation_hint(e, case, tol)} [{_dtype_name(dtype)}]",
                (f"case '{case.name}': {case.what}; exact {name} = {want!r}",))))
    # the case where the difference is largest against its tolerance first: the most telling one
    return [f for _, f in sorted(out, key=lambda item: -item[0])]


# ----------------------------------------------------------------------------- expected gradients
def expected_gradient(fn, case: Categorical, placement: str, dtype: torch.dtype) -> torch.Tensor:
    """The exact expected gradient [V] with respect to q's logits z of Σ_x q(x)·f(x) placed as
    ``placement`` (cases.PLACEMENTS), fn evaluated in ``dtype`` on log q = log_softmax(z)."""
    z = torch.tensor(case.logits_q, dtype=F64, requires_grad=True)  # host: an exact case's logits
    lq = torch.log_softmax(z, -1)
    q = lq.detach().exp()
    f = _call(fn, lq.to(dtype), case.log_p().to(dtype)).to(F64)
    objective = PLACEMENTS[placement].objective(q, f, lq)
    if not objective.requires_grad:      # fn detached its output: no gradient at all
        return torch.zeros_like(z)
    (g,) = torch.autograd.grad(objective, z)
    return g.detach()


def gradient_tolerance(ref: Reference, case: Categorical, u: float) -> float:
    """|δg| ≤ √2·Σ_x q(x)·δc(x), δc the rounding error of the per-token coefficient of the score e_x − q
    (|e_x − q| ≤ √2). The coefficient is f, −f′ or f − f′ (the three placements), so
    δc ≤ 4u·(T_f + T_f′) + (T_f′ + T_f″)·δℓ, with δℓ ≤ u·(|ℓ| + |log q| + |log p|) from rounding the
    inputs to the format and forming ℓ there (formulas: T_g bounds |g| by the magnitudes of its terms)."""
    lq, lp = case.log_q(), case.log_p()
    logr = lp - lq
    dlogr = u * (logr.abs() + lq.abs() + lp.abs())
    per_token = (4 * u * (ref.slope_bound(logr, 0) + ref.slope_bound(logr))
                 + (ref.slope_bound(logr) + ref.slope_bound(logr, 2)) * dlogr)
    return float(2 ** 0.5 * (lq.exp() * per_token).sum())


def follows(g: torch.Tensor, refs: dict[str, torch.Tensor], tol: float) -> str:
    """Which of ∇KL(q‖p), ∇KL(p‖q), 0 the gradient ``g`` is (within ``tol``), else its least-squares
    reading a·∇KL(q‖p) + b·∇KL(p‖q) where that fits, else 'none'."""
    if float(g.norm()) <= tol:
        return "0"
    for name, r in refs.items():
        if float((g - r).norm()) <= tol:
            return f"∇{SYMBOL[name]}"
    basis = torch.stack([refs["KL(q||p)"], refs["KL(p||q)"]], 1)
    ab = torch.linalg.lstsq(basis, g[:, None]).solution[:, 0]
    if float((basis @ ab - g).norm()) <= tol:
        return _combination(ab, basis.norm(dim=0), tol)
    cos = float(g @ refs["KL(q||p)"] / (g.norm() * refs["KL(q||p)"].norm()))
    return f"none of ∇KL(q‖p), ∇KL(p‖q), 0 (cosine to ∇KL(q‖p) {cos:.3f})"


def _combination(ab: torch.Tensor, norms: torch.Tensor, tol: float) -> str:
    """a·∇KL(q‖p) + b·∇KL(p‖q) in words, a term dropped where its size is below the tolerance."""
    terms = []
    for c, n, name in zip(ab.tolist(), norms.tolist(), ("∇KL(q‖p)", "∇KL(p‖q)")):
        if abs(c) * n > tol:
            coef = "" if abs(abs(c) - 1) * n <= tol else f"{abs(c):.3g}·"
            terms.append(("− " if c < 0 else "+ ") + coef + name)
    text = " ".join(terms)
    return text[2:] if text.startswith("+ ") else "−" + text[2:]


def _reference_fn(ref: Reference):
    return lambda lq, lp: ref.value(lp - lq)


FOLLOWS = {"KL(q||p)": "∇KL(q‖p)", "reverse": "∇KL(q‖p)", "KL(p||q)": "∇KL(p‖q)", "forward": "∇KL(p‖q)",
           "0": "0", "zero": "0", 0: "0"}


def check_gradients(fn, ref: Reference, placements: tuple[str, ...], want: str | None,
                    dtype: torch.dtype) -> list[Failure]:
    """On the cases where the declared clamps do not fire, the exact expected gradient of fn placed as each
    of ``placements``: which of ∇KL(q‖p), ∇KL(p‖q), 0 it follows, against ``want`` (FOLLOWS' keys), or,
    undeclared, against what the reference formula's own gradient follows there."""
    out, decided = [], 0
    for case in gradient_cases(ref):
        refs, u = case.kl_gradients(), unit_roundoff(dtype)
        tol = gradient_tolerance(ref, case, u)
        r, f = refs["KL(q||p)"], refs["KL(p||q)"]
        if 2 * tol >= min(float(r.norm()), float(f.norm()), float((r - f).norm())):
            continue        # the format's rounding could move the gradient from one reference to another
        decided += 1
        for placement in placements:
            g = expected_gradient(fn, case, placement, dtype)
            got = follows(g, refs, tol)
            if want is not None:
                expected = FOLLOWS[want]
                target = {"∇KL(q‖p)": r, "∇KL(p‖q)": f}.get(expected, torch.zeros_like(g))
            else:       # the formula's own gradient: the same direction, or the same vector where it is none of the three
                target = expected_gradient(_reference_fn(ref), case, placement, F64)
                expected = follows(target, refs, tol)
            if got != expected and float((g - target).norm()) > tol:
                out.append(_gradient_failure(g, target, got, expected, case, placement, tol, dtype))
    if not decided:
        out.append(Failure(f"gradient not checked: the declared clamps fire on every exact case, or no case separates "
                           f"∇KL(q‖p), ∇KL(p‖q) and 0 beyond {_dtype_name(dtype)}'s rounding bound"))
    return out


def _gradient_failure(g, target, got: str, expected: str, case: Categorical, placement: str, tol: float,
                      dtype: torch.dtype) -> Failure:
    """How far the expected gradient is from what it should be: |E[∇] − expected| / |expected| (or |E[∇]|
    where the expected gradient is 0)."""
    scale = float(target.norm()) or 1.0
    words = "relative difference" if float(target.norm()) else "norm"
    return Failure(
        f"gradient {PLACEMENTS[placement].words} on case '{case.name}': follows {got}, expected {expected} "
        f"({_gradient_hint(got, expected)}{words} {float((g - target).norm()) / scale:.3g}) [{_dtype_name(dtype)}]",
        (f"E[∇] = {[round(float(x), 6) for x in g]}; expected {[round(float(x), 6) for x in target]}; "
         f"tolerance {tol:.2g} (the exact gradients: kl_bench.testing.Categorical.kl_gradients)",))


def _gradient_hint(got: str, expected: str) -> str:
    pair = {got, expected}
    if pair == {"∇KL(q‖p)", "∇KL(p‖q)"}:
        return "direction swapped; "
    if got == "0":
        return "no gradient: is the value detached, or k1 in the loss?; "
    return ""


def gradient_cases(ref: Reference) -> list[Categorical]:
    """The cases where no declared clamp fires on any token (a clamp that fires zeroes that token's
    gradient, which none of the three references has)."""
    keep = []
    for case in CASES:
        logr = case.log_p() - case.log_q()
        v = ref.est.fn(logr)
        inside = ref.input_clamp is None or bool(((logr >= ref.input_clamp[0]) & (logr <= ref.input_clamp[1])).all())
        inside = inside and (ref.clamp is None or bool(((v > ref.clamp[0]) & (v < ref.clamp[1])).all()))
        if inside and case.gradients:
            keep.append(case)
    return keep
