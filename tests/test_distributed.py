"""torchrun: batches split across processes give the bytes of one process; a rank that dies stops the
job with one line and no results. The process tests run 2 gloo processes on the CPU (slow suite)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kl_bench.engine.distributed import Ranks, block, drawn_by_rank, rounds

from .helpers import HOOKS

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- splitting (no processes)
@pytest.mark.parametrize("first, total, per_chunk, world", [(0, 20, 3, 2), (0, 200, 1000, 2), (7, 200, 5, 3),
                                                             (0, 1, 4, 4), (0, 5, 1, 8), (199, 200, 50, 2)])
def test_rounds_cover_every_batch_once_and_end_each_round_on_a_prefix(first, total, per_chunk, world):
    seen = []
    per_rank = [list(rounds(first, total, per_chunk, Ranks(r, world))) for r in range(world)]
    assert len({len(p) for p in per_rank}) == 1          # every rank takes part in every round (collectives)
    prev = first
    for i in range(len(per_rank[0])):
        start, stop = per_rank[0][i][:2]
        assert start == prev and all(p[i][:2] == (start, stop) for p in per_rank)
        slices = [p[i][2:] for p in per_rank]
        assert slices[0][0] == start and slices[-1][1] == stop or slices[-1][0] == slices[-1][1]
        for lo, hi in slices:
            assert hi - lo <= per_chunk
            seen += range(lo, hi)
        prev = stop                                     # after round i rank 0 holds batches [first, stop)
    assert seen == list(range(first, total))
    ranges = drawn_by_rank(first, total, per_chunk, world)
    assert sorted(b for r in ranges for lo, hi in r for b in range(lo, hi)) == list(range(first, total))
    if total - first >= world:
        assert all(ranges)                              # nobody idles when there is work for everyone


def test_blocks_are_contiguous_and_cover_every_batch():
    for total, world in [(200, 2), (7, 3), (1, 2)]:
        blocks = [block(total, Ranks(r, world)) for r in range(world)]
        assert blocks[0][0] == 0 and blocks[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))


@pytest.mark.parametrize("case", [
    {"name": "g", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0}, "p": {"mean": 0.5, "std": 1.3}},
    {"name": "c", "kind": "categorical", "vocab": 40,
     "q": {"logits": "zipf", "exponent": 1.1, "seed": 1, "contexts": 3}, "p": {"from": "q", "noise": 0.4, "seed": 2}},
])
def test_gradient_totals_merged_from_blocks_are_the_one_process_bytes(case):
    """Each rank adds a block of batches; rank 0's merge gives the total of one process, bit for bit."""
    from kl_bench.api import prepare
    from kl_bench.experiment.gradient_rows import gradient_items, unit
    from kl_bench.core.estimators import resolve_estimator
    from kl_bench.sampling.seeding import batch_sizes, batch_streams
    prep = prepare({"spec_version": 1, "experiment": {"name": "m", "draws": 30_000, "device": "cpu"},
                                 "case": [case]})
    pair = prep.pairs[0]
    refs = pair.gradient_references()
    dirs = {k: unit(v) for k, v in zip(("reverse", "forward"), refs.values())}
    items = gradient_items(pair, [resolve_estimator(n) for n in ("k1", "k2", "k3")])
    streams = batch_streams(0, "m/gradients", batch_sizes(30_000, 23), CPU)
    one = pair.gradient_accumulator(items, dirs, CPU)
    for b in streams:
        one.add(b)
    assert one.splittable
    parts = []
    for r in range(3):
        acc = pair.gradient_accumulator(items, dirs, CPU)
        acc.keep_batches = True
        lo, hi = block(len(streams), Ranks(r, 3))
        for b in streams[lo:hi]:
            acc.add(b)
        parts.append(acc.partial())
    acc.merge(parts)
    assert np.array_equal(acc.total(), one.total())
    assert acc.total().tobytes() == one.total().tobytes()


