"""`kl-bench report`: every figure from a small run, valid PNGs, the paper table's numbers, the HTML's
references, several folders side by side, and clear errors for missing or incomplete folders."""
import math
import os
import re
import shutil
import struct
import subprocess

import matplotlib
import pandas as pd
import pytest
from typer.testing import CliRunner

from pathlib import Path

from kl_bench.present import (pages, plots, plots_distribution, report, report_data, report_differences,
                               report_document, report_figures, report_md, report_tex)
from kl_bench.core.draws import row_label
from kl_bench.cli import app
from kl_bench.present.report_data import load_results
from kl_bench.present.report_tex import tex_number
from kl_bench.foundation.errors import SpecError

from .conftest import spec_toml, stub_plot_functions, unrendered_bytes
from .helpers import one_line

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

SPEC = """
spec_version = 1
[experiment]
name = "small"
draws = 20000
device = "cpu"
batches = 20
estimators = ["k1", "k2", "k3", "full"]
lambdas = [0.0, 1.0, "optimal"]

[[case]]
name = "gauss"
kind = "gaussian"
q = {mean = 0.0, std = 1.0}
p = {mean = 0.5, std = 1.1}

[[case]]
name = "cat"
kind = "categorical"
vocab = 300
q = {logits = "zipf", exponent = 1.1, seed = 1}
p = {from = "q", noise = 0.3, seed = 2}

[[case]]
name = "roll-T4"
kind = "rollout"
vocab = 60
buckets = 3
length = 4
eos = 59
draws = 5000
q = {logits = "zipf", exponent = 1.1, seed = 1}
p = {from = "q", noise = 0.3, seed = 2}

[[case]]
name = "roll-T8"
kind = "rollout"
vocab = 60
buckets = 3
length = 8
eos = 59
draws = 5000
q = {logits = "zipf", exponent = 1.1, seed = 1}
p = {from = "q", noise = 0.3, seed = 2}
"""


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A run of SPEC and its report (`run --report`), whose figures are built but not rendered (empty files): the
    tests of its tables and pages read it; the two tests below render its figures (building them takes 1 s of
    CPU, rendering them 6 s)."""
    root = tmp_path_factory.mktemp("rep")
    spec = root / "small.toml"
    spec.write_text(SPEC)
    # PNG only, as conftest's png_figures_only asks of every test, and unrendered as its unrendered_figures: those
    # fixtures are function-scoped, so they are not yet in force while a module-scoped fixture runs.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report_figures, "FIGURE_FORMATS", ("png",))
        mp.setattr(report_figures, "figure_bytes", unrendered_bytes)
        res = runner.invoke(app, ["run", str(spec), "--out", str(root / "small"), "--quiet", "--report"])
    assert res.exit_code == 0, res.output
    return root / "small"


SMALL_FIGURES = {f"{kind}_{case}.png" for kind in ("bias_std", "distribution", "convergence")
                 for case in ("gauss", "cat", "roll-T4", "roll-T8")} | {
    "lambda_gauss.png", "lambda_cat.png", "lambda_roll-T4-seq.png", "lambda_roll-T4-tok.png", "lambda_roll-T8-seq.png",
    "lambda_roll-T8-tok.png", "rollout_growth_0.png", "planning.png"}


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _rendered_report(folder: Path, out: Path, keep=lambda file: True) -> dict[str, bytes]:
    """{file: PNG} of `kl-bench report folder --out out`, its figures rendered; only those whose file ``keep``
    accepts are drawn (and shown in its pages)."""
    every = report_figures.figure_panels
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(report_figures, "figure_panels", lambda *a: [(k, p) for k, p in every(*a) if keep(p.file)])
        res = runner.invoke(app, ["report", str(folder), "--out", str(out), "-q"])
    assert res.exit_code == 0, res.output
    return {p.name: p.read_bytes() for p in (out / "figures").iterdir()}


def _sensible_png(name: str, data: bytes) -> None:
    w, h = _png_size(data)
    assert 400 <= w <= 3000 and 250 <= h <= 3000 and len(data) > 10_000, (name, w, h, len(data))


def test_every_figure_is_in_the_report_and_each_kind_is_rendered_as_a_sensible_png(small_run, tmp_path):
    """Every figure of SPEC's report is there; the rollout case's and the run's (rollout_growth, planning) are
    rendered: one of every kind of figure this report has, drawn from real results. The bias, distribution and
    convergence figures of Gaussian and categorical cases are rendered by the tests of unusual names and of an
    infinite KL below; all 20 figures of this report by the slow test after this one."""
    assert SMALL_FIGURES <= {p.name for p in (small_run / "report" / "figures").iterdir()}
    results = report_data.load_report_results([small_run])
    every = report_figures.figure_panels(results, report_data.report_frame(results))

    def keep(file):
        return "roll-T4" in file or file in ("rollout_growth_0.png", "planning.png")
    assert {kind.name for kind, p in every if keep(p.file)} == {kind.name for kind, _ in every}      # every kind
    figs = _rendered_report(small_run, tmp_path / "r", keep)
    assert set(figs) == {p.file for _, p in every if keep(p.file)}, set(figs)
    for name, data in figs.items():
        _sensible_png(name, data)


@pytest.mark.slow
def test_every_figure_is_rendered_as_a_sensible_png(small_run, tmp_path):
    figs = _rendered_report(small_run, tmp_path / "r")
    assert SMALL_FIGURES <= set(figs), SMALL_FIGURES - set(figs)
    for name, data in figs.items():
        _sensible_png(name, data)


def test_figures_are_also_written_as_deterministic_vectors(small_run):
    """For a paper: every figure as PDF and SVG beside the PNG (the default formats; the tests' conftest
    draws PNG only), the same bytes each time (no dates), linked from report.md."""
    assert report_figures.FIGURE_FORMATS == ("png",)          # conftest's png_figures_only
    res = report_data.load_results(small_run)
    rows = res.summary[res.summary["case"] == "gauss"]
    made = [report_figures.figure_bytes(plots.plot_bias_std(rows, title="gauss"), ("png", "pdf", "svg")) for _ in range(2)]
    assert made[0] == made[1]
    assert made[0]["pdf"][:5] == b"%PDF-" and b"<svg" in made[0]["svg"][:2000] and made[0]["png"][:4] == b"\x89PNG"
    md = report_md.report_md([res], "", [("bias_std_gauss.png", "c", made[0])])
    assert "(figures/bias_std_gauss.pdf)" in md and "(figures/bias_std_gauss.svg)" in md
    assert "Vector" not in report_md.report_md([res], "", [("bias_std_gauss.png", "c", {"png": b""})])
    import inspect
    assert inspect.signature(report_figures.build_figures).parameters["formats"].default is None
    assert report_figures.figure_bytes.__defaults__ == (None,)


def test_table_tex_holds_the_summary_numbers_as_displayed(small_run):
    """bias/true in % (the vocabulary of docs/results.md: "+0.28% ± 0.34%"), std/true a plain ratio."""
    from kl_bench.foundation.formatting import measured_cells
    text = (small_run / "report" / "table.tex").read_text()
    df = pd.read_csv(small_run / "summary.csv", keep_default_na=True)
    rows = df[df["lambda"].isna() | (df["estimator"] == "cv_opt")]
    for _, r in rows.iterrows():       # each measured value to its SE's precision, the exact one beside it alike
        true = abs(r["true_kl"])
        exact = 0.0 if abs(r["exact_rel_bias"]) < 1e-12 else 100 * r["exact_rel_bias"]
        bias, se, exact = measured_cells(100 * r["rel_bias"], 100 * r["se"] / true, exact, sign=True, unit="%")
        std, std_se, exact_std = measured_cells(r["rel_std"], r["std_se"] / true, r["exact_rel_std"])
        for shown in (rf"{tex_number(bias)} $\pm$ {tex_number(se)}", tex_number(exact),
                      rf"{tex_number(std)} $\pm$ {tex_number(std_se)}", tex_number(exact_std)):
            assert shown in text, (r["case"], r["estimator"], shown)
        assert all(x == "0" or "%" in x for x in (bias, exact)), (bias, exact)
    assert "stdev" not in text and "std/true" in text
    # a tiny relative bias in % (results/precision: +1.2e-05%) is a power of ten and an escaped %; a minus is
    # math's minus, never a text hyphen (issue 44)
    assert tex_number("+1.2e-05%") == r"$+1.2\times 10^{-5}$\%" and tex_number("-0.025%") == r"$-$0.025\%"
    assert tex_number("-1.2e-5") == r"$-1.2\times 10^{-5}$" and "-" not in tex_number("-0.5").replace("$-$", "")
    # A paper includes it as it is: booktabs, five columns, no \resizebox, every row 5 cells, a short caption.
    assert text.count("{") == text.count("}") and "resizebox" not in text
    for rule in (r"\toprule", r"\midrule", r"\bottomrule", r"\caption{", r"\begin{tabular}{lrrrr}"):
        assert rule in text
    for table in text.split(r"\begin{tabular}")[1:]:
        body = table.split(r"\bottomrule")[0].splitlines()[3:]
        assert all(line.count("&") == 4 for line in body if not line.startswith(("\\midrule", "\\multicolumn"))), body
        assert sum(line.count("&") == 4 for line in body) <= report_tex.TEX_ROWS_PER_TABLE
    for case in df["case"].unique():
        assert rf"\emph{{{case}}}" in text
    captions = re.findall(r"\\caption\{(.*)\}", text)
    assert captions and all(len(c) < 400 for c in captions), captions
    assert "% " in text and "20,000" in text and "seed 0" in text      # provenance in a comment


def test_heavy_tailed_rows_are_marked_in_every_measured_column():
    """A heavy-tailed row (results/rollout: moderate-T256's seq k3) carries † on its measured bias ± SE and
    std ± SE in the paper table and on its z in the terminal table: its SE is not valid."""
    from kl_bench.present import case_tables as display
    res = report_data.load_results(ROOT / "results" / "rollout")
    df = res.summary.assign(key=res.summary["case"], label=[row_label(r) for _, r in res.summary.iterrows()])
    heavy = df[df["heavy_tail"] != ""]
    assert not heavy.empty
    cases, rows = report_document.paper_table(df)
    keys = [c[0] for c in cases]
    for _, r in heavy.iterrows():
        if not (math.isnan(r["lambda"]) or r["estimator"] == "cv_opt"):
            continue
        cells = dict(rows)[r["label"]][keys.index(r["case"])]
        assert cells[0].endswith("†") and cells[2].endswith("†") and not cells[1].endswith("†"), cells
        compact = display.compact_frame(df, r["case"])
        line = compact[compact.iloc[:, 0] == r["label"]].iloc[0]
        assert line.iloc[2].endswith("†") and line.iloc[6].endswith("†"), list(line)
    light = df[(df["heavy_tail"] == "") & df["lambda"].isna()].iloc[0]
    assert not dict(rows)[light["label"]][keys.index(light["case"])][0].endswith("†")


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="pdflatex is not installed")
def test_table_tex_compiles(small_run, tmp_path):
    doc = tmp_path / "doc.tex"
    doc.write_text("\\documentclass{article}\\usepackage{booktabs}\\usepackage{graphicx}\\begin{document}\n"
                   + (small_run / "report" / "table.tex").read_text() + "\n\\end{document}\n")
    proc = subprocess.run(["pdflatex", "-interaction=nonstopmode", doc.name], cwd=tmp_path, capture_output=True)
    assert proc.returncode == 0, proc.stdout[-2000:]


def test_report_html_references_and_embeds_every_figure(small_run):
    html = (small_run / "report" / "report.html").read_text()
    md = (small_run / "report" / "report.md").read_text()
    pngs = list((small_run / "report" / "figures").glob("*.png"))
    for p in (small_run / "report" / "figures").iterdir():
        assert f"figures/{p.name}" in md
        assert p.suffix != ".png" or f"figures/{p.name}" in html
    assert html.count("data:image/png;base64,") == len(pngs)
    assert "bias/true" in (small_run / "report" / "table.md").read_text()


@pytest.fixture(scope="module")
def identical_runs(tmp_path_factory) -> Path:
    """A folder holding two runs of one spec and seed, `small/` and `other/`: read only."""
    root = tmp_path_factory.mktemp("identical")
    gauss = {"name": "gauss", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0}, "p": {"mean": 0.4, "std": 1.0}}
    spec = root / "spec.toml"
    spec.write_text(spec_toml({"name": "small", "draws": 4000, "seed": 0, "device": "cpu", "batches": 8,
                               "estimators": ["k1", "k3"]}, [gauss]))
    for folder in ("small", "other"):            # the same experiment and seed twice
        assert runner.invoke(app, ["run", str(spec), "--out", str(root / folder), "--quiet"]).exit_code == 0
    return root


def test_several_folders_side_by_side(identical_runs, tmp_path, unrendered_figures):
    """`report A B` on two small folders: labels, the differences with z, the terminal lines (the figures are
    built, not rendered: tests/test_plots.py renders a bias_std figure of two runs)."""
    res = runner.invoke(app, ["report", str(identical_runs / "small"), str(identical_runs / "other"), "--out",
                              str(tmp_path / "both")])
    assert res.exit_code == 0, res.output
    table = (tmp_path / "both" / "table.md").read_text()
    # told apart by folder name, never by absolute path
    assert "small (small)/gauss" in table and "small (other)/gauss" in table and str(identical_runs) not in table
    diffs = pd.read_csv(tmp_path / "both" / "differences.csv")
    assert len(diffs) == 2 and (diffs["diff"] == 0).all() and (diffs["z"] == 0).all()     # identical runs
    assert "Differences between runs" in (tmp_path / "both" / "report.md").read_text()
    assert "differences: 2 rows compared" in res.output and "|z| > 5 in 0" in res.output


def test_runs_are_labelled_by_experiment_and_seed_and_differences_carry_z():
    from kl_bench.present.report_data import Results, run_labels
    from kl_bench.present.report_differences import differences

    def res(name, seed, folder):
        return Results(Path("/abs/path") / folder, name, pd.DataFrame(), {"seed": seed}, None, None, None)
    assert run_labels([res("a", 0, "x"), res("b", 0, "y")]) == ["a", "b"]
    assert run_labels([res("a", 0, "x"), res("a", 1, "y")]) == ["a seed 0", "a seed 1"]
    assert run_labels([res("a", 0, "x"), res("a", 0, "y")]) == ["a (x)", "a (y)"]
    assert run_labels([res("a", 0, "x"), res("a", 0, "x")]) == ["a (x) #1", "a (x) #2"]
    nan = float("nan")
    rows = pd.DataFrame({"run": ["A", "B", "A", "B", "A"], "case": ["c"] * 4 + ["d"],
                         "label": ["k1", "k1", "k3", "k3", "k1"], "estimator": ["k1", "k1", "k3", "k3", "k1"],
                         "lambda": [nan] * 5, "mean": [1.0, 1.3, 2.0, 2.0, 5.0], "se": [0.03, 0.04, 0.1, 0.1, 1.0],
                         "true_kl": [1.0] * 4 + [5.0], "heavy_tail": ["", "", "", "big", ""]})
    d = differences(rows)
    assert list(d["row"]) == ["k1", "k3"]                     # d/k1 is in one run only: not compared
    k1 = d.iloc[0]
    assert k1["diff"] == pytest.approx(0.3) and k1["se"] == pytest.approx(0.05) and k1["z"] == pytest.approx(6.0)
    assert k1["against"] == "A" and k1["heavy_tail"] == "" and d.iloc[1]["heavy_tail"] == "†"


@pytest.mark.parametrize("damage", ["missing", "no-summary", "no-envelope", "bad-columns", "bad-json"])
def test_missing_or_incomplete_folders_give_one_clear_line(damage, small_run, tmp_path):
    target = tmp_path / "r"
    if damage != "missing":
        shutil.copytree(small_run, target)
    if damage == "no-summary":
        (target / "summary.csv").unlink()
    elif damage == "no-envelope":
        (target / "run.json").unlink()
    elif damage == "bad-columns":
        (target / "summary.csv").write_text("case,estimator\ng,k1\n")
    elif damage == "bad-json":
        (target / "run.json").write_text("{not json")
    res = runner.invoke(app, ["report", str(target), "--out", str(tmp_path / "rep")])
    assert res.exit_code == 2, res.output
    msg = res.stderr.strip()
    assert len(msg.splitlines()) == 1 and str(target) in msg and "Traceback" not in res.output
    assert not (tmp_path / "rep").exists()


def test_plot_functions_take_an_axis_and_return_its_figure(small_run):
    import matplotlib.pyplot as plt
    r = load_results(small_run)
    fig, ax = plt.subplots()
    sweep = r.sweep[(r.sweep["case"] == "cat")]
    assert plots.plot_lambda_curve(sweep, ax=ax) is fig
    fig2, axes = plt.subplots(1, 2)
    assert plots.plot_bias_std(r.summary[r.summary["case"] == "cat"], axes=axes) is fig2
    plt.close("all")
    assert matplotlib.get_backend().lower() == "agg"


def test_report_html_has_no_backticks_and_tables_scroll_in_their_own_box(small_run):
    html = (small_run / "report" / "report.html").read_text()
    assert "`" not in html                                   # Markdown code spans became <code>
    assert "<code>" in html and f"<code>{small_run}</code>" in html
    body = html.split("<body>", 1)[1]
    assert body.count("<table") == body.count("<div class='scroll'><table") >= 2
    css = html.split("<style>", 1)[1].split("</style>", 1)[0]
    assert ".scroll{overflow-x:auto" in css and "white-space:nowrap" in css


def test_html_text_helpers():
    from kl_bench.present.pages import html_inline, html_text
    assert html_inline("results: `a<b`; spec `x.toml`") == "results: <code>a&lt;b</code>; spec <code>x.toml</code>"
    assert html_inline("odd ` tick") == "odd &#96; tick"
    assert html_text("case `x`") == "case &#96;x&#96;"


def test_no_growth_figure_for_one_length_and_token_mean_rows_are_drawn(tmp_path, unrendered_figures):
    """Two rollout cases of one family at the same T draw no std-against-T figure (a single point per
    line); tok_mean and tok_batch rows appear in the per-case figures like every other row. Which figures
    a report has is the question here, not how they look: they are built, not rendered."""
    one_t = SPEC.split("[[case]]\nname = \"roll-T4\"")[0].split("[[case]]")[0] + "\n".join(
        f'[[case]]\nname = "r{i}"\nkind = "rollout"\nvocab = 60\nbuckets = 3\nlength = 6\neos = 59\n'
        f'eos_prob = 0.2\nper_sequence_mean = true\ntoken_mean_batch = 8\ndraws = 8000\n'
        f'q = {{logits = "zipf", exponent = 1.1, seed = 1}}\np = {{from = "q", noise = 0.{i + 2}, seed = 2}}\n'
        for i in range(2))
    spec = tmp_path / "one.toml"
    spec.write_text(one_t)
    res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "one"), "--quiet", "--report"])
    assert res.exit_code == 0, res.output
    figs = {p.name for p in (tmp_path / "one" / "report" / "figures").iterdir()}
    assert "bias_std_r0.png" in figs and not any(f.startswith("rollout_growth") for f in figs), figs
    md = (tmp_path / "one" / "report" / "report.md").read_text()
    assert "tok_batch k3" in md and "tok_mean k3" in md


# ----------------------------------------------------------------------------- reports that answer (issue 31 item 5)
def test_the_advice_is_in_report_md_and_html(small_run):
    """What `kl-bench run` prints as advice (to log, in the loss) opens both pages, every line of it."""
    from kl_bench.present.pages import html_text
    from kl_bench.present.report_document import advice_lines
    md = (small_run / "report" / "report.md").read_text()
    html = (small_run / "report" / "report.html").read_text()
    lines = advice_lines([load_results(small_run)])["small"]
    assert any(": to log, " in line for line in lines) and any("in the loss" in line for line in lines)
    for line in lines:
        assert f"- {line}" in md and html_text(line) in html, line
    assert md.index("## Advice") < md.index("## Paper table") and html.index("<h2>Advice") < html.index("Paper table")


def test_one_vocabulary_in_every_table_of_the_report(small_run):
    """bias/true in %, std/true (never stdev/true) a ratio, n ±10% an integer with separators or "never",
    never "inf" (docs/results.md, "Units and words")."""
    from kl_bench.present.report_document import ROW_HEADER, batch_cell
    rep = small_run / "report"
    for name in ("report.md", "report.html", "table.md", "table.tex"):
        text = (rep / name).read_text()
        assert "stdev" not in text and "std/true" in text
    # a tiny relative bias in % (results/precision: +1.2e-05%) is a power of ten and an escaped %
    assert tex_number("+1.2e-05%") == r"$+1.2\times 10^{-5}$\%" and tex_number("-0.025%") == r"$-$0.025\%" and "bias/true" in text, name
    html = (rep / "report.html").read_text()
    rows = html.split("<h2>All rows</h2>")[1]
    cells = [re.findall(r"<td>(.*?)</td>", tr) for tr in rows.split("<tr>")[2:]]
    n_col, bias_col = ROW_HEADER.index("n ±10%"), ROW_HEADER.index("bias/true")
    assert cells and all(re.fullmatch(r"\d{1,3}(,\d{3})*|never|—", c[n_col]) for c in cells), [c[n_col] for c in cells]
    assert all(c[bias_col] in ("0", "0 ± 0") or "%" in c[bias_col] for c in cells)   # "0": an exact zero
    assert ">inf<" not in html and "inf" not in (rep / "table.md").read_text()
    assert batch_cell(math.inf, 0.3) == "never" and batch_cell(1_234_567.4, 0.0) == "1,234,567"
    assert batch_cell(870.0, math.nan) == "—"          # no exact bias known: the measured one cannot decide


def test_identical_runs_show_one_differences_table_everywhere(identical_runs, tmp_path, unrendered_figures):
    """`report A B` on two identical runs (one spec and seed, two folders; one folder given twice is refused):
    diff/true "0 ± x%" (was "0 ± ,"), and report.md, report.html and the terminal show the same columns in
    the same order."""
    res = runner.invoke(app, ["report", str(identical_runs / "small"), str(identical_runs / "other"), "--out",
                              str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert "± ," not in res.output and re.search(r"diff/true 0 ± \d[\d.]*%, z 0\b", res.output), res.output
    md = (tmp_path / "r" / "report.md").read_text().split("## Differences between runs")[1]
    html = (tmp_path / "r" / "report.html").read_text().split("Differences between runs")[1]
    md_rows = [[c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| ")]
    html_rows = [re.findall(r"<t[hd]>(.*?)</t[hd]>", tr) for tr in html.split("</table>")[0].split("<tr>")[1:]]
    assert md_rows == html_rows and md_rows[0] == report_differences.DIFF_HEADER and len(md_rows) == 3, (md_rows, html_rows)
    assert all(row[4].startswith("0 ± ") and row[4].endswith("%") for row in md_rows[1:])


def test_figure_formats_are_chosen_and_png_is_the_default(tmp_path, small_run, unbuilt_figures):
    """--formats adds formats beside the PNG (which file types, and their links, are the question: small_run
    builds these figures already, and the tests above render them)."""
    res = runner.invoke(app, ["report", str(small_run), "--out", str(tmp_path / "svg"), "--formats", "svg", "-q"])
    assert res.exit_code == 0, res.output
    made = {p.suffix for p in (tmp_path / "svg" / "figures").iterdir()}
    assert made == {".png", ".svg"}                     # PNG always: the pages show it
    assert "(figures/bias_std_gauss.svg)" in (tmp_path / "svg" / "report.md").read_text()
    assert {p.suffix for p in (small_run / "report" / "figures").iterdir()} == {".png"}
    bad = runner.invoke(app, ["report", str(small_run), "--out", str(tmp_path / "bad"), "--formats", "png,jpg"])
    assert bad.exit_code == 2 and "--formats" in bad.stderr and "jpg" in bad.stderr and len(bad.stderr.splitlines()) == 1
    assert not (tmp_path / "bad").exists()
    help_text = " ".join(runner.invoke(app, ["report", "--help"]).output.split())
    assert "--formats" in help_text and "default: png" in help_text, help_text


def _page_is_self_contained(html: str, pngs: int) -> None:
    assert html.startswith("<!doctype html>") and "<style>" in html and "`" not in html
    assert html.count("data:image/png;base64,") == pngs
    assert not re.search(r"(src|href)=['\"](?!data:)", html)          # nothing loaded from elsewhere


def test_training_and_audit_reports_have_a_self_contained_html_page(tmp_path):
    from tests.test_audit import _gen, _steps
    import kl_bench.api as api
    from kl_bench.audit import AuditLog, Sampler, audit_step
    spec = tmp_path / "t.toml"
    spec.write_text('spec_version = 1\n[experiment]\nname = "t"\ndraws = 10\ndevice = "cpu"\n[train]\n'
                    'optimizer = "sgd"\nlr = 0.5\nsteps = 3\nbeta = 0.5\nreward = { random = 1.0 }\n'
                    'combinations = ["k1/reward", "k3/loss"]\n[[case]]\nname = "cat"\nkind = "categorical"\n'
                    'vocab = 12\nq = { logits = "zipf", exponent = 1.1, seed = 1 }\np = { from = "q", noise = 0.5, seed = 2 }\n')
    api.train(spec).write(tmp_path / "train")
    res = runner.invoke(app, ["report", str(tmp_path / "train")])
    assert res.exit_code == 0 and "report.html (1 figure)" in res.stdout, res.output     # "1 figure", not "1 figures"
    html = (tmp_path / "train" / "report" / "report.html").read_text()
    _page_is_self_contained(html, 1)
    assert "Closest to the optimum" in html and "KL(q‖q*)" in html and "cat: closest to the optimum" in html
    log = AuditLog()
    for s, (pv, values, mask) in enumerate(_steps(_gen(3), Sampler(top_k=5), 1)):
        log.add(audit_step(pv, values, mask, estimator="trl.grpo", step=s, source="loss"))
    log.write(tmp_path / "audit", trainer="test")
    res = runner.invoke(app, ["report", str(tmp_path / "audit")])
    assert res.exit_code == 0 and "report.html (1 figure)" in res.stdout, res.output
    html = (tmp_path / "audit" / "report" / "report.html").read_text()
    _page_is_self_contained(html, 1)
    assert "1 step, mean logged" in html and "pooled z" in html              # "1 step", not "1 steps"


# ----------------------------------------------------------------------------- edge cases of a new user's specs
ZERO_SPEC = """
spec_version = 1
[experiment]
name = "same"
draws = 4000
device = "cpu"
batches = 20
estimators = ["k1", "k3"]

[[case]]
name = "g0"
kind = "gaussian"
q = {mean = 0.0, std = 1.0}
p = {mean = 0.0, std = 1.0}

[[case]]
name = "c0"
kind = "categorical"
vocab = 50
q = {logits = "zipf", exponent = 1.1, seed = 1}
p = {from = "q", noise = 0.0}

[[case]]
name = "g"
kind = "gaussian"
q = {mean = 0.0, std = 1.0}
p = {mean = 0.3, std = 1.0}
"""


def _md_cells(line: str) -> list[str]:
    """The cells of a Markdown table row, split where GitHub splits them: at every | without a backslash."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def test_a_case_with_kl_zero_is_reported_in_absolute_values(tmp_path, unrendered_figures):
    """p = q (a Gaussian with q = p, a categorical with noise 0): the report, like `kl-bench run`, shows the
    bias ± SE and the std ± SE absolute (no relative value exists) and says so in the case's heading."""
    spec = tmp_path / "same.toml"
    spec.write_text(ZERO_SPEC)
    res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "same"), "--quiet", "--report"])
    assert res.exit_code == 0, res.output
    lines = (tmp_path / "same" / "report" / "table.md").read_text().splitlines()
    head = _md_cells(lines[0])
    summary = load_results(tmp_path / "same").summary.set_index(["case", "estimator"])
    for k, case in enumerate(["g0", "c0", "g"]):
        zero = case != "g"
        assert head[1 + 4 * k].startswith(f"{case} (KL = 0 (p = q): bias and std absolute") == zero, head
        assert head[1 + 4 * k].endswith("bias ± SE" if zero else "bias/true ± SE") and \
            head[3 + 4 * k] == ("std ± SE" if zero else "std/true ± SE"), head
        for line in lines[2:4]:
            cells = _md_cells(line)
            r = summary.loc[(case, cells[0])]
            bias, std = cells[1 + 4 * k], cells[3 + 4 * k]
            if zero:      # the numbers of summary.csv as they are: absolute
                from kl_bench.foundation.formatting import measured_cells
                b = measured_cells(float(r["bias"]), float(r["se"]), float(r["exact_mean"]) - float(r["true_kl"]),
                                   sign=True)
                sd = measured_cells(float(r["std"]), float(r["std_se"]), float(r["exact_std"]))
                assert bias == f"{b[0]} ± {b[1]}" and cells[2 + 4 * k] == b[2], (case, cells)
                assert std == f"{sd[0]} ± {sd[1]}" and cells[4 + 4 * k] == sd[2], (case, cells)
            else:
                assert bias.endswith("%") and "%" in bias.split(" ± ")[0], (case, cells)
    tex = (tmp_path / "same" / "report" / "table.tex").read_text()
    assert r"\emph{g0} (KL = 0 (p = q): bias and std absolute, not /true)" in tex
    html = (tmp_path / "same" / "report" / "report.html").read_text()
    assert "<th>bias ± SE</th>" in html and "<th>bias/true ± SE</th>" in html


