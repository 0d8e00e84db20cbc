"""One GPU table (issue 33): every sampling path of kl-bench against its raw limit and its plain baseline,
timed in one run on one device, with the device's name, the peak GPU memory of each kl-bench pipeline and
the time of the run. benchmarks/gpu.sh runs it on a CUDA machine; --smoke runs it on the CPU with tiny
sizes (CI), so that it cannot rot.

  path (default sizes)                kl-bench             raw limit (same shape)            plain baseline
  tokens, V = 50,257, 10^8 and 10^10  alias + count        torch.rand + one gather a draw    torch.multinomial + gather
  counts, V = 50,257, 10^10           multinomial tree     torch.binomial down the same      torch.multinomial + gather
                                      (kl_bench.sampling.multinomial) tree, one ATen kernel a level
  rollouts, 10^6 × T 256, V 50,257,   rollout sampler      one uniform + the gathers per     flattened inverse CDF +
  C 256                                                    token-step                        searchsorted
  rollout gradients, 10^6             gradient rows        the raw limit + one index_add_    the same pipeline on the
  (C 32, T 16, V 50,257)                                   per token-step                    CPU, in the same run
  audit, V = 151,936, d 896           stream_kl,           two tiled float32 forwards        dense float32
                                      stream_values        (the floor of an exact KL)        (log_softmax of both)

Baselines and limits that cost O(draws) run on fewer draws (--baseline-draws, --limit-draws) and are
compared by rate. Each pipeline runs once after one untimed warm-up call at small size (CUDA context,
kernels, tables); figures are single runs. Rates: draws (or draw-equivalents, token-steps, rollouts,
positions) per second.

    python benchmarks/bench_gpu.py --device cuda                  # the table (benchmarks/gpu.sh)
    python benchmarks/bench_gpu.py --smoke                        # tiny sizes on the CPU (CI), --ops included
    python benchmarks/bench_gpu.py --device cpu --paths counts --ops   # ATen operations per call, any device

--profile and --ops run the counts path with the tree on the device, also on a CPU (where kl-bench
otherwise draws count vectors with numpy on the host).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import time
from dataclasses import dataclass
from typing import Callable

import torch

import bench_audit as audit          # beside this script
import bench_gradients as grads
import bench_rollout as rollouts
import bench_vocab50k as vocab
from kl_bench.audit.tiling import pieces
from launches import count_ops  # benchmarks/launches.py (this folder is on sys.path)
from kl_bench.sampling import seeding

V = 50257


@dataclass
class Line:
    path: str
    size: str
    unit: str
    ours: float             # rate of kl-bench's pipeline
    limit: float            # rate of the raw limit of the same shape
    baseline: float         # rate of the plain baseline
    peak_mib: float         # peak GPU memory of kl-bench's pipeline (nan on the CPU)
    seconds: float          # kl-bench's pipeline


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def rate(fn: Callable[[], object], units: float, dev: torch.device) -> tuple[float, float, float]:
    """(units per second, seconds, peak GPU MiB) of one call of ``fn``."""
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    sync(dev)
    t = time.perf_counter()
    fn()
    sync(dev)
    s = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else float("nan")
    return units / s, s, peak


# ----------------------------------------------------------------------------- raw limits
def counts_limit(q: torch.Tensor, sizes: list[int], dev: torch.device) -> Callable[[], torch.Tensor]:
    """torch.binomial down the same binary tree, all batches at once, one generator: one ATen kernel a
    level. Not kl-bench's sampler (float64 counts, exact below 2^53 only; CUDA's kernel draws float32
    uniforms), but the fastest a tree of binomials goes on this device. Returns the timed call (the tree
    is built outside it)."""
    from kl_bench.sampling.multinomial import MultinomialTree
    tree = MultinomialTree.of(q.to(dev))
    g = torch.Generator(device=dev).manual_seed(0)
    first = torch.tensor(sizes, dtype=torch.float64, device=dev)[:, None]

    def run() -> torch.Tensor:
        counts = first
        for left, _, next_size in tree.levels:
            x = torch.binomial(counts, left.expand_as(counts).contiguous(), generator=g)
            counts = torch.stack([x, counts - x], -1).reshape(len(sizes), -1)[:, :next_size]
        return counts
    return run


def rollout_limit(n: int, length: int, buckets: int, dev: torch.device, scatter: bool = False,
                  vocab: int = V) -> Callable[[], torch.Tensor]:
    """One uniform and the gathers per token-step, the floor of any rollout sampler of this shape: a token
    x = ⌊u·V⌋, its log r from a [C·V] table, its next bucket from a [V] table, summed along the path (and,
    with ``scatter``, one weight per token-step added into [C·V] totals: the floor of the gradient pass).
    Returns the timed call (the tables are made outside it)."""
    g = torch.Generator(device=dev).manual_seed(0)
    table = torch.randn(buckets * vocab, dtype=torch.float64, generator=g, device=dev)
    bucket = torch.randint(0, buckets, (vocab,), generator=g, device=dev)
    totals = torch.zeros(buckets * vocab, dtype=torch.float64, device=dev)

    def run() -> torch.Tensor:
        c = torch.zeros(n, dtype=torch.int64, device=dev)
        acc = torch.zeros(n, dtype=torch.float64, device=dev)
        for _ in range(length):
            u = torch.rand(n, dtype=torch.float64, generator=g, device=dev)
            x = (u * vocab).long()
            at = c * vocab + x
            acc += table[at]
            if scatter:
                totals.index_add_(0, at, acc)
            c = bucket[x]
        return acc.sum() + totals.sum()
    return run


# ----------------------------------------------------------------------------- the paths
@contextlib.contextmanager
def device_setting(table: dict, value: int | None, dev: torch.device):
    """``table[dev.type]`` (a per-device-type setting of kl_bench.sampling.seeding) set to ``value`` for the
    block (None: kl-bench's own), and restored after."""
    keep = dict(table)
    if value is not None:
        table[dev.type] = value
    try:
        yield
    finally:
        table.clear()
        table.update(keep)


def token_lines(a, dev: torch.device) -> list[Line]:
    pair = vocab.make_pair("tokens")
    # Warm-up on batches of V draws: the dense count path that the timed sizes take (batches far smaller
    # than V take the sparse one; the GPU table of 2026-11-27 warmed only that one).
    vocab.engine(pair, 200 * V, dev)
    out = []
    for n in a.token_draws:
        nl, nb = min(n, a.limit_draws), min(n, a.baseline_draws)
        limit = rate(lambda: vocab.raw_limit(pair, nl, dev), nl, dev)[0]
        base = rate(lambda: vocab.torch_multinomial(pair, nb, dev), nb, dev)[0]
        for label, factor in (("", None), (" (pieces of 2^20)", 1)):
            if factor is not None and (dev.type != "cuda" or n < 10**10):
                continue                                   # the piece size only differs on CUDA, at scale
            with device_setting(seeding.TOKEN_PIECES, factor, dev):
                r, s, peak = rate(lambda: vocab.engine(pair, n, dev), n, dev)
            out.append(Line("tokens" + label, f"{n:.0e} draws", "draws/s", r, limit, base, peak, s))
    return out


def count_lines(a, dev: torch.device) -> list[Line]:
    pair = vocab.make_pair("counts")
    q = pair.model.log_q[0].exp()
    n = a.count_draws
    sizes = seeding.batch_sizes(n, 200)
    nb = min(n, a.baseline_draws)
    base = rate(lambda: vocab.torch_multinomial(pair, nb, dev), nb, dev)[0]
    counts_limit(q, sizes[:2], dev)()                                        # warm-up
    limit = rate(counts_limit(q, sizes, dev), n, dev)[0]
    out = []
    for where, label in (("device", "counts, torch tree on the device"), ("host", "counts, numpy on the host")):
        with vocab.counts_on(where, dev):
            vocab.engine(pair, 2 * V, dev)                                   # warm-up
            r, s, peak = rate(lambda: vocab.engine(pair, n, dev), n, dev)
        out.append(Line(label, f"{n:.0e} draws", "draw-eq/s", r, limit, base, peak, s))
    return out


def rollout_lines(a, dev: torch.device) -> list[Line]:
    n, t, c = a.rollouts, a.length, a.buckets
    pair = rollouts.make_pair(c, t)
    rollouts.engine(pair, min(n, 1000), dev, 1000)                           # warm-up (alias tables too)
    steps = n * t
    limit = rate(rollout_limit(n, t, c, dev), steps, dev)[0]
    base = rate(lambda: rollouts.inverse_cdf(pair, n, dev), steps, dev)[0]
    out = []
    # Blocks of steps (seeding.STEP_BLOCKS: 8 on CUDA, chosen by operation count) against step by step
    # (the CPU's 1): the GPU decides (issue 33). Then a run's batches (200: 5,000 rollouts each at 10^6),
    # whose uniforms come a block of steps a call (seeding.UNIFORM_STEPS) or one call a step.
    small = max(1, n // 200)
    for label, block, batch, uniforms in (("", None, a.rollout_batch, None),
                                          (", step by step", 1, a.rollout_batch, None),
                                          (f", batches of {small:,}", None, small, None),
                                          (f", batches of {small:,}, uniforms a step", None, small, 1)):
        if (block == 1 and seeding.step_block(dev) == 1) or (uniforms == 1 and seeding.uniform_steps(dev) == 1):
            continue
        with device_setting(seeding.STEP_BLOCKS, block, dev), device_setting(seeding.UNIFORM_STEPS, uniforms, dev):
            r, s, peak = rate(lambda: rollouts.engine(pair, n, dev, batch), steps, dev)
        out.append(Line(f"rollouts (C {c}, T {t}){label}", f"{n:.0e} rollouts", "token-steps/s", r, limit, base, peak, s))
    # The benchmark's lean prototype (bench_rollout.lean: the same draws, sums by embedding_bag over a step
    # table): a third of the engine's bytes a token-step by the proxy (benchmarks/README.md); does the GPU's
    # rate follow?
    rollouts.lean(pair, min(n, 1000), dev, 1000)                             # warm-up (its step table too)
    r, s, peak = rate(lambda: rollouts.lean(pair, n, dev, a.rollout_batch), steps, dev)
    out.append(Line(f"rollouts (C {c}, T {t}), lean prototype", f"{n:.0e} rollouts", "token-steps/s", r, limit, base,
                    peak, s))
    return out


def gradient_lines(a, dev: torch.device) -> list[Line]:
    n = a.gradient_rollouts
    pair = grads.make_rollout()
    grads.kl_bench_rollout(pair, 1000, dev)                                  # warm-up
    limit = rate(rollout_limit(n, grads.T, grads.C, dev, scatter=True, vocab=grads.V), n, dev)[0]
    cpu = torch.device("cpu")
    base = rate(lambda: grads.kl_bench_rollout(pair, n, cpu), n, cpu)[0] if dev.type != "cpu" else float("nan")
    r, s, peak = rate(lambda: grads.kl_bench_rollout(pair, n, dev), n, dev)
    return [Line(f"rollout gradients (C {grads.C}, T {grads.T})", f"{n:.0e} rollouts", "rollouts/s", r, limit, base,
                 peak, s)]


def audit_lines(a, dev: torch.device) -> list[Line]:
    n, v, d = a.positions, a.vocab, a.dim
    layer = audit.make_layer(n, v, d, device=str(dev))
    m = audit.methods(a.tile or pieces(dev)[1])          # the device's own chunk and tile (tiling.PIECES)
    timed = ("two tiled float32 forwards (floor)", "dense float32", "stream_kl", "stream_values trl.grpo, b = q (callback)")
    for name in timed:
        m[name](*layer)       # warm-up (a first call also compiles CUDA's jiterator kernels: seconds)
    limit = rate(lambda: m["two tiled float32 forwards (floor)"](*layer), n, dev)[0]
    base = rate(lambda: m["dense float32"](*layer), n, dev)[0]
    out = []
    for name in ("stream_kl", "stream_values trl.grpo, b = q (callback)"):
        r, s, peak = rate(lambda: m[name](*layer), n, dev)
        out.append(Line(f"audit {name.split(' (')[0]}", f"{n} × {v:,}", "positions/s", r, limit, base, peak, s))
    # Issue 32: on an H100 the CPU's pieces (chunk 256, tile 4,096) left stream_values dispatch-bound
    # (32 forwards, 8,827 launches per 1,024 positions); a GPU's default is now 1,024 × 8,192, chosen by
    # operation count. Larger pieces mean fewer launches and more memory (chunk × tile elements a buffer):
    # each setting of --audit-pieces (the CPU's among them) measured here, beside the default.
    for chunk, tile in a.audit_pieces:
        values = audit._values(("trl.grpo",), audit.Sampler(), tile, chunk=chunk)
        values(*layer)                                      # warm-up
        r, s, peak = rate(lambda: values(*layer), n, dev)
        out.append(Line(f"audit stream_values chunk {chunk} tile {tile}", f"{n} × {v:,}", "positions/s", r, limit,
                        base, peak, s))
    return out


def profile(a, dev: torch.device) -> None:
    """Each selected path's kl-bench pipeline once more, at a tenth of its size or less, under torch's
    profiler: the operators that take the device's (or, on the CPU, the host's) time, and the number of
    kernel launches. Profile before tuning (issue 33)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    cuda = dev.type == "cuda"
    key = "cuda_time_total" if cuda else "cpu_time_total"
    runs = {path: calls[0][1] for path, (_, _, calls) in _tenths(a, dev).items()}      # kl-bench's pipelines
    for path in a.profile or a.paths:
        if path not in runs:
            continue
        runs[path]()                                                         # warm (tables, kernels)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sync(dev)
        t = time.perf_counter()
        with torch_profile(activities=activities) as prof:
            runs[path]()
            sync(dev)
        s = time.perf_counter() - t
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
        print(f"\nprofile of {path} (a tenth of its size; {s:.2f} s under the profiler; {launches:,} kernel launches)")
        print(events.table(sort_by=key, row_limit=14, max_name_column_width=60))


def operations(a, dev: torch.device) -> None:
    """Each selected path's kl-bench pipeline once more, at a tenth of its size, with the ATen operations it
    dispatches counted (benchmarks/launches.py): on a GPU each is a kernel launch, so this is the
    launch count of a launch-bound path, and it is measured on any device (the CPU in CI). Then the same
    calls' memory traffic by the proxy of benchmarks/launches.py (bytes streamed and random 32-byte
    reads), per unit of the path's rate: what bounds a path whose vectors are long."""
    print(f"\nATen operations per pipeline call ({dev}): all of them, and those that make a kernel on a GPU (about "
          "one launch each; views, empty and wrapped scalars make none)")
    traffic = []
    for path, (units, unit, runs) in _tenths(a, dev).items():
        if path not in (a.ops or a.paths):
            continue
        for label, run in runs:
            run()                                                            # warm (tables)
            _, ops = count_ops(run)
            kernels = [(k, v) for k, v in ops.most_common() if k not in ops.free][:4]
            print(f"  {label:<10} {sum(ops.values()):>9,} operations, {ops.launching:>9,} kernels   most: "
                  + ", ".join(f"{k} {v:,}" for k, v in kernels))
            traffic.append((label, unit, sum(ops.streamed.values()) / units, sum(ops.sectors.values()) / units,
                            ops.traffic / units))
    print("\nMemory traffic per unit (a proxy from shapes, benchmarks/launches.py: operands and results "
          "once each, a random read a 32-byte sector)")
    for label, unit, streamed, sectors, total in traffic:
        print(f"  {label:<10} {streamed:9,.1f} B streamed, {sectors:6.2f} random reads, {total:9,.1f} B a {unit}")


def _on_device_tree(run: Callable[[], object], dev: torch.device) -> object:
    """``run()`` with count vectors drawn by the tree on ``dev`` (a CPU draws numpy's by default)."""
    with vocab.counts_on("device", dev):
        return run()


def _tenths(a, dev: torch.device) -> dict[str, tuple[float, str, list[tuple[str, Callable[[], object]]]]]:
    """Each path's pipelines at a tenth of its size (profiles, operation counts and traffic): per path its
    units (draws, token-steps, ...), the unit's name and the (label, call) pairs: kl-bench's pipeline and,
    for the rollouts, the raw limit, the baseline and the lean prototype beside it. A pair is made once and
    shared by the calls, as the timed table shares it (the calls' tables are cached per pair)."""
    n, t = max(1, a.rollouts // 10), a.length
    pair = rollouts.make_pair(a.buckets, t)
    steps = n * t
    return {
        "tokens": (max(a.token_draws) // 10, "draw", [("tokens", lambda: vocab.engine(
            vocab.make_pair("tokens"), max(a.token_draws) // 10, dev))]),
        "counts": (a.count_draws // 10, "draw", [("counts", lambda: _on_device_tree(lambda: vocab.engine(
            vocab.make_pair("counts"), a.count_draws // 10, dev), dev))]),
        "rollouts": (steps, "token-step", [
            ("rollouts", lambda: rollouts.engine(pair, n, dev, max(1, a.rollout_batch // 10))),
            ("  lean", lambda: rollouts.lean(pair, n, dev, max(1, a.rollout_batch // 10))),
            ("  icdf", lambda: rollouts.inverse_cdf(pair, n, dev)),
            ("  limit", rollout_limit(n, t, a.buckets, dev))]),
        "gradients": (a.gradient_rollouts // 10, "rollout", [("gradients", lambda: grads.kl_bench_rollout(
            grads.make_rollout(), a.gradient_rollouts // 10, dev))]),
        "audit": (max(1, a.positions // 4), "position", [("audit", lambda: audit.methods(
            a.tile or pieces(dev)[1])["stream_values trl.grpo, b = q (callback)"](
            *audit.make_layer(max(1, a.positions // 4), a.vocab, a.dim, device=str(dev))))]),
    }


PATHS = {"tokens": token_lines, "counts": count_lines, "rollouts": rollout_lines, "gradients": gradient_lines,
         "audit": audit_lines}


def _g(x: float, spec: str) -> str:
    return "–" if x != x else format(x, spec)


def show(lines: list[Line]) -> None:
    """The table, as Markdown (benchmarks/README.md's GPU table has these columns)."""
    print(f"| {'path':<42} | {'size':<16} | {'unit':<13} | {'kl-bench':>9} | {'raw limit':>9} | {'of limit':>8} "
          f"| {'baseline':>9} | {'vs baseline':>11} | {'peak GPU MiB':>12} | {'s':>7} |")
    print("|" + "|".join("-" * w for w in (44, 18, 15, 11, 11, 10, 11, 13, 14, 9)) + "|")
    for x in lines:
        print(f"| {x.path:<42} | {x.size:<16} | {x.unit:<13} | {x.ours:9.3g} | {x.limit:9.3g} | {x.ours / x.limit:8.0%} "
              f"| {_g(x.baseline, '9.3g'):>9} | {_g(x.ours / x.baseline, '10.2f') + '×':>11} "
              f"| {_g(x.peak_mib, '12,.0f'):>12} | {x.seconds:7.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--token-draws", type=int, nargs="+", default=[10**8, 10**10])
    ap.add_argument("--count-draws", type=int, default=10**10)
    ap.add_argument("--limit-draws", type=int, default=10**10, help="most draws the raw limits run (compared by rate)")
    ap.add_argument("--baseline-draws", type=int, default=10**9, help="most draws torch.multinomial runs")
    ap.add_argument("--rollouts", type=int, default=10**6)
    ap.add_argument("--rollout-batch", type=int, default=10**5, help="rollouts a batch (each its own generator)")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--buckets", type=int, default=256)
    ap.add_argument("--gradient-rollouts", type=int, default=10**6)
    ap.add_argument("--positions", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--dim", type=int, default=896)
    ap.add_argument("--tile", type=int, default=None, help="the audit's tile (default: the device's, tiling.PIECES)")
    ap.add_argument("--audit-pieces", type=lambda s: [tuple(int(x) for x in p.split("x")) for p in s.split(",")],
                    default=[(256, 4096), (4096, 16384), (4096, 32768)],
                    help="stream_values' chunk x tile settings timed beside the default (e.g. 1024x8192,4096x16384)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--profile", nargs="*", choices=list(PATHS), default=None,
                    help="then these paths' pipelines (none named: every path run) under torch's profiler")
    ap.add_argument("--ops", nargs="*", choices=list(PATHS), default=None,
                    help="then these paths' ATen operations per call, counted at a tenth of their size (none named: "
                         "every path run; any device)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: CI checks that the table runs")
    a = ap.parse_args()
    if a.smoke:
        a.ops = [] if a.ops is None else a.ops
        a.device, a.token_draws, a.count_draws, a.limit_draws, a.baseline_draws = "cpu", [20_000], 200_000, 20_000, 20_000
        a.rollouts, a.rollout_batch, a.length, a.buckets, a.gradient_rollouts = 400, 200, 8, 4, 400
        a.positions, a.vocab, a.dim, a.tile, a.audit_pieces = 8, 1000, 16, 256, [(4, 512)]
        grads.V, grads.C, grads.T = 1000, 4, 8          # bench_gradients' rollout, shrunk
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py: no CUDA device (run --smoke, or --device cpu)")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    start = time.perf_counter()
    print(f"kl-bench GPU table: {name}; torch {torch.__version__}; "
          f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    lines: list[Line] = []
    for path in a.paths:
        lines += PATHS[path](a, dev)
    show(lines)
    total = time.perf_counter() - start
    overall = f"; peak GPU memory of any pipeline {max(x.peak_mib for x in lines):,.0f} MiB" if dev.type == "cuda" else ""
    print(f"run time {total:.1f} s (setup, warm-ups, limits and baselines included){overall}")
    if a.ops is not None:
        operations(a, dev)
    if a.profile is not None:
        profile(a, dev)


if __name__ == "__main__":
    main()
