"""Hardening against what the machine does (issue 31, item 6): reads bounded without allocating their cap
(tested under a real `ulimit -v`), a disk with no room or that fills mid-write (`ulimit -f`, and a real
full tmpfs where a user namespace allows mounting one), signals at every phase of every command, and
nothing created by a command that fails: one line, exit 2 (130 for a signal), nothing left behind."""
import errno
import hashlib
import io
import json
import os
import resource
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import kl_bench.api as api
from kl_bench.foundation import safe_io
from kl_bench.cli import app
from kl_bench.foundation.errors import SpecError
from kl_bench.results import checkpoint

runner = CliRunner()

SPEC = """spec_version = 1
[experiment]
name = "{name}"
draws = 20_000
batches = 20
device = "cpu"
estimators = ["k1", "k3"]
[[case]]
name = "g"
kind = "gaussian"
q = {{ mean = 0.0, std = 1.0 }}
p = {{ mean = 0.3, std = 1.1 }}
"""

TRAIN = """spec_version = 1
[experiment]
name = "t"
draws = 10
device = "cpu"
[train]
optimizer = "sgd"
lr = 0.5
steps = 3
beta = 0.5
reward = { random = 1.0 }
combinations = ["k1/reward", "k3/loss"]
[[case]]
name = "cat"
kind = "categorical"
vocab = 12
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.5, seed = 2 }
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A spec, its results folder, a baseline and a checkpoint that --resume accepts; matplotlib's font
    cache built (its first import writes it: under `ulimit -f` that would be a warning of its own)."""
    subprocess.run([sys.executable, "-c", "import matplotlib.font_manager"], check=True, capture_output=True)
    root = tmp_path_factory.mktemp("io")
    spec = root / "io.toml"
    spec.write_text(SPEC.format(name="io"))
    assert runner.invoke(app, ["run", str(spec), "--out", str(root / "res"), "-q"]).exit_code == 0
    assert runner.invoke(app, ["baseline", str(spec), "--results", str(root / "res"), "--out",
                               str(root / "b.json")]).exit_code == 0
    sp = api.load(spec)
    ident = checkpoint.checkpoint_identity(sp, torch.device("cpu"), sp.case_draws())
    sums = torch.tensor([[0.5, -0.2, 900.0, 800.0, 300.0, 0.0]] * 3, dtype=torch.float64)
    (root / "ck").mkdir()
    checkpoint.save_checkpoint(root / "ck", ident, {"g": sums})
    return {"root": root, "spec": spec, "res": root / "res", "base": root / "b.json", "ck": root / "ck"}


def _cli(*args, env=None, limits=(), cwd=None):
    """The console script in a child process (kl_bench._test_hooks: with the hooks the environment asks for),
    under resource limits [(RLIMIT_*, value)]."""
    def limit():
        for what, value in limits:
            resource.setrlimit(what, (value, value))
    return subprocess.run([sys.executable, "-m", "kl_bench._test_hooks", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})}, preexec_fn=limit, cwd=cwd)


def _one_line(proc, code, *needles) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], err[-3000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in proc.stdout + err, err[-3000:]
    for n in needles:
        assert n in err, (n, err)
    return err


def _tree(folder: Path) -> dict:
    """Every path under ``folder`` with its bytes (None for folders): what must not change."""
    return {str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes())
            for p in sorted(folder.rglob("*"))}


# ----------------------------------------------------------------------------- memory limits
class _File(io.BytesIO):
    """A file whose fstat reports ``size`` (a /proc file reports 0), recording what read() is asked for."""

    def __init__(self, data: bytes, size: int):
        super().__init__(data)
        self.size, self.asked = size, []

    def fileno(self):
        return -1

    def read(self, n=-1):
        self.asked.append(n)
        return super().read(n)


def test_reads_never_ask_for_more_than_the_file_holds_plus_a_block(monkeypatch):
    """read(n) allocates n bytes first: the cap (2 GiB for batches.csv) must never be asked for at once."""
    files = []
    monkeypatch.setattr(safe_io.os, "fstat", lambda fd: os.stat_result((0o100644, 0, 0, 1, 0, 0, files[-1].size,
                                                                        0, 0, 0)))
    data = b"x" * 5000
    files.append(_File(data, len(data)))
    assert safe_io.read_capped(files[-1], 2 << 30, "f", "batches.csv") == data
    assert files[-1].asked[0] == len(data) + 1 and max(files[-1].asked) <= 1 << 20, files[-1].asked
    # a file whose size lies (/proc reports 0) is read a block at a time and refused beyond its cap
    files.append(_File(b"y" * (3 << 20), 0))
    with pytest.raises(SpecError, match="more than the 2 MiB"):
        safe_io.read_capped(files[-1], 2 << 20, "f", "prompts")
    assert max(files[-1].asked) <= 1 << 20, files[-1].asked


