"""Helpers shared by the test files: the small Gaussian spec most CLI tests run, the results folder built
from it, the console script in a child process, and the checks of a one-line error."""
import hashlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch
from typer.testing import CliRunner

runner = CliRunner()

# The console script with the test hooks the environment asks for installed first (run by path: test code,
# not part of the package).
HOOKS = str(Path(__file__).with_name("kl_test_hooks.py"))

# One Gaussian case, k1 and k3, 20,000 draws in 20 batches: the spec of the CLI's error-path tests.
# ``more``: further estimators (', "k2"'); ``extra``: lines appended to the case.
GAUSS_SPEC = """spec_version = 1
[experiment]
name = "{name}"
draws = 20_000
batches = 20
device = "cpu"
seed = {seed}
estimators = ["k1", "k3"{more}]
[[case]]
name = "g"
kind = "gaussian"
q = {{ mean = 0.0, std = 1.0 }}
p = {{ mean = 0.3, std = 1.1 }}
{extra}
"""

# One categorical case of vocabulary 50 (q, p and extra lines given), 2,000 draws.
CAT_SPEC = """spec_version = 1
[experiment]
name = "c"
draws = 2_000
batches = 10
device = "cpu"
estimators = ["k1", "k3"]
[[case]]
name = "c"
kind = "categorical"
vocab = 50
q = {q}
p = {p}
{extra}
"""

# A small training spec: two combinations on a categorical case of vocabulary 12, 3 steps.
TRAIN_SPEC = """spec_version = 1
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

# The sums of 3 batches of a checkpoint of GAUSS_SPEC that --resume accepts (the layout of
# kl_bench.engine.monte_carlo: per estimator (k1, k3) the centred sums, their squares, the counts of
# negative values; 1000 draws per batch).
SOUND_SUMS = [[0.5, -0.2, 900.0, 800.0, 300.0, 0.0]] * 3


def gauss_text(name: str = "p", seed: int = 0, more: str = "", extra: str = "") -> str:
    """``GAUSS_SPEC`` filled in."""
    return GAUSS_SPEC.format(name=name, seed=seed, more=more, extra=extra)


def gauss_spec(folder: Path, name: str = "p", seed: int = 0, more: str = "", extra: str = "",
               text: str | None = None) -> Path:
    """Write ``GAUSS_SPEC`` (or ``text``) to ``folder/name.toml``; returns its path."""
    path = folder / f"{name}.toml"
    path.write_text(text if text is not None else gauss_text(name, seed, more, extra))
    return path


def rehash(folder: Path) -> None:
    """As a buggy writer would leave it: run.json's sha256 updated to the damaged files."""
    env = json.loads((folder / "run.json").read_text())
    env["files"] = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in env["files"]}
    (folder / "run.json").write_text(json.dumps(env))


def save_checkpoint(spec_path: Path, out: Path, edit=lambda sums: None) -> None:
    """A checkpoint of 3 batches of ``spec_path`` that the run would accept, then changed by ``edit``."""
    import kl_bench.api as api
    from kl_bench.results import checkpoint
    sp = api.load(spec_path)
    ident = checkpoint.checkpoint_identity(sp, torch.device("cpu"), sp.case_draws())
    sums = torch.tensor(SOUND_SUMS, dtype=torch.float64)
    edit(sums)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint.save_checkpoint(out, ident, {"g": sums})


def build_gauss_results(root: Path) -> dict:
    """``GAUSS_SPEC``'s spec, its results folder, a baseline and a checkpoint that --resume accepts, under
    ``root``: {"root", "spec", "res", "base", "ck"}."""
    from kl_bench.cli import app
    # matplotlib's font cache built first: its first import writes it, a warning of its own under `ulimit -f`
    subprocess.run([sys.executable, "-c", "import matplotlib.font_manager"], check=True, capture_output=True)
    spec = gauss_spec(root, "made")
    res = runner.invoke(app, ["run", str(spec), "--out", str(root / "res"), "-q"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["baseline", str(spec), "--results", str(root / "res"), "--out", str(root / "b.json")])
    assert res.exit_code == 0, res.output
    save_checkpoint(spec, root / "ck")
    return {"root": root, "spec": spec, "res": root / "res", "base": root / "b.json", "ck": root / "ck"}


def one_line(res, code: int = 2, *needles: str) -> str:
    """A CliRunner result that failed with ``code``: one line on stderr holding every needle, no traceback."""
    err = res.stderr.strip()
    assert res.exit_code == code, (res.exit_code, res.output)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert len(err.splitlines()) == 1 and "Traceback" not in res.output, err
    for n in needles:
        assert n in err, (n, err)
    return err


def one_line_proc(proc, code: int, *needles: str) -> str:
    """The same for a finished child process (subprocess.run)."""
    err = proc.stderr.strip()
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], err[-3000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in proc.stdout + err, err[-3000:]
    for n in needles:
        assert n in err, (n, err)
    return err


def _testing_argv(args) -> list[str]:
    # HOOKS: the console script with the test hooks the environment asks for (KL_BENCH_SELF_SIGNAL)
    return [sys.executable, HOOKS, *map(str, args)]


def cli_run(*args, env=None, limits=(), cwd=None) -> subprocess.CompletedProcess:
    """The console script in a child process, to its end, under resource limits [(RLIMIT_*, value)]."""
    def limit():
        for what, value in limits:
            resource.setrlimit(what, (value, value))
    return subprocess.run(_testing_argv(args), capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, preexec_fn=limit if limits else None, cwd=cwd)


def cli_popen(*args, env=None, **kw) -> subprocess.Popen:
    """The console script in a child process, started (pipes for stdout and stderr)."""
    return subprocess.Popen(_testing_argv(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, **kw)


def leftovers(folder: Path) -> list[str]:
    """Staging folders, temporary files, probes and lock files a command left anywhere under ``folder``."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*") if ".staging-" in p.name
                  or p.name.endswith(".lock") or p.name.startswith((".tmp-", ".kl-bench-probe")))


def tree(folder: Path) -> dict:
    """Every path under ``folder`` with its bytes (None for folders): what must not change."""
    return {str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes())
            for p in sorted(folder.rglob("*"))}


def cli_inprocess(*args, cwd=None) -> subprocess.CompletedProcess:
    """The command line run in this process (CliRunner), as :func:`cli_run` reports a child: for tests of
    what a command does with its paths, not of the process (signals, resource limits: :func:`cli_run`).
    The record of what this process wrote (foundation.storage._COMMITTED) starts empty, as in a new process."""
    import contextlib

    from kl_bench.cli import app
    from kl_bench.foundation import storage
    saved = storage._COMMITTED
    storage._COMMITTED = set()
    try:
        with contextlib.chdir(cwd or os.getcwd()):
            res = runner.invoke(app, [str(a) for a in args])
    finally:
        storage._COMMITTED = saved
    err = res.stderr
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        import traceback
        err += "".join(traceback.format_exception(res.exception))
    return subprocess.CompletedProcess(list(args), res.exit_code, res.stdout, err)
