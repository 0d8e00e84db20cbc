"""Checkpoints of an interrupted run (``--checkpoint-every``, ``--resume``): what one holds (the per-batch
sums of every case so far, and the identity of the run: spec, seed, device, draws, batches), written
atomically into the results folder, and read back with every field checked (a checkpoint is data on disk:
anything impossible is one line)."""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..foundation.errors import SpecError
from ..foundation.safe_io import cap_for, load_npz, read_regular
from ..foundation.atomic import atomic_write_bytes

# A .npz archive (numpy arrays only: no pickles, no torch): "identity" (run.json-style JSON, as uint8) and
# "sums/<case>" (the case's [batches, features] float64 sums). Checkpoints before the package tree were
# torch.save files at .checkpoint.pt: read no more (a resume says so in one line).
CHECKPOINT = ".checkpoint.npz"
OLD_CHECKPOINT = ".checkpoint.pt"


def checkpoint_identity(spec, device, case_draws: list[int]) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the spec text, seed, device, draws and batches."""
    return {"spec_sha256": spec.sha256, "seed": spec.experiment.seed, "device": str(device),
            "draws": list(case_draws), "batches": spec.experiment.batches}


def save_checkpoint(out_dir: Path, identity: dict[str, Any], sums: dict[str, np.ndarray]) -> None:
    """``sums``: case → [batches, features] float64 array (the engine's sums, on the host)."""
    arrays = {"identity": np.frombuffer(json.dumps(identity, sort_keys=True).encode(), dtype=np.uint8)}
    arrays.update({f"sums/{case}": np.ascontiguousarray(s, dtype=np.float64) for case, s in sums.items()})
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(Path(out_dir) / CHECKPOINT, buf.getvalue())


def load_checkpoint(out_dir: Path, identity: dict[str, Any],
                    batches: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """The batch sums of an interrupted run. ``batches``: {case: number of batches of this run}; a
    checkpoint holding other cases, more batches, or anything but 2-D float64 sums is refused."""
    path = Path(out_dir) / CHECKPOINT
    data = _read(out_dir, path)
    stored = _identity(data)
    if not isinstance(stored, dict) or any(not k.startswith("sums/") for k in data):
        raise SpecError(f"checkpoint is not a kl-bench checkpoint; delete {path}", file=str(out_dir))
    sums = {k[len("sums/"):]: v for k, v in data.items()}
    for case, s in sums.items():
        problem = _checkpoint_sums_problem(case, s, batches)
        if problem:
            raise SpecError(f"checkpoint {problem}; delete {path}", file=str(out_dir))
    _check_settings(stored, identity, out_dir)
    return sums


def _read(out_dir: Path, path: Path) -> dict[str, np.ndarray]:
    """The checkpoint's arrays; one line where there is none (or one of an older format) or it is unreadable."""
    if not path.exists():
        if (Path(out_dir) / OLD_CHECKPOINT).exists():
            raise SpecError(f"the checkpoint was written by an older kl-bench ({OLD_CHECKPOINT}); rerun without "
                            "--resume", file=str(out_dir))
        raise SpecError("nothing to resume: no checkpoint in the results folder", file=str(out_dir))
    raw = read_regular(path, "checkpoint")
    try:
        return load_npz(raw, str(path), cap_for("checkpoint"))
    except SpecError as e:
        detail = e.message.removeprefix("unreadable (truncated or corrupted?): ")
        raise SpecError(f"checkpoint is unreadable (truncated or corrupted? {detail}); delete {path}",
                        file=str(out_dir)) from None


def _check_settings(stored: dict, identity: dict[str, Any], out_dir: Path) -> None:
    """The checkpoint's identity is this run's (as JSON stores it); else one line naming what differs."""
    if stored != json.loads(json.dumps(identity)):
        diff = [k for k in identity if stored.get(k) != json.loads(json.dumps(identity[k]))]
        raise SpecError(f"checkpoint was made with other settings ({', '.join(diff)} "
                        f"{'differs' if len(diff) == 1 else 'differ'}); rerun without --resume",
                        file=str(out_dir))


def _identity(data: dict) -> Any:
    """The checkpoint's identity (taken out of ``data``): JSON in a uint8 array; None if it is not that."""
    try:
        return json.loads(bytes(data.pop("identity")).decode()) if "identity" in data else None
    except (ValueError, TypeError):
        return None


def _checkpoint_sums_problem(case: str, sums: Any, batches: dict[str, int] | None) -> str | None:
    """What is wrong with one case's sums in a checkpoint (a 2-D float64 table without NaN, no more
    batches than the run has), in words, or None."""
    if not isinstance(sums, np.ndarray) or sums.ndim != 2 or sums.dtype != np.float64:
        return f"sums of case '{case}' are not a 2-D float64 table"
    if bool(np.isnan(sums).any()):
        return f"sums of case '{case}' hold NaN (corrupted?)"
    if batches is not None and (case not in batches or sums.shape[0] > batches[case]):
        want = f"the run has {batches[case]}" if case in batches else "the spec has no such case"
        return f"holds {sums.shape[0]} batches of case '{case}' but {want}"
    return None


def remove_checkpoint(out_dir: Path) -> None:
    (Path(out_dir) / CHECKPOINT).unlink(missing_ok=True)
    (Path(out_dir) / OLD_CHECKPOINT).unlink(missing_ok=True)
