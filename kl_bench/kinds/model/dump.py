"""``kl-bench dump-logits``: run the two models once (on a GPU box) and write files any machine can
benchmark: the prompts' next-token log-probs [B, V] of both models (``next_token.pt``: a categorical
case) and, with ``length`` > 1, sampled continuations' per-token log-probs with a mask and the per-step
analytic KL (``continuations.pt``: a ``logprobs`` case)."""
from __future__ import annotations

import io
from pathlib import Path

import torch

from ...foundation import signals
from ...foundation.typed_toml import MAX_DRAWS, check_device, check_seed
from ...foundation.errors import SpecError
from ...sampling.seeding import batch_generator
from ...foundation.storage import FolderLock, check_output_dir, clean_stale, fs_error, write_folder
from . import lm
from .pair import ModelPair, check_vocabularies


def dump_logits(policy: Path, reference: Path, prompts: Path, out: Path, *, length: int = 1, samples: int = 0,
                seed: int = 0, dtype: str = "float32", batch_size: int = 64, eos: int | None = None,
                device: str = "auto", progress=None) -> dict[str, Path]:
    """Write ``out/next_token.pt`` ({"policy", "reference"}: float32 log-probs [B, V], one row a prompt)
    and, when ``length`` > 1, ``out/continuations.pt`` ({"logp_policy", "logp_ref", "mask", "kl_full"}
    [N, T] float32/float64, "tokens" [N, T], "prompt" [N]) for ``samples`` continuations (default: one
    per prompt) drawn from the policy, batch i seeded by (seed, "dump", i). Returns the written paths.
    ``progress``: an object with ``label(text)`` and ``advance(n)`` (kl_bench.foundation.progress.LazyProgress),
    told of every batch of prompts and continuations."""
    dev = _check_options(out, length=length, samples=samples, dtype=dtype, batch_size=batch_size, eos=eos,
                         device=device, seed=seed)
    q = lm.load_model(policy, dtype, "--policy")
    p = lm.load_model(reference, dtype, "--reference")
    check_vocabularies(q, p, key="--reference")
    signals.phase("pairs")
    try:
        ids = lm.read_prompts(prompts, policy)
        lm.check_prompts(ids, prompts, [q, p], length if length > 1 else 0, eos, key="--prompts")
    except SpecError as e:
        raise SpecError(e.message, key=e.key if e.key == "--eos" else "--prompts") from None
    if progress is not None:
        progress.set_total(len(ids) + ((samples or len(ids)) if length > 1 else 0))
        progress.label("next-token log-probs")
    lq = lm.next_token_logprobs(q.to(dev), ids, batch_size, dev)
    lp = lm.next_token_logprobs(p.to(dev), ids, batch_size, dev)
    if progress is not None:
        progress.advance(len(ids))
    files = {"next_token.pt": _tensor_bytes({"policy": lq.float(), "reference": lp.float()})}
    if length > 1:
        pair = ModelPair("dump", q, p, ids, length, eos, batch_size)
        files["continuations.pt"] = _tensor_bytes(_continuations(pair, samples or len(ids), seed, dev, progress))
    signals.phase("write")
    _save(out, files)
    signals.phase("written")
    return {name[:-3]: out / name for name in files}


def _continuations(pair: ModelPair, n: int, seed: int, dev: torch.device, progress) -> dict[str, torch.Tensor]:
    """``n`` continuations from the policy, ``pair.batch_size`` at a time (batch i seeded by (seed, "dump", i)),
    as the columns of continuations.pt."""
    length, batch_size = pair.length, pair.batch_size
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in ("tokens", "logp_policy", "logp_ref", "kl_full", "mask",
                                                          "prompt")}
    if progress is not None:
        progress.label(f"continuations of {length} tokens")
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
                col = torch.cat([col, torch.zeros(m, pad, dtype=col.dtype)], 1)  # host: dumped columns are host tensors
            cols[k].append(col)
        if progress is not None:
            progress.advance(m)
    data = {k: torch.cat(v) for k, v in cols.items()}
    data["mask"] = data["mask"].to(torch.uint8)
    return data


def _check_options(out: Path, *, length: int, samples: int, dtype: str, batch_size: int, eos: int | None,
                   device: str, seed: int) -> torch.device:
    """Every option of dump-logits checked before a model is loaded (one line naming the option); returns
    the device. The output folder must be a folder that can be written (not a file, /dev/null, /proc)."""
    checks = [("--dtype", dtype in lm.DTYPES, f"must be one of {', '.join(lm.DTYPES)}, got '{dtype}'"),
              ("--length", length >= 1, f"must be ≥ 1, got {length}"),
              ("--samples", 0 <= samples <= MAX_DRAWS, f"must lie in [0, 2^53] (0: one per prompt), got {samples}"),
              ("--batch-size", 1 <= batch_size <= lm.MAX_BATCH_SIZE, f"must lie in [1, 2^20], got {batch_size}"),
              ("--eos", eos is None or eos >= 0, f"must be a token id ≥ 0, got {eos}"),
              ("--device", check_device(device) is None, check_device(device) or ""),
              ("--seed", check_seed(seed) is None, check_seed(seed) or "")]
    for key, ok, msg in checks:
        if not ok:
            raise SpecError(msg, key=key)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecError(f"'{device}' was asked for but this machine has no CUDA device", key="--device")
    check_output_dir(out)
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)


def _tensor_bytes(data: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(data, buf)
    return buf.getvalue()


def _save(out: Path, files: dict[str, bytes]) -> None:
    """Every file at once, as a results folder is written (kl_bench.foundation.storage): under the folder's lock, staged
    and swapped in, so that a full disk or a signal leaves the old folder (or none) and never half the files;
    never through a symlink, never onto a device."""
    try:
        with FolderLock(out):
            clean_stale(out)
            write_folder(out, files)
    except OSError as e:
        raise fs_error(e, out) from None
