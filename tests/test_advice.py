"""Advice that fits how an estimator is used (issue 25, item 6) and tables that fit the terminal (item 5).

The advice is checked against the exact planning quantities it is built from (kl_bench.core.planning), on
exact tables of small cases, so every number in a sentence can be recomputed here."""
import io
import math
import os
import re
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

import kl_bench.api as api
from kl_bench.analysis.advice import AdviceOptionError, check_options, recommendations
from kl_bench.cli import app
from kl_bench.present.tables import print_tables
from kl_bench.core.planning import n_for_rel_error

runner = CliRunner()

CAT = """
spec_version = 1
[experiment]
name = "adv"
draws = 40_000
batches = 20
estimators = ["k1", "k2", "k3", "abs"]
{extra}
[[case]]
name = "c"
kind = "categorical"
vocab = 64
q = {{ logits = "zipf", exponent = 1.1, seed = 1 }}
p = {{ from = "q", noise = 0.5, seed = 2 }}
{case}
"""


def _spec(write_spec, extra="", case=""):
    return write_spec(CAT.format(extra=extra, case=case))


def _row(df, est):
    return df[(df["case"] == "c") & (df["estimator"] == est)].iloc[0]


def test_value_advice_is_the_lowest_rmse_among_estimators_that_reach_the_tolerance(write_spec):
    df = api.exact(_spec(write_spec))
    for batch, tol in [(64, 0.1), (512, 0.05), (8, 0.3)]:
        value = [a for a in recommendations(df, batch=batch, tolerance=tol) if a.use == "value"][0]
        plans = {}
        for est in ["k1", "k2", "k3", "abs"]:
            r = _row(df, est)
            bias, std, true = r["exact_mean"] - r["true_kl"], r["exact_std"], r["true_kl"]
            plans[est] = (math.sqrt(bias**2 + std**2 / batch), n_for_rel_error(bias, std, true, tol))
        reach = {e: p for e, p in plans.items() if math.isfinite(p[1])}
        best = min(reach, key=lambda e: reach[e][0])
        assert value.row == best
        assert f"needs a batch of {reach[best][1]:,.0f}" in value.text
        assert "abs" not in reach          # |log r| is biased far beyond any tolerance here
        assert value.row != "abs"


def test_no_estimator_is_recommended_as_reaching_a_tolerance_none_can(write_spec):
    df = api.exact(_spec(write_spec, case='sampler = { temperature = 0.7 }'))
    value = [a for a in recommendations(df, tolerance=0.01) if a.use == "value"][0]
    ns = [n_for_rel_error(r["exact_mean"] - r["true_kl"], r["exact_std"], r["true_kl"], 0.01)
          for _, r in df.iterrows()]
    assert not any(math.isfinite(n) for n in ns)
    assert value.row == "" and "gets within ±1% at any batch size" in value.text
    # the sampler causes the bias, and weights remove it: the advice says so
    assert 'weights = "token"' in value.text


def test_importance_weights_make_k3_unbiased_and_the_hint_goes_away(write_spec):
    df = api.exact(_spec(write_spec, case='sampler = { temperature = 0.7, weights = "token" }'))
    assert abs(_row(df, "k3")["exact_rel_bias"]) < 1e-9
    value = [a for a in recommendations(df) if a.use == "value"][0]
    assert "weights" not in value.text


def test_a_sampler_that_misses_support_is_not_told_to_use_weights(write_spec):
    df = api.exact(_spec(write_spec, case="sampler = { top_k = 8 }"))
    value = [a for a in recommendations(df) if a.use == "value"][0]
    assert "no importance weight recovers" in value.text and 'weights = "token"' not in value.text


def test_loss_advice_comes_from_the_gradient_rows_when_computed(write_spec):
    res = api.run(_spec(write_spec, extra="gradients = true"))
    loss = [a for a in res.recommendations() if a.use == "loss"][0]
    g = res.gradients
    reverse = g[g["equals"] == "reverse"]
    best = reverse.loc[reverse["n_for_cos90"].astype(float).idxmin()]
    assert loss.row == f"{best['estimator']} in {best['mode']} mode"
    assert "k1 in loss mode has zero expected gradient" in loss.text      # the pitfall is named
    assert not loss.general


