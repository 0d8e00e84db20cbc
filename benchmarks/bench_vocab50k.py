"""Draws per second for a vocab-50257 categorical with every estimator, side by side in one process:

  kl-bench engine        alias sampling → bincount → one matmul with a per-token feature table
  torch.multinomial      plain pipeline: multinomial ids → gather log p, log q → each estimator → float64 sums
  numpy Generator.choice plain pipeline with numpy's sampler

Each pipeline computes the same statistics (sum, sum of squares, negatives for six estimators) in
chunks of 2^22 draws. Peak memory is measured in fresh subprocesses (VmHWM) at 10^7 and 10^8 draws.

    python benchmarks/bench_vocab50k.py [--draws 10000000] [--device cpu|cuda] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kl_bench.engine import run_case
from kl_bench.estimators import ESTIMATORS, lookup
from kl_bench.logits import zipf_logits
from kl_bench.pairs import CategoricalPair
from memory import peak_in_child  # benchmarks/memory.py, beside this script

V = 50257
CHUNK = 1 << 22
NAMES = ESTIMATORS.names()


def make_pair() -> CategoricalPair:
    lq = torch.log_softmax(zipf_logits(V, 1.1, 1), -1)
    g = torch.Generator().manual_seed(2)
    lp = torch.log_softmax(lq + 0.3 * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    return CategoricalPair("bench", lq, lp)


def _stats(logr: torch.Tensor, acc: torch.Tensor) -> None:
    for j, name in enumerate(NAMES):
        f = lookup(name).fn(logr)
        acc[0, j] += f.sum()
        acc[1, j] += (f * f).sum()
        acc[2, j] += (f < 0).sum()


def torch_multinomial(pair: CategoricalPair, n: int, device: torch.device) -> torch.Tensor:
    q = pair.log_q[0].exp().to(device)
    lq, lp = pair.log_q[0].to(device), pair.log_p[0].to(device)
    g = torch.Generator(device=device).manual_seed(0)
    acc = torch.zeros(3, len(NAMES), dtype=torch.float64, device=device)
    for start in range(0, n, CHUNK):
        ids = torch.multinomial(q, min(CHUNK, n - start), replacement=True, generator=g)
        _stats(lp[ids] - lq[ids], acc)
    return acc


def numpy_choice(pair: CategoricalPair, n: int) -> torch.Tensor:
    q = pair.log_q[0].exp().numpy()
    lq, lp = pair.log_q[0], pair.log_p[0]
    rng = np.random.default_rng(0)
    acc = torch.zeros(3, len(NAMES), dtype=torch.float64)
    for start in range(0, n, CHUNK):
        ids = torch.from_numpy(rng.choice(V, size=min(CHUNK, n - start), p=q))
        _stats(lp[ids] - lq[ids], acc)
    return acc


def engine(pair: CategoricalPair, n: int, device: torch.device):
    return run_case(pair, NAMES, draws=n, seed=0, batches=200, chunk=CHUNK, device=device)


def timed(fn, device: torch.device, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def peak_memory(n: int, device: str) -> dict:
    """Peak RSS (and CUDA peak) of the engine at ``n`` draws, in a fresh process (benchmarks/memory.py)."""
    return peak_in_child(f"import bench_vocab50k as b; p = b.make_pair(); dev = torch.device('{device}')",
                         f"b.engine(p, {n}, dev)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=10_000_000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, no memory runs: CI checks that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.draws, args.repeats, args.no_memory, args.memory_only = 20_000, 1, True, False
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    if args.memory_only:
        for m in (10**7, 10**8):
            print(m, peak_memory(m, args.device))
        return
    pair = make_pair()
    n = args.draws
    rows = [("kl-bench engine (alias + bincount + matmul)", timed(lambda: engine(pair, n, dev), dev, args.repeats)),
            ("torch.multinomial + gather (baseline)", timed(lambda: torch_multinomial(pair, n, dev), dev, args.repeats))]
    if dev.type == "cpu":
        rows.append(("numpy Generator.choice + gather (baseline)", timed(lambda: numpy_choice(pair, n), dev, 1)))
    base = rows[1][1]
    print(f"V = {V}, {len(NAMES)} estimators, {n:,} draws, device {dev}"
          f"{' (' + torch.cuda.get_device_name(dev) + ')' if dev.type == 'cuda' else f', {args.threads} threads'}")
    print(f"{'pipeline':<46} {'seconds':>8} {'draws/s':>14} {'vs multinomial':>15}")
    for name, t in rows:
        print(f"{name:<46} {t:8.3f} {n / t:14,.0f} {base / t:14.1f}x")
    if not args.no_memory:
        for m in (10**7, 10**8):
            r = peak_memory(m, args.device)
            print(f"engine peak RSS at {m:.0e} draws: {r['rss_peak_mib']:.0f} MiB "
                  f"(after setup {r['rss_before_mib']:.0f} MiB)"
                  + (f", CUDA peak {r['cuda_peak_mib']:.0f} MiB" if r["cuda_peak_mib"] is not None else ""))


if __name__ == "__main__":
    main()