# ----------------------------------------------------------------------------- 2 gloo processes
SPEC = """
spec_version = 1
[experiment]
name = "dist"
draws = 240_000
batches = 24
chunk = 25_000
device = "cpu"
estimators = ["k1", "k2", "k3"]
lambdas = [0.5, "optimal"]
gradients = true

[[case]]
name = "g"
kind = "gaussian"
q = { mean = 0.0, std = 1.0 }
p = { mean = 0.5, std = 1.2 }

[[case]]
name = "c"
kind = "categorical"
vocab = 300
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.3, seed = 2 }

[[case]]
name = "r"
kind = "rollout"
vocab = 30
buckets = 4
length = 6
eos = 29
draws = 24_000
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.3, seed = 2 }

[[sweep]]
case = "c"
p.noise = [0.1, 1.0]
"""
FILES = ["summary.csv", "batches.csv", "lambda_sweep.csv", "gradients.csv", "reservoir.npz"]


def _env(**extra) -> dict:
    # OMP_NUM_THREADS too (tests/conftest.py sets it to 1 in xdist workers): a plain run here uses torch's own
    # thread count, which the comparisons with torchrun's one thread per process are about.
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**env, **extra}


def _kl_bench(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kl_bench", *map(str, args)], capture_output=True, text=True,
                          env=env or _env(), timeout=300)


def _torchrun(*args, nproc=2, env=None) -> subprocess.CompletedProcess:
    # --standalone: a free port on localhost, so parallel jobs on one machine do not collide.
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), HOOKS, *map(str, args)], capture_output=True, text=True,
                          env=env or _env(), timeout=300)


def _ours(stderr: str) -> list[str]:
    """kl-bench's lines on stderr (torchrun's own banner and failure report left out)."""
    return [line for line in stderr.splitlines() if line.startswith(("error:", "interrupted"))]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    spec = tmp / "dist.toml"
    spec.write_text(SPEC)
    res = _kl_bench("run", spec, "--out", tmp / "one", "--quiet")
    assert res.returncode == 0, res.stderr
    return spec, tmp / "one"


def _same_bytes(a: Path, b: Path) -> None:
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ja, jb = json.loads((a / "run.json").read_text()), json.loads((b / "run.json").read_text())
    for key in ("spec_sha256", "seed", "draws_per_case", "batches", "device", "spec_text"):
        assert ja[key] == jb[key], key
    for name in FILES:
        assert ja["files"][name] == jb["files"][name] if "files" in ja else True


@pytest.mark.slow
def test_two_gloo_processes_write_the_bytes_of_one(one_process, tmp_path):
    spec, one = one_process
    res = _torchrun("run", spec, "--out", tmp_path / "two", "--quiet")
    assert res.returncode == 0, res.stderr
    assert not _ours(res.stderr) and not res.stdout.strip()     # --quiet: nothing from either rank
    _same_bytes(one, tmp_path / "two")
    env1, env2 = (json.loads((d / "run.json").read_text()) for d in (one, tmp_path / "two"))
    assert env1["world_size"] == 1 and env2["world_size"] == 2
    cases = env2["rank_batches"]
    assert set(cases) == {"g", "c[p.noise=0.1]", "c[p.noise=1]", "r"}
    for name, passes in cases.items():
        for kind, per_rank in passes.items():
            assert len(per_rank) == 2 and (all(per_rank) or (name, kind) == ("r", "gradients")), (name, kind)
            drawn = sorted(b for ranges in per_rank for lo, hi in ranges for b in range(lo, hi))
            assert drawn == list(range(24)), (name, kind)
    assert env2["rank_batches"]["r"]["gradients"] == [[[0, 24]], []]     # rollout totals: rank 0 alone
    assert env1["rank_batches"]["g"]["main"] == [[[0, 24]]]


