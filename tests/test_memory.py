"""Memory: the pre-check of a case's tables counts the process's address-space limit (``ulimit -v``) as
well as physical memory, and an allocation that fails anyway is one line naming the file, the case, what
was being done and what to change for that command (exit 2)."""
import resource
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import kl_bench
from kl_bench.cli import app
from kl_bench.foundation.memory import check_memory, memory_advice, memory_limit
from kl_bench.foundation.errors import OutOfMemory, SpecError, memory_words

runner = CliRunner()

SPEC = """
spec_version = 1
[experiment]
name = "mem"
draws = 4000
seed = 0
device = "cpu"
batches = 20
estimators = ["k1", "k3"]

[[case]]
name = "huge"
kind = "categorical"
vocab = {vocab}
q = {{ logits = "zipf", exponent = 1.1, seed = 1 }}
p = {{ from = "q", noise = 1.0, seed = 2 }}
"""

TORCH_OOM = RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: you "
                         "tried to allocate 8000000000 bytes. Error code 12 (Cannot allocate memory)")


def _mapped_kb() -> int:
    with open("/proc/self/status") as fh:
        return int(fh.read().split("VmSize:")[1].split()[0])


def _fake_address_space_limit(monkeypatch, limit: int) -> None:
    real = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit", lambda what: (limit, limit) if what == resource.RLIMIT_AS else real(what))


def test_the_memory_pre_check_counts_the_address_space_limit(monkeypatch):
    """The check said "more than this machine's 23 GiB" under `ulimit -v 3000000`: a 20,000,000-token case
    passed it and failed 10 s later with a MemoryError. Now the limit less what is mapped is the ceiling."""
    have, words = memory_limit()
    assert "this machine's" in words or "ulimit" in words
    _fake_address_space_limit(monkeypatch, _mapped_kb() * 1024 + (256 << 20))
    left, words = memory_limit()
    assert left <= 256 << 20 and "ulimit -v" in words, words
    msg = check_memory(1 << 30, "the tables")
    assert msg is not None and "ulimit -v" in msg and "1 GiB" in msg, msg
    assert "ulimit -v allows" in memory_advice("a smaller case")


def test_a_case_past_ulimit_v_is_refused_before_any_allocation(tmp_path):
    """A real `ulimit -v` (1 GiB above what the imports map): one line naming the spec, the case and
    'vocab', at once (the old pre-check passed it: exact then built tables until MemoryError)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    spec = tmp_path / "big.toml"
    spec.write_text(SPEC.format(vocab=20_000_000))
    probe = subprocess.run([sys.executable, "-c", "import torch, pandas, scipy.special; "
                            "print(open('/proc/self/status').read().split('VmPeak:')[1].split()[0])"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("cannot measure the address space the imports take")
    limit = (int(probe.stdout.split()[-1]) + (1 << 20)) * 1024
    proc = subprocess.run([sys.executable, "-m", "kl_bench", "exact", str(spec), "-q"], capture_output=True, text=True,
                          timeout=300, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    err = proc.stderr.strip()
    if proc.returncode != 2 and "import" in err:
        pytest.skip("kl-bench does not start under the limit here")
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err[-3000:]
    for needle in ("big.toml", "case 'huge'", "key 'vocab'", "20,000,000", "ulimit -v"):
        assert needle in err, (needle, err)


@pytest.mark.parametrize("error, words", [(MemoryError(), "(MemoryError)"), (TORCH_OOM, "(could not allocate 7.45 GiB)")])
def test_running_out_of_memory_building_a_case_names_it_and_its_size(write_spec, monkeypatch, error, words):
    """`exact` under `ulimit -v` said "out of memory (MemoryError): give the run more memory, or fewer draws at
    once (a smaller [experiment] chunk, more batches)": no file, no case, and advice for sampling, which
    exact does not do."""
    from kl_bench.api import preparation

    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr(preparation, "build_pair", fail)
    spec = write_spec(SPEC.format(vocab=5000), "mem.toml")
    res = runner.invoke(app, ["exact", str(spec), "-q"])
    err = res.stderr.strip()
    assert res.exit_code == 2 and len(err.splitlines()) == 1, (res.exit_code, res.output)
    for needle in ("mem.toml: case 'huge': out of memory building the case (categorical, vocab 5,000)", words,
                   "give kl-bench more memory", "or a smaller case"):
        assert needle in err, (needle, err)
    assert "chunk" not in err and "draws" not in err
    # the Python API: a SpecError (one line) that is still a MemoryError
    with pytest.raises(MemoryError) as caught:
        kl_bench.exact(spec)
    assert isinstance(caught.value, OutOfMemory) and isinstance(caught.value, SpecError)
    context = caught.value.__context__          # the failed allocation's frames (and tables) are let go
    assert caught.value.case == "huge" and (context is None or context.__traceback__ is None)


def test_running_out_of_memory_in_the_exact_moments_or_sampling_names_the_case(write_spec, monkeypatch, tmp_path):
    from kl_bench.experiment import case as case_module
    from kl_bench.experiment import rows
    spec = write_spec(SPEC.format(vocab=5000), "mem.toml")

    def fail(*args, **kwargs):
        raise TORCH_OOM
    with monkeypatch.context() as m:
        m.setattr(rows, "exact_rows", fail)
        res = runner.invoke(app, ["exact", str(spec), "-q"])
    err = res.stderr.strip()
    assert res.exit_code == 2 and len(err.splitlines()) == 1, res.output
    assert "case 'huge': out of memory computing the exact moments (categorical V=5000)" in err, err
    monkeypatch.setattr(case_module, "run_experiment_case", fail)
    res = runner.invoke(app, ["run", str(spec), "--out", str(tmp_path / "o"), "-q"])
    err = res.stderr.strip()
    assert res.exit_code == 2 and len(err.splitlines()) == 1, res.output
    for needle in ("case 'huge': out of memory sampling the case (4,000 draws, 4,000 at once)",
                   "could not allocate 7.45 GiB", "fewer draws at once (a smaller [experiment] chunk"):
        assert needle in err, (needle, err)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command, advice", [("exact", "smaller cases"), ("run", "a smaller [experiment] chunk"),
                                             ("train", "fewer seeds")])
def test_an_unlocated_failed_allocation_gets_its_commands_advice(write_spec, monkeypatch, capsys, tmp_path, command,
                                                                 advice):
    """Where no case was being built, computed or sampled, the line names the command and advice that fits it
    (exact's had been about draws and chunks)."""
    from kl_bench import api, cli
    from kl_bench.api import run_folder

    def fail(*args, **kwargs):
        raise MemoryError()
    monkeypatch.setattr(api, "exact", fail)
    monkeypatch.setattr(run_folder, "train_to_folder", fail)
    monkeypatch.setattr(run_folder, "run_to_folder", fail)
    spec = write_spec(SPEC.format(vocab=500))
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, str(spec), *(["--out", str(tmp_path / "o")] if command != "exact" else []), "-q"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: out of memory in `kl-bench {command}` (MemoryError): give kl-bench more memory")
    assert advice in err, err
    if command == "exact":
        assert "chunk" not in err and "draws" not in err


def test_memory_words():
    assert memory_words(MemoryError()) == "MemoryError"
    assert memory_words(TORCH_OOM) == "could not allocate 7.45 GiB"
    cuda = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity "
                                       "of 79.19 GiB of which 3.12 GiB is free.")
    assert memory_words(cuda) == "CUDA could not allocate 20.00 GiB"
    assert len(memory_words(MemoryError("x " * 200))) <= 120


