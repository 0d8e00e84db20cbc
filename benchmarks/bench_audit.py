"""The trainer audit's cost (issues 24, 32), against plain baselines in the same run:

  A. At a Qwen2.5-0.5B-sized output layer (V = 151,936, d = 896, random weights), the exact per-position
     KL(q‖p) of N positions, in units of one plain output-layer forward (h @ Wᵀ in float32, [N, V]):
       dense float64 / float32   both models' [N, V] logits, log_softmax, Σ q (log q − log p)
       two tiled forwards        the floor of any exact KL: both models' float32 tile matmuls, nothing else
       stream_kl                 kl_bench.audit.stream_kl: KL only, one pass
       stream_values ...         the full audit (estimator moments under q and the sampler, consistency
                                 terms), one pass for polynomial estimators: the callback's settings
                                 (trl.grpo, b = q), top_k = 50, every polynomial estimator
       TRL chunked               trl's ChunkedDivergenceFunction with beta = 1 (reverse KL), if installed
     with the max |error| against the dense float64 values (against stream_kl in float64 when --methods
     leaves dense out) and, unless --no-memory, the peak resident memory of each in a fresh process.
     --clock cpu times the process's CPU seconds (steadier on a shared machine). On a GPU (--device cuda)
     the same table, timed with CUDA synchronisation.
  B. The audit's share of a GRPO step: a Qwen2-shaped model built from its config with random weights
     (--layers 24: Qwen2-0.5B's shape, for a GPU; 2 layers by default on the CPU), plain steps against the
     time KLAudit(every=1, max_rows=8) spends itself; the share at every = 10 follows. When trl is installed.

    python benchmarks/bench_audit.py [--positions 512] [--threads 1] [--clock wall|cpu] [--methods stream_kl,tiled]
                                     [--no-memory] [--no-trainer] [--no-layer] [--layers 2] [--device cpu] [--smoke]
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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        _sync()
        t = clock()
        fn()
        _sync()
        best = min(best, clock() - t)
    return best


DEVICE = "cpu"


def make_layer(n: int, vocab: int, d: int, seed: int = 0, device: str | None = None):
    """Hidden states and output layers of a policy and a nearby reference (random, float32), made on the
    CPU from a seeded generator and moved to ``device`` (the same numbers on every device)."""
    g = torch.Generator().manual_seed(seed)
    hp = torch.randn(n, d, generator=g)
    hr = hp + 0.1 * torch.randn(n, d, generator=g)
    wp = torch.randn(vocab, d, generator=g) / d ** 0.5 * 4
    wr = wp + 0.05 * torch.randn(vocab, d, generator=g) / d ** 0.5 * 4
    return tuple(x.to(device or DEVICE) for x in (hp, hr, wp, wr))


def dense_kl(hp, hr, wp, wr) -> torch.Tensor:
    return position_values(hp.double() @ wp.double().T, hr.double() @ wr.double().T, ()).kl


def dense_float32(hp, hr, wp, wr) -> torch.Tensor:
    """The plain dense computation in float32: both [N, V] logits, two log-softmaxes, Σ q (log q − log p)."""
    lq, lp = torch.log_softmax(hp @ wp.T, -1), torch.log_softmax(hr @ wr.T, -1)
    return (lq.exp() * (lq - lp)).sum(-1)


def trl_chunked(hp, hr, wp, wr):
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    return ChunkedDivergenceFunction.apply(hp, wp, None, hr, wr, None, 1.0)[0]


def two_tiled_forwards(hp, hr, wp, wr, tile: int):
    """Both output layers' float32 logits, tile by tile, dropped unused: what any exact KL must pay."""
    for lo in range(0, wp.shape[0], tile):
        hp @ wp[lo:lo + tile].T, hr @ wr[lo:lo + tile].T


def _values(estimators, sampler, tile, **kw):
    return lambda hp, hr, wp, wr: stream_values(hp, hr, Head(wp), Head(wr), estimators, sampler, tile=tile, **kw).kl


