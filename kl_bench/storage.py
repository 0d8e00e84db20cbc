"""Results that are never lost: atomic files, an atomic swap of the whole results folder, a lock
against two runs writing one folder, and checkpoints for --resume.

A run stages every file in a sibling folder ``.NAME.staging-PID`` and then exchanges it with ``NAME``
in one ``renameat2(RENAME_EXCHANGE)`` call (Linux ≥ 3.15): readers see the old folder or the new one,
never a mix, whatever signal arrives (SIGKILL included). Where the exchange is unavailable, files are
replaced one by one (each atomically), ``run.json`` last.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from .errors import SpecError

_UMASK = os.umask(0)
os.umask(_UMASK)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# Test hook: seconds to sleep between staged writes, so that signal tests can land mid-write.
_WRITE_DELAY_ENV = "KL_BENCH_WRITE_DELAY"


def _write_file(fh, data: bytes) -> None:
    """The one place result bytes reach the disk (tests inject ENOSPC and EROFS here)."""
    fh.write(data)
    fh.flush()
    os.fsync(fh.fileno())


def fs_error(err: OSError, target: Path, what: str = "cannot write results", key: str | None = None) -> SpecError:
    """An OSError while writing results as a one-line input error naming the path."""
    reason = err.strerror or err.__class__.__name__
    return SpecError(f"{what}: {reason}", file=str(target), key=key)


def check_output_file(path: Path) -> Path:
    """Refuse, before any work, an output file that cannot be written: a folder, a path under a file, a
    folder that cannot be created or written."""
    path = Path(path)
    if str(path) in ("", ".", "..") or path.name in ("", ".", ".."):
        raise SpecError("must name a file", file=str(path), key="--out")
    if path.is_dir():
        raise SpecError("is a folder; give a file name", file=str(path), key="--out")
    _check_parent_writable(path)
    return path


def output_dir(path: Path) -> Path:
    """The folder results go to: a symlink to a folder is followed (the link itself stays)."""
    path = Path(path)
    return path.resolve() if path.is_symlink() and path.resolve().is_dir() else path


def check_output_dir(path: Path) -> Path:
    """Refuse, before any sampling, a results folder that cannot be written: '', '.', '..', an existing
    file (or /dev/null), a path under a file, a location that cannot be created or written (/proc, a
    read-only mount). A symlink to a folder is followed: the results go where it points."""
    path = Path(path)
    if str(path) in ("", ".", "..") or path.name in ("", ".", ".."):
        raise SpecError("must name a results folder (not '', '.' or '..')", file=str(path), key="--out")
    path = output_dir(path)
    if path.exists() and not path.is_dir():
        raise SpecError("exists and is not a folder", file=str(path), key="--out")
    _check_parent_writable(path)
    return path


def _check_parent_writable(path: Path) -> None:
    parent = path.parent
    probe = parent
    while not probe.exists():                 # the nearest existing ancestor must be a writable folder
        probe = probe.parent
    if not probe.is_dir():
        raise SpecError(f"cannot be created: {probe} is a file", file=str(path), key="--out")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".kl-bench-probe-", dir=parent)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise fs_error(e, path, "cannot write there", key="--out") from None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a mix:
    write a temporary file in the same folder, fsync it, then rename it over the target."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            _write_file(fh, data)
        os.chmod(tmp, 0o666 & ~_UMASK)      # mkstemp makes 0600 files; results are for sharing
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (renameat2 RENAME_EXCHANGE); False where unsupported."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def staging_dir(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.staging-{os.getpid()}"


def clean_stale(out_dir: Path) -> None:
    """Remove staging folders and temporary files left by killed runs (call under the lock)."""
    if out_dir.parent.exists():
        for p in out_dir.parent.glob(f".{out_dir.name}.staging-*"):
            shutil.rmtree(p, ignore_errors=True)
    if out_dir.exists():
        for p in out_dir.glob(".tmp-*"):
            p.unlink(missing_ok=True)


def write_results(out_dir: Path, files: dict[str, bytes], envelope: dict[str, Any]) -> None:
    """Write a results folder atomically. run.json records the sha256 of each data file.

    Entries of an existing folder that this run does not produce (a report, notes) are carried over.
    """
    out_dir = Path(out_dir)
    delay = float(os.environ.get(_WRITE_DELAY_ENV, "0") or 0)
    envelope = dict(envelope)
    envelope["files"] = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    files = {**files, "run.json": (json.dumps(envelope, indent=2, default=str) + "\n").encode()}
    stage = staging_dir(out_dir)
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        for name, data in files.items():
            with open(stage / name, "wb") as fh:
                _write_file(fh, data)
            os.chmod(stage / name, 0o666 & ~_UMASK)
            if delay:
                time.sleep(delay)
        if not out_dir.exists():
            os.rename(stage, out_dir)
            return
        for entry in out_dir.iterdir():
            if entry.name not in files and not entry.name.startswith((".tmp-", ".checkpoint")):
                dest = stage / entry.name
                if entry.is_dir():
                    shutil.copytree(entry, dest, copy_function=os.link)
                else:
                    os.link(entry, dest)
        if _exchange(stage, out_dir):
            shutil.rmtree(stage, ignore_errors=True)       # now holds the previous results
            return
        for name in list(files)[:-1] + ["run.json"]:        # fallback: file by file, run.json last
            atomic_write_bytes(out_dir / name, (stage / name).read_bytes())
        shutil.rmtree(stage, ignore_errors=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


class FolderLock:
    """An exclusive, non-blocking lock on a results folder (a lock file beside it, held with flock).

    The kernel releases it when the process dies, however it dies, so a killed run never leaves a
    stale lock behind."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir.parent / f".{self.out_dir.name}.lock"
        self.fh = None

    def __enter__(self) -> "FolderLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise fs_error(e, self.out_dir) from None
        for _ in range(100):
            try:
                self.fh = open(self.path, "a+")
            except OSError as e:
                raise fs_error(e, self.out_dir) from None
            try:
                fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.fh.seek(0)
                holder = self.fh.read().strip() or "?"
                self.fh.close()
                self.fh = None
                raise SpecError(f"results folder is being written by another kl-bench run (pid {holder}); "
                                f"wait for it to finish or choose another --out", file=str(self.out_dir)) from None
            # The holder before us may have unlinked the file we opened: lock the file at the path.
            try:
                same = os.fstat(self.fh.fileno()).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            self.fh.close()
            self.fh = None
        self.fh.seek(0)
        self.fh.truncate()
        self.fh.write(str(os.getpid()))
        self.fh.flush()
        return self

    def __exit__(self, *exc) -> None:
        if self.fh is not None:
            # Remove the lock file while still holding the lock, whatever the outcome: nothing is left
            # beside the results. A run that opened the old file meanwhile sees it unlinked and retries.
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_UN)
            self.fh.close()
            self.fh = None