def test_a_training_folder_at_the_optimum_everywhere_is_reported(tmp_path):
    """vocab = 1: KL(q‖q*) is 0 at every step of every combination, exact and sampled. Its panel cannot be
    a log axis (nothing above 0): it is drawn on a linear one that says so, and the report is one line."""
    import kl_bench.api as api
    spec = tmp_path / "v1.toml"
    spec.write_text('spec_version = 1\n[experiment]\nname = "v1"\ndraws = 8\ndevice = "cpu"\n[train]\n'
                    'optimizer = "adam"\nlr = 0.05\nsteps = 4\nbeta = 0.5\ngradients = ["exact", "sampled"]\nseeds = 2\n'
                    'combinations = ["k1/reward", "k3/loss"]\n[[case]]\nname = "one"\nkind = "categorical"\n'
                    'vocab = 1\nq = { logits = "zipf", exponent = 1.1, seed = 1 }\np = { from = "q", noise = 1.0, seed = 2 }\n')
    api.train(spec).write(tmp_path / "train")
    assert (pd.read_csv(tmp_path / "train" / "train.csv")["kl_opt"] == 0).all()
    res = runner.invoke(app, ["report", str(tmp_path / "train")])
    assert res.exit_code == 0, res.output
    assert res.stderr == "" and len(res.stdout.splitlines()) == 1, res.output
    png = (tmp_path / "train" / "report" / "figures" / "training_one.png").read_bytes()
    assert _png_size(png)[0] > 1000