# 3 GB of address space, as `ulimit -v 3000000` sets it (kB): common on shared clusters and in containers.
ULIMIT_V_KB = 3_000_000
_IMPORTS = "import torch, pandas, scipy.special, matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot"


@pytest.fixture(scope="module")
def address_space_limit():
    """3 GB, or less: 1 GiB above what the imports of a command map (VmPeak), so that a read that allocates
    its 2 GiB cap fails on every machine, as it did under 3 GB where more was mapped (more threads, CUDA).
    Skips where the interpreter cannot even import torch under it."""
    probe = subprocess.run([sys.executable, "-c", _IMPORTS + "; print(open('/proc/self/status').read()"
                            ".split('VmPeak:')[1].split()[0])"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("cannot measure the address space the imports take")
    limit = min(ULIMIT_V_KB, int(probe.stdout.split()[-1]) + (1 << 20)) * 1024
    check = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True,
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    if check.returncode != 0:
        pytest.skip("torch does not import under the address-space limit on this machine")
    return [(resource.RLIMIT_AS, limit)]


@pytest.mark.parametrize("command", ["check", "resume", pytest.param("baseline", marks=pytest.mark.slow),
                                     pytest.param("report", marks=pytest.mark.slow)])
def test_every_read_of_a_results_folder_or_checkpoint_works_under_ulimit_v(made, tmp_path, address_space_limit,
                                                                           command):
    """Reading batches.csv (cap 2 GiB) or a checkpoint (cap 2 GiB) allocated the cap: MemoryError."""
    ck = tmp_path / "ck"
    shutil.copytree(made["ck"], ck)
    args = {"check": ["check", made["spec"], "--results", made["res"], "--baseline", made["base"], "-q"],
            "baseline": ["baseline", made["spec"], "--results", made["res"], "--out", tmp_path / "b.json", "-q"],
            "resume": ["run", made["spec"], "--out", ck, "--resume", "-q"],
            "report": ["report", made["res"], "--out", tmp_path / "rep"]}[command]
    proc = _cli(*args, limits=address_space_limit)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, \
        proc.stderr[-3000:]


# ----------------------------------------------------------------------------- full disks
FSIZE = resource.RLIMIT_FSIZE       # `ulimit -f`: a write beyond it fails with EFBIG (Python ignores SIGXFSZ)


@pytest.mark.parametrize("command", ["run", "report", *(pytest.param(c, marks=pytest.mark.slow)
                                                        for c in ("exact", "baseline", "check", "train"))])
def test_a_disk_with_no_room_is_one_line_before_any_work_and_creates_nothing(made, tmp_path, command):
    spec = tmp_path / "t.toml"
    spec.write_text(TRAIN)
    deep = tmp_path / "new" / "deeper"
    args = {"run": ["run", made["spec"], "--out", deep / "r", "-q"],
            "report": ["report", made["res"], "--out", deep / "rep"],
            "exact": ["exact", made["spec"], "--out", deep / "e.csv"],
            "baseline": ["baseline", made["spec"], "--out", deep / "b.json", "-q"],
            "check": ["check", made["spec"], "--results", made["res"], "--json", deep / "c.json", "-q"],
            "train": ["train", spec, "--out", deep / "t", "-q"]}[command]
    before = _tree(tmp_path)
    proc = _cli(*args, limits=[(FSIZE, 0)])
    _one_line(proc, 2, os.strerror(errno.EFBIG), "key '--json'" if command == "check" else "key '--out'")
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("command", ["run", pytest.param("report", marks=pytest.mark.slow),
                                     pytest.param("train", marks=pytest.mark.slow)])
def test_a_disk_that_fills_mid_write_keeps_the_earlier_folder_and_leaves_nothing(made, tmp_path, command):
    """Room for the probe and the lock, not for the results: the folder staged beside the old one fails."""
    spec = tmp_path / "t.toml"
    spec.write_text(TRAIN)
    out = tmp_path / "out"
    args = {"run": ["run", made["spec"], "--out", out, "-q", "--seed", "4"],
            "report": ["report", made["res"], "--out", out],
            "train": ["train", spec, "--out", out, "-q", "--seed", "4"]}[command]
    first = {"run": ["run", made["spec"], "--out", out, "-q"], "report": ["report", made["res"], "--out", out],
             "train": ["train", spec, "--out", out, "-q"]}[command]
    assert runner.invoke(app, list(map(str, first))).exit_code == 0
    before = _tree(tmp_path)
    proc = _cli(*args, limits=[(FSIZE, 1024)])
    _one_line(proc, 2, os.strerror(errno.EFBIG), str(out))
    assert _tree(tmp_path) == before


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
def test_a_real_full_disk_is_one_line_and_leaves_nothing(made, tmp_path, command, room):
    """A 64 KiB tmpfs filled to the last block (or with 8 KiB left): ENOSPC, as on a real disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    args = {"run": f"run {made['spec']} --out {disk}/a/r -q", "report": f"report {made['res']} --out {disk}/rep",
            "baseline": f"baseline {made['spec']} --results {made['res']} --out {disk}/b.json -q"}[command]
    blocks = {"none": "", "some": "count=14"}[room]
    script = (f"mount -t tmpfs -o size=64k tmpfs {disk} && dd if=/dev/zero of={disk}/fill bs=4k {blocks} "
              f"2>/dev/null; {sys.executable} -m kl_bench._test_hooks {args}; echo rc=$? >&2; ls -A {disk} >&2")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    if command == "baseline" and room == "some":           # a baseline this small fits in 8 KiB
        assert lines == ["rc=0", "b.json", "fill"], proc.stderr
        return
    assert len(lines) == 3 and lines[1:] == ["rc=2", "fill"], proc.stderr
    assert "No space left on device" in lines[0] and "Traceback" not in proc.stderr + proc.stdout


# ----------------------------------------------------------------------------- nothing created by a failure
@pytest.mark.parametrize("dirs", [["missing"], ["res", "missing"], ["empty"]])
def test_a_report_that_fails_creates_no_folder(made, tmp_path, monkeypatch, dirs):
    """`report missing` made missing/ (its default --out's parent), `report a missing` made runs/."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    paths = [made["res"] if d == "res" else tmp_path / d for d in dirs]
    before = _tree(tmp_path)
    for out in ([] if len(paths) > 1 else [None]) + [tmp_path / "a" / "b" / "rep"]:
        res = runner.invoke(app, ["report", *map(str, paths), *(["--out", str(out)] if out else [])])
        assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1, res.output
        assert _tree(tmp_path) == before, res.output


def test_a_run_that_fails_after_taking_the_lock_removes_the_folders_it_made(made, tmp_path, monkeypatch):
    from kl_bench.foundation import atomic

    def fail(fh, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(atomic, "_write_file", fail)
    res = runner.invoke(app, ["run", str(made["spec"]), "--out", str(tmp_path / "a" / "b" / "r"), "-q"])
    assert res.exit_code == 2 and "No space left on device" in res.output, res.output
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- report --out, baseline's default
@pytest.mark.parametrize("out, needle", [("new.html", "looks like a file name; --out names the report folder"),
                                         ("notes.md", "give e.g. --out"),
                                         ("file", "is a file; --out names the report folder")])
def test_report_out_is_a_folder_and_a_file_name_says_so(made, tmp_path, out, needle):
    (tmp_path / "file").write_text("keep")
    before = _tree(tmp_path)
    res = runner.invoke(app, ["report", str(made["res"]), "--out", str(tmp_path / out)])
    assert res.exit_code == 2 and needle in res.output and "key '--out'" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and _tree(tmp_path) == before


def test_a_report_folder_whose_name_has_a_suffix_is_still_a_folder(made, tmp_path):
    (tmp_path / "r.html").mkdir()           # asked for: an existing folder is a folder whatever its name
    assert runner.invoke(app, ["report", str(made["res"]), "--out", str(tmp_path / "r.html")]).exit_code == 0
    assert (tmp_path / "r.html" / "report.html").is_file()


def test_baseline_never_writes_into_the_tracked_tree_unless_asked(made, tmp_path, monkeypatch):
    """`kl-bench baseline experiments/ci.toml` replaced the committed results/baselines/ci.json."""
    monkeypatch.chdir(tmp_path)
    committed = tmp_path / "results" / "baselines" / "io.json"
    committed.parent.mkdir(parents=True)
    committed.write_text("committed")
    res = runner.invoke(app, ["baseline", str(made["spec"]), "--results", str(made["res"])])
    assert res.exit_code == 0, res.output
    assert committed.read_text() == "committed"
    assert "→ runs/baselines/io.json" in res.output and "--out results/baselines/io.json" in res.output
    made_now = tmp_path / "runs" / "baselines" / "io.json"
    # the gate reads the committed one by default, the new one when asked
    assert runner.invoke(app, ["check", str(made["spec"]), "--results", str(made["res"]), "--baseline",
                               str(made_now), "-q"]).exit_code == 0
    res = runner.invoke(app, ["baseline", str(made["spec"]), "--results", str(made["res"]), "--out", str(committed)])
    assert res.exit_code == 0 and '"kl_bench_baseline": 1' in committed.read_text(), res.output


# ----------------------------------------------------------------------------- signals at every phase
def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*") if ".staging-" in p.name
                  or p.name.endswith(".lock") or p.name.startswith((".tmp-", ".kl-bench-probe")))


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
def test_a_signal_at_every_phase_of_every_command_is_one_line(made, tmp_path, command, phase, sig):
    spec = tmp_path / "t.toml"
    spec.write_text(TRAIN)
    out = tmp_path / "out"
    args = {"run": ["run", made["spec"], "--out", out, "-q"], "report": ["report", made["res"], "--out", out],
            "check": ["check", made["spec"], "--results", made["res"], "--json", out, "-q"],
            "baseline": ["baseline", made["spec"], "--results", made["res"], "--out", out, "-q"],
            "exact": ["exact", made["spec"], "--out", out],
            "train": ["train", spec, "--out", out, "-q"]}[command]
    proc = _cli(*args, env={"KL_BENCH_SELF_SIGNAL": f"{phase}:{sig}"})
    err = _one_line(proc, 130, "interrupted")
    done = phase in ("written", "report-written")
    assert out.exists() == done, (err, list(tmp_path.iterdir()))
    assert (str(out) in err and "complete" in err) if done else ("nothing was" in err or "no " in err), err
    assert _leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- what stands inside --out
@pytest.mark.parametrize("plant", ["folder", "fifo", "symlink"])
def test_an_entry_at_an_output_name_that_is_not_a_regular_file_is_refused_and_kept(made, tmp_path, plant):
    """A folder, a FIFO or a symlink at summary.csv inside an existing results folder was swapped out with
    the old folder (a user's folder at batches.csv, and what it held, deleted in silence). Now one line,
    exit 2, and the folder as it was."""
    out = tmp_path / "out"
    shutil.copytree(made["res"], out)
    (out / "summary.csv").unlink()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    {"folder": lambda p: (p.mkdir(), (p / "precious.txt").write_text("precious")),
     "fifo": lambda p: os.mkfifo(p), "symlink": lambda p: p.symlink_to(victim)}[plant](out / "summary.csv")
    before = _tree(out) if plant != "fifo" else None
    proc = _cli("run", made["spec"], "--out", out, "-q")
    _one_line(proc, 2, "summary.csv", "refusing to replace it", "key '--out'")
    if before is not None:
        assert _tree(out) == before
    assert victim.read_text() == "precious" and not list(tmp_path.glob(".out.*"))


def test_a_symlink_as_the_results_folder_is_refused(made, tmp_path):
    """kl-bench never writes through a link: --out naming a symlink to a folder is one line, exit 2, and
    the folder it points to is untouched."""
    target = tmp_path / "target"
    shutil.copytree(made["res"], target)
    before = _tree(target)
    (tmp_path / "link").symlink_to(target)
    for command in (["run", made["spec"], "--out", tmp_path / "link", "-q"],
                    ["report", made["res"], "--out", tmp_path / "link"]):
        _one_line(_cli(*command), 2, "symbolic link", "key '--out'")
    assert _tree(target) == before


def test_a_symlink_at_the_checkpoint_is_refused_before_any_sampling(made, tmp_path):
    """--resume (or checkpoints) with a symlink at .checkpoint.npz: refused at start, its target neither read
    nor written (it was read through the link, and refused only at the first checkpoint's write)."""
    ck = tmp_path / "ck"
    shutil.copytree(made["ck"], ck)
    real = tmp_path / "elsewhere.npz"
    (ck / ".checkpoint.npz").rename(real)
    (ck / ".checkpoint.npz").symlink_to(real)
    before = real.read_bytes()
    _one_line(_cli("run", made["spec"], "--out", ck, "--resume", "-q"), 2, "symbolic link", "key '--resume'")
    _one_line(_cli("run", made["spec"], "--out", ck, "-q"), 2, "symbolic link", ".checkpoint.npz", "key '--out'")
    assert real.read_bytes() == before and not (ck / "summary.csv").exists()


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError(
    "[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
    "8000000000 bytes. Error code 12 (Cannot allocate memory)")])
def test_running_out_of_memory_is_one_line(made, monkeypatch, capsys, error):
    """An allocation that fails (a MemoryError, or torch's allocator on the host or a GPU) is one line, exit 2,
    not a 75-line traceback."""
    from kl_bench import cli
    from kl_bench.api import run_folder as runner

    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr(runner, "run_to_folder", fail)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", str(made["spec"]), "--out", str(made["root"] / "never"), "-q"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: out of memory"), err
    assert not (made["root"] / "never").exists()


