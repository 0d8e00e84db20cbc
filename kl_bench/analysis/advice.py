"""Advice that fits how an estimator is used: one line per case for the value a trainer logs (or puts in
the reward), and one for the loss, plus the warnings a run's rows call for.

Analysis only: a summary DataFrame (and, where computed, the gradients DataFrame) in, sentences out; no
engine, case kind or sampler is imported, so that a script, ``kl-bench run``, ``kl-bench exact`` and a
notebook get the same advice (:meth:`kl_bench.api.Result.recommendations`).

Why two lines. An estimator's *value* is judged by its bias and spread as a batch mean: what the logged
KL or the KL in the reward is. In the *loss* what matters is the expected gradient, and that is not the
gradient of the expected value: k1 in the loss has zero expected gradient although its mean is the KL
exactly, and k3 in the loss follows ∇KL(p‖q) (docs/gradients.md). So the value advice ranks estimators by
RMSE at the user's batch among those that can reach the tolerance at all, and the loss advice ranks
estimator × mode rows by whether their expected gradient equals ∇KL(q‖p), then by the batch they need for
a cosine of 0.9.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from ..core.aggregates import PER_TOKEN
from ..core.draws import draws_from_b, row_label
from ..core.estimators import CV, PAIR_ROWS
from ..foundation.formatting import count, fmt, pct
from ..core.planning import n_for_rel_error, never_words, rmse
from ..core.rejection import WORDS as REJECTION_WORDS
from .gate_advice import gate_lines, proxy_shares
from ..core.stats import HeavyTail, unknown_reason
from ..core.targets import REVERSE

DEFAULT_BATCH = 64
DEFAULT_TOLERANCE = 0.10
PROB = 0.95           # "within ±tolerance with 95% probability"

# Per-draw identities (docs/gradients.md), valid when the draws come from q itself.
IDENTITIES = ("k2 in the loss, k3 with an IS weight q/sg(q) or straight-through, and k1 in the reward follow "
              "∇KL(q||p) exactly; k1 in the loss has zero expected gradient and k3 in the loss follows ∇KL(p||q)")
IS_HINT = ('the bias comes from drawing from b ≠ q: importance weights q/b (sampler weights = "token", or '
           '"sequence" on a rollout) make k1 and k3 unbiased again')
REJECTION_HINT = ("part of the bias is the sampler's rejection mask (a rejected sequence counts 0 whatever the "
                  "importance weights), which no weight undoes")


@dataclass(frozen=True)
class Advice:
    """One recommendation. ``use``: "value" (what is logged or put in the reward) or "loss" (what is
    differentiated); ``row``: the recommended row's label ("" where none qualifies); ``detail``: the
    sentence, without the case's name; ``general``: it restates identities that hold for every case
    drawn from q (the terminal prints such a sentence once)."""
    case: str
    use: str
    row: str
    detail: str
    general: bool = False
    cases: tuple[str, ...] = ()     # a merged sentence (:func:`merged`): every case it holds for

    @property
    def text(self) -> str:
        return f"{self.case}: {self.detail}"

    def __str__(self) -> str:
        return self.text


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _sampler(rows: pd.DataFrame) -> str:
    """The case's sampler b ≠ q as its rows name it; "" where the draws come from q (no sampler, or one
    that changes nothing: "q itself", which is no mismatch)."""
    s = rows["sampler"].iloc[0] if "sampler" in rows and len(rows) else ""
    return s if draws_from_b(s) else ""


def _unweighted_sampler(rows: pd.DataFrame) -> bool:
    """Draws from b ≠ q with no importance weights: unbiased estimators of KL(q||p) are biased here."""
    s = _sampler(rows)
    return bool(s) and "IS weights" not in s


def _sampler_hint(rows: pd.DataFrame) -> str:
    """Why a sampler biases the estimates, and the remedy: IS weights where b covers q's support; where b
    never draws some of q's mass (top-k, top-p, min_length), no weight recovers it."""
    if REJECTION_WORDS in _sampler(rows):
        return REJECTION_HINT
    miss = rows["support_miss"].max() if "support_miss" in rows and len(rows) else 0.0
    if isinstance(miss, float) and miss > 0:
        return (f"the sampler never draws {fmt(miss, 3)} of q's mass (worst context or step), which no importance "
                "weight recovers: compute the KL on draws from q itself (no top-k, top-p or min_length)")
    return IS_HINT if _unweighted_sampler(rows) else ""


