"""Inputs that would hang kl-bench or exhaust its memory: FIFOs and devices as inputs, files over
their cap, headers claiming huge sizes, deeply nested or huge-number TOML and JSON, binary prompts, reads
bounded without allocating their cap (under a real `ulimit -v`): one line naming the file, exit 2."""
import hashlib
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import kl_bench.api as api
from kl_bench.cli import app
from kl_bench.foundation import safe_io
from kl_bench.foundation.errors import SpecError
from kl_bench.results import checkpoint
from kl_bench.sampling.logits_files import read_tensor_file

from .helpers import (CAT_SPEC, cli_run, gauss_spec, gauss_text, one_line,
                      rehash, runner)


# ============================================================================ 3. nothing hangs, nothing exhausts memory
def test_a_fifo_or_device_as_spec_is_one_line(tmp_path, no_hang):
    os.mkfifo(tmp_path / "fifo.toml")
    for path, needle in ((tmp_path / "fifo.toml", "FIFO"), ("/dev/zero", "character device"),
                         ("/dev/urandom", "character device")):
        one_line(runner.invoke(app, ["run", str(path), "-q"]), 2, needle)


def test_a_fifo_or_device_as_baseline_logits_checkpoint_or_batches_is_one_line(gauss_results, gauss_folder, tmp_path, no_hang):
    os.mkfifo(tmp_path / "b.json")
    for base in (tmp_path / "b.json", Path("/dev/zero")):
        res = runner.invoke(app, ["check", str(gauss_results["spec"]), "--results", str(gauss_results["res"]), "--baseline", str(base)])
        one_line(res, 2, str(base))
    os.mkfifo(tmp_path / "q.npy")
    spec = gauss_spec(tmp_path, text=CAT_SPEC.format(q='{ file = "q.npy" }', p='{ from = "q", noise = 0.3 }', extra=""))
    one_line(runner.invoke(app, ["run", str(spec), "-q", "--out", str(tmp_path / "o")]), 2, "FIFO", "q.npy")
    (gauss_folder / "batches.csv").unlink()
    os.mkfifo(gauss_folder / "batches.csv")
    one_line(runner.invoke(app, ["check", str(gauss_results["spec"]), "--results", str(gauss_folder), "-q"]), 2, "FIFO")
    out = tmp_path / "res"
    out.mkdir()
    os.mkfifo(out / checkpoint.CHECKPOINT)
    one_line(runner.invoke(app, ["run", str(gauss_results["spec"]), "--out", str(out), "-q", "--resume"]), 2, "FIFO")


def test_files_over_their_cap_are_refused_before_reading(gauss_results, tmp_path, monkeypatch):
    monkeypatch.setitem(safe_io.CAPS, "spec", 64)
    one_line(runner.invoke(app, ["run", str(gauss_results["spec"]), "-q"]), 2, "more than the 64 B")
    monkeypatch.setitem(safe_io.CAPS, "spec", 1 << 20)
    monkeypatch.setitem(safe_io.CAPS, "baseline", 64)
    res = runner.invoke(app, ["check", str(gauss_results["spec"]), "--results", str(gauss_results["res"]), "--baseline",
                                 str(gauss_results["base"])])
    one_line(res, 2, "more than the 64 B", str(gauss_results["base"]))


def _npy_claiming(count: int) -> bytes:
    """A .npy file whose header claims ``count`` float64 values but which holds 3."""
    from numpy.lib import format as npf
    header = io.BytesIO()
    npf.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (count,)})
    return header.getvalue() + np.zeros(3).tobytes()


def test_headers_claiming_huge_sizes_are_refused(gauss_folder, tmp_path, gauss_results):
    (tmp_path / "q.npy").write_bytes(_npy_claiming(10**12))
    with pytest.raises(SpecError, match="claims shape"):
        read_tensor_file(tmp_path / "q.npy")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:          # a reservoir member claiming 10^12 values (7 TiB)
        z.writestr("g.npy", _npy_claiming(10**12))
    (gauss_folder / "reservoir.npz").write_bytes(buf.getvalue())
    rehash(gauss_folder)
    one_line(runner.invoke(app, ["check", str(gauss_results["spec"]), "--results", str(gauss_folder), "-q"]), 2, "claims shape")


