"""Logits and other numeric tensors read from files (.npy, .pt, .safetensors) or given in memory: what a
tensor or array must be to serve as logits, files opened safely (regular files only, size caps), one
tensor picked by key, as float64; a trainer's [B, T, V] logits flattened to the positions its mask keeps."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch

from ..foundation.errors import SpecError
from ..foundation.registry import did_you_mean
from ..foundation.safe_io import cap_for, load_npy, open_regular, read_capped


def is_array(value) -> bool:
    """A tensor or ndarray given where a spec table would be (Python API)."""
    return isinstance(value, (torch.Tensor, np.ndarray))


def unsupported_array(value) -> str | None:
    """Why a tensor or ndarray cannot be logits (sparse, complex, not real numbers), or None.
    Casting would silently drop the imaginary part or densify a sparse layout."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":     # a shape without values: nothing to copy, hash or sample
            return "logits must hold values: a tensor on the 'meta' device has a shape but no data"
        if value.layout != torch.strided:
            return f"logits must be a dense tensor, got a sparse one ({value.layout}); use .to_dense()"
        if value.is_complex():
            return f"logits must be real, got complex dtype {value.dtype}"
        if value.dtype == torch.bool:
            return "logits must be real numbers, got dtype torch.bool"
        return None
    if isinstance(value, np.ndarray):
        if np.iscomplexobj(value):
            return f"logits must be real, got complex dtype {value.dtype}"
        if not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)):
            return f"logits must be real numbers, got dtype {value.dtype}"
    return None


def read_logits_file(path: Path, key: str | None = None, mask: Path | None = None,
                     mask_key: str | None = None, what: str = "logits") -> torch.Tensor:
    """Load unnormalised logits of shape [V], [B, V] or [B, T, V] as float64 [N, V].

    [B, T, V] (a trainer's logits over sequences): every position whose ``mask`` entry is nonzero is a
    context (N = the mask's count); without a mask every position is. [B, V] may take a [B] mask.
    Formats: .npy, .pt (a tensor of any float dtype, bf16 dumps included, or a dict: ``key`` names the
    tensor, optional when the dict holds one; loaded with ``weights_only=True``, so no pickled code runs)
    and .safetensors (``key`` as for a dict). ``what``: what the file holds, for messages ("bucket map").
    """
    t = read_tensor_file(path, key, what=what)
    if t.ndim == 3 and 0 not in t.shape:
        return _masked_positions(t, mask, mask_key)
    if mask is not None:
        m = read_tensor_file(mask, mask_key, what="mask")
        rows = t.shape[0] if t.ndim == 2 else 1
        if m.ndim != 1 or m.shape[0] != rows:
            raise SpecError(f"{mask}: mask has shape {list(m.shape)} but the logits are {list(t.shape)} "
                            f"(needs [{rows}], or [B, T] with [B, T, V] logits)")
        t = t.reshape(rows, -1)[m != 0]
        if t.shape[0] == 0:
            raise SpecError(f"{mask}: the mask selects no row")
    if t.ndim == 1:
        t = t.unsqueeze(0)
    if t.ndim != 2 or t.shape[1] == 0 or t.shape[0] == 0:
        raise SpecError(f"{path}: {what} must have shape [V], [B, V] or [B, T, V], got {list(t.shape)}")
    return t


def _masked_positions(t: torch.Tensor, mask: Path | None, mask_key: str | None) -> torch.Tensor:
    """[B, T, V] logits → [N, V]: the positions whose [B, T] mask entry is nonzero (every one without a mask)."""
    m = None if mask is None else read_tensor_file(mask, mask_key, what="mask")
    if m is not None and tuple(m.shape) != tuple(t.shape[:2]):
        raise SpecError(f"{mask}: mask has shape {list(m.shape)} but the logits are {list(t.shape)} "
                        f"(needs [B, T] = {list(t.shape[:2])})")
    t = t.reshape(-1, t.shape[-1]) if m is None else t[m != 0]
    if t.shape[0] == 0:
        raise SpecError(f"{mask}: the mask selects no position")
    return t


def read_tensor_file(path: Path, key: str | None = None, what: str = "logits") -> torch.Tensor:
    """One numeric tensor from .npy, .pt or .safetensors, as float64 (any shape; see read_logits_file).
    Only a regular file is opened, within half of this machine's memory (kl_bench.foundation.safe_io); a .npy header
    is checked against the file's size before numpy allocates the array."""
    if not path.exists() and not path.is_symlink():
        raise SpecError(f"{what} file not found: {path}")
    suffix = path.suffix.lower()
    if suffix not in (".npy", ".pt", ".safetensors"):
        raise SpecError(f"{path}: {what} files must end in .npy, .pt or .safetensors, got '{suffix}'")
    try:
        fh = open_regular(path, "tensor", what)
    except SpecError as e:
        raise SpecError(f"{e.file}: {e.message}") from None
    with fh:
        return _read_tensor(fh, path, suffix, key, what)


