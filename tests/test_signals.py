"""Signals (SIGINT, SIGTERM, SIGHUP) at every phase of every command, during the console script's
start-up and inside compiled code: one line, exit 130, the earlier results kept, nothing left behind; after
the swap, the line says the results were written. No sleeps: the process signals itself at a named phase."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kl_bench import cli as cli_module
from kl_bench.foundation import signals, storage

from .helpers import (TRAIN_SPEC, cli_inprocess, cli_popen, cli_run, gauss_spec, gauss_text, leftovers, one_line_proc)


@pytest.mark.parametrize("phase,sig", [("start", "SIGINT"), ("write", "SIGINT"),
                                       pytest.param("start", "SIGTERM", marks=pytest.mark.slow),
                                       pytest.param("pairs", "SIGINT", marks=pytest.mark.slow),
                                       pytest.param("pairs", "SIGTERM", marks=pytest.mark.slow)])
def test_a_signal_at_any_phase_is_one_line_and_keeps_earlier_results(small_spec, tmp_path, phase, sig):
    out = tmp_path / "res"
    assert cli_inprocess("run", small_spec, "--out", out, "-q").returncode == 0     # the earlier results
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = cli_run("run", small_spec, "--out", out, "-q", "--seed", "3", env={"KL_BENCH_SELF_SIGNAL": f"{phase}:{sig}"})
    err = proc.stderr.strip()
    assert proc.returncode == 130 and len(err.splitlines()) == 1 and "Traceback" not in err, (proc.returncode, err)
    assert "interrupted" in err and ("while writing" in err) == (phase == "write")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and leftovers(tmp_path) == []


# (command, phase): the phases each command passes (kl_bench.foundation.signals.phase); after "written" or
# "report-written" the new files are complete and the line says so.
PHASES = [("run", "start"), ("run", "pairs"), ("run", "write"), ("run", "staged"), ("run", "written"),
          ("report", "start"), ("report", "staged"), ("report", "report-written"),
          ("check", "start"), ("check", "write"), ("check", "written"),
          ("baseline", "start"), ("baseline", "write"), ("baseline", "written"),
          ("exact", "start"), ("exact", "write"), ("exact", "written"),
          ("train", "start"), ("train", "staged")]


FAST = {("run", "staged", "SIGTERM"), ("report", "staged", "SIGTERM"), ("baseline", "write", "SIGINT")}


@pytest.mark.parametrize("command, phase, sig", [(*p, s) if (*p, s) in FAST else
                                                 pytest.param(*p, s, marks=pytest.mark.slow)
                                                 for p in PHASES for s in ("SIGINT", "SIGTERM")])
def test_a_signal_at_every_phase_of_every_command_is_one_line(gauss_results, tmp_path, command, phase, sig):
    spec = tmp_path / "t.toml"
    spec.write_text(TRAIN_SPEC)
    out = tmp_path / "out"
    args = {"run": ["run", gauss_results["spec"], "--out", out, "-q"], "report": ["report", gauss_results["res"], "--out", out],
            "check": ["check", gauss_results["spec"], "--results", gauss_results["res"], "--json", out, "-q"],
            "baseline": ["baseline", gauss_results["spec"], "--results", gauss_results["res"], "--out", out, "-q"],
            "exact": ["exact", gauss_results["spec"], "--out", out],
            "train": ["train", spec, "--out", out, "-q"]}[command]
    proc = cli_run(*args, env={"KL_BENCH_SELF_SIGNAL": f"{phase}:{sig}"})
    err = one_line_proc(proc, 130, "interrupted")
    done = phase in ("written", "report-written")
    assert out.exists() == done, (err, list(tmp_path.iterdir()))
    assert (str(out) in err and "complete" in err) if done else ("nothing was" in err or "no " in err), err
    assert leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- signals
def test_a_swallowed_signal_during_parsing_never_exits_0_nor_rewrites_run_json(gauss_results, gauss_folder, handlers, capsys,
                                                                             monkeypatch):
    monkeypatch.setattr(storage, "_COMMITTED", set())       # what this (test) process wrote before
    before = (gauss_folder / "run.json").read_bytes()
    signals.seen[0] = 1           # as if a library had swallowed the KeyboardInterrupt
    with pytest.raises(SystemExit) as e:
        cli_module.main(["run", str(gauss_results["spec"]), "--out", str(gauss_folder), "-q", "--seed", "9"])
    assert e.value.code == 130 and (gauss_folder / "run.json").read_bytes() == before
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing was written" in err[0], err


@pytest.mark.slow
@pytest.mark.parametrize("phase, needle", [("written", "were written to"), ("report-written", "report files were written")])
def test_a_signal_just_after_the_swap_says_the_results_were_written(gauss_results, gauss_folder, phase, needle):
    p = cli_popen("run", gauss_results["spec"], "--out", gauss_folder, "-q", "--seed", "3", *(["--report"] if "report" in phase else []),
             env={"KL_BENCH_SELF_SIGNAL": phase})
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130 and len(err.strip().splitlines()) == 1 and needle in err, err
    assert json.loads((gauss_folder / "run.json").read_text())["seed"] == 3


def _catches_sigint(pid: int) -> bool:
    """Whether kl-bench has installed its handlers (/proc's SigCgt mask; it catches SIGTERM with SIGINT,
    which Python does not by default): before that, the interpreter starts up under Python's default
    SIGINT handling, which no program can change."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


