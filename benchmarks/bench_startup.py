"""Start-up time: `import kl_bench`, `kl-bench --help` and `kl-bench list` against the plain baseline
`import torch` (which every one of them pays), median of several fresh processes each.

    python benchmarks/bench_startup.py [--repeats 7] [--smoke]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time

CASES = {
    "python -c 'import torch' (baseline)": [sys.executable, "-c", "import torch"],
    "python -c 'import kl_bench'": [sys.executable, "-c", "import kl_bench"],
    "python -c 'import kl_bench; kl_bench.run'": [sys.executable, "-c", "import kl_bench; kl_bench.run"],
    "kl-bench --help": [sys.executable, "-m", "kl_bench", "--help"],
    "kl-bench list": [sys.executable, "-m", "kl_bench", "list"],
}


def median_seconds(cmd: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="one run each: CI checks that it runs")
    args = ap.parse_args()
    repeats = 1 if args.smoke else args.repeats
    if shutil.which("kl-bench") is None:
        print("note: the kl-bench console script is not on PATH; timing `python -m kl_bench` instead")
    # smoke: the baseline and the console script's --help (it runs; the timings need --repeats)
    cases = {k: v for k, v in CASES.items() if not args.smoke or k in ("python -c 'import torch' (baseline)",
                                                                          "kl-bench --help")}
    rows = [(name, median_seconds(cmd, repeats)) for name, cmd in cases.items()]
    base = rows[0][1]
    print(f"median of {repeats} fresh processes")
    print(f"{'command':<40} {'seconds':>8} {'minus import torch':>19}")
    for name, t in rows:
        print(f"{name:<40} {t:8.2f} {t - base:+19.2f}")


if __name__ == "__main__":
    main()