NAMES = ["a|b", "a,b", "a-b", "κλ", "日本語", "x" * 90 + "1", "x" * 90 + "2", "Noise", "noise", "emoji 🙂", "tick`s",
         "y" * 300]


def _names_run(tmp_path, names=NAMES) -> Path:
    cases = "".join(f'[[case]]\nname = "{n}"\nkind = "gaussian"\nq = {{mean = 0.0, std = 1.0}}\n'
                    f'p = {{mean = {0.1 + 0.05 * i:.2f}, std = 1.0}}\n' for i, n in enumerate(names))
    spec = tmp_path / "names.toml"
    spec.write_text('spec_version = 1\n[experiment]\nname = "names"\ndraws = 2000\ndevice = "cpu"\nbatches = 20\n'
                    'estimators = ["k1", "k3"]\n' + cases)
    res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "names"), "--quiet"])
    assert res.exit_code == 0, res.output
    return tmp_path / "names"


def test_every_case_has_its_own_figure_files_and_markdown_tables_keep_their_columns(tmp_path, unrendered_figures):
    """Names that make the same slug (a|b, a,b, a-b; 日本語 and κλ; two long names alike in their first 90
    characters; Noise and noise on a case-insensitive file system) each get their own figure file, the
    same from run to run, and report.md shows each case's own figure; a | in a name is escaped in every
    Markdown table, so that every row has the header's number of cells."""
    folder = _names_run(tmp_path)
    out = [report.build_report([folder])]           # every figure built with every name, not rendered
    with pytest.MonkeyPatch.context() as mp:        # the files again: which they are does not depend on drawing
        stub_plot_functions(mp)
        out.append(report.build_report([folder]))
    assert out[0].keys() == out[1].keys()                        # deterministic
    figures = [f for f in out[0] if f.startswith("figures/")]
    assert len({f.lower() for f in figures}) == len(figures)
    md = out[0]["report.md"].decode()
    for kind in ("bias_std", "distribution", "convergence"):
        files = re.findall(rf"\]\(figures/({kind}_[^)]*)\)", md)
        assert len(set(files)) == len(NAMES), files
    for name in NAMES:       # the figure under a case's heading is the one drawn for it
        caption = f"{pages.md_text(name)}: bias and std per estimator"
        block = md.split(f"### {caption}", 1)[1].split("###", 1)[0]
        file = re.search(r"\(figures/(bias_std_[^)]*)\)", block).group(1)
        assert sum(f"(figures/{file})" in b for b in md.split("### ")) == 1, (name, file)
    for table in (out[0]["table.md"].decode(), md.split("## Paper table", 1)[1].split("## Figures", 1)[0]):
        rows = [line for line in table.splitlines() if line.startswith("|")]
        assert len({len(_md_cells(line)) for line in rows}) == 1, rows[:2]
        assert len(_md_cells(rows[0])) == 1 + 4 * len(NAMES)
        assert "a\\|b" in rows[0] and "tick\\`s" in rows[0]


