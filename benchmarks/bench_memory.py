"""Peak memory of one case with ``batches = 2`` as the draws grow, for every kind, in fresh processes.

Each run is measured twice in the same invocation:

  pieces        the engine as it is: a batch is drawn in fixed pieces (2^16 draws on the CPU)
  whole batch   the plain baseline: the piece size raised above the batch, so each batch of N/2 draws
                is drawn and reduced at once (what the engine did before pieces)

The whole-batch baseline is skipped where it would not fit in this machine's memory. Peak resident
memory is VmHWM after a reset following setup (benchmarks/memory.py), so it is the run's own peak.

    python benchmarks/bench_memory.py [--draws 1e6 1e7 1e8] [--device cpu] [--smoke]
"""
from __future__ import annotations

import argparse

import torch

from memory import peak_in_child  # benchmarks/memory.py, beside this script

# kind → (spec case table, largest draws timed here, largest draws for the whole-batch baseline)
CASES = {
    "gaussian": ({"kind": "gaussian", "q": {"mean": 0.0, "std": 1.0}, "p": {"mean": 0.3, "std": 1.1}},
                 10**8, 10**7),
    "categorical (tokens)": ({"kind": "categorical", "vocab": 50257, "sampling": "tokens",
                              "q": {"logits": "zipf", "exponent": 1.1, "seed": 1},
                              "p": {"from": "q", "noise": 0.3, "seed": 2}}, 10**8, 10**8),
    "categorical (counts)": ({"kind": "categorical", "vocab": 50257, "sampling": "counts",
                              "q": {"logits": "zipf", "exponent": 1.1, "seed": 1},
                              "p": {"from": "q", "noise": 0.3, "seed": 2}}, 10**10, 0),
    "rollout (T = 16)": ({"kind": "rollout", "vocab": 5000, "buckets": 8, "length": 16, "eos": 4999,
                          "q": {"logits": "zipf", "exponent": 1.1, "seed": 1},
                          "p": {"from": "q", "noise": 0.3, "seed": 2}}, 10**7, 10**7),
}
ROWS = ["k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3", "full"]


def setup(case: dict, device: str, whole: bool) -> str:
    spec = {"spec_version": 1, "experiment": {"name": "mem", "draws": 1000, "device": device, "estimators": ROWS},
            "case": [{"name": "c", **case}]}
    raise_piece = "import kl_bench.sampling.seeding as s; s.PIECE_DRAWS.update(cpu=1 << 62, cuda=1 << 62); " if whole else ""
    return (f"{raise_piece}from kl_bench.api import prepare; from kl_bench.engine.monte_carlo import run_case; "
            f"prep = prepare({spec!r}); pair = prep.pairs[0]; dev = torch.device('{device}')")


def step(n: int) -> str:
    return f"run_case(pair, {ROWS!r}, draws={n}, seed=0, batches=2, chunk=1 << 22, device=dev)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=float, nargs="+", default=[1e6, 1e7, 1e8, 1e10])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--smoke", action="store_true", help="10^4 draws per kind: CI checks that it runs")
    args = ap.parse_args()
    sizes = [10**4] if args.smoke else [int(d) for d in args.draws]
    dev = torch.device(args.device)
    print(f"peak resident memory of one case, batches = 2, device {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""))
    print(f"{'kind':<22} {'draws':>7} {'pieces MiB':>11} {'whole batch MiB':>16} {'setup MiB':>10}")
    # Smoke: two kinds (a Gaussian and a categorical by counts) run the same measuring code as all four.
    kinds = {k: v for k, v in CASES.items() if k in ("gaussian", "categorical (counts)")} if args.smoke else CASES
    for kind, (case, most, most_whole) in kinds.items():
        for n in sizes:
            if n > most and not args.smoke:
                continue
            r = peak_in_child(setup(case, args.device, False), step(n))
            run = r["rss_peak_mib"] - r["rss_before_mib"]
            whole = "skipped"
            # Smoke: the whole-batch baseline for the first kind only (one child each: CI checks it runs).
            if (n <= most_whole and not args.smoke) or (args.smoke and kind == next(iter(CASES))):
                w = peak_in_child(setup(case, args.device, True), step(n))
                whole = f"{w['rss_peak_mib'] - w['rss_before_mib']:.0f}"
            cuda = f"   CUDA peak {r['cuda_peak_mib']:.0f} MiB" if r["cuda_peak_mib"] is not None else ""
            print(f"{kind:<22} {n:7.0e} {run:11.0f} {whole:>16} {r['rss_before_mib']:10.0f}{cuda}", flush=True)


if __name__ == "__main__":
    main()
