"""Atomic files: a file written whole or not at all (a temporary file beside it, fsynced, then renamed
over the target), the one place result bytes reach the disk, fresh temporary names, and the folders made
for a file removed again when it fails."""
from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from .attributes import FILE_BITS, keep_attributes, stat_of
from .errors import SpecError
from .safe_io import check_write_target

_UMASK = os.umask(0)
os.umask(_UMASK)


def _write_file(fh, data: bytes) -> None:
    """The one place result bytes reach the disk (tests inject ENOSPC and EROFS here)."""
    fh.write(data)
    fh.flush()
    os.fsync(fh.fileno())


def fs_error(err: OSError, target: Path, what: str = "cannot write results", key: str | None = None) -> SpecError:
    """An OSError while writing results as a one-line input error naming the path."""
    reason = err.strerror or err.__class__.__name__
    return SpecError(f"{what}: {reason}", file=str(target), key=key)


# A new file that is ours: made here (O_EXCL), never through a link (O_NOFOLLOW), closed on exec.
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def temp_name(folder: Path, prefix: str) -> Path:
    """A fresh name for a temporary file in ``folder`` (48 random bits), chosen before the file is made: a
    signal at any moment leaves a name the caller knows and can remove (tempfile.mkstemp binds its name
    only after it has made the file, so a Ctrl-C in between left a stray temporary file)."""
    return folder / f"{prefix}{os.urandom(6).hex()}"


def unlink_temp(tmp: Path) -> None:
    """Remove the temporary file ``tmp`` if it is there: after a failure anywhere from its open on (a signal
    may come between the open that made it and the next line). A file of that name that the open refused
    (O_EXCL) would be someone else's, but the name's 48 random bits make that a 2^-48 chance."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.unlink(tmp)


def make_parents(path: Path) -> list[Path]:
    """Create the missing ancestors of ``path``; returns those created, outermost first (for
    :func:`remove_made`: a command that fails leaves no folder behind)."""
    missing = []
    parent = Path(path).parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def remove_made(made: list[Path]) -> None:
    """Remove the folders :func:`make_parents` created, innermost first, where they are still empty."""
    for d in reversed(made):
        try:
            d.rmdir()
        except OSError:
            return


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never a mix:
    write a temporary file in the same folder, fsync it, then rename it over the target. On any failure
    nothing is left: no temporary file, no folder made for it."""
    path = Path(path)
    check_write_target(path)
    made = make_parents(path)
    replaced = stat_of(path, stat.S_ISREG)
    # The name is bound before the file exists (temp_name), inside the try: a signal at any moment leaves
    # nothing behind. O_EXCL | O_NOFOLLOW: the temporary file is new and ours.
    tmp = temp_name(path.parent, f".tmp-{path.name[:100]}.")
    try:
        fd = os.open(tmp, NEW_FILE, 0o600)
        with os.fdopen(fd, "wb") as fh:
            _write_file(fh, data)
        if replaced is not None:            # the file it replaces keeps the permissions its owner gave it
            keep_attributes(replaced, tmp, FILE_BITS)
        else:
            os.chmod(tmp, 0o666 & ~_UMASK)  # made 0600; results are for sharing
        check_write_target(path)            # again: a link or device may have appeared meanwhile
        os.replace(tmp, path)
    except BaseException:
        unlink_temp(tmp)
        remove_made(made)
        raise



def stage_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "xb") as fh:        # O_CREAT | O_EXCL: a new file, never one a symlink points to
        _write_file(fh, data)
