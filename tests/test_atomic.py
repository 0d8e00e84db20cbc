"""Results are written atomically: a failed write or an interrupted run never leaves a half-written
file and never destroys an earlier run."""
import os
import signal
import subprocess
import sys
import time

import pytest

from kl_bench import storage


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "summary.csv"
    target.write_text("old\n")

    def broken_replace(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(storage.os, "replace", broken_replace)
    with pytest.raises(OSError):
        storage.atomic_write_bytes(target, b"new\n")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.csv"]


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
    proc = subprocess.Popen([sys.executable, "-m", "kl_bench", "run", str(spec), "--out", str(out), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)            # well inside the sampling loop (≈ 1 minute of work)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "interrupted" in err and "Traceback" not in err
    assert (out / "summary.csv").read_text() == "earlier run\n"
    assert (out / "run.json").read_text() == "{}\n"
    assert sorted(os.listdir(out)) == ["run.json", "summary.csv"]
