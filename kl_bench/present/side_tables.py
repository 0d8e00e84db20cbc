"""The tables across the cases of a run, printed after the per-case ones (:func:`side_tables` picks
those a run calls for): Schulman's layout, the cases side by side (:func:`schulman_table`); rollouts by
length (:func:`rollout_table`); sampling mismatch (:func:`mismatch_table`); control variates cv(λ)
(:func:`lambda_table`)."""
from __future__ import annotations

import math

import pandas as pd
from rich.markup import escape
from rich.table import Table

from ..core.draws import draws_from_b, row_label
from ..foundation.formatting import fmt, measured_cells, num as _num, pct
from .cells import bias_cells, dagger, pm, ratio_cell, unknown_mean, with_reference


def _with_exact(measured: str, exact: str) -> str:
    """"measured (exact)", or the measured value alone where no exact value exists (no empty brackets)."""
    return f"{measured} ({exact})" if exact else measured


def _exact_measured(exact: str, measured: str) -> str:
    """"exact (measured)", with either one alone where the other is blank (no empty brackets)."""
    return " ".join(x for x in (exact, f"({measured})" if measured else "") if x)


def _std_cell(r, value: float) -> str:
    # A std measured on a heavy tail is not to be trusted: mark it instead of printing it plainly.
    return ratio_cell(value) + dagger(r) if ratio_cell(value) else ""


MAX_TABLE_CASES = 8     # the side-by-side table's case columns beyond which it is not printed


def schulman_table(df: pd.DataFrame) -> Table:
    """Schulman's layout: rows are estimators; per case, bias/true (%) and std/true, measured (exact)."""
    df = with_reference(df)
    cases = list(dict.fromkeys(df["case"]))
    if len(cases) > MAX_TABLE_CASES:      # a sweep's grid: one column pair per case would not fit a screen
        t = Table(title=f"bias/true and std/true: {len(cases)} cases, too many for one table (see summary.csv "
                        "and the report's sweep figures)", title_justify="left", show_edge=False, pad_edge=False)
        return t
    t = Table(title="bias/true and std/true per estimator (measured, exact in brackets)",
              title_justify="left", show_edge=False, pad_edge=False)
    if "approx" in df and df["approx"].any():
        t.caption = ("≈: no exact value; measured against the reference, the Rao–Blackwellised full mean "
                     "(Monte Carlo), and no exact value in brackets")
        t.caption_justify = "left"
    t.add_column("estimator")
    for c in cases:
        true = df.loc[df["case"] == c, "true_kl"].iloc[0]
        approx = "≈" if "approx" in df and df.loc[df["case"] == c, "approx"].iloc[0] else "="
        t.add_column(escape(f"{c}\nbias/true"), justify="right")
        t.add_column(f"KL{approx}{fmt(true, 3)}\nstd/true", justify="right")
    keys = list(dict.fromkeys(zip(df["estimator"], df["aggregate"].fillna(""))))
    for est, agg in keys:
        cells = [f"{agg} {est}" if agg else est]
        for c in cases:
            row = df[(df["case"] == c) & (df["estimator"] == est) & (df["aggregate"].fillna("") == agg)]
            if row.empty:
                cells += ["", ""]
                continue
            cells += _schulman_cells(row.iloc[0])
        t.add_row(*cells)
    return t


def _schulman_cells(r) -> list[str]:
    """bias/true and std/true, "measured (exact)", the measured to its SE's precision (the SE not shown)."""
    truth = _num(r["true_kl"])
    if not (math.isfinite(truth) and truth != 0):       # no relative value (KL = 0) or no truth
        return ["unknown" if unknown_mean(r) else "", ""]
    bias, _, exact = bias_cells(_num(r["rel_bias"]) * abs(truth), r["bias_se"], _num(r["exact_rel_bias"]) * abs(truth),
                                truth, False)
    std, _, exact_std = measured_cells(r["rel_std"], _num(r["std_se"]) / abs(truth), r["exact_rel_std"])
    if unknown_mean(r):
        return [_with_exact("unknown", exact), exact_std]
    return [_with_exact(bias + dagger(r), exact), _with_exact(std + dagger(r) if std else "", exact_std)]


