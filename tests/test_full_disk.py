"""A disk with no room, one that fills mid-write (`ulimit -f`, and a real full tmpfs where a user
namespace allows mounting one), a read-only mount, and a command that fails part-way: one line, exit 2,
the earlier results intact, nothing created and nothing left behind."""
import errno
import os
import resource
import shutil
import stat
import subprocess
import sys

import pytest

from kl_bench.cli import app
from kl_bench.foundation import atomic

from .helpers import (HOOKS, TRAIN_SPEC, cli_run, leftovers, one_line,
                      one_line_proc, runner, tree)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_disk_or_read_only_mount_keeps_earlier_results(small_spec, tmp_path, monkeypatch, code):
    out = tmp_path / "res"
    assert runner.invoke(app, ["run", str(small_spec), "--out", str(out), "-q"]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail(fh, data):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(atomic, "_write_file", fail)
    res = runner.invoke(app, ["run", str(small_spec), "--out", str(out), "-q", "--seed", "5"])
    one_line(res, 2, os.strerror(code), str(out))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert leftovers(tmp_path) == [] and not list(out.glob(".tmp-*"))
    res = runner.invoke(app, ["exact", str(small_spec), "--out", str(tmp_path / "e.csv")])
    one_line(res, 2, os.strerror(code))
    assert not (tmp_path / "e.csv").exists() and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.slow
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_report_and_run_report_on_a_full_disk_or_read_only_mount(gauss_results, gauss_folder, tmp_path, monkeypatch, code):
    assert runner.invoke(app, ["report", str(gauss_folder), "--out", str(tmp_path / "rep")]).exit_code == 0
    before = {p.relative_to(tmp_path / "rep"): p.read_bytes() for p in (tmp_path / "rep").rglob("*") if p.is_file()}
    real = atomic._write_file

    def fail_reports(fh, data):                 # only the report's files: the results still get written
        if ".rep.staging-" in str(fh.name) or ".report.staging-" in str(fh.name):
            raise OSError(code, os.strerror(code))
        real(fh, data)
    monkeypatch.setattr(atomic, "_write_file", fail_reports)
    one_line(runner.invoke(app, ["report", str(gauss_folder), "--out", str(tmp_path / "rep")]), 2, os.strerror(code))
    after = {p.relative_to(tmp_path / "rep"): p.read_bytes() for p in (tmp_path / "rep").rglob("*") if p.is_file()}
    assert after == before and not list(tmp_path.glob(".rep.staging-*"))
    res = runner.invoke(app, ["run", str(gauss_results["spec"]), "--out", str(tmp_path / "new"), "-q", "--report"])
    one_line(res, 2, os.strerror(code), "report")


# ----------------------------------------------------------------------------- full disks
FSIZE = resource.RLIMIT_FSIZE       # `ulimit -f`: a write beyond it fails with EFBIG (Python ignores SIGXFSZ)


@pytest.mark.parametrize("command", ["run", "report", *(pytest.param(c, marks=pytest.mark.slow)
                                                        for c in ("exact", "baseline", "check", "train"))])
def test_a_disk_with_no_room_is_one_line_before_any_work_and_creates_nothing(gauss_results, tmp_path, command):
    spec = tmp_path / "t.toml"
    spec.write_text(TRAIN_SPEC)
    deep = tmp_path / "new" / "deeper"
    args = {"run": ["run", gauss_results["spec"], "--out", deep / "r", "-q"],
            "report": ["report", gauss_results["res"], "--out", deep / "rep"],
            "exact": ["exact", gauss_results["spec"], "--out", deep / "e.csv"],
            "baseline": ["baseline", gauss_results["spec"], "--out", deep / "b.json", "-q"],
            "check": ["check", gauss_results["spec"], "--results", gauss_results["res"], "--json", deep / "c.json", "-q"],
            "train": ["train", spec, "--out", deep / "t", "-q"]}[command]
    before = tree(tmp_path)
    proc = cli_run(*args, limits=[(FSIZE, 0)])
    one_line_proc(proc, 2, os.strerror(errno.EFBIG), "key '--json'" if command == "check" else "key '--out'")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("command", ["run", pytest.param("report", marks=pytest.mark.slow),
                                     pytest.param("train", marks=pytest.mark.slow)])
def test_a_disk_that_fills_mid_write_keeps_the_earlier_folder_and_leaves_nothing(gauss_results, tmp_path, command):
    """Room for the probe and the lock, not for the results: the folder staged beside the old one fails."""
    spec = tmp_path / "t.toml"
    spec.write_text(TRAIN_SPEC)
    out = tmp_path / "out"
    args = {"run": ["run", gauss_results["spec"], "--out", out, "-q", "--seed", "4"],
            "report": ["report", gauss_results["res"], "--out", out],
            "train": ["train", spec, "--out", out, "-q", "--seed", "4"]}[command]
    first = {"run": ["run", gauss_results["spec"], "--out", out, "-q"], "report": ["report", gauss_results["res"], "--out", out],
             "train": ["train", spec, "--out", out, "-q"]}[command]
    assert runner.invoke(app, list(map(str, first))).exit_code == 0
    before = tree(tmp_path)
    proc = cli_run(*args, limits=[(FSIZE, 1024)])
    one_line_proc(proc, 2, os.strerror(errno.EFBIG), str(out))
    assert tree(tmp_path) == before


def _tmpfs_available() -> bool:
    """Whether a user namespace may mount a tmpfs here (the mount lives and dies with the namespace)."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _tmpfs_available(), reason="needs a user namespace to mount a small tmpfs")
@pytest.mark.parametrize("room", ["none", "some"])
@pytest.mark.parametrize("command", ["run", "report", "baseline"])
def test_a_real_full_disk_is_one_line_and_leaves_nothing(gauss_results, tmp_path, command, room):
    """A 64 KiB tmpfs filled to the last block (or with 8 KiB left): ENOSPC, as on a real disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    args = {"run": f"run {gauss_results['spec']} --out {disk}/a/r -q", "report": f"report {gauss_results['res']} --out {disk}/rep",
            "baseline": f"baseline {gauss_results['spec']} --results {gauss_results['res']} --out {disk}/b.json -q"}[command]
    blocks = {"none": "", "some": "count=14"}[room]
    script = (f"mount -t tmpfs -o size=64k tmpfs {disk} && dd if=/dev/zero of={disk}/fill bs=4k {blocks} "
              f"2>/dev/null; {sys.executable} {HOOKS} {args}; echo rc=$? >&2; ls -A {disk} >&2")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    if command == "baseline" and room == "some":           # a baseline this small fits in 8 KiB
        assert lines == ["rc=0", "b.json", "fill"], proc.stderr
        return
    assert len(lines) == 3 and lines[1:] == ["rc=2", "fill"], proc.stderr
    assert "No space left on device" in lines[0] and "Traceback" not in proc.stderr + proc.stdout


# ----------------------------------------------------------------------------- nothing created by a failure
@pytest.mark.parametrize("dirs", [["missing"], ["res", "missing"], ["empty"]])
def test_a_report_that_fails_creates_no_folder(gauss_results, tmp_path, monkeypatch, dirs):
    """`report missing` made missing/ (its default --out's parent), `report a missing` made runs/."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    paths = [gauss_results["res"] if d == "res" else tmp_path / d for d in dirs]
    before = tree(tmp_path)
    for out in ([] if len(paths) > 1 else [None]) + [tmp_path / "a" / "b" / "rep"]:
        res = runner.invoke(app, ["report", *map(str, paths), *(["--out", str(out)] if out else [])])
        assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
        assert tree(tmp_path) == before, res.output


def test_a_run_that_fails_after_taking_the_lock_removes_the_folders_it_made(gauss_results, tmp_path, monkeypatch):
    from kl_bench.foundation import atomic

    def fail(fh, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(atomic, "_write_file", fail)
    res = runner.invoke(app, ["run", str(gauss_results["spec"]), "--out", str(tmp_path / "a" / "b" / "r"), "-q"])
    assert res.exit_code == 2 and "No space left on device" in res.output, res.output
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_results_folder_is_not_replaced(gauss_results, tmp_path):
    """A folder made read-only (chmod a-w) to keep it: a run into it is one line, exit 2, and the folder keeps
    its bytes and its mode (exchanging folders needs only the parent writable: it had been replaced, 755)."""
    out = tmp_path / "kept"
    shutil.copytree(gauss_results["res"], out)
    out.chmod(0o555)
    try:
        before = tree(out)
        proc = cli_run("run", gauss_results["spec"], "--out", out, "-q", "--seed", "9")
        one_line_proc(proc, 2, "read-only folder", "key '--out'")
        assert tree(out) == before and stat.S_IMODE(out.stat().st_mode) == 0o555
    finally:
        out.chmod(0o755)
