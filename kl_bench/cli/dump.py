"""``kl-bench dump-logits``: both models' log-probs written once, to benchmark on any machine."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import Command, app, err_console, int_flag, out_console, user_errors
from .common import device_option, quiet_option, seed_option


@app.command("dump-logits", cls=Command)
def dump_logits(policy: Path = typer.Option(..., "--policy", help="policy model folder (save_pretrained)"),
                reference: Path = typer.Option(..., "--reference", help="reference model folder"),
                prompts: Path = typer.Option(..., "--prompts", help="prompts: .txt (one a line) or .jsonl (input_ids)"),
                out: Path = typer.Option(..., "--out", help="output folder"),
                length: int = typer.Option(1, "--length", parser=int_flag, help="T > 1: also sample continuations of T tokens"),
                samples: int = typer.Option(0, "--samples", parser=int_flag, help="continuations to sample; 0: one per prompt",
                                             show_default=False),
                seed: int = seed_option(0, "seed of the sampled continuations"),
                eos: Optional[int] = typer.Option(None, "--eos", parser=int_flag, help="a continuation ends at this token id"),
                dtype: str = typer.Option("float32", "--dtype", help="dtype the models are loaded and run in: "
                                          "float32, float64, bfloat16 or float16"),
                batch_size: int = typer.Option(64, "--batch-size", parser=int_flag, help="prompts or continuations per forward pass"),
                device: str = device_option("auto", "auto|cpu|cuda|cuda:N"),
                quiet: bool = quiet_option("no progress")) -> None:
    """Write both models' next-token log-probs [B, V] (next_token.pt) and, with --length > 1, sampled
    continuations' per-token log-probs with a mask (continuations.pt), to benchmark on any machine."""
    from ..kinds.model.dump import dump_logits as dump
    from ..foundation.progress import LazyProgress
    # prompts (next token), then the continuations; the count of prompts is known once they are read
    bar = LazyProgress(0, enabled=not quiet, console=err_console, unit="rows")
    try:
        with user_errors():
            written = dump(policy, reference, prompts, out, length=length, samples=samples, seed=seed,
                           dtype=dtype, batch_size=batch_size, eos=eos, device=device, progress=bar)
    finally:
        bar.close()
    from ..present.terminal import prose
    for what, path in written.items():
        prose(out_console, f"{what}: {path}")
    nt = written["next_token"]
    prose(out_console, f'use: [[case]] kind = "categorical", q = {{file = "{nt}", key = "policy"}}, '
          f'p = {{file = "{nt}", key = "reference"}}')
    if "continuations" in written:
        prose(out_console, f'use: [[case]] kind = "logprobs", file = "{written["continuations"]}"')