ROLLOUT_COLUMNS = [("k1", "seq"), ("k3", "seq"), ("k3", "tok"), ("full", "tok")]


def rollout_table(df: pd.DataFrame, lengths: dict[str, int]) -> Table:
    """Rollout cases by length: exact std/true (measured) of seq-k1, seq-k3, tok-k3 and full."""
    t = Table(title="rollouts: std/true against sequence length T, exact (measured)", title_justify="left",
              show_edge=False, pad_edge=False)
    approx_any = False
    for col in ["case", "T", "KL(q||p)"] + [f"{a} {e}" for e, a in ROLLOUT_COLUMNS]:
        t.add_column(col, justify="left" if col == "case" else "right")
    df = with_reference(df)
    for case, length in lengths.items():
        c = df[df["case"] == case]
        approx = "≈" if "approx" in c and c["approx"].iloc[0] else ""     # a Monte Carlo reference, not exact
        approx_any = approx_any or bool(approx)
        t.add_row(case, str(length), approx + fmt(c["true_kl"].iloc[0], 3),
                  *(_rollout_cell(c, est, agg) for est, agg in ROLLOUT_COLUMNS))
    if approx_any:
        t.title = "rollouts: std/true against sequence length T, exact (measured); ≈: measured only, std/reference"
        t.caption = ("≈: no exact value; the measured std / the reference (the Rao–Blackwellised full mean, "
                     "Monte Carlo)")
        t.caption_justify = "left"
    return t


def _rollout_cell(c: pd.DataFrame, est: str, agg: str) -> str:
    """A rollout case's exact std/true of one row (measured in brackets); blank where the case lacks the row."""
    hit = c[(c["estimator"] == est) & (c["aggregate"] == agg) & c["lambda"].isna()]
    if hit.empty:
        return ""
    h = hit.iloc[0]
    measured = _std_cell(h, h["rel_std"])
    # No exact value: the measured std/reference alone, marked ≈ like the KL column.
    return f"{fmt(h['exact_rel_std'])} ({measured})" if fmt(h["exact_rel_std"]) else (f"≈{measured}" if measured else "")


