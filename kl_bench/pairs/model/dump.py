"""``kl-bench dump-logits``: run the two models once (on a GPU box) and write files any machine can
benchmark: the prompts' next-token log-probs [B, V] of both models (``next_token.pt``: a categorical
case) and, with ``length`` > 1, sampled continuations' per-token log-probs with a mask and the per-step
analytic KL (``continuations.pt``: a ``logprobs`` case)."""
from __future__ import annotations

from pathlib import Path

import torch

from ...errors import SpecError
from ...seeding import batch_generator
from . import lm
from .pair import ModelPair


def dump_logits(policy: Path, reference: Path, prompts: Path, out: Path, *, length: int = 1, samples: int = 0,
                seed: int = 0, dtype: str = "float32", batch_size: int = 64, eos: int | None = None,
                device: str = "auto") -> dict[str, Path]:
    """Write ``out/next_token.pt`` ({"policy", "reference"}: float32 log-probs [B, V], one row a prompt)
    and, when ``length`` > 1, ``out/continuations.pt`` ({"logp_policy", "logp_ref", "mask", "kl_full"}
    [N, T] float32/float64, "tokens" [N, T], "prompt" [N]) for ``samples`` continuations (default: one
    per prompt) drawn from the policy, batch i seeded by (seed, "dump", i). Returns the written paths."""
    if dtype not in lm.DTYPES:
        raise SpecError(f"--dtype must be one of {', '.join(lm.DTYPES)}, got '{dtype}'")
    if length < 1:
        raise SpecError(f"--length must be ≥ 1, got {length}")
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    q = lm.load_model(policy, dtype, "--policy")
    p = lm.load_model(reference, dtype, "--reference")
    try:
        ids = lm.read_prompts(prompts, policy)
    except SpecError as e:
        raise SpecError(e.message, key="--prompts") from None
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    lq = lm.next_token_logprobs(q.to(dev), ids, batch_size, dev)
    lp = lm.next_token_logprobs(p.to(dev), ids, batch_size, dev)
    written["next_token"] = out / "next_token.pt"
    torch.save({"policy": lq.float(), "reference": lp.float()}, written["next_token"])
    if length > 1:
        pair = ModelPair("dump", q, p, ids, length, eos, batch_size)
        n = samples or len(ids)
        cols: dict[str, list[torch.Tensor]] = {k: [] for k in ("tokens", "logp_policy", "logp_ref", "kl_full", "mask",
                                                              "prompt")}
        for i, start in enumerate(range(0, n, batch_size)):
            rec: list = []
            m = min(batch_size, n - start)
            pair.generate(m, batch_generator(seed, "dump", i, dev), dev, record=rec)
            cols["prompt"].append(rec[0])
            steps = rec[1:]
            pad = length - len(steps)             # every sequence ended early: the rest is masked
            for k, j in (("tokens", 0), ("logp_policy", 1), ("logp_ref", 2), ("kl_full", 3), ("mask", 4)):
                col = torch.stack([s[j] for s in steps], 1).cpu()
                if pad:
                    col = torch.cat([col, torch.zeros(m, pad, dtype=col.dtype)], 1)
                cols[k].append(col)
        data = {k: torch.cat(v) for k, v in cols.items()}
        data["mask"] = data["mask"].to(torch.uint8)
        written["continuations"] = out / "continuations.pt"
        torch.save(data, written["continuations"])
    return written