# The names of NAMES that drawing can stumble on: the others are ASCII or Greek (which DejaVu Sans has), there for
# the file names and Markdown tables above, whose test builds every figure with every name. A report renders
# three figures a case (0.25 s each): three cases instead of twelve, 3.5 s of CPU instead of 10.
DRAWN_NAMES = ["日本語", "emoji 🙂", "y" * 300]


def test_figures_of_unusual_names_print_no_warnings(tmp_path):
    """Glyphs DejaVu Sans lacks (日本語, an emoji) and a 300-character name: the report draws every figure
    without a warning (every warning in a test is an error, conftest) and prints its one line; a long name
    is cut with an ellipsis in the figures, so that the planning figure's labels fit."""
    folder = _names_run(tmp_path, DRAWN_NAMES)
    res = runner.invoke(app, ["report", str(folder)])
    assert res.exit_code == 0, res.output
    assert res.stderr == "" and len(res.stdout.splitlines()) == 1, res.output
    assert len(list((folder / "report" / "figures").glob("*.png"))) == 3 * len(DRAWN_NAMES) + 1   # and planning
    fig = plots.plot_planning(load_results(folder).summary, title="t")
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[DRAWN_NAMES.index("y" * 300)].endswith("…") and max(map(len, labels)) <= 60, labels
    from kl_bench.present.pages import quiet_drawing
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    with quiet_drawing():        # the missing glyphs, as figure_bytes draws them
        FigureCanvasAgg(fig).draw()           # lays it out as savefig does
        width = fig.get_window_extent().width
        boxes = [t.get_window_extent() for t in fig.axes[0].get_yticklabels()]
    assert all(b.x0 >= 0 and b.x1 <= width for b in boxes), boxes