@pytest.mark.slow
def test_resume_under_torchrun_after_a_rank_died(one_process, tmp_path):
    spec, one = one_process
    out = tmp_path / "cut"
    # Rank 1 dies in the 5th round of main passes; rank 0 has checkpointed after every round.
    res = _torchrun("run", spec, "--out", out, "--quiet", "--checkpoint-every", "1e-9",
                    env=_env(KL_BENCH_RANK_FAIL="1:main:5"))
    assert res.returncode != 0
    lines = _ours(res.stderr)
    # Rank 0 either sees rank 1's death itself or is stopped first by torchrun's SIGTERM (a race that a
    # loaded machine decides either way): both lines say that nothing was written.
    assert len(lines) == 1 and ("no results were written" in lines[0] or "nothing was written" in lines[0]), \
        res.stderr
    assert "kl_bench" + os.sep not in res.stderr          # no traceback from our code (torchrun prints its own)
    assert not (out / "summary.csv").exists() and (out / ".checkpoint.npz").exists()
    res = _torchrun("run", spec, "--out", out, "--quiet", "--resume")
    assert res.returncode == 0, res.stderr
    _same_bytes(one, out)
    env = json.loads((out / "run.json").read_text())
    assert env["resumed"] is True and env["world_size"] == 2
    assert not (out / ".checkpoint.npz").exists()


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["start", "gradients"])
def test_a_rank_that_dies_stops_the_job_and_nothing_is_written(one_process, tmp_path, phase):
    spec, _ = one_process
    out = tmp_path / "out"
    res = _torchrun("run", spec, "--out", out, "--quiet", env=_env(KL_BENCH_RANK_FAIL=f"1:{phase}"))
    assert res.returncode != 0
    lines = _ours(res.stderr)
    assert len(lines) <= 1 and all("no results were written" in x or "nothing was written" in x for x in lines), \
        res.stderr
    assert not (out / "summary.csv").exists() and not (out / "run.json").exists()


