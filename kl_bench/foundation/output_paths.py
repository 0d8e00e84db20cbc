"""Output paths checked before any work: a results folder or output file that cannot be written (a
folder for a file, '.', the current folder, a read-only folder, a name too long, a full disk, one of the
command's own inputs) is refused in one line naming the path and the option."""
from __future__ import annotations

import contextlib
import functools
import os
import stat
from pathlib import Path

from .atomic import NEW_FILE, fs_error, temp_name, unlink_temp
from .errors import SpecError
from .safe_io import check_dir_target, check_write_target


def _os_errors_as_input_errors(check):
    """A path check that meets an OSError (a folder it may not search: EACCES on stat, ELOOP, ENAMETOOLONG)
    says so in one line naming the path, as every other refusal does."""
    @functools.wraps(check)
    def wrapped(path: Path, key: str = "out=", *args, **kwargs) -> Path:
        try:
            return check(path, key, *args, **kwargs)
        except OSError as e:
            raise fs_error(e, Path(path), "cannot be written", key=key) from None
    return wrapped


@_os_errors_as_input_errors
def check_output_file(path: Path, key: str = "out=", inputs=()) -> Path:
    """Refuse, before any work, an output file that cannot be written: a folder, a path under a file, a
    folder that cannot be created or written, "-" (no option writes to stdout), or one of the command's own
    inputs. ``key``: the option that names it; ``inputs``: (path, what) of each file the command reads
    (None skipped), which the output may not be, through any link or spelling (a spec replaced by a CSV; a
    results file whose recorded sha256 then fails every later read)."""
    path = Path(path)
    if str(path) in ("", ".", "..") or path.name in ("", ".", ".."):
        raise SpecError("must name a file", file=str(path), key=key)
    if str(path) == "-":
        raise SpecError("'-' is not read as stdout here: give a file name", file=str(path), key=key)
    _check_name_length(path, key)
    if path.is_dir():
        raise SpecError("is a folder; give a file name", file=str(path), key=key)
    for source, what in inputs:
        if source is not None and same_path(path, Path(source)):
            raise SpecError(f"is {what} this command reads: give another file name", file=str(path), key=key)
    check_write_target(path, key=key)       # a symlink or /dev/null is refused, never replaced
    _check_parent_writable(path, key)
    return path


def same_path(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same inode (through any link or spelling), or, where
    either does not exist yet, the same resolved path."""
    with contextlib.suppress(OSError, RuntimeError):
        if Path(a).exists() and Path(b).exists():
            return os.path.samefile(a, b)
        return Path(a).resolve() == Path(b).resolve()
    return False


# Linux's limit on one path component (NAME_MAX); the temporary names beside a target add a prefix.
_NAME_MAX = 255
_TMP_EXTRA = 40


def _check_name_length(path: Path, key: str = "out=") -> None:
    """An output name too long for the file system once kl-bench's temporary prefix is added."""
    size = len(os.fsencode(path.name))
    if size + _TMP_EXTRA > _NAME_MAX:
        raise SpecError(f"the name is {size} bytes; at most {_NAME_MAX - _TMP_EXTRA} bytes are allowed "
                        f"(file names are limited to {_NAME_MAX} bytes)", file=str(path)[:120] + "…", key=key)


@_os_errors_as_input_errors
def output_dir(path: Path, key: str = "out=") -> Path:
    """The folder results go to (never through a symbolic link: :func:`check_output_dir` refuses one)."""
    path = Path(path)
    _check_name_length(path, key)
    return path


@_os_errors_as_input_errors
def check_output_dir(path: Path, key: str = "out=") -> Path:
    """Refuse, before any sampling, a results folder that cannot be written: '', '.', '..', an existing
    file (or /dev/null), a path under a file, a location that cannot be created or written (/proc, a
    read-only mount), a symbolic link (kl-bench never writes through one)."""
    path = Path(path)
    if str(path) in ("", ".", "..") or path.name in ("", ".", ".."):
        raise SpecError("must name a results folder (not '', '.' or '..')", file=str(path), key=key)
    _check_name_length(path, key)
    path = output_dir(path, key)
    _check_not_around_cwd(path, key)
    check_dir_target(path, key=key)
    _check_parent_writable(path, key)
    _check_not_read_only(path, key)
    return path


def _check_not_around_cwd(path: Path, key: str) -> None:
    """The current folder, or a folder that holds it, is refused as '.' is: a results folder is replaced by
    swapping in a new one, and a shell standing in the old one is left in a deleted folder (`--out "$PWD"`:
    its next command failed to load torch's libraries)."""
    with contextlib.suppress(OSError):
        here = Path.cwd().resolve()
        there = path.resolve()
        if there == here or there in here.parents:
            raise SpecError("is the current folder, or holds it: a results folder is replaced whole, which would "
                            "leave this shell in a deleted folder; give a subfolder (default: runs/<name>)",
                            file=str(path), key=key)


def _check_not_read_only(path: Path, key: str) -> None:
    """An existing folder whose mode has no write bit (chmod a-w: made read-only to keep it) is refused,
    not replaced: exchanging folders needs only its parent to be writable, and would drop the mode with the
    contents. Judged by the mode, not by access(): root may write anywhere, and still should not here."""
    with contextlib.suppress(FileNotFoundError):
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
            raise SpecError("is a read-only folder (no write permission): kl-bench does not replace it; make it "
                            "writable (chmod u+w) to replace it, or choose another folder", file=str(path), key=key)


def _check_parent_writable(path: Path, key: str = "out=") -> None:
    """The folder ``path`` would be made in can take a file with a byte in it: probed in its nearest
    existing ancestor (nothing is created, so a command that fails leaves no folder behind), by writing
    one byte, so that a disk with no room at all is refused before any work, not after it."""
    probe = path.parent
    while not probe.exists():                 # the nearest existing ancestor must be a writable folder
        probe = probe.parent
    if not probe.is_dir():
        raise SpecError(f"cannot be created: {probe} is a file", file=str(path), key=key)
    tmp = temp_name(probe, ".kl-bench-probe-")
    try:
        fd = os.open(tmp, NEW_FILE, 0o600)
        try:
            os.write(fd, b"\n")
        finally:
            os.close(fd)
    except OSError as e:
        raise fs_error(e, path, "cannot write there", key=key) from None
    finally:
        unlink_temp(tmp)
