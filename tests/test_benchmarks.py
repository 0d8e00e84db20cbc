"""Every benchmark runs in its smoke mode (tiny sizes), so that none of them can rot. Slow: each is a
fresh process that imports torch; .ci/run runs them with the other slow tests, whose workers they keep busy."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