def test_a_containers_memory_limit_is_the_ceiling(tmp_path, monkeypatch):
    """cgroup_memory reads a container's limit (cgroup v2 memory.max of the process's group or the root,
    v1 memory.limit_in_bytes; "max" and v1's 2^63 − page are no limit), and memory_limit takes it where it is
    below physical memory, saying so ("this container's 2 GiB"): a container of 2 GiB on a 64 GiB host had
    been told it could hold 64."""
    from kl_bench.foundation import memory
    proc, root = tmp_path / "cgroup", tmp_path / "fs"
    (root / "kubepods" / "x").mkdir(parents=True)
    proc.write_text("0::/kubepods/x\n")
    (root / "kubepods" / "x" / "memory.max").write_text("2147483648\n")
    assert memory.cgroup_memory(str(proc), str(root)) == 2 << 30
    (root / "kubepods" / "x" / "memory.max").write_text("max\n")
    assert memory.cgroup_memory(str(proc), str(root)) is None
    (root / "memory.max").write_text("3221225472\n")                  # the root's (a container's own view)
    assert memory.cgroup_memory(str(proc), str(root)) == 3 << 30
    proc.write_text("12:cpu,cpuacct:/docker/a\n5:memory:/docker/a\n")
    (root / "memory" / "docker" / "a").mkdir(parents=True)
    (root / "memory" / "docker" / "a" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory.cgroup_memory(str(proc), str(root)) is None
    (root / "memory" / "docker" / "a" / "memory.limit_in_bytes").write_text("1073741824\n")
    assert memory.cgroup_memory(str(proc), str(root)) == 1 << 30
    assert memory.cgroup_memory(str(tmp_path / "absent"), str(root)) is None
    monkeypatch.setattr(memory, "cgroup_memory", lambda: 2 << 30)
    monkeypatch.setattr(memory, "_process_limit", lambda: None)
    assert memory.memory_limit() == (2 << 30, "this container's 2 GiB (cgroup memory limit)")
    assert "this container allows 2 GiB" in memory.memory_advice("fewer draws")
    message = memory.check_memory(3 << 30, "a table")
    assert message is not None and "this container's 2 GiB" in message


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError(
    "[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
    "8000000000 bytes. Error code 12 (Cannot allocate memory)")])
def test_running_out_of_memory_is_one_line(gauss_results, monkeypatch, capsys, error):
    """An allocation that fails (a MemoryError, or torch's allocator on the host or a GPU) is one line, exit 2,
    not a 75-line traceback."""
    from kl_bench import cli
    from kl_bench.api import run_folder as runner

    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr(runner, "run_to_folder", fail)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", str(gauss_results["spec"]), "--out", str(gauss_results["root"] / "never"), "-q"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: out of memory"), err
    assert not (gauss_results["root"] / "never").exists()