def test_a_case_with_an_infinite_kl_is_reported(tmp_path):
    """p = 0 at a token q draws: KL(q‖p) = ∞, and every draw of that token has an infinite k1 and k3. The
    report is written (it crashed in the distribution figure's ticks, OverflowError), with no numpy warning
    on stderr, and the figure says how many draws are off its axis."""
    import numpy as np
    g = np.random.default_rng(0)
    q = g.standard_normal(50)
    p = q + 0.3 * g.standard_normal(50)
    p[3] = -np.inf
    np.save(tmp_path / "q.npy", q)
    np.save(tmp_path / "p.npy", p)
    spec = tmp_path / "inf.toml"
    spec.write_text('spec_version = 1\n[experiment]\nname = "inf"\ndraws = 10000\nseed = 0\ndevice = "cpu"\n'
                    'estimators = ["k1", "k3"]\n[[case]]\nname = "c"\nkind = "categorical"\n'
                    'q = { file = "q.npy" }\np = { file = "p.npy" }\n')
    out = tmp_path / "r"
    # In this process, where every warning is an error (conftest), numpy's RuntimeWarnings among them: one fails
    # the command (a fresh `python -W error::RuntimeWarning` cost 4 s of CPU more, importing torch and matplotlib).
    res = runner.invoke(app, ["run", str(spec), "--out", str(out), "--report", "-q"])
    assert res.exit_code == 0 and res.exception is None, (res.exception, res.output[-2000:])
    assert "Traceback" not in res.output and "Warning" not in res.output, res.output[-2000:]
    assert math.isinf(pd.read_csv(out / "summary.csv")["mean"][0])
    assert (out / "report" / "report.html").exists() and (out / "report" / "figures" / "distribution_c.png").exists()
    fig = plots.plot_distribution(pd.DataFrame({"label": ["k1"] * 4, "value": [0.1, -0.2, np.inf, 0.3]}))
    assert "1 infinite or NaN draws off the axis" in fig.axes[0].get_xlabel()
    # A NaN draw leaves the others' quantiles (it had made every one NaN: the line vanished)
    assert np.isfinite(plots_distribution._quantiles(np.array([1.0, 2.0, np.nan, 3.0, np.inf]), np.array([0.1, 0.5]))).all()