def _value_candidates(df: pd.DataFrame, case: str) -> pd.DataFrame:
    """Estimators of the sequence KL(q||p) from sampled log-probs: not pair-supplied rows (``full`` needs
    the whole next-token distributions), not rates per token (another quantity), not the λ sweep."""
    c = df[(df["case"] == case) & (df["target"] == REVERSE) & (df["estimator"] != CV)
           & ~df["estimator"].isin(list(PAIR_ROWS)) & ~df["aggregate"].fillna("").isin(PER_TOKEN)]
    return c


def _plan(r, batch: int, tolerance: float) -> tuple[float, float, float]:
    """(RMSE at the batch, batch for ±tolerance with 95% probability, relative bias) of one row, from
    the exact bias and std where known, else the measured ones (as planning.add_planning does)."""
    true = float(r["true_kl"])
    mean = r["exact_mean"] if _finite(r["exact_mean"]) else r.get("mean", math.nan)
    std = r["exact_std"] if not (isinstance(r["exact_std"], float) and math.isnan(r["exact_std"])) \
        else r.get("std", math.nan)
    bias = mean - true if _finite(true) else math.nan
    rel = bias / true if _finite(true) and true != 0 else math.nan
    return rmse(bias, std, batch), n_for_rel_error(bias, std, true, tolerance, PROB), rel


def _biased(rel: float) -> str:
    """"unbiased" or "+1.2% biased": a relative bias in the advice's words."""
    return "unbiased" if abs(rel) < 1e-9 else f"{pct(rel)} biased"


def _pct(tolerance: float) -> str:
    return f"±{tolerance:.0%}" if round(tolerance * 100) == tolerance * 100 else f"±{tolerance:.2%}"


def value_advice(df: pd.DataFrame, case: str, batch: int = DEFAULT_BATCH,
                 tolerance: float = DEFAULT_TOLERANCE) -> Advice:
    """The estimator to log (or to put in the reward) for one case."""
    c = _value_candidates(df, case)
    if _all_exactly_zero(c):
        return Advice(case, "value", "", "to log: KL(q||p) = 0 here (p = q where q samples): every estimator is "
                      "exactly 0 on every draw, so any of them is exact at any batch size")
    plans = {i: _plan(r, batch, tolerance) for i, r in c.iterrows()}
    plans = {i: p for i, p in plans.items() if _finite(p[0])}
    if not plans:
        return _reference_advice(df, case, batch) or _no_plan(c, case)
    hint = _hint(df, case, c)
    reach = {i: p for i, p in plans.items() if _finite(p[1])}
    if not reach:      # never recommend what cannot reach the tolerance as if it could
        return _unreachable(c, case, plans, batch, tolerance, hint)
    best = min(reach, key=lambda i: reach[i][0])
    r = c.loc[best]
    line = _best_line(r, reach[best], batch, tolerance) + _alternatives(c, plans, reach, best, batch, tolerance) \
        + _pair_row_note(df, case, reach[best][1], batch, tolerance)
    if _finite(reach[best][2]) and abs(reach[best][2]) > 1e-6:
        line += hint
    return Advice(case, "value", row_label(r), line + _heavy_warning(r))


def _heavy_warning(r) -> str:
    """"; warning: <heavy-tail class>" for a heavy-tailed row, else ""."""
    heavy = r.get("heavy_tail")
    return f"; warning: {heavy}" if isinstance(heavy, str) and heavy else ""


def _unreachable(c: pd.DataFrame, case: str, plans: dict, batch: int, tolerance: float, hint: str) -> Advice:
    """The value advice where no candidate gets within the tolerance at any batch size: why, and whose RMSE at
    ``batch`` is the lowest."""
    best = min(plans, key=lambda i: plans[i][0])
    why = never_words(({"n_for_10pct": math.inf, "exact_rel_bias": p[2], "exact_std": c.loc[i, "exact_std"]}
                       for i, p in plans.items()), tolerance)
    return Advice(case, "value", "", f"to log: no estimator of KL(q||p) gets within {_pct(tolerance)} at "
                  f"any batch size ({why}; the lowest RMSE at {batch:,} is "
                  f"{row_label(c.loc[best])}'s, {_biased(plans[best][2])}){hint}")


def _hint(df: pd.DataFrame, case: str, c: pd.DataFrame) -> str:
    """"; why the sampler biases the estimates" for the value advice, or ""."""
    hint = _sampler_hint(df[df["case"] == case]) if _sampler(c) else ""
    return f"; {hint}" if hint else ""


def _all_exactly_zero(c: pd.DataFrame) -> bool:
    """KL(q||p) = 0 with every candidate's exact mean and std 0 (p = q: every trainer's step 0)."""
    return bool(len(c)) and all(r["true_kl"] == 0 and r["exact_mean"] == 0 and r["exact_std"] == 0
                                for _, r in c.iterrows())


