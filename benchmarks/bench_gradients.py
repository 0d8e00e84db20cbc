"""Gradient benchmark throughput and memory, against per-draw autograd (torch.func.vmap), in one process.

Both pipelines compute, for k1, k2 and k3 in every mode (10 rows), the sum of the per-draw gradients,
the sum of their squared norms and their projections on ∇KL(q‖p) and ∇KL(p‖q):

  kl-bench     categorical: token counts (bincount) times per-token tables, O(draws + batches·V);
               rollout: recorded paths, per-step weights, sorted-run |g|², index_add totals
  vmap(grad)   plain: torch.func.vmap(torch.func.grad(per-draw loss)) over chunks of draws; each
               per-draw gradient is a dense θ-sized vector (V, or C·V for rollouts)

Peak memory of kl-bench is measured in fresh processes (ru_maxrss).

    python benchmarks/bench_gradients.py [--draws 10000000] [--rollouts 1000000] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.func import grad, vmap

from kl_bench.experiment import gradient_rows as G
from kl_bench.core import modes as M
from kl_bench.core.estimators import lookup
from kl_bench.core.targets import FORWARD, REVERSE
from kl_bench.sampling.logits import zipf_logits
from kl_bench.kinds import CategoricalPair
from kl_bench.kinds.rollout import RolloutPair
from kl_bench.kinds.rollout.sampler import paths
from memory import peak_in_child  # benchmarks/memory.py, beside this script

V, C, T = 50257, 32, 16
ESTS = [lookup(n) for n in ("k1", "k2", "k3")]
ITEMS = [(e, m) for e in ESTS for m in M.modes_for(e)]


def make_pair() -> CategoricalPair:
    lq = torch.log_softmax(zipf_logits(V, 1.1, 1), -1)
    g = torch.Generator().manual_seed(2)
    lp = torch.log_softmax(lq + 0.3 * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    return CategoricalPair("bench", lq, lp)


def make_rollout() -> RolloutPair:
    g = torch.Generator().manual_seed(2)
    lq = torch.log_softmax(zipf_logits(V, 1.1, 1).expand(C, V) + 0.5 * torch.randn(C, V, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(lq + 0.3 * torch.randn(C, V, generator=g, dtype=torch.float64), -1)
    return RolloutPair("bench-rollout", lq, lp, torch.arange(V) % C, T, V - 1)


def kl_bench_categorical(pair, n: int, device: torch.device):
    return G.gradient_rows(pair, ESTS, draws=n, seed=0, batches=200, device=device)


def kl_bench_rollout(pair, n: int, device: torch.device):
    return G.gradient_rows(pair, ESTS, draws=n, seed=0, batches=200, device=device)


def vmap_categorical(pair: CategoricalPair, n: int, device: torch.device, chunk: int = 64) -> np.ndarray:
    theta0, lp = pair.model.log_q[0].to(device), pair.model.log_p[0].to(device)
    refs = pair.gradient_references()
    rev, fwd = (torch.as_tensor(G.unit(refs[t]), device=device) for t in (REVERSE, FORWARD))
    q = theta0.exp()
    gen = torch.Generator(device=device).manual_seed(0)
    acc = torch.zeros(len(ITEMS), 3 + V, dtype=torch.float64, device=device)
    for lo in range(0, n, chunk):
        xs = torch.multinomial(q, min(chunk, n - lo), replacement=True, generator=gen)
        for j, (est, mode) in enumerate(ITEMS):

            def per_draw(theta, x):
                lq = torch.log_softmax(theta, -1)
                return M.trainer_loss(est, mode, lq.gather(0, x[None])[0], lp.gather(0, x[None])[0])
            gs = vmap(grad(per_draw), in_dims=(None, 0))(theta0, xs)       # [chunk, V]
            acc[j, 0] += (gs * gs).sum()
            acc[j, 1] += (gs @ rev).sum()
            acc[j, 2] += (gs @ fwd).sum()
            acc[j, 3:] += gs.sum(0)
    return acc.cpu().numpy()


def vmap_rollout(pair: RolloutPair, n: int, device: torch.device, chunk: int = 16) -> np.ndarray:
    """Per-sequence gradients of the seq rows (c(L) · S) by vmap over recorded paths: [chunk, C·V]."""
    theta0, lp = pair.model.log_q.reshape(-1).to(device), pair.model.log_p.reshape(-1).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    acc = torch.zeros(len(ITEMS), 1 + C * V, dtype=torch.float64, device=device)
    for lo in range(0, n, chunk):
        p = paths(pair.model, min(chunk, n - lo), gen, device)
        keys, alive = p.keys, p.alive
        for j, (est, mode) in enumerate(ITEMS):

            def per_draw(theta, k, a):
                lq = torch.log_softmax(theta.view(C, V), -1).reshape(-1)
                return M.trainer_loss(est, mode, (lq.gather(0, k) * a).sum(), (lp.gather(0, k) * a).sum())
            gs = vmap(grad(per_draw), in_dims=(None, 0, 0))(theta0, keys, alive)
            acc[j, 0] += (gs * gs).sum()
            acc[j, 1:] += gs.sum(0)
    return acc.cpu().numpy()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def peak_memory(kind: str, n: int, device: str) -> dict:
    """Peak RSS of kl-bench's gradient rows at ``n`` draws, in a fresh process (benchmarks/memory.py)."""
    maker, runner = ("make_pair", "kl_bench_categorical") if kind == "categorical" else ("make_rollout", "kl_bench_rollout")
    return peak_in_child(f"import bench_gradients as b; torch.set_num_threads(2); p = b.{maker}(); "
                         f"dev = torch.device('{device}')", f"b.{runner}(p, {n}, dev)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=10_000_000)
    ap.add_argument("--rollouts", type=int, default=1_000_000)
    ap.add_argument("--baseline-draws", type=int, default=4096)
    ap.add_argument("--baseline-rollouts", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, no memory runs: CI checks that it runs")
    args = ap.parse_args()
    if args.smoke:          # tiny sizes (a 2,000-token vocabulary, 4 buckets, 8 steps): checks that it runs
        global V, C, T
        V, C, T = 2000, 4, 8
        args.draws, args.rollouts, args.baseline_draws, args.baseline_rollouts, args.no_memory = 20_000, 400, 16, 2, True
        # one thread: at these sizes a second intra-op thread only waits (5 s instead of 26 s on 2 cores, 42 s where
        # OMP_NUM_THREADS=1 shrank the OpenMP pool first); the smoke run checks that the benchmark runs, not its speed
        args.threads = 1
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    rows = []
    pair = make_pair()
    kl_bench_categorical(pair, 10_000, dev)                       # warm-up (alias table, tables)
    for n in (args.draws // 10, args.draws):
        s = timed(lambda: kl_bench_categorical(pair, n, dev))
        rows.append(("categorical", "kl-bench", n, s))
    s = timed(lambda: vmap_categorical(pair, args.baseline_draws, dev))
    rows.append(("categorical", "vmap(grad) per draw", args.baseline_draws, s))
    roll = make_rollout()
    kl_bench_rollout(roll, 2_000, dev)
    for n in (args.rollouts // 10, args.rollouts):
        s = timed(lambda: kl_bench_rollout(roll, n, dev))
        rows.append(("rollout", "kl-bench (seq + tok rows)", n, s))
    s = timed(lambda: vmap_rollout(roll, args.baseline_rollouts, dev))
    rows.append(("rollout", "vmap(grad) per sequence (seq rows only)", args.baseline_rollouts, s))
    print("| case | pipeline | draws | seconds | draws/s |\n|---|---|---:|---:|---:|")
    for case, name, n, s in rows:
        print(f"| {case} | {name} | {n:,} | {s:.3f} | {n / s:,.0f} |")
    if not args.no_memory:
        for kind, n in (("categorical", args.draws // 10), ("categorical", args.draws),
                        ("rollout", args.rollouts // 10), ("rollout", args.rollouts)):
            print(kind, n, peak_memory(kind, n, args.device))


if __name__ == "__main__":
    main()