# ----------------------------------------------------------------------------- checkpoints
CHECKPOINT = ".checkpoint.pt"


def checkpoint_identity(spec, device: torch.device, case_draws: list[int]) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the spec text, seed, device, draws and batches."""
    return {"spec_sha256": spec.sha256, "seed": spec.experiment.seed, "device": str(device),
            "draws": list(case_draws), "batches": spec.experiment.batches}


def save_checkpoint(out_dir: Path, identity: dict[str, Any], sums: dict[str, torch.Tensor]) -> None:
    import io
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
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise SpecError(f"checkpoint is unreadable ({e.__class__.__name__}); delete {path}", file=str(out_dir)) from None
    if not isinstance(data, dict) or not isinstance(data.get("sums"), dict):
        raise SpecError(f"checkpoint is not a kl-bench checkpoint; delete {path}", file=str(out_dir))
    for case, sums in data["sums"].items():
        if not isinstance(sums, torch.Tensor) or sums.ndim != 2 or sums.dtype != torch.float64:
            raise SpecError(f"checkpoint sums of case '{case}' are not a 2-D float64 table; delete {path}",
                            file=str(out_dir))
        if batches is not None and (case not in batches or sums.shape[0] > batches[case]):
            want = f"the run has {batches[case]}" if case in batches else "the spec has no such case"
            raise SpecError(f"checkpoint holds {sums.shape[0]} batches of case '{case}' but {want}; delete {path}",
                            file=str(out_dir))
    if data.get("identity") != identity:
        diff = [k for k in identity if data.get("identity", {}).get(k) != identity[k]]
        raise SpecError(f"checkpoint was made with a different {', '.join(diff)}; rerun without --resume",
                        file=str(out_dir))
    return data["sums"]


def remove_checkpoint(out_dir: Path) -> None:
    (Path(out_dir) / CHECKPOINT).unlink(missing_ok=True)