def methods(tile: int):
    """Part A's methods by name. The callback's settings: TRL GRPO's formula (trl.grpo = k3) under TRL's
    default sampler (b = q), and under top_k = 50; "every polynomial estimator" adds k1, k2 and the
    forward ones (k1 changes sign: P(f < 0) under b = q is its second pass, ``negative=False`` skips it)."""
    return {
        "dense float64": dense_kl,
        "dense float32": dense_float32,
        "two tiled float32 forwards (floor)": lambda hp, hr, wp, wr: two_tiled_forwards(hp, hr, wp, wr, tile),
        "stream_kl": lambda hp, hr, wp, wr: stream_kl(hp, hr, Head(wp), Head(wr), tile=tile),
        "stream_values trl.grpo, b = q (callback)": _values(("trl.grpo",), Sampler(), tile),
        "stream_values trl.grpo, top_k=50": _values(("trl.grpo",), Sampler(top_k=50), tile),
        "stream_values k1..fwd_k3, top_k=50": _values(("k1", "k2", "k3", "fwd_k1", "fwd_k3"), Sampler(top_k=50), tile),
        "stream_values k1..fwd_k3, b = q, negative=False": _values(("k1", "k2", "k3", "fwd_k1", "fwd_k3"), Sampler(),
                                                                    tile, negative=False),
        "stream_values (float64 tiles) trl.grpo, b = q": _values(("trl.grpo",), Sampler(), tile, dtype=torch.float64),
        "TRL ChunkedDivergenceFunction (beta=1)": trl_chunked,
    }


def part_a(n: int, vocab: int, d: int, tile: int, repeat: int, memory: bool, only: list[str] | None = None) -> None:
    hp, hr, wp, wr = make_layer(n, vocab, d)
    chosen = {k: f for k, f in methods(tile).items() if not only or any(w in k for w in only)}
    unit = _best(lambda: hp @ wp.T, repeat)
    dense = "dense float64" in chosen
    truth = dense_kl(hp, hr, wp, wr) if dense else stream_kl(hp, hr, Head(wp), Head(wr), tile=tile, dtype=torch.float64)
    where = "CPU" if DEVICE == "cpu" else torch.cuda.get_device_name()
    print(f"A. exact KL of {n} positions at V = {vocab:,}, d = {d}, tile {tile}, {where}, {torch.get_num_threads()} threads, "
          f"{'CPU' if clock is CLOCK['cpu'] else 'wall'} seconds; unit = one float32 output-layer forward "
          f"[{n}, {vocab}] = {unit * 1e3:.1f} ms; errors against {'dense' if dense else 'stream_kl'} float64")
    print(f"{'method':<50} {'s':>8} {'units':>7} {'max |err|':>10} {'peak MiB':>9}")
    for name, fn in chosen.items():
        try:
            kl = fn(hp, hr, wp, wr)
        except ImportError:
            print(f"{name:<50} (trl not installed)")
            continue
        s = _best(lambda: fn(hp, hr, wp, wr), repeat)
        err = float("nan") if kl is None else (kl.double() - truth).abs().max().item()
        peak = _peak(name, n, vocab, d, tile) if memory else float("nan")
        print(f"{name:<50} {s:8.3f} {s / unit:7.2f} {err:10.1e} {peak:9.0f}")


def _peak(name: str, n: int, vocab: int, d: int, tile: int) -> float:
    from memory import peak_in_child      # benchmarks/memory.py, beside this script
    setup = (f"import torch, bench_audit as b; hp, hr, wp, wr = b.make_layer({n}, {vocab}, {d}); "
             f"fn = b.methods({tile})[{name!r}]")
    return peak_in_child(setup, "fn(hp, hr, wp, wr)")["rss_peak_mib"] - peak_in_child(setup, "None")["rss_peak_mib"]


def qwen2_models(folder: Path, *, layers: int = 2, hidden: int = 896, vocab: int = 151_936, heads: int = 14,
                 kv_heads: int = 2, intermediate: int = 4864, seed: int = 0) -> Path:
    """A Qwen2-shaped policy and reference (Qwen2-0.5B's shape at ``layers = 24``), random weights built from
    the config (no hub), the reference the policy moved a little, with the tiny models' tokenizer and
    prompts (its ids all lie in the larger vocabulary), in ``folder``: what
    kl_bench.integrations.demo.build_trainer takes."""
    import shutil

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kl_bench.kinds.model.tiny import build_tiny_models
    tiny = build_tiny_models(folder / "tiny")
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=True,
                      max_position_embeddings=1024, pad_token_id=0, eos_token_id=0, bos_token_id=0)
    g = torch.Generator().manual_seed(seed)  # host: demo models are built on the CPU
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        policy = Qwen2ForCausalLM(cfg)
    for name in ("policy", "reference"):
        model = policy
        if name == "reference":
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.02 * p.std() * torch.randn(p.shape, generator=g))  # host: demo models are built on the CPU
        model.save_pretrained(folder / name)
        for f in (tiny / "policy").iterdir():
            if "token" in f.name or f.name in ("vocab.json", "merges.txt", "special_tokens_map.json"):
                shutil.copy(f, folder / name / f.name)
    shutil.copy(tiny / "prompts.txt", folder / "prompts.txt")
    return folder


