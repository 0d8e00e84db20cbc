"""Advice for gates (issue 42 item 5): per case, what share of its divergence each sampled-token proxy and top-K
statistic sees, and which swept gates stay light (mask at most 1% of tokens) at which threshold, with what that
leaves unseen of KL(q||p)."""
from __future__ import annotations

import math

import pandas as pd

from ..foundation.formatting import pct

# A gate "light enough" to leave training alone: at most this share of tokens masked.
LIGHT = 0.01


def proxy_shares(df: pd.DataFrame, case: str, gates: pd.DataFrame | None = None) -> str:
    """'bin_kl sees 3.2% of KL(q||p), bin_tv 8.0% of TV(q,p)': the exact means of the proxies' rows (token rows on
    rollouts) over their targets, then the top-K gates' shares from gates.csv; '' where there are none."""
    seen: dict[str, str] = {}
    c = df[(df["case"] == case) & df["estimator"].isin(["bin_kl", "bin_tv"]) & df["aggregate"].isin(["", "tok"])]
    for _, r in c.iterrows():
        if r["true_kl"] and math.isfinite(r["true_kl"]) and math.isfinite(r["exact_mean"]):
            seen[r["estimator"]] = f"{pct(r['exact_mean'] / r['true_kl'], sign=False)} of {r['target']}"
    if gates is not None and "sees" in gates:
        g = gates[(gates["case"] == case) & gates["gate"].str.startswith("topk_")].drop_duplicates("gate")
        for _, r in g.iterrows():
            if math.isfinite(r["sees"]):
                seen[r["gate"]] = f"{pct(r['sees'], sign=False)} of {'KL(q||p)' if '_kl' in r['gate'] else 'TV(q,p)'}"
    if not seen:
        return ""
    first, *rest = seen.items()
    return ", ".join([f"{first[0]} sees {first[1]}"] + [f"{k} {v}" for k, v in rest])


def gate_lines(gates: pd.DataFrame, case: str) -> list[str]:
    """One sentence on the swept gates of ``case``: those that mask at most 1% of tokens at some δ (the smallest
    such δ, with the share masked and the KL left unseen there, or where it masks nothing from), and those that
    mask more at every δ swept (with their share at the largest δ)."""
    g = gates[gates["case"] == case]
    light, heavy = [], []
    for name in dict.fromkeys(g["gate"]):
        rows = g[g["gate"] == name].sort_values("delta")
        ok = rows[rows["tokens_masked"] <= LIGHT]
        if not len(ok):
            heavy.append((name, rows.iloc[-1]))
            continue
        r = ok.iloc[0]
        if r["tokens_masked"] == 0:
            light.append(f"{name} masks no token from δ = {r['delta']:g}")
        else:
            light.append(f"{name} > {r['delta']:g} masks {pct(r['tokens_masked'], sign=False)} of tokens and leaves "
                         f"{pct(r['kl_unseen'], sign=False)} of KL(q||p) unseen")
    out = []
    if light:
        out.append("light gates (≤ 1% of tokens): " + "; ".join(light))
    if heavy:
        out.append(f"masking more than {pct(LIGHT, sign=False)} of tokens at every δ swept: "
                   + ", ".join(f"{n} ({pct(r['tokens_masked'], sign=False)} at δ = {r['delta']:g})" for n, r in heavy))
    return out
