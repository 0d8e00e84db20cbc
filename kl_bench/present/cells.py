"""The cells of a measured row beside its exact value, shared by the terminal tables and the report: the
bias by the one digit rule (kl_bench.foundation.formatting.measured_cells), the † of a heavy-tailed row, the
unknown mean of degenerate importance weights, and the rows measured against a Monte Carlo reference."""
from __future__ import annotations

import math

import pandas as pd

from ..core.stats import HeavyTail
from ..foundation.formatting import below_floor, fmt, measured_cells, num


def dagger(r) -> str:
    """"†" for a heavy-tailed row (its measured std, SE, CI and z are not valid), else "". Every column
    whose value leans on the measured SE carries it, not only the std."""
    heavy = r.get("heavy_tail")
    return "†" if isinstance(heavy, str) and heavy else ""      # NaN (from a CSV) is no flag


def unknown_mean(r) -> bool:
    """A row whose measured mean and SE say nothing (degenerate importance weights): shown as unknown."""
    return r.get("heavy_tail", "") == HeavyTail.DEGENERATE.value


def bias_cells(diff: float, se: float, exact_diff: float, truth: float, zero: bool) -> tuple[str, str, str]:
    """(bias, its SE, the exact bias) by the one digit rule (formatting.measured_cells): relative to the
    truth in %, absolute where the KL is 0, blank where no truth exists."""
    exact_diff = 0.0 if below_floor(exact_diff, truth) else exact_diff     # float64 rounding of an unbiased row
    if zero:
        return measured_cells(diff, se, exact_diff, sign=True)
    if not (math.isfinite(truth) and truth != 0):
        return "", "", ""
    return measured_cells(100 * diff / abs(truth), 100 * se / abs(truth), 100 * exact_diff / abs(truth),
                          sign=True, unit="%")


def pm(value: str, se: str, mark: str = "") -> str:
    """"value ± se" and ``mark``; the value alone without an SE; blank without a value."""
    return (f"{value} ± {se}" if value and se else value) + (mark if value else "")


def with_reference(df: pd.DataFrame) -> pd.DataFrame:
    """Rows without an exact value but with a Monte Carlo reference (ref_kl: model continuations, logged
    log-probs) get true_kl, rel_bias and rel_std measured against that reference, for the summary tables;
    their exact columns stay blank. Headers mark such cases with ≈. Every row gets ``bias_se``, the SE of
    the bias shown: ``se`` where the truth is exact, ``ref_diff_se`` against a reference (logged data: the
    log's own SE, never the resampling one), so that bias ± bias_se and z agree."""
    df = df.copy()
    df["bias_se"] = df["se"] if "se" in df else math.nan      # an exact-only frame has no SE
    if "ref_kl" not in df:
        return df
    use = df["true_kl"].isna() & df["ref_kl"].notna()
    ref = df.loc[use, "ref_kl"].astype(float)
    diff = df.loc[use, "ref_diff"].astype(float) if "ref_diff" in df else df.loc[use, "mean"] - ref
    df.loc[use, "true_kl"] = ref
    df.loc[use, "rel_bias"] = diff / ref
    df.loc[use, "bias_se"] = df.loc[use, "ref_diff_se"] if "ref_diff_se" in df else float("nan")
    std = df.loc[use, "exact_std"].where(df.loc[use, "exact_std"].map(num).map(math.isfinite), df.loc[use, "std"])
    df.loc[use, "rel_std"] = std / ref
    df["approx"] = use
    return df


def bias_se(r) -> float:
    """The SE of a row's bias: its ``bias_se`` where the results carry one (the log's own SE for logged
    log-probs), else the SE of its mean."""
    value = r["bias_se"] if "bias_se" in r else math.nan
    return float(value) if isinstance(value, (int, float)) and value == value else float(r["se"])


def bias_std_cells(r) -> tuple[str, str, str, str]:
    """("bias ± SE", exact bias, "std ± SE", exact std) of a row, relative to the truth (%, a ratio) or
    absolute where it is 0 (cells.bias_cells, formatting.measured_cells); the SE of the bias is bias_se."""
    truth, exact_mean = num(r["true_kl"]), num(r["exact_mean"])
    zero = truth == 0
    diff = num(r["bias"]) if zero else num(r["rel_bias"]) * abs(truth)
    b, se, e = bias_cells(diff, bias_se(r), exact_mean - truth, truth, zero)
    scale = 1.0 if zero else abs(truth)
    std, exact_std = (num(r["std"]), num(r["exact_std"])) if zero else (num(r["rel_std"]), num(r["exact_rel_std"]))
    s, s_se, s_exact = measured_cells(std, num(r["std_se"]) / scale, exact_std)
    return pm(b, se), e, pm(s, s_se), s_exact


def diff_cell(rel_diff: float, rel_se: float) -> str:
    """diff/true ± SE in %, by the one digit rule (formatting.measured_cells): z = diff / SE reads off it."""
    value, se, _ = measured_cells(100 * rel_diff, 100 * rel_se, sign=True, unit="%")
    return pm(value, se) or "—"


def ratio_cell(x: float) -> str:
    """A plain ratio (std/true): rounding below 1e-12 (the std of a constant row) prints as 0."""
    return fmt(x, scale=1.0)