def test_loss_advice_without_gradients_states_the_on_policy_identities_once(write_spec, tmp_path):
    res = runner.invoke(app, ["run", str(_spec(write_spec)), "--out", str(tmp_path / "o"), "--batch", "256",
                              "--tolerance", "0.05"])
    assert res.exit_code == 0, res.output
    assert "c: to log, " in res.output and "at a batch of 256" in res.output and "±5% with 95%" in res.output
    assert res.output.count("k1 in the loss has zero expected gradient") == 1


@pytest.mark.parametrize("flags,key", [(["--batch", "0"], "--batch"), (["--tolerance", "2"], "--tolerance"),
                                       (["--tolerance", "nan"], "--tolerance")])
def test_bad_advice_options_are_one_line_and_exit_2(write_spec, tmp_path, flags, key):
    for cmd in (["run", str(_spec(write_spec)), "--out", str(tmp_path / "o")], ["exact", str(_spec(write_spec))]):
        res = runner.invoke(app, cmd + flags)
        assert res.exit_code == 2 and key in res.output, res.output
        assert not (tmp_path / "o").exists()
    with pytest.raises(AdviceOptionError):
        check_options(True, 0.1)


def test_exact_prints_the_same_advice_as_the_api(write_spec):
    spec = _spec(write_spec)
    res = runner.invoke(app, ["exact", str(spec)])
    assert res.exit_code == 0
    for a in recommendations(api.exact(spec)):
        assert a.detail in res.output


# ------------------------------------------------------------------ tables at the terminal's width
def _render(df, width, terminal=True, wide=False):
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=terminal, color_system=None, highlight=False)
    print_tables(con, df, {"c": "a description of q and p", "d": "another"}, wide=wide)
    return buf.getvalue()


@pytest.fixture(scope="module")
def two_cases(tmp_path_factory):
    path = tmp_path_factory.mktemp("s") / "s.toml"
    path.write_text(CAT.format(extra="", case="") + """
[[case]]
name = "d"
kind = "gaussian"
q = { mean = 0.0, std = 1.0 }
p = { mean = 0.1, std = 1.0 }
""")
    return api.run(path).summary


def test_80_columns_compact_one_line_a_row_nothing_truncated(two_cases):
    out = _render(two_cases, 80)
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert not any(line.endswith(" ") for line in lines)
    assert "…" not in out                                   # no cell cut short
    assert "bias/true ± se" in out and "exact mean" not in out
    k1 = [line for line in lines if line.startswith("k1 ") and "q||p" in line]
    assert len(k1) == 2 and all("±" in line for line in k1)   # one line per row, value ± se on it


def test_a_side_table_too_wide_for_the_terminal_is_stacked_every_cell_kept(two_cases):
    """Issue 31: a table wider than the terminal is printed in parts that each fit (the estimator column in
    every part), never a pointer to --wide and never a cut cell."""
    from kl_bench.present.side_tables import schulman_table
    from kl_bench.present.terminal import natural_width, show
    buf = io.StringIO()
    con = Console(file=buf, width=40, force_terminal=True, color_system=None)
    table = schulman_table(two_cases)
    assert natural_width(con, table) > 40
    show(con, table)
    lines = buf.getvalue().splitlines()
    assert all(len(line) <= 40 for line in lines) and "…" not in buf.getvalue()
    assert sum("(1/" in line or "(2/" in line for line in lines) >= 2                # in parts
    plain = io.StringIO()
    show(Console(file=plain, width=400, force_terminal=False), schulman_table(two_cases))
    cells = {c for line in plain.getvalue().splitlines()[3:] for c in line.split()}
    assert cells <= {c for line in lines for c in line.split()}                       # every cell, whole


def test_200_columns_full_table_and_wide_flag(two_cases):
    out = _render(two_cases, 200)
    assert "exact mean" in out and "mean ± se" in out
    assert all(len(line) <= 200 and not line.endswith(" ") for line in out.splitlines())
    assert "exact mean" in _render(two_cases, 80, wide=True)


def test_piped_output_has_no_trailing_spaces_and_titles_that_do_not_wrap(two_cases):
    out = _render(two_cases, 400, terminal=False)
    assert not any(line.endswith(" ") for line in out.splitlines())
    assert "c: a description of q and p" in out.splitlines()[0]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="pty")
