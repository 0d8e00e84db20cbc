"""Readable terminal tables: the per-case detail table and Schulman's layout."""
from __future__ import annotations

import math

import pandas as pd
from rich.console import Console
from rich.table import Table


def fmt(x: float, digits: int = 3) -> str:
    """Significant-digit formatting that shows inf and leaves missing values blank."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 1e5:
        return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"
    return f"{x:.{digits - 1}e}"


def fmt_rel(x: float) -> str:
    """A relative bias; |x| < 1e-9 is float64 rounding of two exact sums, shown as 0."""
    if isinstance(x, float) and math.isfinite(x) and abs(x) < 1e-9:
        return "0"
    return fmt(x)


def detail_table(df: pd.DataFrame, case: str, description: str) -> Table:
    """One case: measured value ± SE next to the exact one, relative bias and noise, z."""
    t = Table(title=f"{case}: {description}", title_justify="left", show_edge=False, pad_edge=False)
    for col, just in [("estimator", "left"), ("target", "left"), ("true", "right"), ("mean ± se", "right"),
                      ("exact mean", "right"), ("bias/true", "right"), ("exact", "right"),
                      ("std/true", "right"), ("exact", "right"), ("z", "right"), ("P(<0)", "right")]:
        t.add_column(col, justify=just)
    for _, r in df[df["case"] == case].iterrows():
        z = r["z"]
        zs = fmt(z, 2)
        if isinstance(z, float) and math.isfinite(z) and abs(z) >= 5:
            zs = f"[bold red]{zs}[/]"
        t.add_row(r["estimator"], r["target"], fmt(r["true_kl"], 4),
                  f"{fmt(r['mean'], 4)} ± {fmt(r['se'], 2)}", fmt(r["exact_mean"], 4),
                  fmt_rel(r["rel_bias"]), fmt_rel(r["exact_rel_bias"]), fmt(r["rel_std"]), fmt(r["exact_rel_std"]),
                  zs, fmt(r["frac_negative"], 2))
    return t


def exact_table(df: pd.DataFrame, case: str, description: str) -> Table:
    t = Table(title=f"{case}: {description}", title_justify="left", show_edge=False, pad_edge=False)
    for col in ["estimator", "target", "true", "exact mean", "bias/true", "std/true"]:
        t.add_column(col, justify="left" if col in ("estimator", "target") else "right")
    for _, r in df[df["case"] == case].iterrows():
        t.add_row(r["estimator"], r["target"], fmt(r["true_kl"], 4), fmt(r["exact_mean"], 4),
                  fmt_rel(r["exact_rel_bias"]), fmt(r["exact_rel_std"]))
    return t


def schulman_table(df: pd.DataFrame) -> Table:
    """Schulman's layout: rows are estimators; per case, bias/true and stdev/true, measured (exact)."""
    cases = list(dict.fromkeys(df["case"]))
    t = Table(title="bias/true and stdev/true per estimator (measured, exact in brackets)",
              title_justify="left", show_edge=False, pad_edge=False)
    t.add_column("estimator")
    for c in cases:
        true = df.loc[df["case"] == c, "true_kl"].iloc[0]
        t.add_column(f"{c}\nbias/true", justify="right")
        t.add_column(f"KL={fmt(true, 3)}\nstdev/true", justify="right")
    for est in dict.fromkeys(df["estimator"]):
        cells = [est]
        for c in cases:
            row = df[(df["case"] == c) & (df["estimator"] == est)]
            if row.empty:
                cells += ["", ""]
                continue
            r = row.iloc[0]
            cells.append(f"{fmt_rel(r['rel_bias'])} ({fmt_rel(r['exact_rel_bias'])})")
            cells.append(f"{fmt(r['rel_std'])} ({fmt(r['exact_rel_std'])})")
        t.add_row(*cells)
    return t


def print_tables(console: Console, df: pd.DataFrame, descriptions: dict[str, str], exact_only: bool = False) -> None:
    for case in dict.fromkeys(df["case"]):
        console.print(exact_table(df, case, descriptions[case]) if exact_only
                      else detail_table(df, case, descriptions[case]))
        console.print()
    if not exact_only and df["case"].nunique() > 1:
        console.print(schulman_table(df))