def test_a_report_over_an_earlier_one_removes_its_figures_and_keeps_the_users(tmp_path, build_spec, write_spec,
                                                                             unrendered_figures):
    """`report --out R` over an earlier report of other cases: the figures the earlier report.md showed and
    this report does not draw are gone with it (they would sit beside the new report, named like its own),
    a file of the user's in R/figures/ stays, and the new report's figures are all there."""
    gauss = {"kind": "gaussian", "q": {"mean": 0.0, "std": 1.0}, "p": {"mean": 0.2, "std": 1.0}}
    both = write_spec(build_spec([{"name": "one", **gauss}, {"name": "two", **gauss}], draws=4000, batches=8), "a.toml")
    one = write_spec(build_spec([{"name": "one", **gauss}], draws=4000, batches=8), "b.toml")
    for spec, out in ((both, "A"), (one, "B")):
        assert runner.invoke(app, ["run", str(spec), "-q", "--out", str(tmp_path / out)]).exit_code == 0
    rep = tmp_path / "R"
    assert runner.invoke(app, ["report", str(tmp_path / "A"), "-q", "--out", str(rep)]).exit_code == 0
    before = {p.name for p in (rep / "figures").iterdir()}
    assert any("two" in n for n in before)
    (rep / "figures" / "mine.png").write_bytes(b"mine")
    assert runner.invoke(app, ["report", str(tmp_path / "B"), "-q", "--out", str(rep)]).exit_code == 0
    after = {p.name for p in (rep / "figures").iterdir()}
    shown = set(re.findall(r"\]\(figures/([^)]+)\)", (rep / "report.md").read_text()))
    assert after == shown | {"mine.png"}, (after, shown)
    assert not any("two" in n for n in after) and (rep / "figures" / "mine.png").read_bytes() == b"mine"