@pytest.mark.parametrize("args, key, needle", [
    (["exact", "{spec}", "--out", "{spec}", "-q"], "--out", "is the spec this command reads"),
    (["exact", "{spec}", "--out", "-", "-q"], "--out", "'-' is not read as stdout"),
    (["check", "{spec}", "--results", "{res}", "--json", "{spec}"], "--json", "is the spec this command reads"),
    (["check", "{link}", "--results", "{res}", "--junit", "{spec}"], "--junit", "is the spec this command reads"),
    (["check", "{spec}", "--results", "{res}", "--json", "{res}/summary.csv"], "--json",
     "is a file of the results folder"),
    (["check", "{spec}", "--results", "{res}", "--junit", "{res}/run.json"], "--junit",
     "is a file of the results folder"),
    (["check", "{spec}", "--results", "{res}", "--baseline", "{base}", "--json", "{base}"], "--json",
     "is the baseline this command reads"),
    (["exact", "{spec}", "--out", "{base}", "-q"], "--out", "is a kl-bench baseline"),
    (["exact", "{spec}", "--out", "{res}/batches.csv", "-q"], "--out", "is a file of the results folder"),
    (["check", "{spec}", "--results", "{res}", "--json", "{out}/v.out", "--junit", "{out}/./v.out"], "--junit",
     "names the --json file too"),
    (["baseline", "{spec}", "--results", "{res}", "--out", "{spec}"], "--out", "is the spec this command reads"),
    (["baseline", "{spec}", "--results", "{res}", "--out", "{res}/run.json"], "--out", "is a file of the results folder"),
    (["report", "{res}", "--out", "{res}/", "-q"], "--out", "is a results folder this report reads"),
])
def test_an_output_over_the_commands_own_input_is_refused(made, tmp_path, args, key, needle):
    """An output path naming one of the command's inputs (the spec, through a link too; the --results folder
    or a file in it; the --baseline; the other report of the same command) is one line, exit 2, and every
    input keeps its bytes: `exact --out SPEC` had replaced the spec with a CSV, `check --json
    DIR/summary.csv` a results file (whose recorded sha256 then failed every later read)."""
    (tmp_path / "link.toml").symlink_to(made["spec"])
    fill = dict(spec=made["spec"], res=made["res"], base=made["base"], link=tmp_path / "link.toml", out=tmp_path)
    before = (made["spec"].read_bytes(), _tree(made["res"]), made["base"].read_bytes())
    proc = _cli(*[a.format(**fill) for a in args], cwd=tmp_path)
    _one_line(proc, 2, f"key '{key}'", needle)
    assert (made["spec"].read_bytes(), _tree(made["res"]), made["base"].read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.toml"]


def test_a_read_only_results_folder_is_not_replaced(made, tmp_path):
    """A folder made read-only (chmod a-w) to keep it: a run into it is one line, exit 2, and the folder keeps
    its bytes and its mode (exchanging folders needs only the parent writable: it had been replaced, 755)."""
    out = tmp_path / "kept"
    shutil.copytree(made["res"], out)
    out.chmod(0o555)
    try:
        before = _tree(out)
        proc = _cli("run", made["spec"], "--out", out, "-q", "--seed", "9")
        _one_line(proc, 2, "read-only folder", "key '--out'")
        assert _tree(out) == before and stat.S_IMODE(out.stat().st_mode) == 0o555
    finally:
        out.chmod(0o755)


def test_a_rerun_says_the_report_it_kept_is_stale(made, tmp_path):
    """A rerun keeps the files it did not write (a report among them): one line on stderr, even with -q,
    says the report describes the replaced results; `--report` remakes it and says nothing."""
    out = tmp_path / "r"
    shutil.copytree(made["res"], out)
    (out / "report").mkdir()
    (out / "report" / "report.md").write_text("seed 0")
    proc = _cli("run", made["spec"], "--out", out, "-q", "--seed", "5")
    assert proc.returncode == 0 and "describes the results this run replaced" in proc.stderr, proc.stderr
    assert (out / "report" / "report.md").read_text() == "seed 0"          # kept, not deleted
    proc = _cli("run", made["spec"], "--out", out, "-q", "--seed", "6", "--report")
    assert proc.returncode == 0 and "describes" not in proc.stderr, proc.stderr


def test_small_input_slips_are_plain_one_liners(made, tmp_path):
    """A spec saved with a byte-order mark is read (it was a TOML syntax error at line 1, column 1); --draws in
    another script's digits is refused as a spec's would be; a .npy path holding something else says so
    without quoting the file's first bytes (a link to /etc/passwd had shown its first bytes). (A bad results
    cell is quoted as the number it is, not as numpy's repr: tests/test_probe.py.)"""
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b"\xef\xbb\xbf" + made["spec"].read_bytes())
    assert runner.invoke(app, ["exact", str(bom), "-q"]).exit_code == 0
    res = runner.invoke(app, ["run", str(made["spec"]), "--draws", "\u0663", "--out", str(tmp_path / "o"), "-q"])
    assert res.exit_code == 2 and "key '--draws'" in res.output and not (tmp_path / "o").exists(), res.output
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t:x:0:0")
    (tmp_path / "q.npy").symlink_to(secret)
    (tmp_path / "npy.toml").write_text(
        'spec_version = 1\n[experiment]\nname = "n"\ndraws = 1000\n[[case]]\nname = "c"\nkind = "categorical"\n'
        'q = { file = "q.npy" }\np = { from = "q", noise = 0.1, seed = 1 }\n')
    res = runner.invoke(app, ["exact", str(tmp_path / "npy.toml"), "-q"])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "not a .npy file" in lines[0] and "s3cr3t" not in lines[0], res.output



