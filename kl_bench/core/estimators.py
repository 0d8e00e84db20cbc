"""Monte Carlo KL estimators as pure tensor functions of the per-draw log-ratio, with their
capabilities declared (see docs/estimators.md).

Notation: x ~ q, log r = log p(x) − log q(x), r = exp(log r). Reference: J. Schulman, "Approximating KL
Divergence" (2020), http://joschu.net/blog/kl-approx.html.

Every estimator maps ``logr: Tensor[...]`` to a tensor of the same shape and dtype. ``logr`` may be
−inf where p(x) = 0 < q(x); every built-in returns a well-defined value there (+inf or 0), never NaN.
An estimator that declares ``needs_logq`` is a function of the sampled token's two probabilities, not of
their ratio alone (the sampled-token proxies ``bin_kl`` and ``bin_tv`` that trainers gate tokens with):
it maps ``(logr, logq)`` to values, ``logq`` = log q(x) of the same draws; call it through
:meth:`Estimator.on`, which passes what it needs.

What the rest of the code asks an estimator (never its name):
- ``poly``: its value as Σ c · r^s · (log r)^k, {(s, k): c}. Exact oracles get E[f] and E[f²] from the
  moments E[r^s (log r)^k] (closed forms for Gaussians, the dynamic program for rollouts).
- ``abs_poly``: its value as |Σ c · r^s · (log r)^k| (``abs``): E[f²] is still a polynomial moment.
- ``token_only``: not a polynomial in r and log r, so on rollouts it gets token-level rows only (that
  is where trainers apply such functions, and where an exact oracle exists for any function).
- ``needs_logq``: a function of (log r, log q(x)); token-only, no gradient rows, and only on kinds that
  hand the estimators log q(x) (every kind with a vocabulary; not the Gaussian, whose densities are not
  probabilities).
- ``straight_through``: trainers use it with the straight-through trick (the value of this estimator,
  the gradient of k2), so it gets that gradient mode.

``full`` is not an estimator: it is a row the pair supplies (:data:`FULL`, a :class:`PairRow`), the
analytic KL of each draw's context(s).

Plug-ins: ``"package.module:function"`` in a spec's ``estimators`` (a function of log r, elementwise),
:func:`register_estimator`, or the ``kl_bench.estimators`` entry-point group (its name is a contract with
installed plug-ins: it stayed when this module moved to ``kl_bench.core``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from ..foundation.errors import SpecError
from ..foundation.formatting import CV, CV_OPT  # noqa: F401  (the rows' names, used here and re-exported)
from .presets import PRESETS, WeightedClamp, neg_inf_limit
from ..foundation.registry import Registry, UnknownName, did_you_mean
from .targets import FORWARD, REVERSE, TV, check_target

Poly = dict[tuple[int, int], float]


def poly_derivative(poly: Poly) -> Poly:
    """d/dL of Σ a r^s L^k (r = e^L): Σ a (s r^s L^k + k r^s L^(k−1))."""
    out: Poly = {}
    for (s, k), a in poly.items():
        if s:
            out[(s, k)] = out.get((s, k), 0.0) + a * s
        if k:
            out[(s, k - 1)] = out.get((s, k - 1), 0.0) + a * k
    return out


@dataclass(frozen=True)
class Estimator:
    name: str
    fn: Callable[[torch.Tensor], torch.Tensor] = field(compare=False)
    target: str          # a registered target (kl_bench.core.targets): what the estimator estimates
    unbiased: bool       # E_q[f] equals the target exactly
    nonnegative: bool    # f ≥ 0 for every draw
    formula: str
    poly: Poly | None = None
    abs_poly: Poly | None = None
    straight_through: bool = False
    lam: float | None = None   # λ of a control variate cv(λ); None otherwise
    fitted: bool = False       # cv_opt: λ fitted on an independent pilot pass
    plugin: bool = False       # loaded from user code: its output is checked on every call
    # NeMo-RL's importance-weighted clamp order (kl_bench.core.presets): gets the loss_is_nemo gradient mode
    weighted: WeightedClamp | None = None
    source: str = ""           # library presets: the file whose formula it reproduces
    library_mode: str = ""     # library presets: the gradient mode the library applies by default
    # ≥ 0 in exact arithmetic, but the formula's order of operations (a library's (e^ℓ − 1) − ℓ in float32)
    # rounds to slightly below 0 near log r = 0 (−6e-8): not ``nonnegative``, listed as "≥0 up to rounding"
    rounding_negative: bool = False
    needs_logq: bool = False   # fn(logr, logq): a function of the sampled token's own probabilities too
    analytic: ClassVar[bool] = False   # a function of log r (PairRow: supplied by the pair)

    def __post_init__(self):
        check_target(self.target)
        if self.needs_logq and (self.poly is not None or self.abs_poly is not None):
            raise ValueError(f"estimator '{self.name}': a function of log q(x) is not a polynomial in r and log r")

    def on(self, logr: torch.Tensor, logq: torch.Tensor | None = None) -> torch.Tensor:
        """The estimator's values on draws with log-ratio ``logr`` and, where it needs it, log q(x) ``logq``
        (same shape). A caller that has no log q(x) passes None; an estimator needing it then raises."""
        if not self.needs_logq:
            return self.fn(logr)
        if logq is None:
            raise SpecError(f"estimator '{self.name}' needs log q(x) of each draw, which this caller does not have")
        return self.fn(logr, logq)

    @property
    def token_only(self) -> bool:
        return self.poly is None


@dataclass(frozen=True)
class PairRow:
    """A row whose per-draw value the pair supplies instead of a function of log r."""
    name: str
    target: str
    formula: str
    draws_field: str = "full"           # the kl_bench.core.draws.Draws field that holds its per-draw value
    unbiased: bool = True
    nonnegative: bool = True
    poly: ClassVar[None] = None
    abs_poly: ClassVar[None] = None
    lam: ClassVar[None] = None
    fitted: ClassVar[bool] = False
    straight_through: ClassVar[bool] = False
    needs_logq: ClassVar[bool] = False
    plugin: ClassVar[bool] = False
    token_only: ClassVar[bool] = True   # on rollouts: summed along the path (tok)
    analytic: ClassVar[bool] = True


# `full`: Σ_x q(x|c) log(q(x|c)/p(x|c)) for the draw's context c (summed over the steps of a rollout).
# Its expectation is KL(q‖p) and it has no sampling noise within a context (Rao–Blackwellisation).
FULL = PairRow("full", REVERSE, "Σ_x q log(q/p) per context")
PAIR_ROWS: dict[str, PairRow] = {FULL.name: FULL}

RowSource = Estimator | PairRow


def _r_logr(logr: torch.Tensor) -> torch.Tensor:
    # r·log r → 0 as log r → −inf (p(x) = 0); the plain product would give 0·(−inf) = NaN.
    # exp of float64 log-ratios overflows only past log r ≈ 709, far beyond any sane pair.
    return torch.where(torch.isneginf(logr), torch.zeros_like(logr), torch.exp(logr) * logr)


def k1(logr: torch.Tensor) -> torch.Tensor:
    """k1 = −log r. Shape-preserving. Unbiased for KL(q‖p); high variance when KL is small."""
    return -logr


def k2(logr: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log r)². Shape-preserving. Biased (an f-divergence), low variance, ≥ 0."""
    return 0.5 * logr * logr


