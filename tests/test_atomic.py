"""Results are written atomically: a failed write or an interrupted run never leaves a half-written
file and never destroys an earlier run."""
import os
import signal
import subprocess
import sys
import time

import pytest

from kl_bench.foundation import atomic, output_paths, storage

from .helpers import HOOKS


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "summary.csv"
    target.write_text("old\n")

    def broken_replace(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(atomic.os, "replace", broken_replace)
    with pytest.raises(OSError):
        atomic.atomic_write_bytes(target, b"new\n")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.csv"]


@pytest.mark.parametrize("where", ["open", "write"])
def test_a_signal_just_after_the_temporary_file_is_made_leaves_nothing(tmp_path, monkeypatch, where):
    """tempfile.mkstemp bound the temporary file's name only after making the file, so a Ctrl-C in between
    left a stray .tmp-… (a run's checkpoints every 0.05 s hit that window): the name is chosen first now.
    Here the signal comes right after the open returns (before the fd is bound) and during the write, for
    a result file and the folder probe of an output path."""
    target = tmp_path / "summary.csv"
    target.write_text("old\n")
    real_open, real_write = os.open, atomic._write_file

    def open_then_signal(path, flags, *a, **kw):
        fd = real_open(path, flags, *a, **kw)
        if flags & os.O_CREAT:
            os.close(fd)
            raise KeyboardInterrupt
        return fd

    def write_then_signal(fh, data):
        real_write(fh, data[:1])
        raise KeyboardInterrupt
    if where == "open":
        monkeypatch.setattr(atomic.os, "open", open_then_signal)
    else:
        monkeypatch.setattr(atomic, "_write_file", write_then_signal)
    with pytest.raises(KeyboardInterrupt):
        atomic.atomic_write_bytes(target, b"new\n")
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.csv"]
    if where == "open":
        with pytest.raises(KeyboardInterrupt):
            output_paths._check_parent_writable(tmp_path / "new" / "out")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.csv"]


@pytest.mark.parametrize("planted", ["fifo", "link-to-folder", "link-to-file", "file", "folder"])
def test_anything_planted_at_the_staging_path_is_removed_never_opened_or_followed(tmp_path, planted):
    """shutil.rmtree opens its argument before it checks it is a folder: a FIFO named like a staging folder
    (.NAME.staging-PID, left by anyone) made every later write wait forever."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("precious")
    out = tmp_path / "out"
    stage = storage.staging_dir(out)
    {"fifo": lambda: os.mkfifo(stage), "link-to-folder": lambda: stage.symlink_to(victim),
     "link-to-file": lambda: stage.symlink_to(victim / "keep"), "file": lambda: stage.write_text("x"),
     "folder": lambda: (stage.mkdir(), (stage / "old").write_text("x"))}[planted]()
    (tmp_path / f".out.staging-{os.getpid() + 1}").symlink_to(victim)     # a "dead run's" stage, cleaned
    # In a child of this process's pid's stage name: a write that blocks fails the test instead of hanging it.
    code = ("import os, sys; from pathlib import Path; from kl_bench.foundation import storage; "
            f"storage.staging_dir = lambda out: Path({str(stage)!r}); "
            f"storage.write_locked(Path({str(out)!r}), {{'a.csv': b'1\\n'}})")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert (out / "a.csv").read_bytes() == b"1\n" and (victim / "keep").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "victim"]


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 130)])
def test_signal_during_a_run_keeps_the_earlier_results(sig, code, tmp_path, write_spec):
    spec = write_spec("""
        spec_version = 1
        [experiment]
        draws = 2_000_000_000
        device = "cpu"
        [[case]]
        name = "g"
        kind = "gaussian"
        q = {mean = 0.0, std = 1.0}
        p = {mean = 0.5, std = 1.0}
    """)
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.csv").write_text("earlier run\n")
    (out / "run.json").write_text("{}\n")
    proc = subprocess.Popen([sys.executable, "-m", "kl_bench", "run", str(spec), "--out", str(out), "--quiet",
                             "--checkpoint-every", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # An event, not a sleep: the first checkpoint means the sampling loop is running (≈ 1 minute of work).
    _wait_for(lambda: (out / ".checkpoint.npz").exists() or proc.poll() is not None, timeout=240)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "interrupted" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert (out / "summary.csv").read_text() == "earlier run\n"
    assert (out / "run.json").read_text() == "{}\n"
    assert sorted(os.listdir(out)) == [".checkpoint.npz", "run.json", "summary.csv"]


# ----------------------------------------------------------------------------- SIGKILL, resume, locking
import hashlib  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

LONG = """
spec_version = 1
[experiment]
name = "long"
draws = {draws}
seed = 4
device = "cpu"
batches = 400
chunk = 200000
estimators = ["k1", "k3"]
[[case]]
name = "g"
kind = "gaussian"
q = {{mean = 0.0, std = 1.0}}
p = {{mean = 0.5, std = 1.0}}
[[case]]
name = "c"
kind = "categorical"
vocab = 1000
q = {{logits = "zipf", exponent = 1.1, seed = 1}}
p = {{from = "q", noise = 0.3, seed = 2}}
"""


def _cli(*args, env=None):
    # HOOKS: the console script with the test hooks the environment asks for (KL_BENCH_KILL_AFTER_STAGED)
    script = [HOOKS] if env else ["-m", "kl_bench"]
    return subprocess.Popen([sys.executable, *script, *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def _finish(proc, timeout=300) -> tuple[int, str]:
    """Wait for a process and collect its stderr (closing the pipe)."""
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def _consistent(folder: Path) -> str:
    """The sha256 of summary.csv if every data file matches the hashes in run.json; fails otherwise."""
    env = json.loads((folder / "run.json").read_text())
    for name, digest in env["files"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name
    assert not list(folder.glob(".tmp-*"))
    return env["files"]["summary.csv"]


def _wait_for(pred, timeout=240.0):     # from the start: Python, torch's import, the first chunk on a busy machine
    t0 = time.time()
    while not pred():
        assert time.time() - t0 < timeout
        time.sleep(0.01)


@pytest.mark.slow
def test_sigkill_while_writing_leaves_the_earlier_results_whole(write_spec, tmp_path):
    spec = write_spec(LONG.format(draws=200_000))
    out = tmp_path / "out"
    first = _cli("run", spec, "--out", out, "--quiet")
    assert _finish(first)[0] == 0
    before = _consistent(out)
    # The run kills itself right after its second staged file: the swap not yet done (an event, not a time).
    proc = _cli("run", spec, "--out", out, "--quiet", "--seed", "9", env={"KL_BENCH_KILL_AFTER_STAGED": "2"})
    assert _finish(proc)[0] == -signal.SIGKILL
    assert any(tmp_path.glob(".out.staging-*"))             # it died mid-write...
    assert _consistent(out) == before                       # ...and the old folder is whole
    # The next run cleans up the dead run's staging folder and lands whole.
    again = _cli("run", spec, "--out", out, "--quiet", "--seed", "9")
    assert _finish(again)[0] == 0
    assert _consistent(out) != before
    assert not list(tmp_path.glob(".out.staging-*"))


@pytest.mark.slow
def test_resume_after_sigkill_is_identical_to_an_uninterrupted_run(write_spec, tmp_path):
    # 6M draws in chunks of 200,000; checkpoints after every chunk (1e-9 s), and the cut run kills itself
    # right after its second (an event, not a time: a fast machine cannot finish first), so the resumed
    # run restores some batches and draws the rest.
    spec = write_spec(LONG.format(draws=6_000_000))
    whole = _cli("run", spec, "--out", tmp_path / "whole", "--quiet")
    rc, err = _finish(whole)
    assert rc == 0, err
    proc = _cli("run", spec, "--out", tmp_path / "cut", "--quiet", "--checkpoint-every", "1e-9",
                env={"KL_BENCH_KILL_AFTER_CHECKPOINT": "2"})
    assert _finish(proc, 300)[0] == -signal.SIGKILL, "the run finished before its second checkpoint"
    assert not (tmp_path / "cut" / "summary.csv").exists()
    # A checkpoint from another seed is refused clearly, and the refusal leaves it as it was.
    checkpoint = (tmp_path / "cut" / ".checkpoint.npz").read_bytes()
    rc, err = _finish(_cli("run", spec, "--out", tmp_path / "cut", "--quiet", "--resume", "--seed", "5"))
    assert rc == 2 and "(seed differs)" in err and err.count("\n") == 1, err
    assert (tmp_path / "cut" / ".checkpoint.npz").read_bytes() == checkpoint
    resumed = _cli("run", spec, "--out", tmp_path / "cut", "--quiet", "--resume")
    rc, err = _finish(resumed)
    assert rc == 0, err
    assert json.loads((tmp_path / "cut" / "run.json").read_text())["resumed"] is True
    assert (tmp_path / "cut" / "summary.csv").read_bytes() == (tmp_path / "whole" / "summary.csv").read_bytes()
    assert not (tmp_path / "cut" / ".checkpoint.npz").exists()


@pytest.mark.slow
def test_two_runs_on_one_folder_do_not_collide(write_spec, tmp_path):
    # The first run is far too long to finish here (4·10^8 draws, minutes): events, not timing, end it.
    # Its batches stay small (10^6 draws: a checkpoint and a SIGINT are seen within a second).
    spec = write_spec(LONG.format(draws=400_000_000))
    out = tmp_path / "out"
    first = _cli("run", spec, "--out", out, "--quiet", "--checkpoint-every", "0.2")
    try:
        # The first checkpoint proves the first run holds the lock and is sampling.
        _wait_for(lambda: (out / ".checkpoint.npz").exists() or first.poll() is not None)
        rc, err = _finish(_cli("run", spec, "--out", out, "--quiet"), 120)
        assert first.poll() is None, "the first run ended too early for this test"
        assert rc == 2, err
        assert "being written by another kl-bench run" in err and err.count("\n") == 1
        # The refused run touched nothing: the first one is still sampling and stops cleanly on SIGINT...
        first.send_signal(signal.SIGINT)
        rc, err = _finish(first)
        assert rc == 130 and "interrupted" in err and err.count("\n") == 1, err
        assert sorted(os.listdir(out)) == [".checkpoint.npz"]
        # ...and its lock is released with it: the next run takes the folder and lands whole.
        small = write_spec(LONG.format(draws=100_000), "small.toml")
        assert _finish(_cli("run", small, "--out", out, "--quiet"))[0] == 0
        _consistent(out)
    finally:
        if first.poll() is None:          # a failed assertion: no process or pipe left behind
            first.kill()
            first.communicate()


# The console script, hung up on (SIGHUP: an SSH session or terminal that closes) right after its second
# checkpoint: an event, not a time. With "nohup", SIGHUP is ignored before kl-bench starts, as nohup leaves it.
_HANG_UP_AFTER_CHECKPOINT = """
import os, signal, sys
# "default": as a terminal leaves it, whatever the test runner's own parent did (under nohup it inherits SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv.pop(1) == "nohup" else signal.SIG_DFL)
from kl_bench.api import run_folder as runner
save, saved = runner.save_checkpoint, [0]
def save_then_hang_up(*args, **kwargs):
    save(*args, **kwargs)
    saved[0] += 1
    if saved[0] == 2:
        os.kill(os.getpid(), signal.SIGHUP)
runner.save_checkpoint = save_then_hang_up
sys.argv[0] = "kl-bench"
import kl_bench.__main__ as m
m.entry()
"""


@pytest.mark.slow
@pytest.mark.parametrize("parent", ["default", "nohup"])
def test_a_hang_up_mid_run_is_an_interrupt_unless_the_parent_ignores_it(write_spec, tmp_path, parent):
    """SIGHUP had killed a run by the signal (exit 129, no line) and left its lock file (.out.lock) beside the
    folder. Now it is SIGTERM's twin: one 'interrupted' line, exit 130, the checkpoint kept for --resume, the
    lock removed, the earlier results untouched. Under nohup it stays ignored and the run finishes."""
    spec = write_spec(LONG.format(draws=2_000_000))
    out = tmp_path / "out"
    first = _cli("run", write_spec(LONG.format(draws=100_000), "small.toml"), "--out", out, "--quiet")
    assert _finish(first)[0] == 0
    before = _consistent(out)
    proc = subprocess.Popen([sys.executable, "-c", _HANG_UP_AFTER_CHECKPOINT, parent, "run", str(spec), "--out",
                             str(out), "--quiet", "--checkpoint-every", "1e-9"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    rc, err = _finish(proc)
    assert not (tmp_path / ".out.lock").exists() and not list(tmp_path.glob(".out.staging-*"))
    if parent == "nohup":
        assert rc == 0 and err == "", err
        assert _consistent(out) != before and not (out / ".checkpoint.npz").exists()
        return
    assert rc == 130, (rc, err)
    assert "interrupted" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert (out / ".checkpoint.npz").exists() and _consistent(out) == before