def test_a_summary_saved_with_a_byte_order_mark_says_so_or_is_read_once_rehashed(made, tmp_path):
    """A spreadsheet saving "CSV UTF-8" puts a byte-order mark before the header; kl-bench writes none. The
    recorded sha256 refuses the file, and the line now names the mark; a folder whose run.json was updated to
    the new hash (as the probe did) reads, the mark read past as pandas does (it had been "missing columns
    case (not a kl-bench summary.csv?)")."""
    res = tmp_path / "res"
    shutil.copytree(made["res"], res)
    data = b"\xef\xbb\xbf" + (res / "summary.csv").read_bytes()
    (res / "summary.csv").write_bytes(data)
    with pytest.raises(SpecError, match="sha256 mismatch.*starts with a byte-order mark"):
        api.load_results(res)
    env = json.loads((res / "run.json").read_text())
    env["files"]["summary.csv"] = hashlib.sha256(data).hexdigest()
    (res / "run.json").write_text(json.dumps(env, indent=2) + "\n")
    got = api.load_results(res).summary
    assert list(got.columns) == list(api.load_results(made["res"]).summary.columns) and "case" in got.columns


def test_the_default_baseline_is_an_input_too_and_a_report_beside_the_results_is_fine(made, tmp_path):
    """`check --json results/baselines/<name>.json` (the baseline the gate reads when --baseline is not given)
    had replaced it with the check's JSON; a report written into the results folder under a name of its
    own (DIR/check.json, a CI's habit) is allowed: the folder still reads."""
    (tmp_path / "results" / "baselines").mkdir(parents=True)
    default = tmp_path / "results" / "baselines" / "io.json"
    shutil.copy(made["base"], default)
    proc = _cli("check", made["spec"], "--results", made["res"], "--json", default, cwd=tmp_path)
    _one_line(proc, 2, "key '--json'", "is the baseline this command reads")
    assert default.read_bytes() == made["base"].read_bytes()
    res = tmp_path / "res"
    shutil.copytree(made["res"], res)
    assert _cli("check", made["spec"], "--results", res, "--json", res / "check.json", cwd=tmp_path).returncode == 0
    assert (res / "check.json").exists() and _cli("check", made["spec"], "--results", res, cwd=tmp_path).returncode == 0


