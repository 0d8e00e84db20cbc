"""Generated tokens per second for rollouts (sampling plus estimators), side by side in one process:

  kl-bench rollout sampler   per-bucket alias tables flattened to [C·V]: one uniform and two gathers
                             per token, every batch's steps on one long vector
  inverse CDF               a strong plain baseline: flattened per-bucket CDFs, searchsorted per token
  torch.multinomial per step plain baseline: at each step gather each rollout's bucket row of q
                             ([n, V]!), torch.multinomial(…, 1), gather log r, same estimator sums

Both compute L = Σ log r_t, per-token sums of k1, k2, k3, fwd_k3, the full (analytic) KL along the
path, with EOS. The baseline materialises [n, V] probabilities per step, so it runs in small batches.

    python benchmarks/bench_rollout.py [--rollouts 20000] [--length 64] [--buckets 32] [--device cpu]
"""
from __future__ import annotations

import argparse
import time

import torch

from kl_bench.core.draws import Row
from kl_bench.core.estimators import lookup
from kl_bench.sampling.logits import zipf_logits
from kl_bench.kinds import RolloutPair
from kl_bench.kinds.rollout.sampler import simulate
from kl_bench.sampling import seeding
from kl_bench.sampling.alias import pick

V = 50257
TOK = ["k1", "k2", "k3", "fwd_k3", "full"]


