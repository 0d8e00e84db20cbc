"""A whole `kind = "model"` case with continuations against the plain baseline, in one process:

  kl-bench model case   both models stepped with their KV caches; at every step both full next-token
                        log-probs (float32 log-softmax → float64), the token drawn by inverse CDF from an
                        explicit generator, L = Σ log r_t, per-token k1/k2/k3, the analytic per-step KL
                        (`full`, the reference) and every row's feature sums (engine.run_case, joint λ sums)
  baseline              model.generate(do_sample=True) for the same number of continuations of T tokens,
                        plus one forward pass of the reference over the generated sequences (what a
                        trainer does to get log p of the sampled tokens), and nothing else

Both run `batch_size` continuations per call. The models are the tiny random GPT-2s the test suite
builds (kl_bench.kinds.model.tiny), or your own with --models DIR (policy/, reference/, prompts.txt).

    python benchmarks/bench_model.py [--continuations 512] [--length 32] [--batch-size 64] [--device cpu]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from kl_bench.engine.monte_carlo import run_case
from kl_bench.kinds.model import ModelPair, lm
from kl_bench.kinds.model.tiny import build_tiny_models

ROWS = ["k1", "k2", "k3", "full"]


def baseline(policy, reference, prompts, n: int, length: int, batch: int, device) -> None:
    torch.manual_seed(0)       # model.generate samples from the global RNG (this script owns the process)
    with torch.no_grad():
        for start in range(0, n, batch):
            m = min(batch, n - start)
            ids, mask = lm.left_pad([prompts[(start + i) % len(prompts)] for i in range(m)], device)
            out = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=length, min_new_tokens=length,
                                  do_sample=True, top_k=0, pad_token_id=0)
            full = torch.cat([mask, torch.ones(m, out.shape[1] - mask.shape[1], dtype=mask.dtype, device=device)], 1)
            logits = reference(input_ids=out, attention_mask=full,
                               position_ids=(full.cumsum(-1) - 1).clamp(min=0)).logits
            torch.log_softmax(logits[:, ids.shape[1] - 1:-1].float(), -1).gather(-1, out[:, ids.shape[1]:, None])


def ours(pair: ModelPair, n: int, device) -> None:
    run_case(pair, ROWS, draws=n, seed=0, batches=max(2, n // pair.batch_size), chunk=1 << 22, device=device,
             joint=True)


def timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--continuations", type=int, default=512)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (1: tiny models on a shared machine)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    args = ap.parse_args()
    if args.smoke:
        args.continuations, args.length, args.repeats = 32, 4, 1
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.models or build_tiny_models(tmp)
        policy = lm.load_model(folder / "policy", "float32", "policy").to(device)
        reference = lm.load_model(folder / "reference", "float32", "reference").to(device)
        prompts = lm.read_prompts(folder / "prompts.txt", folder / "policy")
        pair = ModelPair("bench", policy, reference, prompts, args.length, None, args.batch_size)
        n, t = args.continuations, args.length
        ours(pair, min(n, args.batch_size), device)                 # warm-up (allocations, kernels)
        baseline(policy, reference, prompts, min(n, args.batch_size), t, args.batch_size, device)
        t_ours = timed(lambda: ours(pair, n, device), args.repeats)
        t_base = timed(lambda: baseline(policy, reference, prompts, n, t, args.batch_size, device), args.repeats)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {args.threads} thread(s)"
    print(f"device: {name}; torch {torch.__version__}; {n} continuations × T={t}, batch {args.batch_size}, "
          f"V={lm.vocab_size(policy)}, best of {args.repeats}")
    print("| pipeline | seconds | tokens/s | vs baseline |")
    print("|---|---|---|---|")
    print(f"| kl-bench model case (every row, reference, λ sums) | {t_ours:.3f} | {n * t / t_ours:,.0f} | "
          f"**{t_ours / t_base:.2f}×** time |")
    print(f"| model.generate + one reference forward | {t_base:.3f} | {n * t / t_base:,.0f} | 1.00× |")


if __name__ == "__main__":
    main()
