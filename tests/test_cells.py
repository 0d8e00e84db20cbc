"""Issue 44, item 1: every printed cell is checkable by eye. The measured value is printed to its SE's
precision and the exact value beside it to as many digits (kl_bench.foundation.formatting.measured_cells),
so that z recomputed from the printed cells, (value − exact) / SE, is the printed z within the rounding of
the printed digits; this holds for every row of every committed results folder, in the terminal's compact
and detail tables, the report's "All rows" and the paper table (md, tex)."""
from __future__ import annotations

import math
import re
from decimal import Decimal
from pathlib import Path

import pytest

from kl_bench.foundation.formatting import fmt, measured_cells
from kl_bench.present import report_data, report_document
from kl_bench.present.case_tables import compact_frame, detail_table
from kl_bench.present.cells import with_reference

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = sorted(p.parent for p in ROOT.glob("results/*/summary.csv"))
NUMBER = re.compile(r"^[+-]?(\d+)(?:\.(\d*))?(?:e([+-]?\d+))?$")


def parse(cell: str) -> tuple[float, float]:
    """(the value a printed number stands for, the unit of its last printed digit: half of it is the most
    that rounding moved it); "0" is an exact zero (unit 0)."""
    text = cell.strip().rstrip("†").rstrip("%")
    m = NUMBER.match(text)
    assert m, f"not a number as the tables print one: {cell!r}"
    if text == "0":
        return 0.0, 0.0
    decimals = len(m.group(2) or "")
    exp = int(m.group(3) or 0)
    return float(Decimal(text)), 10.0 ** (exp - decimals)


def split_pm(cell: str) -> tuple[str, str]:
    value, _, se = cell.rstrip("†").partition(" ± ")
    return value, se


def within_rounding(value: str, se: str, exact: str, z: str) -> tuple[float, float, float]:
    """(z recomputed from the printed cells, the printed z, the most rounding can put between them).
    With m, e, s, z the unrounded numbers and m', e', s', z' the printed ones (each within half its last
    digit u): (m' − e')/s' − z = ((m' − m) − (e' − e))/s' + z (s − s')/s', so
    |(m' − e')/s' − z'| ≤ (u_m + u_e)/(2 s') + (|z'| + u_z/2) u_s/(2 s') + u_z/2."""
    (m, um), (e, ue), (s, us), (zp, uz) = parse(value), parse(exact), parse(se), parse(z)
    bound = (um + ue) / (2 * s) + (abs(zp) + uz / 2) * us / (2 * s) + uz / 2
    return (m - e) / s, zp, bound * (1 + 1e-9)       # 1e-9: the float64 arithmetic of this check


def checkable(value: str, se: str, exact: str, z: str) -> bool:
    """A row whose cells carry a z to recompute: a number ± a non-zero SE, an exact value, a finite z."""
    cells = (value, se, exact, z)
    return all(c and NUMBER.match(c.rstrip("†%")) for c in cells) and parse(se)[0] > 0


def assert_z(where: str, value: str, se: str, exact: str, z: str) -> int:
    if not checkable(value, se, exact, z):
        return 0
    recomputed, printed, bound = within_rounding(value, se, exact, z)
    assert abs(recomputed - printed) <= bound, (where, value, se, exact, z, recomputed)
    # ... and that bound is small: the SE has two significant digits (its last digit u ≤ SE/10), the value
    # and the exact one are printed to that digit or finer, so their rounding moves z by at most 0.1
    (_, um), (_, ue), (s, us) = parse(value), parse(exact), parse(se)
    assert us <= s / 10 * (1 + 1e-9) and max(um, ue) <= us, (where, value, se, exact)
    return 1


@pytest.fixture(scope="module", params=FOLDERS, ids=[p.name for p in FOLDERS])
def folder(request):
    res = report_data.load_results(request.param)
    df = res.summary.copy()
    df["key"] = df["case"]
    from kl_bench.core.draws import row_label
    df["label"] = [row_label(r) for _, r in df.iterrows()]
    return request.param.name, df


def test_compact_and_detail_tables(folder):
    name, df = folder
    checked = 0
    for case in dict.fromkeys(df["case"]):
        frame = compact_frame(df, case)
        bias_col = frame.columns[2]
        for (_, cells), (_, r) in zip(frame.iterrows(), df[df["case"] == case].iterrows()):
            value, se = split_pm(cells[bias_col])
            checked += assert_z(f"{name} {case} compact", value, se, cells["exact"], cells["z"])
        rows = df[df["case"] == case]
        if rows["true_kl"].map(lambda t: math.isfinite(t) and t != 0).all():
            table = detail_table(df, case, "")
            cols = {c.header: list(c.cells) for c in table.columns if c.header != "exact"}
            exact = [list(c.cells) for c in table.columns if c.header in ("exact mean",)][0]
            for i, cell in enumerate(cols["mean ± se"]):
                value, se = split_pm(cell)
                z = re.sub(r"\[/?[a-z ]*\]", "", cols["z"][i])     # rich markup of |z| ≥ 5
                checked += assert_z(f"{name} {case} detail", value, se, exact[i], z)
    assert checked or name in ("baselines",), f"{name}: no row checked"