def test_the_cli_in_an_80_column_terminal(write_spec, tmp_path):
    import pty
    spec = _spec(write_spec)
    env = {**os.environ, "COLUMNS": "80", "LINES": "50", "TERM": "xterm"}
    code = ("import sys; from kl_bench.cli import main; "
            f"sys.argv = ['kl-bench', 'run', {str(spec)!r}, '--out', {str(tmp_path / 'o')!r}]; main()")
    pid, fd = pty.fork()          # a real terminal of 80 columns: what a person sees
    if pid == 0:
        os.execve(sys.executable, [sys.executable, "-c", code], env)
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode("utf-8", "replace")).replace("\r", "")
    assert os.waitstatus_to_exitcode(status) == 0, text
    table = [line for line in text.splitlines() if line.startswith(("k1 ", "k2 ", "k3 ", "abs "))]
    assert len(table) == 4 and all(len(line) <= 80 for line in table), text
    assert "…" not in "\n".join(table)


def test_exact_names_a_sampler_missing_mass_without_a_summary(tmp_path, build_spec):
    """`kl-bench exact` on a case whose sampler truncates (top_p) crashed in the warning about the missed
    mass (it read the summary's heavy_tail column, which an exact table has none of): exit 0, and the
    warning says what is known without draws."""
    from typer.testing import CliRunner

    from kl_bench.cli import app
    case = {"name": "top-p", "kind": "categorical", "vocab": 300, "q": {"logits": "zipf", "exponent": 1.1, "seed": 1},
            "p": {"from": "q", "noise": 0.3, "seed": 2}, "sampler": {"top_p": 0.9}}
    (tmp_path / "s.toml").write_text(build_spec(cases=[case]))
    res = CliRunner().invoke(app, ["exact", str(tmp_path / "s.toml"), "-q"])
    assert res.exit_code == 0, res.output
    assert "warning: case 'top-p': the sampler never draws" in res.output and "Traceback" not in res.output


def test_a_sampler_that_is_q_itself_is_no_mismatch(write_spec):
    """Issue 44: a sweep case headed "sampler b: q itself" (temperature 1) was told "the bias comes from
    drawing from b ≠ q" and listed under "draws come from b ≠ q". Its draws are q's: on-policy advice, no
    mismatch table."""
    df = api.exact(_spec(write_spec, case="sampler = { temperature = 1.0 }"))
    assert set(df["sampler"]) == {"q itself"}
    texts = " ".join(a.text for a in recommendations(df))
    assert "b ≠ q" not in texts and "on-policy" in texts, texts
    from kl_bench.present.side_tables import side_tables
    assert not any("sampling mismatch" in str(t.title) for t, _ in side_tables(df.assign(mean=df["exact_mean"],
                                                                                           se=0.0, std=df["exact_std"],
                                                                                           frac_negative=0.0)))


def test_the_value_advice_considers_full_where_it_exists(write_spec):
    """Issue 44: `full` (Σ_x q log(q/p), Rao–Blackwellised) needed far fewer draws than k3 and went unsaid."""
    spec = write_spec(CAT.format(extra="", case="").replace('"abs"]', '"abs", "full"]'))
    df = api.exact(spec)
    value = [a for a in recommendations(df) if a.use == "value"][0]
    full = _row(df, "full")
    n = n_for_rel_error(full["exact_mean"] - full["true_kl"], full["exact_std"], full["true_kl"], 0.1)
    assert f"full (Rao–Blackwellised) needs {n:,.0f}" in value.text and value.row != "full", value.text


def test_never_says_its_real_reason():
    """Issue 44: "never" was captioned as bias where the variance is infinite."""
    from kl_bench.core.planning import never_words
    rows = [{"n_for_10pct": math.inf, "exact_rel_bias": 0.0, "exact_std": math.inf},
            {"n_for_10pct": math.inf, "exact_rel_bias": 0.3, "exact_std": 1.0},
            {"n_for_10pct": 10.0, "exact_rel_bias": 0.0, "exact_std": 1.0}]
    assert never_words(rows[:1]) == "the variance is infinite"
    assert never_words(rows) == "the variance is infinite or the bias alone exceeds ±10%"
    assert never_words(rows[2:]) == ""
