"""Differences between runs: each run's rows against the same rows of the first folder that has them
(differences.csv, :data:`DIFF_COLUMNS`), and the cells and note the report shows them with."""
from __future__ import annotations

import math

import pandas as pd

from ..foundation.formatting import sig
from .cells import dagger, diff_cell, with_reference


DIFF_COLUMNS = {                      # differences.csv: one row per (run, case, row) also found in the first run
    "run": "the run compared (its label in the report)",
    "against": "the run it is compared with: the first folder given that has the row",
    "case": "case name", "row": "the row's label (estimator, λ, aggregate)",
    "mean": "this run's mean", "mean_against": "the other run's mean",
    "diff": "mean − mean_against",
    "rel_diff": "diff / |true KL| (or the reference where no exact value exists)",
    "se": "SE of diff: √(se² + se_against²), the runs being independent",
    "rel_se": "se / |true KL|: the SE of rel_diff",
    "z": "diff / se: |z| > 5 says the runs measure different things (not valid where heavy_tail)",
    "heavy_tail": "† where either row is heavy-tailed (its SE, so z, is not valid)",
}


def differences(df: pd.DataFrame) -> pd.DataFrame:
    """Row-by-row differences between runs (columns :data:`DIFF_COLUMNS`): each run's row against the same
    (case, row) of the first run that has it. ``df``: the report's frame (columns run, case, label, mean,
    se, true_kl, heavy_tail)."""
    d = with_reference(df)
    d = d[d["lambda"].isna() | (d["estimator"] == "cv_opt")]
    out = []
    for (case, label), g in d.groupby(["case", "label"], sort=False):
        if g["run"].nunique() < 2:
            continue
        a = g.iloc[0]
        for _, b in g.iloc[1:].iterrows():
            diff = float(b["mean"]) - float(a["mean"])
            se = math.hypot(float(a["se"]), float(b["se"]))
            true = abs(float(a["true_kl"]))
            scale = true if true and math.isfinite(true) else math.nan
            out.append({"run": b["run"], "against": a["run"], "case": case, "row": label, "mean": b["mean"],
                        "mean_against": a["mean"], "diff": diff, "rel_diff": diff / scale, "se": se,
                        "rel_se": se / scale, "z": _z(diff, se), "heavy_tail": dagger(a) or dagger(b)})
    return pd.DataFrame(out, columns=list(DIFF_COLUMNS))


def _z(diff: float, se: float) -> float:
    """diff / se; where both runs are exact (se = 0): 0 if they agree to the bit, else ±∞."""
    if se > 0 or math.isnan(se):
        return diff / se if se > 0 else math.nan
    return 0.0 if diff == 0 else math.copysign(math.inf, diff)


DIFF_HEADER = ["run", "against", "case", "row", "diff/true ± SE", "z"]


def difference_cells(r) -> list[str]:
    """One difference as the report and the terminal show it (:data:`DIFF_HEADER`): diff/true ± SE in %
    (the vocabulary of bias/true), z with † where it is not valid."""
    return [str(r["run"]), str(r["against"]), str(r["case"]), str(r["row"]),
            diff_cell(float(r["rel_diff"]), float(r["rel_se"])), f"{sig(r['z'], 2)}{r['heavy_tail']}"]


DIFF_NOTE = ("Each run's rows against the same rows of the first folder that has them: the difference of "
             "the means relative to the true KL (in %) ± its SE √(se² + se′²), and z = difference / SE (|z| > 5: "
             "the runs disagree beyond their noise; † heavy-tailed, z not valid). All of them: differences.csv.")