# ----------------------------------------------------------------------------- 5. report: one folder twice
def test_a_report_refuses_a_folder_given_twice_by_any_name(checked_run, tmp_path):
    """`kl-bench report D D` had compared a run with itself as if independent (diff 0, z 0)."""
    _, folder, _, _, _ = checked_run
    link = tmp_path / "link"
    os.symlink(folder, link)
    other_spelling = folder.parent / "." / ".." / folder.parent.name / folder.name
    for second, said in ((folder, "is given twice"), (other_spelling, f"is {folder} again"),
                         (link, f"is {folder} again")):
        out = tmp_path / "report"
        res = runner.invoke(app, ["report", str(folder), str(second), "--out", str(out), "--quiet"])
        line = one_line(res)
        assert line.startswith(f"error: {second}: {said}") and "give each folder once" in line, line
        assert not out.exists()
    from kl_bench.present.report import write_report
    with pytest.raises(SpecError, match="is given twice"):
        write_report([folder, folder], tmp_path / "api")


def test_every_renderer_runs_and_none_overwrites_anothers_files(identical_runs, unrendered_figures, monkeypatch):
    """A new format is one renderer in RENDERERS: it runs in every report, and a renderer that returns a path
    another part of the report already wrote (here table.md, report_md's) fails instead of replacing it."""
    calls = []

    def txt(doc):
        calls.append(doc)
        return {"report.txt": b"text"}
    monkeypatch.setattr(report, "RENDERERS", report.RENDERERS + (txt,))
    files = report.build_report([identical_runs / "small"])
    assert len(calls) == 1 and files["report.txt"] == b"text" and "table.md" in files
    monkeypatch.setattr(report, "RENDERERS", report.RENDERERS + (lambda doc: {"table.md": b"mine"},))
    with pytest.raises(RuntimeError, match="writes table.md, which another part of the report already wrote"):
        report.build_report([identical_runs / "small"])