def _no_plan(c: pd.DataFrame, case: str) -> Advice:
    """Where no candidate has a finite RMSE: a case with neither exact moments nor measured ones (Monte Carlo
    only, e.g. a rejection mask by a sum over tokens, and nothing sampled yet) says so."""
    if len(c) and "mean" not in c and not c["exact_mean"].map(_finite).any():
        return Advice(case, "value", "", "no exact moments here (Monte Carlo only): `kl-bench run` measures them")
    return Advice(case, "value", "", "no estimator of KL(q||p) has a finite RMSE here")


def _best_line(r, plan: tuple[float, float, float], batch: int, tolerance: float) -> str:
    err, n, _ = plan
    true = float(r["true_kl"])
    scale = f", {fmt(err / true, 3)}× the KL" if _finite(true) and true > 0 else ""
    return (f"to log, {row_label(r)} (RMSE {fmt(err)} at a batch of {batch:,}{scale}); {_pct(tolerance)} with "
            f"{PROB:.0%} probability needs a batch of {count(n)}")


def _alternatives(c: pd.DataFrame, plans: dict, reach: dict, best, batch: int, tolerance: float) -> str:
    """What the user might pick instead: the estimator that reaches the tolerance with fewer draws, and
    those with a lower RMSE at the batch that never reach it (named, so that they are not mistaken)."""
    out = ""
    fewer = min(reach, key=lambda i: reach[i][1])
    if fewer != best and reach[fewer][1] < reach[best][1]:
        out += f"; {row_label(c.loc[fewer])} gets there with fewer draws ({count(reach[fewer][1])}, {_biased(reach[fewer][2])})"
    lower = [i for i, p in plans.items() if i not in reach and p[0] < reach[best][0]]
    if lower:
        names = ", ".join(row_label(c.loc[i]) for i in lower)
        out += f" ({names}: lower RMSE at {batch:,}, but biased beyond {_pct(tolerance)} at any batch)"
    return out


def _pair_row_note(df: pd.DataFrame, case: str, n_best: float, batch: int, tolerance: float) -> str:
    """Where the case has a pair-supplied row (``full``: Σ_x q log(q/p) per context, Rao–Blackwellised) that
    reaches the tolerance with fewer draws than the sampled-log-prob pick: that it does, for a trainer that
    has the whole next-token distributions (issue 44: 79 draws against k3's 1,042 went unsaid)."""
    c = df[(df["case"] == case) & (df["target"] == REVERSE) & df["estimator"].isin(list(PAIR_ROWS))
           & ~df["aggregate"].fillna("").isin(PER_TOKEN)]
    plans = {i: _plan(r, batch, tolerance) for i, r in c.iterrows()}
    plans = {i: p for i, p in plans.items() if _finite(p[1]) and p[1] < n_best}
    if not plans:
        return ""
    i = min(plans, key=lambda j: plans[j][1])
    return (f"; with the whole next-token distributions at hand, {row_label(c.loc[i])} (Rao–Blackwellised) "
            f"needs {count(plans[i][1])} (RMSE {fmt(plans[i][0])} at {batch:,})")


def _reference_advice(df: pd.DataFrame, case: str, batch: int) -> Advice | None:
    """Where no exact value exists but a Monte Carlo reference does: the sampled-log-prob estimator with
    the smallest measured RMSE at the batch against the reference, sqrt((mean − ref)² + std²/batch)."""
    c = df[(df["case"] == case) & (df["target"] == REVERSE) & (df["estimator"] != CV)
           & ~df["estimator"].isin(list(PAIR_ROWS))]
    if "ref_kl" not in c or c["ref_kl"].isna().all():
        return None
    # the bias against the reference as the data say it (logged data: the log's own means, ref_diff) and
    # the best-known std (exact over the log where it is, else measured)
    diff = c["ref_diff"] if "ref_diff" in c else c["mean"] - c["ref_kl"]
    std = c["exact_std"].where(c["exact_std"].map(_finite), c["std"])
    err = (diff ** 2 + std ** 2 / batch) ** 0.5
    if not err.map(math.isfinite).any():
        return None
    best = c.loc[err.idxmin()]
    return Advice(case, "value", row_label(best),
                  f"to log, {row_label(best)} (measured RMSE {fmt(float(err.min()))} at a batch of "
                  f"{batch:,} against the reference, the full mean {fmt(best['ref_kl'])} ± "
                  f"{fmt(best['ref_se'])}: Monte Carlo, no exact value)")


