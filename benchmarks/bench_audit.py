"""The trainer audit's cost (issue 24), against plain baselines in the same run:

  A. At a Qwen2.5-0.5B-sized output layer (V = 151,936, d = 896, random weights), the exact per-position
     KL(q‖p) of N positions, in units of one plain output-layer forward (h @ Wᵀ in float32, [N, V]):
       dense float64       both models' logits in float64, log_softmax, Σ q (log q − log p): [N, V] tensors
       two tiled forwards  the floor of any exact KL: both models' float32 tile matmuls, nothing else
       stream_kl           kl_bench.audit.stream_kl: one pass, vocabulary tiles, online log-sum-exp
       stream_values       the full audit (k3 moments under q and under a top-k sampler): two passes
       TRL chunked         trl's ChunkedDivergenceFunction with beta = 1 (reverse KL), when trl is installed
     with the max |error| against the dense float64 values (against stream_kl in float64, equal to them to
     1e-12 by tests/test_audit.py, when --methods leaves dense out) and, unless --no-memory, the peak
     resident memory of each in a fresh process. --clock cpu times the process's CPU seconds instead of
     wall seconds (steadier on a shared machine: time spent descheduled does not count).
  B. The audit's share of a training step: the tiny GRPO run (kl_bench.integrations.demo) with and
     without KLAudit(every=1), when trl is installed.

    python benchmarks/bench_audit.py [--positions 256] [--threads 2] [--clock wall|cpu] [--methods stream_kl,tiled]
                                     [--no-memory] [--no-trainer] [--no-layer] [--smoke]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from pathlib import Path

import torch

from kl_bench.audit import Head, Sampler, position_values, stream_kl, stream_values


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCK["wall"]


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def make_layer(n: int, vocab: int, d: int, seed: int = 0):
    """Hidden states and output layers of a policy and a nearby reference (random, float32)."""
    g = torch.Generator().manual_seed(seed)
    hp = torch.randn(n, d, generator=g)
    hr = hp + 0.1 * torch.randn(n, d, generator=g)
    wp = torch.randn(vocab, d, generator=g) / d ** 0.5 * 4
    wr = wp + 0.05 * torch.randn(vocab, d, generator=g) / d ** 0.5 * 4
    return hp, hr, wp, wr


def dense_kl(hp, hr, wp, wr) -> torch.Tensor:
    return position_values(hp.double() @ wp.double().T, hr.double() @ wr.double().T, ()).kl


def trl_chunked(hp, hr, wp, wr):
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    return ChunkedDivergenceFunction.apply(hp, wp, None, hr, wr, None, 1.0)[0]


def two_tiled_forwards(hp, hr, wp, wr, tile: int):
    """Both output layers' float32 logits, tile by tile, dropped unused: what any exact KL must pay."""
    for lo in range(0, wp.shape[0], tile):
        hp @ wp[lo:lo + tile].T, hr @ wr[lo:lo + tile].T


def methods(tile: int):
    return {
        "dense float64": dense_kl,
        "two tiled float32 forwards (floor)": lambda hp, hr, wp, wr: two_tiled_forwards(hp, hr, wp, wr, tile),
        "stream_kl (float32 matmul)": lambda hp, hr, wp, wr: stream_kl(hp, hr, Head(wp), Head(wr), tile=tile,
                                                                       dtype=torch.float32),
        "stream_kl (float64 matmul)": lambda hp, hr, wp, wr: stream_kl(hp, hr, Head(wp), Head(wr), tile=tile),
        "stream_values k3, top_k=50 (float32 matmul)": lambda hp, hr, wp, wr: stream_values(
            hp, hr, Head(wp), Head(wr), ("k3",), Sampler(top_k=50), tile=tile, dtype=torch.float32).kl,
        "TRL ChunkedDivergenceFunction (beta=1)": trl_chunked,
    }


