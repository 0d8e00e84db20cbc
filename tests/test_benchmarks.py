"""Every benchmark runs in its smoke mode (tiny sizes), so that none of them can rot. Slow: each is a
fresh process that imports torch; .ci/run runs them with the other slow tests, whose workers they keep busy."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("bench_*.py"))


def test_there_are_benchmarks():
    assert len(BENCHMARKS) >= 9, BENCHMARKS


@pytest.mark.slow
@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_benchmark_smoke_runs(path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    res = subprocess.run([sys.executable, str(path), "--smoke"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, (res.stdout[-1500:], res.stderr[-1500:])
    assert res.stdout.strip(), "a benchmark prints its figures"


@pytest.mark.slow
def test_gpu_script_smoke_runs():
    """benchmarks/gpu.sh --smoke: the GPU table's driver, on the CPU with tiny sizes (here two of its paths;
    test_benchmark_smoke_runs runs bench_gpu.py --smoke whole)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHON": sys.executable}          # this interpreter (a plain `python3` on PATH may lack torch)
    res = subprocess.run(["bash", "benchmarks/gpu.sh", "--smoke", "--paths", "tokens", "rollouts"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout[-1500:], res.stderr[-1500:])
    assert "kl-bench GPU table: CPU" in res.stdout and "| tokens " in res.stdout and "| rollouts (C 4, T 8)" in res.stdout


GPU_COLUMNS = ["path", "size", "unit", "kl-bench", "raw limit", "of limit", "baseline", "vs baseline", "peak GPU MiB", "s"]


def test_the_gpu_table_in_the_readme_has_the_printed_columns():
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    section = readme.split("## GPU table", 1)[1]
    assert "| " + " | ".join(GPU_COLUMNS) + " |" in section
    source = (ROOT / "benchmarks" / "bench_gpu.py").read_text()
    header = source.split("def show(", 1)[1].split("print(\"|\"", 1)[0]
    positions = [header.index(f"'{c}'") for c in GPU_COLUMNS]
    assert positions == sorted(positions)
    assert "not measured" in section or "Device: NVIDIA" in section or "Device: AMD" in section


def test_the_lean_rollout_prototype_sums_the_engines_draws(monkeypatch):
    """bench_rollout.lean (the GPU table's prototype: the engine's draws, sums by embedding_bag over a step
    table) returns the engine's sums: bit for bit with blocks of one step (both add the same float64 values
    in step order), and with blocks of 5 steps and 7 steps of uniforms a call (CUDA's kind of settings,
    forced on the CPU) within the bound of reordered float64 additions, 2·T·2⁻⁵³ per unit of Σ|terms|."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_rollout as br
    from kl_bench.sampling import seeding

    from kl_bench.kinds import RolloutPair
    bench = br.make_pair(4, 16).model
    # EOS the likeliest token (q ≈ 0.1 in every bucket; the benchmark's V − 1 is so unlikely that no path
    # would end).
    eos = int(bench.log_q.exp().sum(0).argmax())
    pair = RolloutPair("eos", bench.log_q, bench.log_p, bench.bucket, 16, eos)
    cpu = torch.device("cpu")
    ours = br.engine(pair, 600, cpu, 250)
    lean = br.lean(pair, 600, cpu, 250, block=1)
    assert torch.equal(ours[0], lean[0]) and torch.equal(ours[1], lean[1])
    monkeypatch.setitem(seeding.UNIFORM_STEPS, "cpu", 7)
    ours = br.engine(pair, 600, cpu, 250)
    lean = br.lean(pair, 600, cpu, 250, block=5)
    # Σ|terms| ≤ paths · T · the step table's largest entry per column.
    bound = 2 * 16 * 2.0 ** -53 * 600 * 16 * br.step_table(pair, cpu).abs().amax(0)
    assert ((ours[0] - lean[0]).abs() <= bound[3:]).all(), (ours[0] - lean[0], bound[3:])
    assert (ours[1] - lean[1]).abs() <= bound[0]
    assert not torch.equal(br.engine(pair, 600, cpu, 250)[1], br.engine(pair, 601, cpu, 250)[1])  # not a constant
