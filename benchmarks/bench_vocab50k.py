"""Draws per second for a vocab-50257 categorical with every estimator, side by side in one process:

  kl-bench counts        each batch's count vector ~ Multinomial(n, q) drawn directly (O(V) per batch
                         whatever n) → one product with a per-token feature table: draw-equivalents.
                         Timed both ways in the same run: numpy's sequential conditional binomials on the
                         host, and kl_bench.sampling.multinomial's binary tree of binomials (torch) on the device;
                         the row marked "(default)" is what kl-bench uses on this device type
  kl-bench tokens        every token drawn (alias table, pieces of 2^16) → bincount → the same product
  torch.multinomial      plain pipeline: multinomial ids → gather log p, log q → each estimator → float64 sums
  numpy Generator.choice plain pipeline with numpy's sampler
  raw limit              torch.rand + one gather per token and a sum: the device's best per-token rate

Each pipeline computes the same statistics (sum, sum of squares, negatives for the estimators). The
token pipelines cost O(draws), so at 10^10 draws they are timed on fewer draws in the same run and
compared by rate. Peak memory is measured in fresh subprocesses (VmHWM).

    python benchmarks/bench_vocab50k.py [--draws 100000000 10000000000] [--device cpu|cuda] [--threads 2]
"""
from __future__ import annotations

import argparse
import contextlib
import time

import numpy as np
import torch

from kl_bench.engine.monte_carlo import run_case
from kl_bench.core.estimators import lookup
from kl_bench.sampling.logits import zipf_logits
from kl_bench.kinds import CategoricalPair
from kl_bench.kinds.categorical import sampler as categorical   # where the count vectors are drawn
from memory import peak_in_child  # benchmarks/memory.py, beside this script

V = 50257
CHUNK = 1 << 22
NAMES = ["k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3"]   # the core estimators (presets are variants of these)


def make_pair(sampling: str = "counts") -> CategoricalPair:
    lq = torch.log_softmax(zipf_logits(V, 1.1, 1), -1)
    g = torch.Generator().manual_seed(2)
    lp = torch.log_softmax(lq + 0.3 * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    return CategoricalPair("bench", lq, lp, sampling=sampling)


def _stats(logr: torch.Tensor, acc: torch.Tensor) -> None:
    for j, name in enumerate(NAMES):
        f = lookup(name).fn(logr)
        acc[0, j] += f.sum()
        acc[1, j] += (f * f).sum()
        acc[2, j] += (f < 0).sum()


def torch_multinomial(pair: CategoricalPair, n: int, device: torch.device) -> torch.Tensor:
    q = pair.model.log_q[0].exp().to(device)
    lq, lp = pair.model.log_q[0].to(device), pair.model.log_p[0].to(device)
    g = torch.Generator(device=device).manual_seed(0)
    acc = torch.zeros(3, len(NAMES), dtype=torch.float64, device=device)
    for start in range(0, n, CHUNK):
        ids = torch.multinomial(q, min(CHUNK, n - start), replacement=True, generator=g)
        _stats(lp[ids] - lq[ids], acc)
    return acc


def raw_limit(pair: CategoricalPair, n: int, device: torch.device) -> torch.Tensor:
    """What the device can do at best per token: one uniform and one gather of a [V] table, summed."""
    table = pair.model.log_p[0].to(device)
    g = torch.Generator(device=device).manual_seed(0)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, n, CHUNK):
        u = torch.rand(min(CHUNK, n - start), dtype=torch.float64, generator=g, device=device)
        total += table[(u * V).long().clamp_(max=V - 1)].sum()
    return total


def numpy_choice(pair: CategoricalPair, n: int) -> torch.Tensor:
    q = pair.model.log_q[0].exp().numpy()
    lq, lp = pair.model.log_q[0], pair.model.log_p[0]
    rng = np.random.default_rng(0)
    acc = torch.zeros(3, len(NAMES), dtype=torch.float64)
    for start in range(0, n, CHUNK):
        ids = torch.from_numpy(rng.choice(V, size=min(CHUNK, n - start), p=q))
        _stats(lp[ids] - lq[ids], acc)
    return acc


def engine(pair: CategoricalPair, n: int, device: torch.device):
    return run_case(pair, NAMES, draws=n, seed=0, batches=200, chunk=CHUNK, device=device)