def _grad_label(r) -> str:
    agg = r.get("aggregate", "")
    lab = r["estimator"] if not _finite(r.get("lambda", math.nan)) else f"{r['estimator']}({r['lambda']:.3g})"
    lab = f"{agg} {lab}" if isinstance(agg, str) and agg else lab
    return f"{lab} in {r['mode']} mode"


def loss_advice(df: pd.DataFrame, case: str, gradients: pd.DataFrame | None = None) -> Advice:
    """The estimator × mode to differentiate for one case: from its gradient rows when they were
    computed, else from the per-draw identities (which hold only when the draws come from q)."""
    rows = df[df["case"] == case]
    g = gradients[gradients["case"] == case] if gradients is not None and "case" in gradients else None
    if g is None or g.empty:
        return _identity_advice(rows, case)
    cos = g["exact_cos_reverse"].where(g["exact_cos_reverse"].notna(), g["cos_reverse"]).astype(float)
    n90 = g["n_for_cos90"].astype(float)
    exact_rows = g[g["equals"] == "reverse"]
    tail = _pitfalls(g)
    if not exact_rows.empty:
        best = exact_rows.loc[n90[exact_rows.index].idxmin()]
        n = float(best["n_for_cos90"])
        need = f"; a batch of {n:,.0f} gives cos ≥ 0.9 with ∇KL" if _finite(n) else ""
        return Advice(case, "loss", _grad_label(best), f"in the loss, {_grad_label(best)} (expected "
                      f"gradient = ∇KL(q||p){need}){tail}")
    usable = g[cos.notna()]
    if usable.empty:
        return Advice(case, "loss", "", "in the loss: no gradient row has a cosine with ∇KL(q||p)")
    order = usable.assign(_c=cos[usable.index], _n=n90[usable.index]).sort_values(["_c", "_n"],
                                                                                   ascending=[False, True])
    best = order.iloc[0]
    hint = _sampler_hint(rows) if _sampler(rows) else ""
    hint = f"; {hint}" if hint else ""
    return Advice(case, "loss", _grad_label(best), f"in the loss, no estimator × mode follows ∇KL(q||p) "
                  f"exactly here; closest: {_grad_label(best)} (cos {fmt(best['_c'])}){hint}")


def _identity_advice(rows: pd.DataFrame, case: str) -> Advice:
    """The loss advice without gradient rows: the per-draw identities, which hold only when q draws."""
    if _sampler(rows):
        return Advice(case, "loss", "", "in the loss: draws come from b ≠ q, so the on-policy identities do "
                      "not hold; [experiment] gradients = true shows what each estimator × mode follows", general=True)
    return Advice(case, "loss", "", f"in the loss (per draw, on-policy): {IDENTITIES}; [experiment] gradients = true "
                  "measures their variances", general=True)


def _pitfalls(g: pd.DataFrame) -> str:
    """"; avoid: …" naming up to three gradient rows whose expected gradient is zero, ∇KL(p||q) or ∇UKL; or ""."""
    pitfalls = [f"{_grad_label(r)} has zero expected gradient" for _, r in g[g["equals"] == "zero"].iterrows()]
    pitfalls += [f"{_grad_label(r)} follows ∇KL(p||q)" for _, r in g[g["equals"] == "forward"].iterrows()]
    pitfalls += [f"{_grad_label(r)} follows the unnormalised KL over what the sampler draws (ukl)"
                 for _, r in g[g["equals"] == "ukl"].iterrows()]
    return f"; avoid: {', '.join(pitfalls[:3])}" if pitfalls else ""


def merged(advice: list[Advice]) -> list[Advice]:
    """``advice`` as ``kl-bench run`` prints it: each case's own sentences in order, then each sentence that holds
    for several cases alike (the on-policy identities) once, its ``case`` naming them all ("g, h") and ``cases``
    listing them. Already merged advice is returned as it is."""
    general: dict[str, list[Advice]] = {}
    out = []
    for a in advice:
        if a.general:
            general.setdefault(a.detail, []).append(a)
        else:
            out.append(a)
    for detail, alike in general.items():
        names = tuple(dict.fromkeys(c for a in alike for c in (a.cases or (a.case,))))
        out.append(Advice(", ".join(names), alike[0].use, alike[0].row, detail, True, names))
    return out


def advice_lines(advice: list[Advice]) -> list[str]:
    """The lines ``kl-bench run`` prints for ``advice`` (:func:`merged`)."""
    return [a.text for a in merged(advice)]


class AdviceOptionError(ValueError):
    """A batch or tolerance the advice cannot use; ``key`` names it."""

    def __init__(self, message: str, key: str):
        super().__init__(message)
        self.key = key


