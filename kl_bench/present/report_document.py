"""The report's document model: what the report says, made once (:class:`ReportDocument`), then written
by each format's renderer (kl_bench.present.report_md, report_html, report_tex). Here: the paper table as
cells (:func:`paper_table`), its captions and the runs' provenance, the advice, the group baselines, the
table of every row, and the vocabulary of docs/results.md ("Units and words") they are written in:
bias/true in %, std/true a plain ratio, n ±10% an integer with thousands separators ("never": the bias
alone exceeds ±10%; "—": no exact bias is known)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from ..core.aggregates import AGGREGATES
from ..core.draws import row_label
from ..foundation.formatting import measured_cells, pct, sig
from .cells import bias_std_cells, dagger, pm, unknown_mean, with_reference
from .report_data import Results


@dataclass
class ReportDocument:
    """What a report of results folders says, whatever its format: the runs (``results``) and every row of
    them (``df``: :func:`kl_bench.present.report_data.report_frame`); the paper table (``cases``, ``rows``:
    :func:`paper_table`) with its short caption and the runs' provenance (:func:`captions`); the figures
    (``figs``: [(file name, caption, {format: bytes})]); the differences between runs (``diffs``, None for
    one run); the advice per run (:func:`advice_lines`) for a batch of ``batch`` draws and a ``tolerance``."""
    results: list[Results]
    df: pd.DataFrame
    cases: list[tuple]
    rows: list[tuple]
    short_caption: str
    provenance: str
    figs: list[tuple[str, str, dict[str, bytes]]]
    diffs: pd.DataFrame | None
    advice: dict[str, list[str]]
    batch: int = 64
    tolerance: float = 0.1

    @property
    def caption(self) -> str:
        """The tables' caption with the runs' provenance after it."""
        return f"{self.short_caption} {self.provenance}"


def batch_cell(n: float, exact_bias: float) -> str:
    """n ±10%: the draws a mean needs to land within ±10% of the truth with 95% probability, an integer
    with thousands separators; "never" where the bias alone is larger (or the variance infinite); "—"
    where no exact bias is known (a logged or sampled reference: the measured bias cannot decide it)."""
    if not (isinstance(exact_bias, (int, float)) and math.isfinite(exact_bias)):
        return "—"
    if n is None or n != n:
        return ""
    return "never" if math.isinf(n) else f"{n:,.0f}"


def paper_table(df: pd.DataFrame):
    """Schulman's layout: rows are estimators; per case bias/true (in %) and std/true (a ratio), measured
    ± SE and exact.

    A case without an exact value but with a Monte Carlo reference (model continuations, logged log-probs)
    shows its measured values against that reference (display.with_reference), its title marked ≈ and its
    exact cells —.

    Returns (cases [(key, title, true_kl, kind)], rows [(label, [cells per case: 4 strings])]): the
    measured cells are "value ± SE", with † where the row is heavy-tailed (its SE is not valid); the title
    of a case against a reference ends in " ≈" (see kl_head)."""
    df = with_reference(df[df["lambda"].isna() | (df["estimator"] == "cv_opt")])
    cases = []
    for key in dict.fromkeys(df["key"]):
        c = df[df["key"] == key]
        approx = "approx" in c and bool(c["approx"].iloc[0])
        cases.append((key, key + (" ≈" if approx else ""), float(c["true_kl"].iloc[0]), str(c["kind"].iloc[0])))
    labels = list(dict.fromkeys(df["label"]))
    rows = []
    for lab in labels:
        cells = []
        for key, _, _, _ in cases:
            hit = df[(df["key"] == key) & (df["label"] == lab)]
            if hit.empty:
                cells.append(["", "", "", ""])
                continue
            cells.append(paper_cells(hit.iloc[0]))
        rows.append((lab, cells))
    return cases, rows


def paper_cells(r) -> list[str]:
    """A row's four cells of the paper table: bias/true ± SE (%), exact, std/true ± SE, exact, by the one
    digit rule (formatting.measured_cells: each measured value to its SE's precision, the exact value beside
    it to as many digits); where the KL is 0 (p = q: every trainer's step 0) no relative value exists, so
    bias ± SE, its exact value, std ± SE and the exact std are absolute, as `kl-bench run` shows them (the
    case's heading says so, kl_head); "—" where no exact value exists, "unknown" where the mean is."""
    bias, exact_bias, std, exact_std = bias_std_cells(r)
    if unknown_mean(r):
        return ["unknown", exact_bias or "—", "unknown", exact_std or "—"]
    return [bias + dagger(r) if bias else "—", exact_bias or "—", std + dagger(r) if std else "—", exact_std or "—"]


def captions(results: list[Results]) -> tuple[str, str]:
    """(the tables' short caption, the runs' provenance: draws per case, seed, device, cases)."""
    bits = []
    for res in results:
        env = res.envelope
        draws = env.get("draws_per_case")
        if isinstance(draws, dict):
            values = sorted(set(draws.values()))
            draws_txt = " / ".join(f"{v:,}" for v in values)
        else:
            draws_txt = f"{draws:,}" if isinstance(draws, int) else "?"
        cases = "; ".join(f"{name}: {meta.get('description', '')}" for name, meta in env.get("cases", {}).items())
        bits.append(f"{res.name}: {draws_txt} draws per case, seed {env.get('seed')}, device {env.get('device')}. "
                    f"Cases: {cases}.")
    approx = any(meta.get("reference", "").startswith("full mean") for res in results
                 for meta in res.envelope.get("cases", {}).values() if isinstance(meta.get("reference"), str))
    note = ("A case marked ≈ has no exact value: its values are measured against the reference, the "
            "Rao–Blackwellised full mean (Monte Carlo), and its exact columns are —. ") if approx else ""
    if any(_zero_cases(res.summary) for res in results):
        note += "A case with KL = 0 (p = q) shows its bias and std absolute, not /true: no relative value exists. "
    note += _aggregate_note(results)
    return ("Bias and per-draw std of each KL estimator relative to the true KL (bias/true in %, std/true a "
            "ratio): measured ± SE to the SE's last digit, exact beside it; † a heavy tail (its std, SE and z are "
            "not valid). " + note).strip(), " ".join(bits)


def _zero_cases(summary: pd.DataFrame) -> list[str]:
    """The cases whose every row's true value is 0 (p = q)."""
    true = summary["true_kl"].astype(float)
    return [c for c, t in true.groupby(summary["case"], sort=False) if bool((t == 0).all())]


def _aggregate_note(results: list[Results]) -> str:
    """What each aggregate of the rows is, in the AGGREGATES table's words, and which are per token."""
    present = [a for a in AGGREGATES if a and any(res.summary["aggregate"].eq(a).any() for res in results)]
    if not present:
        return ""
    note = "Rows: " + "; ".join(f"{a}: {AGGREGATES[a].label}" for a in present) + ". "
    per_token = [a for a in present if AGGREGATES[a].per_token]
    if per_token:
        note += f"{' and '.join(per_token)} rows are relative to the KL per generated token, KL/E|y|. "
    return note


ZERO_HEAD = "KL = 0 (p = q): bias and std absolute, not /true"


def kl_head(title: str, true: float) -> tuple[str, str]:
    """(case title, "KL = x" or "KL ≈ x" for a case measured against its Monte Carlo reference; at KL = 0,
    that its bias and std are absolute: no relative value exists)."""
    if title.endswith(" ≈"):
        return title[:-2], f"KL ≈ {sig(true)}"
    return title, ZERO_HEAD if true == 0 else f"KL = {sig(true)}"


def column_heads(true: float) -> list[str]:
    """The four column heads of a case in the paper table: relative, or absolute where the KL is 0."""
    if true == 0:
        return ["bias ± SE", "exact", "std ± SE", "exact"]
    return ["bias/true ± SE", "exact", "std/true ± SE", "exact"]


def run_lines(res: Results) -> list[str]:
    """A run's provenance, as Markdown list items: its folder, spec, seed, device, commit, time and speed."""
    env = res.envelope
    restored = env.get("restored_draws") or 0
    kept = f" ({restored:,} draws restored from a checkpoint)" if restored else ""
    return [f"- results: `{res.path}`; spec `{env.get('spec_path')}` (sha256 {str(env.get('spec_sha256'))[:12]}…)",
            f"- seed {env.get('seed')}, device {env.get('device')} ({env.get('device_name', '')}), "
            f"git commit {str(env.get('git_commit') or 'unknown')[:10]}, {env.get('wall_seconds')} s, "
            f"{env.get('draws_per_second', 0):,} draws/s{kept}"]


def advice_lines(results: list[Results], batch: int = 64, tolerance: float = 0.1) -> dict[str, list[str]]:
    """{run name: the advice lines `kl-bench run` prints for it} (kl_bench.analysis.advice: what to log, what to put
    in the loss); a sentence that holds for several cases alike is given once, naming them."""
    from ..analysis.advice import recommendations
    out = {}
    for res in results:
        lines, general = [], {}
        for a in recommendations(res.summary, res.gradients, batch=batch, tolerance=tolerance, gates=res.gates):
            if a.general:
                general.setdefault(a.detail, []).append(a.case)
            else:
                lines.append(a.text)
        out[res.name] = lines + [f"{', '.join(cases)}: {detail}" for detail, cases in general.items()]
    return out


def advice_note(batch: int, tolerance: float) -> str:
    return (f"For a batch of {batch:,} draws and a tolerance of ±{pct(tolerance, sign=False)} (`kl-bench report "
            "--batch B --tolerance T` for yours): what to log (or put in the reward), and what to put in the loss.")


BASELINE_NOTE = ("GRPO's group mean and RLOO's leave-one-out in the reward, G draws per group "
                 "(docs/weights.md#group-baselines-reward-mode): |E∇| over the no-baseline gradient's (exact), the "
                 "trace of the per-draw covariance over the no-baseline one (exact on categoricals, measured on "
                 "rollouts), and the larger |z| of the Monte Carlo checks. All columns: group_baselines.csv.")


GATE_NOTE = ("A token is masked when its gate's statistic exceeds δ (docs/gates.md); every column is exact: the share "
             "of tokens and of sequences masked, the share of KL(q||p) the masked tokens carry, the relative bias of k1 "
             "on the kept tokens and of the importance weight's mean, and the share of its divergence the statistic "
             "sees. All columns: gates.csv.")


def _per_run(results: list[Results], table: Callable[[Results], pd.DataFrame | None],
             shown: Callable[[str, pd.DataFrame], pd.DataFrame]) -> pd.DataFrame | None:
    """``shown(run name, table)`` of every run whose ``table`` has rows, in one frame with a ``run`` column (left
    out for one run); None where no run has rows."""
    frames = [shown(res.name, g) for res in results if (g := table(res)) is not None and not g.empty]
    if not frames:
        return None
    out = pd.concat(frames, ignore_index=True)
    return out.drop(columns="run") if len(results) == 1 else out


def gates_frame(results: list[Results]) -> pd.DataFrame | None:
    """The gate rows of every run, as the report shows them (None: no run has them)."""
    return _per_run(results, lambda res: res.gates, _gate_cells)


# gates.csv's columns as the report shows them: (heading, column, signed percentage).
_GATE_SHARES = (("tokens masked", "tokens_masked", False), ("sequences masked", "seq_masked", False),
                ("KL unseen", "kl_unseen", False), ("k1 bias", "k1_bias", True), ("weight bias", "weight_bias", True),
                ("sequence KL unseen", "seq_kl_unseen", False), ("sequence weight bias", "seq_weight_bias", True),
                ("sees", "sees", False))


def _gate_cells(run: str, g: pd.DataFrame) -> pd.DataFrame:
    """One run's gates.csv as the report shows it; a column an older gates.csv lacks is left blank."""
    cols = {"run": run, "case": g["case"], "gate": g["gate"], "δ": [f"{x:g}" for x in g["delta"]]}
    for head, col, signed in _GATE_SHARES:
        cols[head] = [pct(x, sign=signed) for x in g[col]] if col in g else ""
    return pd.DataFrame(cols)


def baselines_frame(results: list[Results]) -> pd.DataFrame | None:
    """The group-baseline rows of every run, as the report shows them (None: no run has them)."""
    return _per_run(results, lambda res: res.group_baselines, _baseline_cells)


def _baseline_cells(run: str, g: pd.DataFrame) -> pd.DataFrame:
    agg = g["aggregate"] if "aggregate" in g else pd.Series("", index=g.index)
    z = pd.concat([g["z_reverse"].abs(), g["z_second"].abs()], axis=1).max(axis=1)
    return pd.DataFrame({
        "run": run, "case": g["case"],
        "estimator": [f"{a}-{e}" if isinstance(a, str) and a else e for a, e in zip(agg, g["estimator"])],
        "baseline": g["baseline"], "G": g["group"], "norm of E∇ / none's": g["exact_shrink"],
        "tr Cov / none's": g["variance_ratio"], "largest abs z": z})


ROW_HEADER = ["case", "row", "target", "true KL", "mean ± SE", "exact mean", "bias/true", "exact", "std/true",
              "exact", "n ±10%", "z", "P(<0)", "heavy tail"]


def row_cells(r) -> list[str]:
    """One summary row for the HTML's table of every row (:data:`ROW_HEADER`), in the vocabulary of the
    tables: each measured value to its SE's precision beside the exact one (formatting.measured_cells),
    bias/true in %, std/true a ratio, n ±10% an integer ("never", "—"), † on every cell that leans on the
    measured SE."""
    approx = "≈" if bool(r.get("approx", False)) else ""      # against the Monte Carlo reference
    mean, se, exact_mean = measured_cells(r["mean"], r["se"], r["exact_mean"])
    bias, exact_bias, std, exact_std = bias_std_cells(r)
    mark = dagger(r)
    cells = [pm(mean, se, mark), bias + mark if bias else "", std.split(" ± ")[0] + mark if std else ""]
    if unknown_mean(r):
        cells = ["unknown"] * 3
    return [str(r["case"]), row_label(r), str(r["target"]), approx + sig(r["true_kl"], 4), cells[0], exact_mean,
            cells[1], exact_bias, cells[2], exact_std, batch_cell(r["n_for_10pct"], r["exact_rel_bias"]),
            sig(r["z"], 2) + mark if r["z"] == r["z"] else "", sig(r["frac_negative"], 2), str(r["heavy_tail"] or "")]
