"""Progress (issue 31 item 4): a line on a terminal for every command that can take more than 2 s (run,
report, train, exact, check), none in a pipe or with -q, one line updated in place in a Jupyter notebook
(kl_bench.run's default there), and a rate that counts only the draws of this process (--resume)."""
import io
import json
import sys
import types

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kl_bench.foundation import progress as P
from kl_bench.cli import app

runner = CliRunner()


class Clock:
    """A stand-in for time.perf_counter: seconds move only when the test says so."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(P, "time", c)
    return c


def _terminal(buf=None):
    return Console(file=buf or io.StringIO(), force_terminal=True, width=200, color_system=None)


def test_nothing_in_a_pipe_or_a_file(clock):
    """stderr not a terminal (a pipe, a CI log): no bar, no line, however long the run."""
    buf = io.StringIO()
    bar = P.LazyProgress(3_000_000, enabled=True, console=Console(file=buf, force_terminal=False, width=200))
    bar.label("a")
    clock.now += 60
    bar.advance(1_000_000)
    bar.label("b (gradients)")
    bar.advance(2_000_000)
    bar.close()
    assert buf.getvalue() == "" and bar.bar is None and bar.cell is None


def test_a_terminal_gets_the_bar_only_after_two_seconds(clock):
    bar = P.LazyProgress(100, enabled=True, console=_terminal(), unit="figures")
    bar.advance(1)
    assert bar.bar is None                      # a command that ends within 2 s says nothing
    clock.now += P.PROGRESS_AFTER_S + 0.1
    bar.label("bias_std_gauss.png")
    bar.advance(1)
    fields = bar.bar.tasks[0].fields
    bar.close()
    assert fields["label"] == "bias_std_gauss.png" and fields["count"] == "2/100 figures"
    assert fields["left"].endswith(" left")


def test_restored_draws_move_the_count_not_the_rate(clock):
    """--resume: a million draws restored from a checkpoint took no time here; the rate and the time left
    count the 1,000 drawn in 2.5 s (400 draws/s), not 1,001,000 (400,400/s)."""
    bar = P.LazyProgress(2_001_000, enabled=True, console=_terminal())
    bar.advance(1_000_000, restored=True)
    clock.now += 2.5
    bar.advance(1_000)
    fields = bar.bar.tasks[0].fields
    bar.close()
    assert fields["count"] == "1,001,000/2,001,000 draws"
    assert fields["rate"] == "400 draws/s", fields
    assert fields["left"] == "41:40 left", fields                 # 1,000,000 draws at 400/s


def _fake_ipython(monkeypatch, shell: str):
    """IPython as a kernel (shell ZMQInteractiveShell) or a terminal shell would present itself; display()
    returns a handle that records its updates."""
    updates = []

    class Handle:
        def update(self, obj):
            updates.append(str(obj))

    def display(obj, display_id=False):
        updates.append(str(obj))
        return Handle()
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: type(shell, (), {})()
    disp = types.ModuleType("IPython.display")
    disp.display = display
    ipython.display = disp
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", disp)
    return updates


def test_a_notebook_is_detected_and_gets_one_line_updated_in_place(monkeypatch, clock):
    assert not P.in_notebook() and P.wanted(None) is False         # a script: off unless asked
    _fake_ipython(monkeypatch, "TerminalInteractiveShell")
    assert not P.in_notebook()                                      # IPython in a terminal: not a notebook
    updates = _fake_ipython(monkeypatch, "ZMQInteractiveShell")
    assert P.in_notebook() and P.wanted(None) is True and P.wanted(False) is False
    # a kernel's stderr is no terminal: the line goes in the cell's output, and is cleared at the end
    bar = P.LazyProgress(10, enabled=True, console=Console(file=io.StringIO(), force_terminal=False))
    clock.now += 3
    bar.label("noise0.3")
    bar.advance(4)
    bar.close()
    assert any("noise0.3" in u and "4/10 draws" in u for u in updates), updates
    assert updates[-1] == ""


def test_kl_bench_run_shows_progress_in_a_notebook_by_default(monkeypatch, build_spec, write_spec):
    import inspect

    import kl_bench
    assert inspect.signature(kl_bench.run).parameters["progress"].default is None
    monkeypatch.setattr(P, "PROGRESS_AFTER_S", -1.0)
    updates = _fake_ipython(monkeypatch, "ZMQInteractiveShell")
    kl_bench.run(write_spec(build_spec(draws=4000, batches=4)))
    assert any("draws" in u and "/8,000 draws" in u for u in updates), updates
    shown = len(updates)
    kl_bench.run(write_spec(build_spec(draws=4000, batches=4)), progress=False)
    assert len(updates) == shown                                   # asked for none: none


def _terminal_err(monkeypatch, buf):
    """The CLI's stderr as a terminal (CliRunner's is a pipe), and progress from the first step."""
    from kl_bench.cli import common
    monkeypatch.setattr(P, "PROGRESS_AFTER_S", -1.0)
    monkeypatch.setattr(common, "err_console", _terminal(buf))
    for module in ("exact", "train"):
        monkeypatch.setattr(sys.modules[f"kl_bench.cli.{module}"], "err_console", common.err_console)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("prog")
    spec = root / "s.toml"
    spec.write_text('spec_version = 1\n[experiment]\nname = "p"\ndraws = 4000\nbatches = 4\ndevice = "cpu"\n'
                    'estimators = ["k1", "k3"]\n[[case]]\nname = "g"\nkind = "gaussian"\n'
                    'q = { mean = 0.0, std = 1.0 }\np = { mean = 0.3, std = 1.0 }\n')
    assert runner.invoke(app, ["run", str(spec), "--out", str(root / "run"), "-q"]).exit_code == 0
    return root


@pytest.mark.parametrize("quiet", [False, True])
def test_report_names_each_figure_on_a_terminal_and_nothing_with_q(monkeypatch, folder, tmp_path, quiet,
                                                                   unrendered_figures):
    buf = io.StringIO()
    _terminal_err(monkeypatch, buf)
    res = runner.invoke(app, ["report", str(folder / "run"), "--out", str(tmp_path / "r"), *(["-q"] if quiet else [])])
    assert res.exit_code == 0, res.output
    if quiet:
        assert buf.getvalue() == "" and res.stdout == ""
    else:
        assert ".png" in buf.getvalue() and "4/4 figures" in buf.getvalue(), buf.getvalue()[-500:]
        assert "(4 figures)" in res.stdout


def test_report_in_a_pipe_prints_its_one_line_and_no_progress(monkeypatch, folder, tmp_path, unrendered_figures):
    monkeypatch.setattr(P, "PROGRESS_AFTER_S", -1.0)
    res = runner.invoke(app, ["report", str(folder / "run"), "--out", str(tmp_path / "r")])
    assert res.exit_code == 0 and res.stderr == "" and res.stdout.count("\n") == 1, res.output


def test_exact_and_train_show_their_progress_on_a_terminal(monkeypatch, folder, tmp_path):
    buf = io.StringIO()
    _terminal_err(monkeypatch, buf)
    assert runner.invoke(app, ["exact", str(folder / "s.toml")]).exit_code == 0
    assert "g: exact moments" in buf.getvalue() and "2/2 steps" in buf.getvalue(), buf.getvalue()[-500:]
    spec = tmp_path / "t.toml"
    spec.write_text('spec_version = 1\n[experiment]\nname = "t"\ndraws = 10\ndevice = "cpu"\n[train]\n'
                    'optimizer = "sgd"\nlr = 0.5\nsteps = 3\nbeta = 0.5\ncombinations = ["k1/reward", "k3/loss"]\n'
                    '[[case]]\nname = "cat"\nkind = "categorical"\nvocab = 12\n'
                    'q = { logits = "zipf", exponent = 1.1, seed = 1 }\np = { from = "q", noise = 0.5, seed = 2 }\n')
    buf.seek(0)
    buf.truncate()
    res = runner.invoke(app, ["train", str(spec), "--out", str(tmp_path / "t")])
    assert res.exit_code == 0, res.output
    assert "cat: k3/loss (exact)" in buf.getvalue() and "8/8 steps" in buf.getvalue(), buf.getvalue()[-500:]
    buf.seek(0)
    buf.truncate()
    assert runner.invoke(app, ["train", str(spec), "--out", str(tmp_path / "t2"), "-q"]).exit_code == 0
    assert buf.getvalue() == ""
    assert runner.invoke(app, ["exact", str(folder / "s.toml"), "-q"]).exit_code == 0
    assert buf.getvalue() == ""


def test_resume_rate_counts_only_the_draws_made_in_this_process(folder, tmp_path, monkeypatch):
    """A run resumed from a checkpoint of 3 of its 4 batches: its bytes are the uninterrupted run's, and
    its draws/s is the 1,000 draws it made over its own sampling time (it was 4,000 over that time)."""
    import torch

    from kl_bench.api import run_folder as R
    import kl_bench.api as api
    from kl_bench.results import checkpoint
    out = tmp_path / "cut"
    monkeypatch.setattr(R, "_write", lambda result, out_dir: None)     # as if killed before writing
    R.run_to_folder(folder / "s.toml", out, checkpoint_every=1e-9)
    sp = api.load(folder / "s.toml")
    ident = checkpoint.checkpoint_identity(sp, torch.device("cpu"), sp.case_draws())
    sums = checkpoint.load_checkpoint(out, ident)
    checkpoint.save_checkpoint(out, ident, {case: s[:3] for case, s in sums.items()})
    monkeypatch.undo()
    res = runner.invoke(app, ["run", str(folder / "s.toml"), "--out", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    env = json.loads((out / "run.json").read_text())
    assert env["resumed"] is True and env["restored_draws"] == 3000
    # sampling_seconds is rounded to the millisecond (off by ≤ 0.0005 s, times the rate) and draws_per_second
    # to an integer (off by ≤ ½, times the seconds): a slow or descheduled run makes the second term count
    assert abs(env["draws_per_second"] * env["sampling_seconds"] - 1000) <= \
        env["draws_per_second"] * 0.0005 + 0.5 * env["sampling_seconds"] + 1
    assert "1,000 draws sampled in" in res.output and "3,000 more restored from the checkpoint" in res.output
    assert (out / "summary.csv").read_bytes() == (folder / "run" / "summary.csv").read_bytes()


def test_progress_names_the_phase_and_shows_the_rate(monkeypatch):
    from rich.console import Console

    from kl_bench.foundation import progress as P
    monkeypatch.setattr(P, "PROGRESS_AFTER_S", -1.0)
    bar = P.LazyProgress(3_000_000, enabled=True, console=Console(file=io.StringIO(), force_terminal=True))
    bar.label("noise0.3 (gradients)")
    bar.advance(1_234_567)
    fields = bar.bar.tasks[0].fields
    bar.close()
    assert fields["label"] == "noise0.3 (gradients)" and fields["count"] == "1,234,567/3,000,000 draws"
    assert fields["rate"].endswith(" draws/s") and "," in fields["rate"]


def test_run_prints_a_recommendation_and_a_rate_that_matches_its_time(small_spec, tmp_path):
    import json
    res = runner.invoke(app, ["run", str(small_spec), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0
    assert "g: to log, k3 (RMSE" in res.output and "±10% with 95% probability needs a batch of" in res.output
    env = json.loads((tmp_path / "o" / "run.json").read_text())
    # the rate is draws over the sampling time that is stated (run.json rounds the time to 1 ms)
    # sampling_seconds is rounded to the millisecond (off by ≤ 0.0005 s, times the rate) and draws_per_second
    # to an integer (off by ≤ ½, times the seconds): a slow or descheduled run makes the second term count
    assert abs(env["draws_per_second"] * env["sampling_seconds"] - 20_000) <= \
        env["draws_per_second"] * 0.0005 + 0.5 * env["sampling_seconds"] + 1
    assert f"draws sampled in {env['sampling_seconds']:.1f} s" in res.output