def check_options(batch: int, tolerance: float) -> None:
    """Refuse a batch that is not a whole number ≥ 1 or a tolerance outside (0, 1)."""
    if isinstance(batch, bool) or not (isinstance(batch, int) and batch >= 1):
        raise AdviceOptionError(f"the batch must be a whole number ≥ 1, got {batch!r}", "batch")
    if not (_finite(tolerance) and 0 < tolerance < 1):
        raise AdviceOptionError(f"the tolerance must lie in (0, 1) (0.05: ±5%), got {tolerance!r}", "tolerance")


def recommendations(df: pd.DataFrame, gradients: pd.DataFrame | None = None, *, batch: int = DEFAULT_BATCH,
                    tolerance: float = DEFAULT_TOLERANCE, gates: pd.DataFrame | None = None) -> list[Advice]:
    """Per case: the value advice, then the loss advice, then the gates' (kl_bench.analysis.gate_advice: the
    proxies' shares, and each swept gate's light threshold). ``df``: a summary (or exact) table;
    ``gradients``: the gradients table when one was computed; ``gates``: gates.csv's rows when swept."""
    check_options(batch, tolerance)
    out = []
    for case in dict.fromkeys(df["case"]):
        out.append(value_advice(df, case, batch, tolerance))
        out.append(loss_advice(df, case, gradients))
        shares = proxy_shares(df, case, gates)
        lines = gate_lines(gates, case) if gates is not None else []
        if shares or lines:
            out.append(Advice(case, "gate", "", "; ".join(([shares] if shares else []) + lines)))
    return out


def warnings(df: pd.DataFrame) -> list[str]:
    """One warning per case and kind of trouble (infinite targets, heavy tails, a sampler missing mass,
    token-mean rows leaving draws out), naming the estimators."""
    reasons = {h.value: h.explanation for h in HeavyTail if h not in (HeavyTail.NONE, HeavyTail.SUPPORT_MISS)}
    out = []
    for case in dict.fromkeys(df["case"]):
        c = df[df["case"] == case]
        out += _support_warnings(case, c)
        for target in dict.fromkeys(c.loc[c["true_kl"] == math.inf, "target"]):
            names = ", ".join(row_label(r) for _, r in c[c["target"] == target].iterrows())
            out.append(f"warning: case '{case}': {target} is infinite (a zero probability where the other side "
                       f"has mass); {names} cannot estimate it")
        out += _group_warnings(case, c)
        if "heavy_tail" not in c:
            continue
        for kind, text in reasons.items():
            hit = c[(c["heavy_tail"] == kind) & (c["true_kl"] != math.inf)]
            if hit.empty:
                continue
            names = ", ".join(row_label(r) for _, r in hit.iterrows())
            if kind == HeavyTail.DEGENERATE.value:          # the mean itself is unknown: say how few draws count
                r = hit.iloc[0]
                out.append(f"warning: case '{case}': {names}: "
                           + unknown_reason(kind, r.get("ess", math.nan), r["draws"], r.get("batches", math.nan)))
            else:
                out.append(f"warning: case '{case}': {names}: {text}; measured std and se are not trustworthy")
    return out


def _support_warnings(case: str, c: pd.DataFrame) -> list[str]:
    miss = c["support_miss"].max() if "support_miss" in c else 0.0
    if not miss > 0:
        return []
    # A summary's heavy_tail says whether the rows are weighted; an exact table (kl-bench exact) has none.
    weighted = (c["heavy_tail"] == HeavyTail.SUPPORT_MISS.value).any() if "heavy_tail" in c else None
    return [f"warning: case '{case}': the sampler never draws {fmt(miss, 3)} of q's mass (worst context or step): "
            + {True: "the importance weight q/b is infinite there, so the weighted estimates miss that mass "
                     "(flagged heavy_tail)",
               False: "every estimate is biased; the exact bias is shown",
               None: "the estimates miss that mass (biased; the exact bias is shown), or, weighted by q/b, "
                     "their weight is infinite there"}[weighted]]


def _group_warnings(case: str, c: pd.DataFrame) -> list[str]:
    """Rows with one value per group of B (tok_batch) use only the draws in whole groups of a batch."""
    if "draws" not in c or not len(c):
        return []
    most = int(c["draws"].max())
    short = c[c["draws"] < 0.99 * most]
    if short.empty:
        return []
    used = int(short["draws"].min())
    return [f"warning: case '{case}': tok_batch rows use {used:,} of {most:,} draws (only whole groups of "
            "token_mean_batch within each batch count): make draws / batches a multiple of token_mean_batch"]