def _read_tensor(fh, path: Path, suffix: str, key: str | None, what: str) -> torch.Tensor:
    size = os.fstat(fh.fileno()).st_size
    try:
        t = _READERS[suffix](fh, size, path, key, what)
        if key is not None and suffix == ".npy":        # after reading: a file that cannot be read says so first
            raise SpecError(f"{path}: a .npy file holds one array; 'key' is for .pt dicts and .safetensors")
        return t
    except SpecError as e:
        raise SpecError(f"{e.file}: {e.message}" if e.file else e.message) from None
    except Exception as e:  # corrupt or truncated files: numpy/torch raise many types
        raise SpecError(f"cannot read {what} file {path}: {e.__class__.__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'unreadable'}") from None


def _supported(obj, path: Path):
    msg = unsupported_array(obj)
    if msg:
        raise SpecError(f"{path}: {msg}")
    return obj


def _read_npy(fh, size: int, path: Path, what: str) -> torch.Tensor:
    arr = load_npy(fh, size, str(path))
    if what == "mask" and arr.dtype == np.bool_:
        arr = arr.astype(np.uint8)
    if not np.issubdtype(arr.dtype, np.number):
        raise SpecError(f"{path}: {what} must be numeric, got dtype {arr.dtype}")
    return torch.from_numpy(np.asarray(_supported(arr, path), dtype=np.float64))


def _read_pt(fh, size: int, path: Path, key: str | None, what: str) -> torch.Tensor:
    # torch.load warns about pickle protocols, sparse layouts and the like on files that are not
    # plain tensor files: those become the one-line error below, never a warning first.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            obj = torch.load(fh, map_location="cpu", weights_only=True)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else "unreadable"
            if "weights only load failed" in first.lower() or e.__class__.__name__ == "UnpicklingError":
                first = "it holds pickled objects other than tensors (loaded with weights_only=True)"
            raise SpecError(f"cannot read {what} file {path}: not a plain tensor file: "
                            f"{e.__class__.__name__}: {first}") from None
    obj = pick_key(obj, key, path)
    if what == "mask" and isinstance(obj, torch.Tensor) and obj.dtype == torch.bool:
        obj = obj.to(torch.uint8)
    if not isinstance(obj, torch.Tensor):
        raise SpecError(f"{path}: expected a tensor (or a dict with one tensor), got {type(obj).__name__}")
    if obj.is_meta:
        raise SpecError(f"{path}: holds a meta tensor (a shape without data): save the values")
    return _supported(obj, path).detach().to(torch.float64)


def _read_safetensors(fh, size: int, path: Path, key: str | None, what: str) -> torch.Tensor:
    try:
        from safetensors.torch import load as load_safetensors
    except ImportError:
        raise SpecError(f"{path}: reading .safetensors needs the safetensors package: "
                        "pip install 'kl-bench[hf]'") from None
    # The header states each tensor's byte range: safetensors checks them against the bytes given.
    obj = pick_key(load_safetensors(read_capped(fh, cap_for("tensor"), path, what)), key, path)
    if what == "mask" and obj.dtype == torch.bool:
        obj = obj.to(torch.uint8)
    return _supported(obj, path).to(torch.float64)


_READERS = {".npy": lambda fh, size, path, key, what: _read_npy(fh, size, path, what),
            ".pt": _read_pt, ".safetensors": _read_safetensors}


def pick_key(obj, key: str | None, path: Path):
    """The tensor named ``key`` in a dict loaded from ``path`` (or its only entry); a tensor as is."""
    if isinstance(obj, dict):
        names = ", ".join(map(str, list(obj)[:8])) + (", ..." if len(obj) > 8 else "")
        if key is not None:
            if key not in obj:
                raise SpecError(f"{path}: no tensor named '{key}'{did_you_mean(key, [str(k) for k in obj])}; "
                                f"it holds: {names}")
            return obj[key]
        if len(obj) == 1:
            return next(iter(obj.values()))
        raise SpecError(f"{path}: expected a tensor (or a dict with one tensor), got a dict of {len(obj)} entries "
                        f"({names}): name one with key = \"...\"")
    if key is not None:
        raise SpecError(f"{path}: holds a single tensor, not a dict: drop 'key'")
    return obj