def k3(logr: torch.Tensor) -> torch.Tensor:
    """k3 = (r − 1) − log r. Shape-preserving. Unbiased for KL(q‖p) and ≥ 0.

    Written as expm1(log r) − log r: for |log r| ≪ 1 the two terms nearly cancel, and expm1 keeps
    the full precision of r − 1 that exp(log r) − 1 would lose.
    """
    return torch.expm1(logr) - logr


def abs_logr(logr: torch.Tensor) -> torch.Tensor:
    """abs = |log r|. Shape-preserving. Biased upward as an estimate of KL(q‖p)."""
    return logr.abs()


# r·log r: d/dℓ = r(log r + 1) → 0 as log r → −∞, but autograd of the product meets 0·∞ there.
@neg_inf_limit
def fwd_k1(logr: torch.Tensor) -> torch.Tensor:
    """fwd_k1 = r log r. Shape-preserving. Importance-weighted, unbiased for KL(p‖q)."""
    return _r_logr(logr)


@neg_inf_limit
def fwd_k3(logr: torch.Tensor) -> torch.Tensor:
    """fwd_k3 = r log r − (r − 1). Shape-preserving. Unbiased for KL(p‖q) and ≥ 0."""
    return _r_logr(logr) - torch.expm1(logr)


def _log1mexp(a: torch.Tensor) -> torch.Tensor:
    """log(1 − e^a) for a ≤ 0, without the cancellation of 1 − e^a: log(−expm1(a)) near a = 0 (where
    1 − e^a is small and expm1 keeps its digits), log1p(−e^a) below −ln 2 (Mächler, "Accurately computing
    log(1 − exp(−|a|))", 2012). −inf at a = 0."""
    return torch.where(a > -0.6931471805599453, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def _mass_k3(logw: torch.Tensor, logv: torch.Tensor) -> torch.Tensor:
    """w·k3(log(v/w)) = w·(v/w − 1 − log(v/w)) for masses w = e^logw, v = e^logv ≤ 1, ≥ 0 and finite wherever the
    limit is: w·expm1(·) − w·(·) where v/w ≤ e (no large terms to cancel, expm1 keeps the digits where v ≈ w),
    v − w(1 + log(v/w)) beyond (where v/w could overflow, and v dominates). w = 0: the limit v; v = 0 < w: +inf."""
    ratio = torch.where(logw == logv, torch.zeros_like(logw), logv - logw)    # log(v/w); 0 where both are −inf
    near = torch.exp(logw) * k3(ratio.clamp(max=1.0))
    w = torch.exp(logw)
    far = torch.exp(logv) - torch.where(w == 0, torch.zeros_like(w), w * (1 + ratio))
    return torch.where(ratio > 1.0, far, near)


def bin_kl(logr: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """bin_kl = D(q(x) ‖ p(x)), the KL between the two Bernoulli laws "the sampled token or not" (DPPO, Qi et
    al., arXiv 2602.04879, the binary approximation of its divergence mask). Shape-preserving; ``logq`` =
    log q(x), log p(x) = logq + logr.

    Written as q·k3(log r) + (1 − q)·k3(log r̄) with r̄ = (1 − p)/(1 − q): the two k3 terms add up to the
    binary KL because q(r − 1) + (1 − q)(r̄ − 1) = 0, and each is ≥ 0, so no two large terms cancel (the
    textbook q log(q/p) + (1−q) log((1−q)/(1−p)) loses the small difference of two large ones). 1 − q and
    1 − p come from log1mexp, not subtraction: for q(x) near 1 the subtraction keeps no digits of 1 − q.
    +inf where p(x) = 0 < q(x) or p(x) = 1 > q(x); 0 where q = p; −log p at q(x) = 1."""
    logp = logq + logr
    return _mass_k3(logq, logp) + _mass_k3(_log1mexp(logq), _log1mexp(logp))


def bin_tv(logr: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """bin_tv = |q(x) − p(x)| (DPPO's binary total variation of the sampled token). Shape-preserving.
    q·|r − 1| with expm1 where r ≤ e (the digits of r − 1 where p ≈ q), p − q beyond (r may overflow)."""
    near = torch.exp(logq) * torch.expm1(logr.clamp(max=1.0)).abs()
    return torch.where(logr > 1.0, torch.exp(logq + logr) - torch.exp(logq), near)


def _adapt_plugin(ref: str, obj: Any) -> Estimator:
    """A plug-in object → an Estimator: a registered one, or a plain function of log r."""
    est = getattr(obj, "__kl_bench_estimator__", obj)
    if isinstance(est, Estimator):
        return est
    if not callable(obj):
        raise SpecError(f"estimator plug-in '{ref}' is a {type(obj).__name__}, not a function of log r")
    return _checked(Estimator(ref, obj, REVERSE, False, False, f"plug-in {ref}", plugin=True))


ESTIMATORS: Registry[Estimator] = Registry("estimator", entry_points="kl_bench.estimators", adapt=_adapt_plugin)

ESTIMATORS.add("k1", Estimator("k1", k1, REVERSE, True, False, "−log r", {(0, 1): -1.0}))
ESTIMATORS.add("k2", Estimator("k2", k2, REVERSE, False, True, "½(log r)²", {(0, 2): 0.5}))
ESTIMATORS.add("k3", Estimator("k3", k3, REVERSE, True, True, "(r−1) − log r",
                               {(1, 0): 1.0, (0, 0): -1.0, (0, 1): -1.0}, straight_through=True))
ESTIMATORS.add("abs", Estimator("abs", abs_logr, REVERSE, False, True, "|log r|", abs_poly={(0, 1): 1.0}))
ESTIMATORS.add("fwd_k1", Estimator("fwd_k1", fwd_k1, FORWARD, True, False, "r·log r", {(1, 1): 1.0}))
ESTIMATORS.add("fwd_k3", Estimator("fwd_k3", fwd_k3, FORWARD, True, True, "r·log r − (r−1)",
                                   {(1, 1): 1.0, (1, 0): -1.0, (0, 0): 1.0}))
# The sampled-token proxies trainers gate tokens with: a small share of the divergence they stand for.
ESTIMATORS.add("bin_kl", Estimator("bin_kl", bin_kl, REVERSE, False, True, "q log(q/p) + (1−q) log((1−q)/(1−p)) of x",
                                   needs_logq=True))
ESTIMATORS.add("bin_tv", Estimator("bin_tv", bin_tv, TV, False, True, "|q(x) − p(x)|", needs_logq=True))

# Library presets ("<library>.<name>", no colon: a colon marks a plug-in), formula for formula.
for _p in PRESETS:
    ESTIMATORS.add(_p.name, Estimator(_p.name, _p.fn, REVERSE, _p.unbiased, _p.nonnegative, _p.formula, _p.poly,
                                      _p.abs_poly, weighted=_p.weighted, source=_p.source,
                                      library_mode=_p.mode, rounding_negative=_p.rounding_negative))

DEFAULT_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3", "full")


# ----------------------------------------------------------------------------- plug-ins
_PROBE = (-30.0, -1.0, -1e-3, 0.0, 1e-3, 1.0, 30.0)


def _checked(est: Estimator) -> Estimator:
    """Wrap a plug-in so that an exception, a wrong shape or NaN is one input error naming it; probe it
    once now, so that a broken plug-in fails before any sampling."""
    user_fn = est.fn

    def fn(logr: torch.Tensor) -> torch.Tensor:
        try:
            out = user_fn(logr)
        except SpecError:
            raise
        except (Exception, SystemExit) as e:      # sys.exit() in a plug-in must not end kl-bench with exit 0
            raise SpecError(f"estimator '{est.name}' raised {e.__class__.__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''}") from None
        if not isinstance(out, torch.Tensor) or out.shape != logr.shape:
            got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise SpecError(f"estimator '{est.name}' must return a tensor of the input's shape "
                            f"{list(logr.shape)}, got {got}")
        if out.requires_grad and not logr.requires_grad:
            raise SpecError(f"estimator '{est.name}' returned a tensor that requires grad (it uses a parameter): "
                            "return a function of log r alone")
        bad = torch.isnan(out) & ~torch.isnan(logr)
        if bool(bad.any()):
            x = float(logr[bad].reshape(-1)[0])
            raise SpecError(f"estimator '{est.name}' returned NaN (first at log r = {x:g})")
        return out.to(logr.dtype)
    wrapped = Estimator(est.name, fn, est.target, est.unbiased, est.nonnegative, est.formula, est.poly,
                        est.abs_poly, est.straight_through, plugin=True)
    wrapped.fn(torch.tensor(_PROBE, dtype=torch.float64))  # host: a plug-in's probe on fixed values
    return wrapped


def register_estimator(name: str, *, target: str = REVERSE, unbiased: bool = False, nonnegative: bool = False,
                       formula: str | None = None, poly: Poly | None = None):
    """Decorator: register a function of log r (elementwise, same shape out) as estimator ``name``.

    >>> import torch, kl_bench
    >>> @kl_bench.register_estimator("half_k1_doc", unbiased=False)
    ... def half_k1(logr):
    ...     return -0.5 * logr
    >>> kl_bench.ESTIMATORS["half_k1_doc"].fn(torch.tensor([-2.0])).tolist()
    [1.0]
    >>> kl_bench.ESTIMATORS.remove("half_k1_doc")

    ``poly`` (optional) declares the value as Σ c r^s (log r)^k, which gives exact moments on every
    kind; without it exact moments come from sums (categoricals), the dynamic program (rollout token
    rows) and quadrature (1-D Gaussians)."""
    def deco(fn: Callable[[torch.Tensor], torch.Tensor]):
        est = _checked(Estimator(name, fn, target, unbiased, nonnegative, formula or f"plug-in {name}", poly))
        old = ESTIMATORS.get(name)
        if old is not None and not old.plugin:
            raise SpecError(f"estimator '{name}' is built in; register the plug-in under another name")
        ESTIMATORS.add(name, est, replace=True)     # re-running a notebook cell re-registers it
        fn.__kl_bench_estimator__ = est
        return fn
    return deco


# ----------------------------------------------------------------------------- control variate, clamps
def cv(logr: torch.Tensor, lam: float) -> torch.Tensor:
    """cv(λ) = −log r + λ(r − 1). Shape-preserving. Unbiased for KL(q‖p) for every λ because
    E_q[r] = 1; ≥ 0 for all r only at λ = 1, where it is k3. λ* = Cov(log r, r)/Var(r) minimises
    its variance (docs/lambda.md)."""
    return -logr + lam * torch.expm1(logr)


def make_cv(lam: float, *, fitted: bool = False) -> Estimator:
    """The control variate at a fixed λ, as an Estimator (a functools.partial of :func:`cv`) named "cv";
    ``fitted``: λ was fitted on a pilot pass (named "cv_opt")."""
    return Estimator(CV_OPT if fitted else CV, functools.partial(cv, lam=lam), REVERSE, True, lam == 1.0,
                     f"−log r + {lam:g}(r−1)", {(0, 1): -1.0, (1, 0): lam, (0, 0): -lam}, lam=lam, fitted=fitted)


def poly_square(poly: Poly) -> Poly:
    """Coefficients of f² given those of f (products of r^s (log r)^k terms)."""
    out: Poly = {}
    for (s1, k1_), c1 in poly.items():
        for (s2, k2_), c2 in poly.items():
            key = (s1 + s2, k1_ + k2_)
            out[key] = out.get(key, 0.0) + c1 * c2
    return out


@dataclass(frozen=True)
class EstimatorOption:
    """A registry estimator with the clamps trainers apply: log r clamped to ±logr_clamp before the
    estimator, the estimate clamped to ±clamp after. Reported under ``label``."""
    name: str
    label: str
    logr_clamp: float | None = None
    clamp: float | None = None


def clamped(logr: torch.Tensor, base: Callable[[torch.Tensor], torch.Tensor], logr_clamp: float | None,
            clamp: float | None) -> torch.Tensor:
    """``base`` as trainers compute it: log r clamped to ±logr_clamp before (so that exp cannot
    overflow), the estimate clamped to ±clamp after. Shape-preserving."""
    x = logr.clamp(-logr_clamp, logr_clamp) if logr_clamp is not None else logr
    f = base(x)
    return f.clamp(-clamp, clamp) if clamp is not None else f


def lookup(name: str) -> RowSource:
    """A spec's estimator name: a pair-supplied row (``full``), a registered estimator, or a plug-in."""
    if name in PAIR_ROWS:
        return PAIR_ROWS[name]
    try:
        return ESTIMATORS[name]
    except UnknownName:
        known = ESTIMATORS.names() + list(PAIR_ROWS)
        raise UnknownName(f"unknown estimator '{name}'{did_you_mean(name, known)}; known: {', '.join(known)} "
                          "(or a plug-in 'package.module:function')") from None


def resolve_estimator(item) -> RowSource:
    """A registry name (or plug-in reference), an Estimator/PairRow, or a spec EstimatorOption (a clamped
    variant reported under its label)."""
    if isinstance(item, (Estimator, PairRow)):
        return item
    if isinstance(item, str):
        return lookup(item)
    if not isinstance(item, EstimatorOption):
        # Anything else (an int, None, a bare function) has no name to look up: said here, not as an
        # AttributeError on ``.name`` below. A bare function is not guessed at: registering it says its target.
        raise SpecError(f"must be an estimator's name (e.g. 'k3'), a plug-in reference ('package.module:function') "
                        f"or an Estimator, got {type(item).__name__}" + (
                            " (register a function with kl_bench.register_estimator, then give its name)"
                            if callable(item) else ""), key="estimator")
    base = lookup(item.name)
    if base.analytic:
        raise SpecError(f"'{base.name}' does not depend on log r: clamps do not apply")
    fn = functools.partial(clamped, base=base.fn, logr_clamp=item.logr_clamp, clamp=item.clamp)
    bits = ([f"log r clamped to ±{item.logr_clamp:g}"] if item.logr_clamp is not None else []) + \
        ([f"estimate clamped to ±{item.clamp:g}"] if item.clamp is not None else [])
    return Estimator(item.label, fn, base.target, False, base.nonnegative, f"{base.formula}, {', '.join(bits)}")
