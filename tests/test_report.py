"""`kl-bench report`: every figure from a small run, valid PNGs, the paper table's numbers, the HTML's
references, several folders side by side, and clear errors for missing or incomplete folders."""
import re
import shutil
import struct
import subprocess

import matplotlib
import pandas as pd
import pytest
from typer.testing import CliRunner

from kl_bench import plots
from kl_bench.cli import app
from kl_bench.report import tex_number, load_results, sig

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
    root = tmp_path_factory.mktemp("rep")
    spec = root / "small.toml"
    spec.write_text(SPEC)
    res = runner.invoke(app, ["run", str(spec), "--out", str(root / "small"), "--quiet", "--report"])
    assert res.exit_code == 0, res.output
    return root / "small"


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_every_figure_is_rendered_as_a_sensible_png(small_run):
    figs = sorted(p.name for p in (small_run / "report" / "figures").iterdir())
    expected = {f"{kind}_{case}.png" for kind in ("bias_std", "distribution", "convergence")
                for case in ("gauss", "cat", "roll-T4", "roll-T8")}
    expected |= {"lambda_gauss.png", "lambda_cat.png", "lambda_roll-T4-seq.png", "lambda_roll-T4-tok.png",
                 "lambda_roll-T8-seq.png", "lambda_roll-T8-tok.png", "rollout_growth_0.png", "planning.png"}
    assert expected <= set(figs), expected - set(figs)
    for name in figs:
        data = (small_run / "report" / "figures" / name).read_bytes()
        w, h = _png_size(data)
        assert 400 <= w <= 3000 and 250 <= h <= 3000 and len(data) > 10_000, (name, w, h, len(data))


def test_table_tex_holds_the_summary_numbers_as_displayed(small_run):
    text = (small_run / "report" / "table.tex").read_text()
    df = pd.read_csv(small_run / "summary.csv", keep_default_na=True)
    rows = df[df["lambda"].isna() | (df["estimator"] == "cv_opt")]
    for _, r in rows.iterrows():
        for col in ("rel_bias", "exact_rel_bias", "rel_std", "exact_rel_std"):
            shown = tex_number(sig(r[col]))
            assert shown in text, (r["case"], r["estimator"], col, shown)
    # structure: balanced braces, booktabs rules, every row has 1 + 4·cases cells
    assert text.count("{") == text.count("}")
    for rule in (r"\toprule", r"\midrule", r"\bottomrule", r"\caption{", r"\begin{tabular}"):
        assert rule in text
    ncols = len(re.search(r"\\begin\{tabular\}\{(\w+)\}", text).group(1))
    assert ncols == 1 + 4 * df["case"].nunique()
    body = text.split(r"\midrule")[1].split(r"\bottomrule")[0].strip().splitlines()
    assert all(line.count("&") == ncols - 1 for line in body)
    assert "20,000 draws" in text or "20,000" in text       # the caption names draws and seed
    assert "seed 0" in text


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
    for p in (small_run / "report" / "figures").iterdir():
        assert f"figures/{p.name}" in html and f"figures/{p.name}" in md
    assert html.count("data:image/png;base64,") == len(list((small_run / "report" / "figures").iterdir()))
    assert "bias/true" in (small_run / "report" / "table.md").read_text()


@pytest.mark.slow
def test_several_folders_side_by_side(small_run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(small_run, other)
    res = runner.invoke(app, ["report", str(small_run), str(other), "--out", str(tmp_path / "both")])
    assert res.exit_code == 0, res.output
    table = (tmp_path / "both" / "table.md").read_text()
    assert "small/gauss" in table and "other/gauss" in table


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
    from kl_bench.report import html_inline, html_text
    assert html_inline("results: `a<b`; spec `x.toml`") == "results: <code>a&lt;b</code>; spec <code>x.toml</code>"
    assert html_inline("odd ` tick") == "odd &#96; tick"
    assert html_text("case `x`") == "case &#96;x&#96;"


def test_no_growth_figure_for_one_length_and_token_mean_rows_are_drawn(tmp_path):
    """Two rollout cases of one family at the same T draw no std-against-T figure (a single point per
    line); tok_mean and tok_batch rows appear in the per-case figures like every other row."""
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