def make_pair(buckets: int, length: int) -> RolloutPair:
    lq = torch.log_softmax(zipf_logits(V, 1.1, 1, buckets), -1)
    g = torch.Generator().manual_seed(2)
    lp = torch.log_softmax(lq + 0.3 * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    return RolloutPair("bench", lq, lp, torch.arange(V) % buckets, length, V - 1)


def engine(pair: RolloutPair, n: int, device: torch.device, batch: int):
    rows = [Row(lookup(e), "tok") for e in TOK]
    gens = [torch.Generator(device=device).manual_seed(i) for i in range(0, n, batch)]
    sizes = [min(batch, n - i) for i in range(0, n, batch)]
    d = simulate(pair.model, sizes, gens, device, rows)
    return d.tok.sum(0), d.logr.sum()


# The lean prototype's step tables, per (model, device): built once, outside the timed call, as the
# sampler's own tables are (RolloutModel.sampling_tables).
_STEP_TABLES: dict = {}


def step_table(pair: RolloutPair, device: torch.device) -> torch.Tensor:
    """[C·V + 1, 3 + rows] float64 on ``device``: per (bucket, token) what a step adds to a path's sums (log r,
    the bucket's analytic KL, r − 1, then each of TOK's values), and a last row of zeros that a finished path
    adds (C = 256, V = 50,257: 824 MiB)."""
    key = (id(pair.model), torch.device(device))
    if key not in _STEP_TABLES:
        model = pair.model
        on = model.sampling_tables(device)
        g, kl = on.logr, on.kl_ctx.repeat_interleave(model.vocab)
        cols = [g, kl, torch.expm1(g)] + [kl if lookup(e).analytic else lookup(e).fn(g) for e in TOK]
        table = torch.stack(cols, -1)
        _STEP_TABLES[key] = torch.cat([table, torch.zeros(1, table.shape[1], dtype=table.dtype, device=device)])
    return _STEP_TABLES[key]


def lean(pair: RolloutPair, n: int, device: torch.device, batch: int, block: int = 8):
    """A prototype, in this benchmark only (issue 33): :func:`engine`'s draws (the same uniforms, so the same
    paths) with the per-path sums formed by the fewest bytes eager PyTorch allows. A step records each path's
    key c·V + x (a finished path's: the step table's zero row) into a [n, ``block``] block, and every
    ``block`` steps one ``embedding_bag`` gathers the keys' rows of :func:`step_table` and sums them per path
    (in step order, float64): no per-step estimator kernels and no [n]-long float64 temporaries. It covers
    this benchmark's model only (one phase, on-policy, EOS, no rejection mask), and it answers whether the
    sampler's bytes a token-step (benchmarks/README.md) or its gathers bound the GPU's rate. Returns what
    :func:`engine` returns (the same sums up to the order of float64 additions)."""
    model = pair.model
    on = model.sampling_tables(device)
    assert len(on.alias) == 1, "the prototype covers one phase"
    table, bucket, v = on.alias[0], on.bucket, model.vocab
    steps = step_table(pair, device)
    finished = torch.tensor(steps.shape[0] - 1, device=device)      # the zero row's key
    starts = range(0, n, batch)
    gens = [torch.Generator(device=device).manual_seed(i) for i in starts]
    sizes = [min(batch, n - i) for i in starts]
    per_call = seeding.uniform_steps(device)
    sums = torch.zeros(n, steps.shape[1], dtype=torch.float64, device=device)
    keys = torch.empty(n, block, dtype=torch.int64, device=device)
    c = torch.zeros(n, dtype=torch.int64, device=device)
    alive = torch.ones(n, dtype=torch.bool, device=device)
    for t in range(model.length):
        if t % per_call == 0:                        # each batch's uniforms from its generator, as the engine's
            k = min(per_call, model.length - t)
            u = torch.cat([torch.rand(m, k, dtype=torch.float64, generator=g, device=device)
                           for m, g in zip(sizes, gens)])
        base = c * v
        x = pick(table, u[:, t % per_call] * v, v, base)
        torch.where(alive, base + x, finished, out=keys[:, t % block])
        alive &= x != model.eos
        c = bucket[x]
        if t % block == block - 1 or t == model.length - 1:
            sums += torch.nn.functional.embedding_bag(keys[:, :t % block + 1], steps, mode="sum")
    # Contiguous, as the engine's sums are: the totals then come from the same reduction over the same layout.
    return sums[:, 3:].contiguous().sum(0), sums[:, 0].contiguous().sum()


def baseline(pair: RolloutPair, n: int, device: torch.device, batch: int):
    model = pair.model
    q = model.log_q.exp().to(device)
    g_tab, kl_ctx, bucket = model.logr_table.to(device), model.kl_ctx.to(device), model.bucket.to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    acc = torch.zeros(len(TOK), dtype=torch.float64, device=device)
    for start in range(0, n, batch):
        m = min(batch, n - start)
        c = torch.zeros(m, dtype=torch.int64, device=device)
        alive = torch.ones(m, dtype=torch.float64, device=device)
        for _ in range(model.length):
            # replacement=True: one draw per row either way, and the inverse-CDF path is far faster
            x = torch.multinomial(q[c], 1, replacement=True, generator=gen).squeeze(1)
            g = g_tab[c, x]
            vals = torch.stack([kl_ctx[c] if e == "full" else lookup(e).fn(g) for e in TOK], -1)
            acc += (alive[:, None] * vals).sum(0)
            alive = alive * (x != model.eos)
            c = bucket[x]
    return acc


def inverse_cdf(pair: RolloutPair, n: int, device: torch.device):
    """A strong plain baseline: per-bucket CDFs flattened with offsets (row c lives in [c, c+1)), one
    searchsorted per token (O(log V)), vectorised over all rollouts like the engine."""
    model = pair.model
    q = model.log_q.exp()
    flat = (q.cumsum(-1) + torch.arange(model.buckets, dtype=torch.float64)[:, None]).reshape(-1).to(device)
    g_flat, kl_ctx, bucket = model.logr_table.reshape(-1).to(device), model.kl_ctx.to(device), model.bucket.to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    v = model.vocab
    c = torch.zeros(n, dtype=torch.int64, device=device)
    alive = torch.ones(n, dtype=torch.float64, device=device)
    acc = torch.zeros(len(TOK), dtype=torch.float64, device=device)
    for _ in range(model.length):
        u = torch.rand(n, dtype=torch.float64, generator=gen, device=device) + c
        x = (torch.searchsorted(flat, u) - c * v).clamp_(0, v - 1)
        g = g_flat[c * v + x]
        vals = torch.stack([kl_ctx[c] if e == "full" else lookup(e).fn(g) for e in TOK], -1)
        acc += (alive[:, None] * vals).sum(0)
        alive = alive * (x != model.eos)
        c = bucket[x]
    return acc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rollouts", type=int, default=20_000)
    ap.add_argument("--baseline-rollouts", type=int, default=1024,
                    help="the baseline is slow: time it on fewer rollouts and compare rates")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--buckets", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: CI checks that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.rollouts, args.baseline_rollouts, args.length = 500, 4, 8
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    pair = make_pair(args.buckets, args.length)
    t = time.perf_counter()
    pair.model.alias_tables
    setup = time.perf_counter() - t
    n, nb = args.rollouts, args.baseline_rollouts

    def timed(fn):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    ours = timed(lambda: engine(pair, n, dev, 5000))
    icdf = timed(lambda: inverse_cdf(pair, n, dev))
    base = timed(lambda: baseline(pair, nb, dev, 256))
    # Rates in token-steps per second (each pipeline steps every rollout T times).
    rate_ours, rate_base = n * args.length / ours, nb * args.length / base
    print(f"rollouts V={V}, C={args.buckets}, T={args.length}, {n:,} rollouts, device {dev}, "
          f"{args.threads} threads (alias setup {setup:.2f} s, not timed below)")
    print(f"{'pipeline':<42} {'rollouts':>9} {'seconds':>8} {'token-steps/s':>14} {'vs baseline':>12}")
    for name, m, sec, rate in (("kl-bench rollout sampler (alias)", n, ours, rate_ours),
                               ("flattened inverse CDF + searchsorted", n, icdf, n * args.length / icdf),
                               ("torch.multinomial per step (baseline)", nb, base, rate_base)):
        print(f"{name:<42} {m:9,} {sec:8.2f} {rate:14,.0f} {rate / rate_base:11.1f}x")


if __name__ == "__main__":
    main()
