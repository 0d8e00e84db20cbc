"""Advice for gates (issue 42 item 5): per case, what share of the divergence each sampled-token proxy sees,
and, for each swept gate, the smallest threshold that masks at most 1% of tokens with what that leaves unseen."""
from __future__ import annotations

import math

import pandas as pd

from ..foundation.formatting import fmt, pct

# A gate "light enough" to leave training alone: at most this share of tokens masked.
LIGHT = 0.01


def proxy_shares(df: pd.DataFrame, case: str) -> str:
    """'bin_kl sees 3.2% of KL(q||p), bin_tv 8.0% of TV(q,p)' from the exact means of the proxies' rows
    (token rows on rollouts), or '' where the case has none or no exact value."""
    bits = []
    c = df[(df["case"] == case) & df["estimator"].isin(["bin_kl", "bin_tv"]) & df["aggregate"].isin(["", "tok"])]
    for _, r in c.iterrows():
        share = r["exact_mean"] / r["true_kl"] if r["true_kl"] and math.isfinite(r["true_kl"]) else math.nan
        if math.isfinite(share):
            bits.append(f"{r['estimator']} sees {pct(share, sign=False)} of {r['target']}")
    return ", ".join(bits)


def gate_lines(gates: pd.DataFrame, case: str) -> list[str]:
    """One sentence per swept gate of ``case``: the smallest δ that masks ≤ 1% of tokens, what that masks of
    the sequences and leaves unseen of KL(q||p); or, where every δ masks more, the largest δ's share."""
    out = []
    g = gates[gates["case"] == case]
    for name in dict.fromkeys(g["gate"]):
        rows = g[g["gate"] == name].sort_values("delta")
        sees = rows["sees"].iloc[0] if "sees" in rows else math.nan
        if name.startswith("topk_") and math.isfinite(sees):
            out.append(f"{name} sees {pct(sees, sign=False)} of {'KL(q||p)' if '_kl' in name else 'TV(q,p)'}")
        light = rows[rows["tokens_masked"] <= LIGHT]
        if len(light):
            r = light.iloc[0]
            if r["tokens_masked"] == 0:
                out.append(f"{name} > {fmt(r['delta'])} masks no token")
                continue
            seq = f" ({pct(r['seq_masked'], sign=False)} of sequences)" if math.isfinite(r["seq_masked"]) else ""
            out.append(f"{name} > {fmt(r['delta'])} masks {pct(r['tokens_masked'], sign=False)} of tokens{seq} and "
                       f"leaves {pct(r['kl_unseen'], sign=False)} of KL(q||p) unseen")
        else:
            r = rows.iloc[-1]
            out.append(f"{name}: every δ swept masks more than {pct(LIGHT, sign=False)} of tokens "
                       f"({pct(r['tokens_masked'], sign=False)} at δ = {fmt(r['delta'])})")
    return out
