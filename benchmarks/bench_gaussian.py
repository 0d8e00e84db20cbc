"""Draws per second for a 1-D Gaussian pair with every estimator, side by side in one process:

  kl-bench engine      pieces of z ~ N(0, 1) (2^16 on the CPU, 2^20 on a GPU) → log r = c0 + c1 z + c2 z²
                       → every estimator's shifted float64 sums, per batch (200 batches)
  plain pipeline       torch.randn in chunks of 2^22 → log r from the two log-densities → each estimator
                       → float64 sum, sum of squares and negatives
  raw limit            torch.randn in chunks of 2^22 and one sum: what the device can do at best

    python benchmarks/bench_gaussian.py [--draws 100000000] [--device cpu|cuda] [--threads 2] [--smoke]
"""
from __future__ import annotations

import argparse
import math

import torch

from kl_bench.engine.monte_carlo import run_case
from kl_bench.core.estimators import lookup
from kl_bench.kinds import GaussianPair
from bench_vocab50k import timed  # benchmarks/, beside this script: best-of-n timing with CUDA syncs

NAMES = ["k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3"]   # the core estimators (presets are variants of these)
CHUNK = 1 << 22
MQ, SQ, MP, SP = 0.0, 1.0, 0.3, 1.1


def engine(n: int, device: torch.device):
    return run_case(GaussianPair("bench", [MQ], [SQ], [MP], [SP]), NAMES, draws=n, seed=0, batches=200,
                    chunk=CHUNK, device=device)


def plain(n: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(0)
    acc = torch.zeros(3, len(NAMES), dtype=torch.float64, device=device)
    for start in range(0, n, CHUNK):
        x = MQ + SQ * torch.randn(min(CHUNK, n - start), dtype=torch.float64, generator=g, device=device)
        logr = (-0.5 * ((x - MP) / SP) ** 2 - math.log(SP)) - (-0.5 * ((x - MQ) / SQ) ** 2 - math.log(SQ))
        for j, name in enumerate(NAMES):
            f = lookup(name).fn(logr)
            acc[0, j] += f.sum()
            acc[1, j] += (f * f).sum()
            acc[2, j] += (f < 0).sum()
    return acc


def raw_limit(n: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(0)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, n, CHUNK):
        total += torch.randn(min(CHUNK, n - start), dtype=torch.float64, generator=g, device=device).sum()
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=10**8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: CI checks that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.draws, args.repeats = 20_000, 1
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    n = args.draws
    engine(min(n, 10**5), dev)                                  # warm-up (first BLAS/RNG calls)
    rows = [("kl-bench engine", timed(lambda: engine(n, dev), dev, args.repeats)),
            ("plain pipeline (randn + estimators + sums)", timed(lambda: plain(n, dev), dev, args.repeats)),
            ("raw limit (randn + one sum)", timed(lambda: raw_limit(n, dev), dev, args.repeats))]
    print(f"Gaussian, {len(NAMES)} estimators, {n:,} draws, device {dev}"
          f"{' (' + torch.cuda.get_device_name(dev) + ')' if dev.type == 'cuda' else f', {args.threads} threads'}")
    print(f"{'pipeline':<44} {'seconds':>8} {'draws/s':>14} {'vs plain':>9} {'of raw limit':>13}")
    for name, t in rows:
        print(f"{name:<44} {t:8.3f} {n / t:14,.0f} {rows[1][1] / t:8.1f}x {rows[2][1] / t:12.0%}")


if __name__ == "__main__":
    main()