def test_report_rows_and_paper_table(folder):
    name, df = folder
    ref = with_reference(df)
    header = report_document.ROW_HEADER
    checked = 0
    for _, r in ref.iterrows():
        cells = dict(zip(header[:6], report_document.row_cells(r)[:6]))
        row = report_document.row_cells(r)
        z = row[header.index("z")]
        value, se = split_pm(cells["mean ± SE"])
        checked += assert_z(f"{name} row mean", value, se, cells["exact mean"], z)
        paper = report_document.paper_cells(r)
        value, se = split_pm(paper[0])
        checked += assert_z(f"{name} paper bias", value, se, paper[1], z)
        value, se = split_pm(row[header.index("bias/true")])
        checked += assert_z(f"{name} row bias", value, se, row[header.index("bias/true") + 1], z)
    assert checked, f"{name}: no row checked"


@pytest.mark.parametrize("value, se, exact", [
    (0.0013628, 2.0e-7, 0.001363),       # issue 44: "0.00136 ± 2e-7" beside 0.001363 read as −15 SE
    (1.44397, 2.0e-4, 1.444),            # "1.44 ± 0.0002" beside 1.444 read as −20 SE
    (0.0502510, 7.3e-6, 0.05024),        # "0.0502 ± 7.3e-6" beside 0.05024 read as −5.5 SE (z = +1.5)
    (0.81822, 4.4e-5, 0.8182),           # the paper table's "0.818 ± 4.4e-5 | 0.817" read as +23 SE
    (8.576e-5, 1.2e-8, 8.5758e-5),
])
def test_issue_examples_read_their_own_z(value, se, exact):
    z = (value - exact) / se
    v, s, e = measured_cells(value, se, exact)
    recomputed, _, bound = within_rounding(v, s, e, f"{z:.6g}")
    assert abs(recomputed - z) <= bound, (v, s, e, recomputed, z)


def test_one_notation_per_cell_group():
    """Value, SE and exact in one notation: a shared power of ten, never 8.58e-5 beside 0.0001261."""
    v, s, e = measured_cells(8.576e-5, 1.2e-8, 1.261e-4)
    assert {x.rsplit("e", 1)[1] for x in (v, s, e)} == {"-4"}, (v, s, e)
    assert measured_cells(0.5024, 7.3e-6, 0.5) == ("0.5024000", "0.0000073", "0.5000000")


def test_a_heavy_tailed_row_is_marked_on_z_and_run_says_what_check_compares(tmp_path):
    """Issue 44: heavy-tailed rows got † on bias, SE and std but not on z (a |z| ≥ 5 lost its † to the red
    style), and `kl-bench check` passed the row at the exact spread while `run` printed only the measured
    z. Now z keeps its †, and the caption gives the z check takes (kl_bench.analysis.gate.z_at_exact_spread)."""
    import io
    from rich.console import Console
    from kl_bench.analysis.gate import exact_comparisons, z_at_exact_spread
    from kl_bench.present.case_tables import compact_table
    from kl_bench.present.tables import print_tables
    res = report_data.load_results(ROOT / "results" / "mismatch")
    df = res.summary
    heavy = df[df["heavy_tail"].isin(["kurtosis > draws", "infinite 4th moment"])]
    assert len(heavy)
    case = heavy["case"].iloc[0]
    rows = df[df["case"] == case].copy()
    j = rows.index[rows["heavy_tail"].isin(["kurtosis > draws", "infinite 4th moment"])][0]
    rows.loc[j, "z"] = -21.0                       # a |z| ≥ 5: styled red, and still marked
    table = compact_table(rows, case)
    z_cells = list(table.columns[6].cells)
    assert any(c.endswith("†") and "-21" in c for c in z_cells), z_cells
    out = io.StringIO()
    print_tables(Console(file=out, width=200), df[df["case"] == case], {case: case})
    text = out.getvalue()
    checked = {c.row.rpartition(": ")[2]: c.z for c in exact_comparisons(df[df["case"] == case])
               if c.statistic == "mean vs exact"}
    from kl_bench.core.draws import row_label
    for _, r in df[(df["case"] == case) & df["heavy_tail"].isin(["kurtosis > draws", "infinite 4th moment"])].iterrows():
        z = z_at_exact_spread(r)
        assert z == pytest.approx(checked[row_label(r)], rel=1e-12)       # the z check takes
        assert f"{row_label(r)} {fmt(z, 2)}" in text.split("as `kl-bench check` takes it:")[1], text