@pytest.mark.slow
def test_without_torchrun_teardown_a_dead_rank_is_one_line_from_the_survivor(one_process, tmp_path):
    """Processes started by hand (no torchrun to stop the survivors): rank 0's next collective fails and
    it says so in one line, exit 1, nothing written."""
    import socket
    spec, _ = one_process
    out = tmp_path / "out"
    cmd = [sys.executable, HOOKS, "run", str(spec), "--out", str(out), "--quiet"]
    for _ in range(5):
        # A free port, closed again before rank 0 listens on it: another process of the machine (the other
        # test worker's job) may take it meanwhile. Rank 0 then cannot join; another port is tried.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", KL_BENCH_RANK_FAIL="1:main",
                    KL_BENCH_DIST_TIMEOUT="120")
        procs = [subprocess.Popen(cmd, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        (_, err0), (_, err1) = (p.communicate(timeout=300) for p in procs)
        if "cannot join" not in err0 + err1 or "address already in use" not in (err0 + err1).lower():
            break
    assert procs[1].returncode == -9 and err1 == ""                      # killed by the test hook
    assert procs[0].returncode == 1, err0
    assert len(err0.strip().splitlines()) == 1 and err0.startswith("error: rank 0: another process") and \
        "no results were written" in err0, err0
    assert not (out / "summary.csv").exists()


@pytest.mark.slow
def test_a_refusal_by_rank_0_stops_every_rank_with_its_one_line(one_process, tmp_path):
    spec, _ = one_process
    res = _torchrun("run", spec, "--out", tmp_path / "none", "--quiet", "--resume")
    assert res.returncode != 0
    assert _ours(res.stderr) == [f"error: {tmp_path / 'none'}: key '--resume': nothing to resume: no checkpoint in "
                                 "the results folder"], res.stderr
    assert not (tmp_path / "none").exists()


LARGE_VOCAB = """
spec_version = 1
[experiment]
name = "big"
draws = 2_000_000
batches = 20
device = "cpu"
estimators = ["k1", "k3"]
gradients = true

[[case]]
name = "v50k"
kind = "categorical"
vocab = 50257
q = { logits = "zipf", exponent = 1.1, seed = 1 }
p = { from = "q", noise = 0.3, seed = 2 }
"""


@pytest.fixture(scope="module")
def large_vocab_two_processes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("big")
    spec = tmp / "big.toml"
    spec.write_text(LARGE_VOCAB)
    res = _torchrun("run", spec, "--out", tmp / "two", "--quiet")     # torchrun: OMP_NUM_THREADS=1 per process
    assert res.returncode == 0, res.stderr
    return spec, tmp / "two"


@pytest.mark.slow
def test_large_vocabulary_matches_one_process_with_the_same_threads(large_vocab_two_processes, tmp_path):
    spec, two = large_vocab_two_processes
    res = _kl_bench("run", spec, "--out", tmp_path / "one", "--quiet", env=_env(OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr
    for name in ("summary.csv", "batches.csv", "gradients.csv"):
        assert (tmp_path / "one" / name).read_bytes() == (two / name).read_bytes(), name


@pytest.mark.slow
def test_large_vocabulary_matches_one_process_with_more_threads(large_vocab_two_processes, tmp_path):
    spec, two = large_vocab_two_processes
    res = _kl_bench("run", spec, "--out", tmp_path / "one", "--quiet", env=_env(OMP_NUM_THREADS="2"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "one" / "summary.csv").read_bytes() == (two / "summary.csv").read_bytes()


@pytest.mark.parametrize("env, words", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, "incomplete"),
    ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, "incomplete"),
    ({"WORLD_SIZE": "two"}, "not a whole number"),
    ({"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29578"}, "must lie in [0, WORLD_SIZE=2)"),
])
def test_a_partial_or_inconsistent_torchrun_environment_is_one_line(env, words, tmp_path, monkeypatch):
    """Never a silent one-process run per rank into one folder, never a wait for ranks that cannot come."""
    from typer.testing import CliRunner

    from kl_bench.cli import app
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    spec = tmp_path / "s.toml"
    spec.write_text('spec_version = 1\n[experiment]\ndraws = 1000\ndevice = "cpu"\n[[case]]\nname = "g"\n'
                    'kind = "gaussian"\nq = { mean = 0.0, std = 1.0 }\np = { mean = 0.1, std = 1.0 }\n')
    res = CliRunner().invoke(app, ["run", str(spec), "--out", str(tmp_path / "out"), "-q"])
    assert res.exit_code == 2, res.output
    assert words in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- who speaks under torchrun
TINY = ('spec_version = 1\n[experiment]\nname = "tiny"\ndraws = 4000\nbatches = 4\ndevice = "cpu"\n[[case]]\n'
        'name = "g"\nkind = "gaussian"\nq = { mean = 0.0, std = 1.0 }\np = { mean = 0.3, std = 1.1 }\n')
# A rank of a two-process job as torchrun describes it (nobody listens on the port: nothing here may join).
RANK_ENV = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599", "KL_BENCH_DIST_TIMEOUT": "20"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A spec and its results folder, written in this process (one process, no torchrun)."""
    from kl_bench.api import run_to_folder
    tmp = tmp_path_factory.mktemp("tiny")
    spec = tmp / "tiny.toml"
    spec.write_text(TINY)
    run_to_folder(spec, tmp / "res")
    return spec, tmp / "res"


@pytest.fixture
def as_rank(monkeypatch):
    """This process as rank r of a two-process torchrun job; cli.main's signal handlers restored after."""
    import signal
    from kl_bench.foundation import signals
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    def set_rank(r: int) -> None:
        for k, v in {**RANK_ENV, "RANK": str(r), "LOCAL_RANK": str(r)}.items():
            monkeypatch.setenv(k, v)
    yield set_rank
    for s, h in saved.items():
        signal.signal(s, h)
    signals.seen[0] = 0


def _bad_inputs(tmp: Path, spec: Path) -> list[list[str]]:
    out = ["--out", str(tmp / "out")]
    bad = [["run", str(spec), "--draws", "0", *out], ["run", str(tmp / "missing.toml"), *out],
           ["run", str(spec), "--bogus"], ["run", str(spec), "--seed", "1.5", *out], ["train", str(tmp / "missing.toml")],
           ["train", str(spec), "--bogus"]]
    if not torch.cuda.is_available():
        bad.append(["run", str(spec), "--device", "cuda:0", *out])
    return bad


def test_bad_input_is_said_by_rank_0_alone_and_every_rank_exits_2(tiny, tmp_path, as_rank, capsys):
    """Every rank reads the same arguments, spec and files, so every rank finds the same error: rank 0 says
    it in one line, the other ranks say nothing (`run` had printed each line once per rank), and every rank
    exits 2."""
    from kl_bench import cli
    spec, _ = tiny
    for args in _bad_inputs(tmp_path, spec):
        for rank in (1, 0):
            as_rank(rank)
            with pytest.raises(SystemExit) as e:
                cli.main(args)
            out, err = capsys.readouterr()
            assert e.value.code == 2, (rank, args, err)
            lines = err.strip().splitlines()
            assert (lines == [] if rank else len(lines) == 1 and lines[0].startswith("error: ")), (rank, args, err)
            assert out == "", (rank, args, out)
    assert not (tmp_path / "out").exists()


def test_a_followers_own_failure_after_joining_is_said_with_its_rank(as_rank, capsys, monkeypatch):
    """What a rank other than 0 finds in its own share of the work (a failed allocation on its device) is
    not rank 0's to say: that rank says it, naming itself."""
    from kl_bench.cli.common import say_error
    from kl_bench.engine import distributed
    as_rank(1)
    say_error("before joining")
    monkeypatch.setattr(distributed, "joined", lambda: True)
    say_error("case 'g': out of memory sampling the case")
    assert capsys.readouterr().err.splitlines() == ["error: rank 1: case 'g': out of memory sampling the case"]


def _rank_one_alone(tmp: Path, spec: Path, res: Path) -> list[list[str]]:
    """Commands that do not split their work, and help: what rank 1 of a job is asked, with arguments good
    enough that one process would read, print or write something."""
    return [["report", str(res)], ["report", str(res), "--out", str(tmp / "rep")], ["exact", str(spec)],
            ["exact", str(spec), "--out", str(tmp / "exact.csv")], ["check", str(spec), "--results", str(res)],
            ["baseline", str(spec), "--results", str(res), "--out", str(tmp / "b.json")], ["list"],
            ["audit", str(res)], ["dump-logits", "--policy", "p", "--reference", "r", "--prompts", "x", "--out",
                                  str(tmp / "d")],
            ["report", str(tmp / "missing")], ["--help"], ["run", "--help"], ["train", "-h"], ["--version"], [],
            ["no-such-command"]]


def test_commands_that_do_not_split_their_work_run_on_rank_0_alone(tiny, tmp_path):
    """`report`, `exact`, `check`, ... under torchrun: rank 0 runs them; every other rank exits 0 at once,
    reading, writing and printing nothing (each rank had made and swapped the same report folder, and
    printed its line)."""
    spec, res = tiny
    before = sorted(p.relative_to(res) for p in res.rglob("*"))
    env = _env(**RANK_ENV, RANK="1", LOCAL_RANK="1")
    for args in _rank_one_alone(tmp_path, spec, res):
        got = _kl_bench(*args, env=env)
        assert (got.returncode, got.stdout, got.stderr) == (0, "", ""), (args, got.stdout, got.stderr)
    assert list(tmp_path.iterdir()) == [] and sorted(p.relative_to(res) for p in res.rglob("*")) == before


@pytest.mark.slow
def test_under_torchrun_bad_input_is_one_line(tiny, tmp_path):
    spec, _ = tiny
    for args in (["--draws", "0", "--out", tmp_path / "out"], ["--bogus"]):
        res = _torchrun("run", spec, *args)
        assert res.returncode != 0
        assert len(_ours(res.stderr)) == 1, res.stderr         # torchrun adds its own report of the exits
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_under_torchrun_a_report_is_written_once_by_rank_0(tiny, tmp_path):
    spec, res = tiny
    got = _torchrun("report", res, "--out", tmp_path / "rep")
    assert got.returncode == 0, got.stderr
    lines = [line for line in got.stdout.splitlines() if line.startswith("report")]
    assert len(lines) == 1 and str(tmp_path / "rep") in lines[0], got.stdout
    assert (tmp_path / "rep" / "report.html").is_file()