@pytest.mark.parametrize("args, key", [(["exact", "{spec}", "--out", "{data}", "-q"], "--out"),
                                       (["check", "{spec}", "--json", "{data}", "-q"], "--json"),
                                       (["check", "{spec}", "--junit", "./{data_name}", "-q"], "--junit"),
                                       (["baseline", "{spec}", "--out", "{data}", "-q"], "--out")])
def test_an_output_over_a_file_the_spec_reads_is_refused(tmp_path, args, key):
    """A spec's own data (logits in q.npy) is an input too: `exact --out q.npy` and `check --json q.npy` had
    replaced it with a CSV or JSON, and the spec then failed to load. Refused before any sampling."""
    import numpy as np
    data = tmp_path / "q.npy"
    np.save(data, np.linspace(-1.0, 1.0, 50))
    spec = tmp_path / "s.toml"
    spec.write_text('spec_version = 1\n[experiment]\nname = "s"\ndraws = 1000\ndevice = "cpu"\n[[case]]\n'
                    'name = "c"\nkind = "categorical"\nq = { file = "q.npy" }\np = { from = "q", noise = 0.2, seed = 1 }\n')
    before = data.read_bytes()
    proc = _cli(*[a.format(spec=spec, data=data, data_name=data.name) for a in args], cwd=tmp_path)
    _one_line(proc, 2, f"key '{key}'", "is a file the spec reads")
    assert data.read_bytes() == before


