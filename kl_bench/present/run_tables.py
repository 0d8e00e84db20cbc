"""The tables of a run's other outputs: what each estimator's gradient optimises (:func:`gradient_table`),
group baselines in the reward (:func:`baseline_table`), gates with their exact rates (:func:`gate_table`), and
the regression gate's comparisons (:func:`check_table`); each with its key columns (what names a row when the table is stacked)."""
from __future__ import annotations

import math

import pandas as pd
from rich.markup import escape
from rich.table import Table

from ..foundation.formatting import count, fmt, measured_cells, pct


def gradient_table(g: pd.DataFrame) -> Table:
    """What each estimator × mode optimises: exact cosines with ∇KL(q||p) and ∇KL(p||q), measured cosine,
    the exact relative error against ∇KL(q||p), the per-draw variance (measured in brackets where no
    exact value exists: rollouts) and the batch size for cos ≥ 0.9. Its first :data:`GRADIENT_KEYS` columns
    name a row (a terminal narrower than the table gets it stacked: see :func:`show`)."""
    t = Table(title="gradients: what each estimator optimises where it sits (exact; measured in brackets)",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ["case", "estimator", "mode", "E[∇] equals", "cos ∇KL(q||p)", "cos ∇KL(p||q)", "rel err (q||p)",
                "tr Cov", "n for cos ≥ 0.9", "z"]:
        t.add_column(col, justify="left" if col in ("case", "estimator", "mode", "E[∇] equals") else "right")
    for _, r in g.iterrows():
        lab = r["estimator"] if not (isinstance(r["lambda"], float) and math.isfinite(r["lambda"])) \
            else f"{r['estimator']}({r['lambda']:.3g})"
        agg = r.get("aggregate", "")
        if isinstance(agg, str) and agg:
            lab = f"{agg}-{lab}"
        eq = r["equals"] if isinstance(r["equals"], str) else ""
        style = {"reverse": "[green]reverse[/]", "forward": "[yellow]forward[/]", "zero": "[red]zero[/]",
                 "ukl": "[cyan]ukl[/]"}.get(eq, eq)
        zmax = max(abs(r["z_reverse"]), abs(r["z_forward"])) if math.isfinite(r["z_reverse"]) else math.nan
        trace = fmt(r["exact_trace_cov"]) if math.isfinite(r["exact_trace_cov"]) else f"({fmt(r['trace_cov'])})"
        t.add_row(escape(r["case"]), lab, r["mode"], style, f"{fmt(r['exact_cos_reverse'])} ({fmt(r['cos_reverse'])})",
                  f"{fmt(r['exact_cos_forward'])} ({fmt(r['cos_forward'])})", fmt(r["exact_relerr_reverse"], scale=1.0),
                  trace, count(r["n_for_cos90"]), fmt(zmax, 2))
    return t


GRADIENT_KEYS = 3       # case, estimator, mode
BASELINE_KEYS = 4       # case, estimator, baseline, G
GATE_KEYS = 3           # case, gate, δ


def gate_table(g: pd.DataFrame) -> Table:
    """Gates (gates.csv): per case, statistic and threshold, the exact share of tokens (and of sequences) masked,
    the share of KL(q||p) the masked tokens carry, and the relative bias of k1 and of the importance weight's
    mean when masked tokens are dropped."""
    t = Table(title="gates: a token is masked when its statistic > δ (exact)", title_justify="left",
              show_edge=False, pad_edge=False)
    for col in ["case", "gate", "δ", "tokens", "sequences", "KL unseen", "k1 bias", "weight bias"]:
        t.add_column(col, justify="left" if col in ("case", "gate") else "right")
    for _, r in g.iterrows():
        t.add_row(escape(r["case"]), r["gate"], f"{r['delta']:g}", pct(r["tokens_masked"], sign=False),
                  pct(r["seq_masked"], sign=False), pct(r["kl_unseen"], sign=False), pct(r["k1_bias"]),
                  pct(r["weight_bias"]))
    return t


def baseline_table(g: pd.DataFrame) -> Table:
    """Group baselines in the reward (group_baselines.csv): the exact shrink of the expected gradient against
    no baseline, the trace-of-covariance ratio (exact; measured in brackets on rollouts) and the larger |z|."""
    t = Table(title="group baselines: |E∇| and tr Cov over no baseline's (measured in brackets)",
              title_justify="left", show_edge=False, pad_edge=False)
    for col in ["case", "estimator", "baseline", "G", "|E∇| ratio", "tr Cov ratio", "z"]:
        t.add_column(col, justify="left" if col in ("case", "estimator", "baseline") else "right")
    for _, r in g.iterrows():
        agg = r.get("aggregate", "")
        lab = f"{agg}-{r['estimator']}" if isinstance(agg, str) and agg else r["estimator"]
        exact = math.isfinite(r["exact_trace_cov"])
        ratio = fmt(r["variance_ratio"]) if exact else f"({fmt(r['variance_ratio'])})"
        zs = [abs(r[c]) for c in ("z_reverse", "z_second") if math.isfinite(r[c])]
        t.add_row(escape(r["case"]), lab, r["baseline"], str(int(r["group"])), fmt(r["exact_shrink"]), ratio,
                  fmt(max(zs), 2) if zs else "")
    return t


def check_table(rep) -> Table:
    """The regression gate's comparisons (a :class:`kl_bench.api.CheckReport`), one line each, each row's
    comparisons together, its case in the first column (:data:`CHECK_LAYOUT`: a terminal too narrow for it
    prints the comparisons under a line naming their case, the name whole rather than folded mid-word)."""
    t = Table(title=f"{len(rep.comparisons):,} comparisons, family-wise α = {rep.alpha:g} (Holm)",
              title_justify="left", show_edge=False, pad_edge=False, box=None, padding=(0, 1))
    for col in ["case", "row", "statistic", "value", "reference", "z", "limit", "result"]:
        t.add_column(col, justify="left" if col in ("case", "row", "statistic", "result") else "right",
                     no_wrap=col not in ("case", "row"), overflow="fold")
    for c in rep.comparisons:
        case, _, label = c.row.rpartition(": ")
        value, _, reference = measured_cells(c.value, c.se, c.reference)   # to the SE's precision
        t.add_row(escape(case), escape(label), c.statistic, value, reference,
                  f"{c.z:+.2f}" if math.isfinite(c.z) else fmt(c.z, sign=True), f"{c.threshold:.2f}",
                  "pass" if c.passed else "[bold red]FAIL[/]")
    return t


CHECK_LAYOUT = {"keys": 3, "group": 1}      # case, row, statistic name a line; the case names a group