def part_b(steps: int, repeat: int, sizes: dict, rows: int, length: int) -> None:
    """The audit's share of a GRPO step on a Qwen2-shaped model built from its config (random weights, no
    hub): plain steps timed against the time KLAudit itself spends (its own clock: the audit of the
    step's rows and the step's one sync), at every = 1, so one audited step's cost is measured; the share
    at every = 10 is that cost over ten plain steps."""
    try:
        import trl  # noqa: F401
    except ImportError:
        print("B. skipped: trl is not installed (pip install 'kl-bench[trl]')")
        return
    import warnings
    warnings.filterwarnings("ignore")
    from transformers import AutoModelForCausalLM

    from kl_bench.integrations.demo import build_trainer
    from kl_bench.integrations.trl import KLAudit
    with tempfile.TemporaryDirectory() as tmp:
        models = qwen2_models(Path(tmp) / "models", **sizes)
        cfg = dict(steps=steps, learning_rate=1e-6, max_completion_length=length, per_device_train_batch_size=rows,
                   num_generations=4, disable_tqdm=True, use_cpu=DEVICE == "cpu")

        def once(audited: bool) -> tuple[float, float]:
            tr = build_trainer(models, Path(tmp) / "run", **cfg)
            cb = KLAudit(tr, every=1, max_rows=rows, print_fn=lambda s: None) if audited else None
            if cb is not None:
                tr.add_callback(cb)
            t = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):      # the trainer prints every step's logs
                tr.train()
            return time.perf_counter() - t, 0.0 if cb is None else cb.seconds
        plain = min(once(False)[0] for _ in range(repeat)) / steps
        audit = min(once(True)[1] for _ in range(repeat)) / steps
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(models / "policy").parameters())
        device = "cpu" if DEVICE == "cpu" else torch.cuda.get_device_name()
        print(f"B. GRPO step on a Qwen2-shaped model ({n_params / 1e6:.0f} M parameters: {sizes['layers']} layers, "
              f"d = {sizes['hidden']}, V = {sizes['vocab']:,}), {rows} completions × {length} tokens a step, "
              f"{torch.get_num_threads()} threads, {device}:")
        print(f"   plain step {plain:.2f} s; one audited step's audit ({rows} rows, {rows * length} positions) "
              f"{audit:.3f} s = {audit / plain:.2%} of a step; at every = 10: {audit / (10 * plain):.3%} of the run")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (part A's layer and part B's trainer)")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--dim", type=int, default=896)
    ap.add_argument("--tile", type=int, default=4096, help="vocabulary tile (4096: fastest measured here)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="training steps for part B")
    ap.add_argument("--layers", type=int, default=2, help="part B: Qwen2 layers (24: Qwen2-0.5B's shape)")
    ap.add_argument("--rows", type=int, default=8, help="part B: completions a step (and max_rows)")
    ap.add_argument("--length", type=int, default=32, help="part B: tokens a completion")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=sorted(CLOCK), default="wall")
    ap.add_argument("--methods", default=None, help="comma-separated words: run the part-A methods naming one")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--no-trainer", action="store_true", help="skip part B")
    ap.add_argument("--no-layer", action="store_true", help="skip part A")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    global clock, DEVICE
    clock, DEVICE = CLOCK[a.clock], a.device
    if a.smoke:
        a.positions, a.vocab, a.dim, a.tile, a.repeat, a.steps, a.no_memory = 8, 1000, 16, 256, 1, 1, True
        a.layers, a.rows, a.length = 1, 4, 4
    if not a.no_layer:
        part_a(a.positions, a.vocab, a.dim, a.tile, a.repeat, not a.no_memory,
               a.methods.split(",") if a.methods else None)
    if not a.no_trainer:
        sizes = dict(layers=a.layers, hidden=a.dim, vocab=a.vocab, heads=14 if a.dim == 896 else 2,
                     kv_heads=2 if a.dim == 896 else 1, intermediate=4864 if a.dim == 896 else 4 * a.dim)
        part_b(a.steps, a.repeat, sizes, a.rows, a.length)


if __name__ == "__main__":
    main()