def test_a_folder_of_another_kind_is_not_replaced_and_a_report_is_judged_before_sampling(made, tmp_path):
    """`train --out` or `audit --out` over a run's results folder had replaced it (its summary.csv gone, in
    silence): one line, exit 2, the folder unchanged; a run's own folder is still replaced by a run. And
    `run --report` into a folder whose report/ is read-only is refused before any sampling, not after."""
    res = tmp_path / "res"
    shutil.copytree(made["res"], res)
    before = _tree(res)
    train = tmp_path / "t.toml"
    train.write_text(TRAIN)
    proc = _cli("train", train, "--out", res, "-q")
    _one_line(proc, 2, "holds kl-bench run results", "key '--out'")
    assert _tree(res) == before
    (res / "report").mkdir()
    (res / "report").chmod(0o555)
    try:
        proc = _cli("run", made["spec"], "--out", res, "-q", "--report")
        _one_line(proc, 2, "read-only folder", "key '--report'")
        assert _tree(res) == {**before, "report": None}
    finally:
        (res / "report").chmod(0o755)
    assert _cli("run", made["spec"], "--out", res, "-q", "--seed", "4").returncode == 0


@pytest.mark.parametrize("command", ["run", "train", "report"])
@pytest.mark.parametrize("where", ["here", "above"])
def test_the_current_folder_or_one_holding_it_is_refused_as_out(tmp_path, monkeypatch, command, where):
    """`--out "$PWD"` swapped the folder the shell stood in for a new one: the shell was left in a deleted
    folder (its next kl-bench died loading torch's libraries). Refused like '.', before any work, for every
    command that writes a folder; the folder and what is in it stay as they were."""
    here = tmp_path / "w"
    here.mkdir()
    (here / "s.toml").write_text(TRAIN if command == "train" else SPEC.format(name="s"))
    if command == "report":
        assert runner.invoke(app, ["run", str(here / "s.toml"), "--out", str(here / "r"), "-q"]).exit_code == 0
    before = os.stat(here).st_ino, sorted(os.listdir(here))
    monkeypatch.chdir(here)
    out = here if where == "here" else tmp_path
    args = {"run": ["run", "s.toml", "-q"], "train": ["train", "s.toml"], "report": ["report", "r", "-q"]}[command]
    res = runner.invoke(app, [*args, "--out", str(out)])
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "is the current folder, or holds it" in lines[0], res.output
    assert (os.stat(here).st_ino, sorted(os.listdir(here))) == before