def mismatch_table(df: pd.DataFrame) -> Table:
    """Cases drawn from a sampler b ≠ q (only those: a case that samples q itself has no mismatch): the sign
    and size of each estimator's bias, exact and measured. More than MAX_TABLE_CASES of them (a sweep's grid)
    repeat what each case's own table printed, hundreds of lines: a title alone then points to summary.csv."""
    sampled = df[df["sampler"].map(draws_from_b)]
    n = sampled["case"].nunique()
    if n > MAX_TABLE_CASES:
        return Table(title=f"sampling mismatch: {n} cases drawn from b ≠ q, each with its bias/true above (E_b, "
                           "measured means and P(mean64<0): summary.csv)", title_justify="left", show_edge=False,
                     pad_edge=False)
    # the true KL of each row is in its case's heading above (a column of it made the table too wide for 80
    # columns once the case is a line of its own: kl_bench.present.terminal.grouped)
    t = Table(title="sampling mismatch: each estimator's bias against its true KL when draws come from b",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ["case", "sampler", "estimator", "E_b exact", "bias/true", "measured ± se", "P(<0)",
                "P(mean64<0)"]:
        t.add_column(col, justify="left" if col in ("case", "sampler", "estimator") else "right")
    for _, r in sampled.iterrows():
        rel = _num(r["exact_rel_bias"]) if math.isfinite(_num(r["exact_rel_bias"])) else _num(r["rel_bias"])
        arrow = "" if not math.isfinite(rel) or abs(rel) < 0.01 else ("[red]▲[/] " if rel > 0 else "[blue]▼[/] ")
        mean, se, exact = measured_cells(r["mean"], r["se"], r["exact_mean"])
        measured = "unknown" if unknown_mean(r) else pm(mean, se, dagger(r))
        t.add_row(escape(r["case"]), escape(str(r["sampler"])), row_label(r), exact,
                  f"{arrow}{pct(rel)}" if math.isfinite(rel) else "", measured,
                  fmt(r["frac_negative"], 2), fmt(r.get("p_neg_b64", math.nan), 2))
    return t


def lambda_table(df: pd.DataFrame) -> Table:
    """Per case: λ*, and std/true at k1 (λ = 0), k3 (λ = 1), λ* and the pilot-fitted cv_opt."""
    t = Table(title="control variate cv(λ) = −log r + λ(r−1): exact std/true (measured)", title_justify="left",
              show_edge=False, pad_edge=False)
    for col in ["case", "λ* exact", "λ* measured", "k1 (λ=0)", "k3 (λ=1)", "cv(λ*)", "cv_opt (λ)",
                "k3 / cv(λ*)"]:
        t.add_column(col, justify="left" if col == "case" else "right")
    cvs = df[df["estimator"].isin(["cv", "cv_opt"])]
    for case, agg in dict.fromkeys(zip(cvs["case"], cvs["aggregate"].fillna(""))):
        t.add_row(*_lambda_cells(cvs[(cvs["case"] == case) & (cvs["aggregate"].fillna("") == agg)], case, agg))
    return t


def _lambda_cells(c: pd.DataFrame, case: str, agg: str) -> list[str]:
    """One case (and aggregate) of :func:`lambda_table`: its cv rows ``c``."""
    r0 = c.iloc[0]

    def at(lam):
        hit = c[(c["estimator"] == "cv") & (c["lambda"] == lam)]
        return "" if hit.empty else _exact_measured(ratio_cell(hit.iloc[0]["exact_rel_std"]),
                                                    _std_cell(hit.iloc[0], hit.iloc[0]["rel_std"]))
    star = r0["lambda_star"]
    # Exact std at λ*: from any cv row, std(λ)/(1 + excess_std(λ)).
    usable = c[c["exact_std"].map(math.isfinite) & c["excess_std"].map(math.isfinite)]
    best = usable.iloc[0]["exact_std"] / (1 + usable.iloc[0]["excess_std"]) / r0["true_kl"] if len(usable) else math.nan
    opt = c[c["estimator"] == "cv_opt"]
    opt_cell = "" if opt.empty else \
        f"{_exact_measured(ratio_cell(opt.iloc[0]['exact_rel_std']), _std_cell(opt.iloc[0], opt.iloc[0]['rel_std']))} " \
        f"λ={opt.iloc[0]['lambda']:.3g}".lstrip()
    k3 = c[(c["estimator"] == "cv") & (c["lambda"] == 1.0)]
    ratio = f"{k3.iloc[0]['excess_std'] + 1:.3g}×" if not k3.empty else ""
    heavy = c["heavy_tail"].fillna("").astype(str).str.len().gt(0).any()
    mc = r0["lambda_star_mc"]
    measured = f"{fmt(mc)} ± {fmt(r0['lambda_star_mc_se'], 2)}" + ("†" if heavy else "") \
        if isinstance(mc, float) and math.isfinite(mc) else ""
    sampled = draws_from_b(r0.get("sampler", ""))
    return [escape(f"{case} ({agg})" if agg else case), "n/a (sampler)" if sampled and not math.isfinite(star)
            else fmt(star), measured, at(0.0), at(1.0), ratio_cell(best), opt_cell, ratio]


def side_tables(df: pd.DataFrame, lengths: dict[str, int] | None = None) -> list[tuple[Table, dict]]:
    """The tables across cases a run calls for, each with how :func:`kl_bench.present.terminal.show` fits it to
    a terminal: its key columns (what names a row when the table is stacked), the runs of columns a part keeps
    together (a case's two columns side by side), the columns that name a group of rows (the mismatch table's
    case and sampler: printed by whole cases). Side by side, rollouts by length, sampling mismatch, control
    variates."""
    extra = []
    if df["case"].nunique() > 1:
        extra.append((schulman_table(df[df["lambda"].isna()]), {"keys": 1, "together": 2}))
    if lengths:
        extra.append((rollout_table(df, lengths), {"keys": 2}))
    if "sampler" in df and df["sampler"].map(draws_from_b).any():
        extra.append((mismatch_table(df), {"keys": 3, "group": 2}))
    if "estimator" in df and df["estimator"].isin(["cv", "cv_opt"]).any():
        extra.append((lambda_table(df), {"keys": 1}))
    return extra