@contextlib.contextmanager
def counts_on(where: str, device: torch.device):
    """Count vectors drawn by numpy on the host ("host") or by the torch tree on ``device`` ("device"),
    whatever this device type's default (kl_bench.kinds.categorical.sampler.COUNTS_ON_HOST)."""
    keep = categorical.COUNTS_ON_HOST
    categorical.COUNTS_ON_HOST = keep | {device.type} if where == "host" else keep - {device.type}
    try:
        yield
    finally:
        categorical.COUNTS_ON_HOST = keep


def counts_rows(pair: CategoricalPair, n: int, device: torch.device, repeats: int) -> list[tuple[str, int, float]]:
    """The counts pipeline with numpy on the host and with the torch tree on the device, in this order."""
    rows = []
    for where, how in (("host", "numpy on the host"), ("device", "torch tree on the device")):
        default = (where == "host") == (device.type in categorical.COUNTS_ON_HOST)
        with counts_on(where, device):
            rows.append((f"kl-bench counts, {how}{' (default)' if default else ''}", n,
                         timed(lambda: engine(pair, n, device), device, repeats)))
    return rows


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


def peak_memory(n: int, device: str, sampling: str) -> dict:
    """Peak RSS (and CUDA peak) of the engine at ``n`` draws, in a fresh process (benchmarks/memory.py)."""
    return peak_in_child(f"import bench_vocab50k as b; p = b.make_pair('{sampling}'); dev = torch.device('{device}')",
                         f"b.engine(p, {n}, dev)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, nargs="+", default=[10**8, 10**10])
    ap.add_argument("--token-draws", type=int, default=10**9,
                    help="most draws the token pipelines are timed on (they cost O(draws); compared by rate)")
    ap.add_argument("--baseline-draws", type=int, default=10**8, help="most draws for the plain baselines")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, no memory runs: CI checks that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.draws, args.token_draws, args.baseline_draws = [20_000], 20_000, 20_000
        args.repeats, args.no_memory = 1, True
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    counts, tokens = make_pair("counts"), make_pair("tokens")
    print(f"V = {V}, {len(NAMES)} estimators, 200 batches, device {dev}"
          f"{' (' + torch.cuda.get_device_name(dev) + ')' if dev.type == 'cuda' else f', {args.threads} threads'}")
    print(f"{'draws':>8} {'pipeline':<54} {'timed on':>9} {'seconds':>8} {'(draw-equivalents)/s':>21} "
          f"{'vs tokens':>9} {'vs multinomial':>14}")
    for n in args.draws:
        nt, nb = min(n, args.token_draws), min(n, args.baseline_draws)
        rows = [("kl-bench tokens (alias + bincount)", nt,
                 timed(lambda: engine(tokens, nt, dev), dev, args.repeats if nt < 10**9 else 1)),
                ("torch.multinomial + gather (baseline)", nb,
                 timed(lambda: torch_multinomial(tokens, nb, dev), dev, 1 if nb >= 10**8 else args.repeats)),
                ("raw limit (torch.rand + one gather)", nt,
                 timed(lambda: raw_limit(tokens, nt, dev), dev, args.repeats if nt < 10**9 else 1))]
        if dev.type == "cpu":
            rows.append(("numpy Generator.choice + gather (baseline)", nb, timed(lambda: numpy_choice(tokens, nb), dev, 1)))
        rows = counts_rows(counts, n, dev, args.repeats) + rows
        rate_tok, rate_mult = rows[2][1] / rows[2][2], rows[3][1] / rows[3][2]
        for name, m, t in rows:
            rate = m / t
            print(f"{n:8.0e} {name:<54} {m:9.0e} {t:8.3f} {rate:21,.0f} {rate / rate_tok:8.1f}x {rate / rate_mult:13.1f}x")
    if not args.no_memory:
        for sampling, sizes in (("tokens", (10**7, 10**8)), ("counts", (10**8, 10**10))):
            for m in sizes:
                r = peak_memory(m, args.device, sampling)
                print(f"engine ({sampling}) peak RSS at {m:.0e} draws: {r['rss_peak_mib']:.0f} MiB "
                      f"(after setup {r['rss_before_mib']:.0f} MiB)"
                      + (f", CUDA peak {r['cuda_peak_mib']:.0f} MiB" if r["cuda_peak_mib"] is not None else ""))


if __name__ == "__main__":
    main()