# A signal at each step of the console script's start-up, sent by the process to itself (no sleeps): right after
# the handlers go in, and while the temp folder is probed. The second had raised out of entry() (a traceback and a
# death by SIGINT, -2) when the handlers went in before the signals were held. SIGHUP (an SSH session that
# closes) had been neither held nor handled: a death by the signal (-1), no line, a lock file left by a run.
_AT_START = """
import os, signal, sys
signal.signal(signal.SIGHUP, signal.SIG_DFL)    # as a terminal leaves it, not as a nohup'd test runner's parent
import kl_bench.__main__ as m
from kl_bench.foundation import signals
where, sig = sys.argv.pop(1), getattr(signal, sys.argv.pop(1))
def kill(f):
    def wrapped(*a):
        out = f(*a)
        os.kill(os.getpid(), sig)
        return out
    return wrapped
if where == "install":
    signals.install = kill(signals.install)
else:
    m._temp_dir_without_probe = kill(m._temp_dir_without_probe)
sys.argv[0] = "kl-bench"
m.entry()
"""


def test_an_interrupt_raised_in_code_run_from_a_string_still_exits_130_under_python_m(tmp_path):
    """CPython remembers a KeyboardInterrupt raised in code run from a string (exec/eval: a dataclass's or
    namedtuple's generated methods during an import) as unhandled even when it is caught, and under
    ``python -m`` ends the process by SIGINT after the exit code is decided: one line, then exit -2 (found by
    a fuzzer, 2 runs in 60: a Ctrl-C during a command's lazy import, when nothing ran a string after it).
    Here a command whose signal comes inside such code, and which says so and exits 130."""
    pkg = tmp_path / "kb_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(textwrap.dedent("""
        import sys
        import kl_bench.cli
        import kl_bench.__main__ as m
        from kl_bench.foundation import signals
        def main():     # a command that a signal interrupts inside exec'd code, and that says so and exits
            signals.release()                      # as kl_bench.cli.main does once its imports are done
            try:
                exec("import os, signal\\nos.kill(os.getpid(), signal.SIGINT)\\nx = 1")
            except KeyboardInterrupt:
                sys.stderr.write("interrupted: nothing was written\\n")
                sys.exit(130)
        kl_bench.cli.main = main
        m.entry()
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    p = subprocess.run([sys.executable, "-m", "kb_probe"], capture_output=True, text=True, timeout=300, env=env,
                       cwd=tmp_path)
    assert p.returncode == 130, (p.returncode, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1 and "interrupted" in p.stderr and "Traceback" not in p.stderr


_IN_FT2FONT = """
import os, signal, sys
count = [0]
def prof(frame, event, arg):    # the first call from matplotlib.ft2font's C++ start-up back into Python
    if event == "call" and frame.f_back is not None and frame.f_back.f_code.co_name == "_call_with_frames_removed":
        what = frame.f_back.f_locals.get("args", (None,))[0]         # the module's spec, or the module
        name = getattr(what, "name", None) or getattr(what, "__name__", None)
        if name == "matplotlib.ft2font" and frame.f_code.co_name != "<module>":
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGINT)
sys.setprofile(prof)
sys.argv = ["kl-bench", *sys.argv[1:]]
import kl_bench.__main__ as m
m.entry()
"""


def test_a_signal_inside_matplotlibs_compiled_start_up_is_one_line_and_130(gauss_results, tmp_path):
    """A report imports matplotlib, whose ft2font extension calls back into Python while it loads: a Ctrl-C
    there was "ImportError: initialization failed" with a 67-line traceback, or an abort (exit 134). The
    signal comes at that call; matplotlib is now imported with the signals held."""
    p = subprocess.run([sys.executable, "-c", _IN_FT2FONT, "report", str(gauss_results["res"]), "--out", str(tmp_path / "rep"),
                        "-q"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 130, (p.returncode, p.stderr[-2000:])
    assert len(p.stderr.strip().splitlines()) == 1 and "interrupted" in p.stderr and not (tmp_path / "rep").exists()


# SIGHUP at both steps (it had been neither held nor handled) and SIGINT at the temp-folder probe (where it
# had raised out of entry()) run by default; the rest of the grid is slow: kl-bench catches SIGTERM with
# SIGINT (one handler), and test_a_signal_at_every_phase_of_every_command_is_one_line sends SIGTERM.
_START_DEFAULT = {("install", "SIGHUP"), ("temp", "SIGHUP"), ("temp", "SIGINT")}


@pytest.mark.parametrize("where, sig", [(w, s) if (w, s) in _START_DEFAULT else pytest.param(w, s, marks=pytest.mark.slow)
                                        for w in ("install", "temp") for s in ("SIGINT", "SIGTERM", "SIGHUP")])
def test_a_signal_during_the_console_scripts_start_up_is_one_line_and_130(where, sig):
    p = subprocess.run([sys.executable, "-c", _AT_START, where, sig, "list"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 130, (p.returncode, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1 and "interrupted" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.3, 1.5, 3.0])
def test_three_sigints_20_to_50_ms_apart_exit_130_with_one_line(gauss_results, tmp_path, delay):
    spec = gauss_spec(tmp_path, text=gauss_text(name="s", seed=0, more="", extra="").replace("20_000", "50_000_000"))
    p = cli_popen("run", spec, "--out", tmp_path / "o", "-q", "--checkpoint-every", "inf")
    deadline = time.monotonic() + 240
    while not _catches_sigint(p.pid):
        assert time.monotonic() < deadline and p.poll() is None, "the handlers never went in"
        time.sleep(0.002)
    time.sleep(delay)
    for gap in (0.02, 0.05, 0.0):
        p.send_signal(signal.SIGINT)
        time.sleep(gap)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (p.returncode, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "interrupted" in err, err
