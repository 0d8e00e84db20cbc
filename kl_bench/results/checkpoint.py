"""Checkpoints of an interrupted run (``--checkpoint-every``, ``--resume``): what one holds (the per-batch
sums of every case so far, and the identity of the run: spec, seed, device, draws, batches), written
atomically into the results folder, and read back with every field checked (a checkpoint is data on disk:
anything impossible is one line)."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from ..errors import SpecError
from ..safe_io import read_regular
from ..storage import atomic_write_bytes

CHECKPOINT = ".checkpoint.pt"


def checkpoint_identity(spec, device: torch.device, case_draws: list[int]) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the spec text, seed, device, draws and batches."""
    return {"spec_sha256": spec.sha256, "seed": spec.experiment.seed, "device": str(device),
            "draws": list(case_draws), "batches": spec.experiment.batches}


def save_checkpoint(out_dir: Path, identity: dict[str, Any], sums: dict[str, torch.Tensor]) -> None:
    buf = io.BytesIO()
    torch.save({"identity": identity, "sums": {k: v.clone() for k, v in sums.items()}}, buf)
    atomic_write_bytes(Path(out_dir) / CHECKPOINT, buf.getvalue())


def load_checkpoint(out_dir: Path, identity: dict[str, Any],
                    batches: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """The batch sums of an interrupted run. ``batches``: {case: number of batches of this run}; a
    checkpoint holding other cases, more batches, or anything but 2-D float64 sums is refused."""
    path = Path(out_dir) / CHECKPOINT
    if not path.exists():
        raise SpecError("nothing to resume: no checkpoint in the results folder", file=str(out_dir))
    raw = read_regular(path, "checkpoint")
    try:
        data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:
        raise SpecError(f"checkpoint is unreadable ({e.__class__.__name__}); delete {path}", file=str(out_dir)) from None
    if not isinstance(data, dict) or not isinstance(data.get("sums"), dict):
        raise SpecError(f"checkpoint is not a kl-bench checkpoint; delete {path}", file=str(out_dir))
    for case, sums in data["sums"].items():
        problem = _checkpoint_sums_problem(case, sums, batches)
        if problem:
            raise SpecError(f"checkpoint {problem}; delete {path}", file=str(out_dir))
    if data.get("identity") != identity:
        diff = [k for k in identity if data.get("identity", {}).get(k) != identity[k]]
        raise SpecError(f"checkpoint was made with a different {', '.join(diff)}; rerun without --resume",
                        file=str(out_dir))
    return data["sums"]


def _checkpoint_sums_problem(case: str, sums: Any, batches: dict[str, int] | None) -> str | None:
    """What is wrong with one case's sums in a checkpoint (a 2-D float64 table without NaN, no more
    batches than the run has), in words, or None."""
    if not isinstance(sums, torch.Tensor) or sums.ndim != 2 or sums.dtype != torch.float64 or sums.is_meta:
        return f"sums of case '{case}' are not a 2-D float64 table"
    if bool(torch.isnan(sums).any()):
        return f"sums of case '{case}' hold NaN (corrupted?)"
    if batches is not None and (case not in batches or sums.shape[0] > batches[case]):
        want = f"the run has {batches[case]}" if case in batches else "the spec has no such case"
        return f"holds {sums.shape[0]} batches of case '{case}' but {want}"
    return None


def remove_checkpoint(out_dir: Path) -> None:
    (Path(out_dir) / CHECKPOINT).unlink(missing_ok=True)