@pytest.mark.parametrize("text, needle", [
    ("a = " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    ("spec_version = 1" + "0" * 5000 + "\n", "4,300 digits"),
    (b"\xff\xfe binary".decode("latin-1"), "TOML"),
])
def test_hostile_spec_text_is_one_line(tmp_path, text, needle):
    path = tmp_path / "s.toml"
    path.write_text(text)
    one_line(runner.invoke(app, ["run", str(path), "-q"]), 2, str(path), needle)


@pytest.mark.parametrize("text, needle", [("[" * 100_000 + "]" * 100_000, "nested too deeply"),
                                          ('{"a": ' + "9" * 5000 + "}", "4,300 digits")])
def test_hostile_json_is_one_line(gauss_results, gauss_folder, tmp_path, text, needle):
    (tmp_path / "b.json").write_text(text)
    res = runner.invoke(app, ["check", str(gauss_results["spec"]), "--results", str(gauss_results["res"]), "--baseline",
                                 str(tmp_path / "b.json")])
    one_line(res, 2, needle)
    (gauss_folder / "run.json").write_text(text)
    one_line(runner.invoke(app, ["report", str(gauss_folder), "--out", str(tmp_path / "rep")]), 2, needle, "run.json")


def test_prompts_that_are_binary_or_a_fifo_are_one_line(tmp_path, no_hang):
    from kl_bench.kinds.model import lm
    (tmp_path / "p.jsonl").write_bytes(b"\x00\x01\xff\xfe")
    with pytest.raises(SpecError, match="not UTF-8 text"):
        lm.read_prompts(tmp_path / "p.jsonl", tmp_path)
    os.mkfifo(tmp_path / "f.jsonl")
    with pytest.raises(SpecError, match="FIFO"):
        lm.read_prompts(tmp_path / "f.jsonl", tmp_path)
    (tmp_path / "d.jsonl").write_text('{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(SpecError, match="line 1"):
        lm.read_prompts(tmp_path / "d.jsonl", tmp_path)


def test_a_meta_tensor_in_a_pt_file_is_refused(tmp_path):
    torch.save(torch.empty(3, 5, device="meta"), tmp_path / "m.pt")
    with pytest.raises(SpecError, match="meta tensor"):
        read_tensor_file(tmp_path / "m.pt")


def test_errors_about_a_files_content_name_the_file(tmp_path):
    q = np.zeros((1, 50))
    q[0, 3] = np.nan
    np.save(tmp_path / "q.npy", q)
    spec = gauss_spec(tmp_path, text=CAT_SPEC.format(q='{ file = "q.npy" }', p='{ from = "q", noise = 0.3 }', extra=""))
    one_line(runner.invoke(app, ["run", str(spec), "-q", "--out", str(tmp_path / "o")]), 2, "q.npy", "NaN")
    np.save(tmp_path / "b.npy", np.zeros((1, 40)))
    spec = gauss_spec(tmp_path, text=CAT_SPEC.format(q='{ logits = "zipf", exponent = 1.1, seed = 1 }',
                                           p='{ from = "q", noise = 0.3 }', extra='sampler = { behavior = { file = '
                                           '"b.npy" }, weights = "token" }'))
    one_line(runner.invoke(app, ["run", str(spec), "-q", "--out", str(tmp_path / "o")]), 2, "b.npy", "vocabulary")
    np.save(tmp_path / "map.npy", np.full(50, 7))
    text = gauss_text(name="r", seed=0, more="", extra="").split("[[case]]")[0] + (
        '[[case]]\nname = "r"\nkind = "rollout"\nvocab = 50\nbuckets = 4\nlength = 3\n'
        'bucket_of = { file = "map.npy" }\nq = { logits = "zipf", exponent = 1.1, seed = 1 }\n'
        'p = { from = "q", noise = 0.3 }\n')
    one_line(runner.invoke(app, ["run", str(gauss_spec(tmp_path, text=text)), "-q"]), 2, "map.npy", "bucket map")


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
def test_every_read_of_a_results_folder_or_checkpoint_works_under_ulimit_v(gauss_results, tmp_path, address_space_limit,
                                                                           command):
    """Reading batches.csv (cap 2 GiB) or a checkpoint (cap 2 GiB) allocated the cap: MemoryError."""
    ck = tmp_path / "ck"
    shutil.copytree(gauss_results["ck"], ck)
    args = {"check": ["check", gauss_results["spec"], "--results", gauss_results["res"], "--baseline", gauss_results["base"], "-q"],
            "baseline": ["baseline", gauss_results["spec"], "--results", gauss_results["res"], "--out", tmp_path / "b.json", "-q"],
            "resume": ["run", gauss_results["spec"], "--out", ck, "--resume", "-q"],
            "report": ["report", gauss_results["res"], "--out", tmp_path / "rep"]}[command]
    proc = cli_run(*args, limits=address_space_limit)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, \
        proc.stderr[-3000:]


def test_a_summary_saved_with_a_byte_order_mark_says_so_or_is_read_once_rehashed(gauss_results, tmp_path):
    """A spreadsheet saving "CSV UTF-8" puts a byte-order mark before the header; kl-bench writes none. The
    recorded sha256 refuses the file, and the line now names the mark; a folder whose run.json was updated to
    the new hash (as the probe did) reads, the mark read past as pandas does (it had been "missing columns
    case (not a kl-bench summary.csv?)")."""
    res = tmp_path / "res"
    shutil.copytree(gauss_results["res"], res)
    data = b"\xef\xbb\xbf" + (res / "summary.csv").read_bytes()
    (res / "summary.csv").write_bytes(data)
    with pytest.raises(SpecError, match="sha256 mismatch.*starts with a byte-order mark"):
        api.load_results(res)
    env = json.loads((res / "run.json").read_text())
    env["files"]["summary.csv"] = hashlib.sha256(data).hexdigest()
    (res / "run.json").write_text(json.dumps(env, indent=2) + "\n")
    got = api.load_results(res).summary
    assert list(got.columns) == list(api.load_results(gauss_results["res"]).summary.columns) and "case" in got.columns