def part_a(n: int, vocab: int, d: int, tile: int, repeat: int, memory: bool, only: list[str] | None = None) -> None:
    hp, hr, wp, wr = make_layer(n, vocab, d)
    chosen = {k: f for k, f in methods(tile).items() if not only or any(w in k for w in only)}
    unit = _best(lambda: hp @ wp.T, repeat)
    dense = "dense float64" in chosen
    truth = dense_kl(hp, hr, wp, wr) if dense else stream_kl(hp, hr, Head(wp), Head(wr), tile=tile)
    print(f"A. exact KL of {n} positions at V = {vocab:,}, d = {d}, tile {tile}, {torch.get_num_threads()} threads, "
          f"{'CPU' if clock is CLOCK['cpu'] else 'wall'} seconds; unit = one float32 output-layer forward "
          f"[{n}, {vocab}] = {unit * 1e3:.1f} ms; errors against {'dense' if dense else 'stream_kl'} float64")
    print(f"{'method':<46} {'s':>8} {'units':>7} {'max |err|':>10} {'peak MiB':>9}")
    for name, fn in chosen.items():
        try:
            kl = fn(hp, hr, wp, wr)
        except ImportError:
            print(f"{name:<46} (trl not installed)")
            continue
        s = _best(lambda: fn(hp, hr, wp, wr), repeat)
        err = float("nan") if kl is None else (kl.double() - truth).abs().max().item()
        peak = _peak(name, n, vocab, d, tile) if memory else float("nan")
        print(f"{name:<46} {s:8.3f} {s / unit:7.2f} {err:10.1e} {peak:9.0f}")


def _peak(name: str, n: int, vocab: int, d: int, tile: int) -> float:
    from memory import peak_in_child      # benchmarks/memory.py, beside this script
    setup = (f"import torch, bench_audit as b; hp, hr, wp, wr = b.make_layer({n}, {vocab}, {d}); "
             f"fn = b.methods({tile})[{name!r}]")
    return peak_in_child(setup, "fn(hp, hr, wp, wr)")["rss_peak_mib"] - peak_in_child(setup, "None")["rss_peak_mib"]


def part_b(steps: int, repeat: int) -> None:
    try:
        import trl  # noqa: F401
    except ImportError:
        print("B. skipped: trl is not installed (pip install 'kl-bench[trl]')")
        return
    import warnings
    warnings.filterwarnings("ignore")
    from kl_bench.integrations.demo import build_trainer
    from kl_bench.integrations.trl import KLAudit
    from kl_bench.pairs.model.tiny import build_tiny_models
    torch.set_num_threads(1)          # tiny models: one thread is fastest (tests/conftest.py, one_thread)
    with tempfile.TemporaryDirectory() as tmp:
        models = build_tiny_models(Path(tmp) / "models")
        def once(audited: bool) -> float:
            tr = build_trainer(models, Path(tmp) / "run", steps=steps, learning_rate=0.0, disable_tqdm=True)
            if audited:
                tr.add_callback(KLAudit(tr, every=1, max_rows=8, print_fn=lambda s: None))
            t = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):      # the trainer prints every step's logs
                tr.train()
            return time.perf_counter() - t
        once(False)                                              # warm-up: first-call costs of torch and TRL
        times = {False: float("inf"), True: float("inf")}
        for _ in range(repeat):                                  # interleaved, best of `repeat`
            for audited in (False, True):
                times[audited] = min(times[audited], once(audited))
        plain, audit = times[False] / steps, times[True] / steps
        print(f"B. tiny GRPO step (8 completions × 8 tokens, V ≈ 1000): {plain * 1e3:.0f} ms plain, "
              f"{audit * 1e3:.0f} ms with KLAudit(every=1): the audit is {(audit - plain) / audit:.0%} of an audited step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--dim", type=int, default=896)
    ap.add_argument("--tile", type=int, default=4096, help="vocabulary tile (4096: fastest measured here)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="training steps for part B")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=sorted(CLOCK), default="wall")
    ap.add_argument("--methods", default=None, help="comma-separated words: run the part-A methods naming one")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-trainer", action="store_true", help="skip part B")
    ap.add_argument("--no-layer", action="store_true", help="skip part A")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    global clock
    clock = CLOCK[a.clock]
    if a.smoke:
        a.positions, a.vocab, a.dim, a.tile, a.repeat, a.steps, a.no_memory = 8, 1000, 16, 256, 1, 1, True
    if not a.no_layer:
        part_a(a.positions, a.vocab, a.dim, a.tile, a.repeat, not a.no_memory,
               a.methods.split(",") if a.methods else None)
    if not a.no_trainer:
        part_b(a.steps, a.repeat)


if __name__ == "__main__":
    main()
