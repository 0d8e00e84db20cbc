"""Safe primitives for every file kl-bench reads or writes: nothing a path can be (a FIFO, a device, a
symlink, a huge or hostile file) hangs a run, exhausts its memory, or makes it write somewhere else.

Reading: :func:`open_regular` opens with ``O_NONBLOCK`` (so a FIFO never blocks the open) and then
``fstat``\\s the open descriptor: anything but a regular file is refused, and so is a file larger than the
cap of its type (:data:`CAPS`, stated in the error), before a byte is read. :func:`read_regular` then
reads at most cap + 1 bytes, never allocating more than the file holds plus a block (files under
/proc report size 0; under ``ulimit -v`` a read of the whole cap at once would fail). Parsers of untrusted text
(:func:`parse_json`, :func:`parse_toml`) turn deep nesting (RecursionError) and over-long numbers
(ValueError: Python refuses int conversions beyond 4,300 digits) into one line. :func:`check_npy_header`
compares what a ``.npy`` header claims (shape × itemsize) with the bytes the file holds, so that a 100-byte
file claiming 10^12 values is refused instead of allocated.

Writing: :func:`check_write_target` refuses a destination that is a symlink or not a regular file
(``/dev/null`` stays a device).
Every error is a :class:`~kl_bench.foundation.errors.SpecError` naming the file.
"""
from __future__ import annotations

import io
import json
import math
import os
import stat
import sys
from pathlib import Path
from typing import Any, BinaryIO

from .errors import SpecError
from .formatting import fmt_bytes

if sys.version_info >= (3, 11):
    import tomllib
else:                       # Python 3.10: the same parser, as the tomli package (a dependency there)
    import tomli as tomllib

MiB = 1 << 20
GiB = 1 << 30


def _memory_cap() -> int:
    """Half of the memory this process may take (physical memory, a container's limit, or less under
    ``ulimit -v``): a file read whole (and converted to float64) must fit beside the run."""
    from .memory import memory_limit
    return memory_limit()[0] // 2


# Size caps per kind of file: far above anything kl-bench writes, far below what would exhaust memory.
CAPS: dict[str, int] = {
    "spec": 16 * MiB,            # a spec is hand-written TOML: 1,024 swept cases fit in well under 1 MiB
    "run.json": 64 * MiB,        # per-case metadata of at most 1,024 cases
    "baseline": 256 * MiB,       # one small JSON object per summary row
    "summary.csv": 256 * MiB,
    "lambda_sweep.csv": 256 * MiB,
    "gradients.csv": 256 * MiB,
    "group_baselines.csv": 256 * MiB,
    "gates.csv": 256 * MiB,      # one row per case, gate and δ
    "train.csv": 256 * MiB,      # one row per recorded step, combination and case
    "audit.csv": 256 * MiB,      # one row per audited step and KL term
    "engine.csv": 256 * MiB,
    "batches.csv": 2 * GiB,      # one row per batch (≤ 2^20) and case
    "reservoir.npz": 2 * GiB,
    "gradients.npz": 2 * GiB,    # float64 vectors of B·V parameters per gradient row
    "checkpoint": 2 * GiB,       # float64 sums: batches × features per case
    "prompts": 256 * MiB,
    "model config": 16 * MiB,    # config.json and tokenizer_config.json of a model folder
}


def cap_for(kind: str) -> int:
    """The size cap of a kind of file (:data:`CAPS`; tensors: half of the memory this process may take)."""
    return CAPS.get(kind) or _memory_cap()


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def describe(path: str | Path) -> str | None:
    """What ``path`` is, in words ("a regular file", "a FIFO (named pipe)", "a dangling symbolic link"),
    following links; None where nothing is there."""
    try:
        return _kind_of(os.stat(path).st_mode)
    except FileNotFoundError:
        return "a dangling symbolic link" if os.path.islink(path) else None
    except OSError as e:
        return f"unreadable ({e.strerror or e})"


def open_regular(path: str | Path, kind: str, what: str | None = None) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file within the cap of ``kind`` (a key of
    :data:`CAPS`, or anything else for tensors); the caller closes the returned file object."""
    path = Path(path)
    what = what or kind
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise SpecError(f"{what} file not found" + (" (a dangling symbolic link)" if os.path.islink(path) else ""),
                        file=str(path)) from None
    except OSError as e:
        raise SpecError(f"cannot read the {what} file: {e.strerror or e}", file=str(path)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"is {_kind_of(st.st_mode)}, not a regular {what} file", file=str(path))
        cap = cap_for(kind)
        if st.st_size > cap:
            raise SpecError(f"{what} file is {fmt_bytes(st.st_size)}, more than the {fmt_bytes(cap)} a {what} "
                            f"file may have", file=str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | Path, kind: str, what: str | None = None) -> bytes:
    """The bytes of a regular file, at most the cap of ``kind`` (see :func:`open_regular`)."""
    what = what or kind
    with open_regular(path, kind, what) as fh:
        return read_capped(fh, cap_for(kind), path, what)


# Bytes asked of read() at once beyond the size fstat reports: read(n) allocates n bytes before reading
# (a 2 GiB cap read in one call needs 2 GiB of address space, a MemoryError under `ulimit -v`).
_BLOCK = 1 << 20


def read_capped(fh: BinaryIO, cap: int, path: str | Path, what: str) -> bytes:
    """Everything left in ``fh``, refused once it exceeds ``cap`` bytes. Memory stays at the file's size
    (plus a block): the first read asks for the size fstat reports (one allocation for an honest file),
    later ones a block at a time, so a file whose st_size lies (/proc reports 0, a file still growing)
    is bounded too."""
    chunks, total = [], 0
    try:
        size = os.fstat(fh.fileno()).st_size - fh.tell()
        want = min(max(size, 0) + 1, cap + 1)
        while True:
            data = fh.read(want)
            if not data:
                break
            chunks.append(data)
            total += len(data)
            if total > cap:
                raise SpecError(f"{what} file is more than the {fmt_bytes(cap)} a {what} file may have",
                                file=str(path))
            want = min(_BLOCK, cap + 1 - total)
    except OSError as e:
        raise SpecError(f"cannot read the {what} file: {e.strerror or e}", file=str(path)) from None
    except MemoryError:
        raise SpecError(f"not enough memory to read the {what} file ({fmt_bytes(total)} read so far)",
                        file=str(path)) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def decode_text(data: bytes, path: str | Path, what: str) -> str:
    """UTF-8 text without NUL bytes (a binary file is one line, not a parse error deep inside)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"the {what} file is not UTF-8 text (byte {e.start}: binary or corrupted?)",
                        file=str(path)) from None
    if "\x00" in text:
        raise SpecError(f"the {what} file holds NUL bytes (binary or corrupted?)", file=str(path))
    if text.startswith("\ufeff"):   # a byte-order mark (some Windows editors write one): not TOML's, not text
        text = text[1:]
    return text


def _unreadable(what: str, e: BaseException, path: str | Path) -> SpecError:
    """The one-line error of a parser that hit a limit: nesting too deep for the interpreter, or a number
    with too many digits (else the exception's name)."""
    if isinstance(e, RecursionError):
        why = "nested too deeply"
    elif isinstance(e, (ValueError, OverflowError)) and "digits" in str(e):
        why = "holds a number with more than 4,300 digits"
    else:
        why = e.__class__.__name__
    return SpecError(f"{what} cannot be read: it {why}", file=str(path))


def parse_json(data: bytes | str, path: str | Path, what: str) -> Any:
    """JSON from untrusted bytes: not UTF-8, not JSON, too deep or a 5000-digit number is one line."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as e:
        raise SpecError(f"{what} is not valid JSON: not UTF-8 text at byte {e.start} (binary or corrupted?)",
                        file=str(path)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{what} is not valid JSON (truncated or corrupted?): {e}", file=str(path)) from None
    except (RecursionError, ValueError, OverflowError) as e:
        raise _unreadable(what, e, path) from None


def parse_toml(text: str, path: str | Path) -> dict:
    """TOML from untrusted text (see :func:`parse_json`)."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"TOML syntax error: {e}", file=str(path)) from None
    except (RecursionError, ValueError, OverflowError) as e:
        raise _unreadable("the spec", e, path) from None


def check_npy_header(fh: BinaryIO, size: int, where: str) -> tuple[tuple[int, ...], Any]:
    """Read a .npy header from ``fh`` (at its start; ``size`` bytes in all) and check that the data it
    announces (shape × itemsize) is exactly what follows, before numpy allocates the array. Returns
    (shape, dtype); the file position is left after the header."""
    import numpy as np
    from numpy.lib import format as npf
    # Checked here, not by numpy, whose error quotes the file's first bytes (a link to /etc/passwd: "got b'root:x'").
    if fh.read(len(npf.MAGIC_PREFIX)) != npf.MAGIC_PREFIX:
        raise SpecError("not a .npy file: it does not start with numpy's magic bytes", file=where)
    fh.seek(0)
    try:
        version = npf.read_magic(fh)
        reader = {(1, 0): npf.read_array_header_1_0, (2, 0): npf.read_array_header_2_0}.get(version)
        if reader is None:
            raise ValueError(f"unsupported .npy version {version}")
        shape, _, dtype = reader(fh)
    except (ValueError, OSError, EOFError, SyntaxError, RecursionError) as e:
        first = (str(e).splitlines() or [""])[0][:120]
        raise SpecError(f"cannot read it as a .npy array (truncated or corrupted?): {e.__class__.__name__}: {first}",
                        file=where) from None
    if dtype.hasobject:
        raise SpecError("holds Python objects, not numbers (pickles are never loaded)", file=where)
    count = math.prod(shape)
    need = count * dtype.itemsize
    have = size - fh.tell()
    if need != have:
        raise SpecError(f"its header claims shape {list(shape)} of {dtype} ({fmt_bytes(need)}) but the file holds "
                        f"{fmt_bytes(max(have, 0))} of data (truncated or corrupted?)", file=where)
    return tuple(shape), np.dtype(dtype)


def load_npy(fh: BinaryIO, size: int, where: str):
    """A .npy array from an open file of ``size`` bytes, its header checked first (no pickles)."""
    import numpy as np
    check_npy_header(fh, size, where)
    fh.seek(0)
    return np.load(fh, allow_pickle=False)


def load_npz(data: bytes, where: str, cap: int) -> dict:
    """Every array of a .npz archive (bytes), each member's header checked against its size first; the
    members together may inflate to at most ``cap`` bytes (a zip's directory states each member's size)."""
    import zipfile
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            infos = z.infolist()
            total = sum(i.file_size for i in infos)
            if total > cap:
                raise SpecError(f"its arrays claim {fmt_bytes(total)} in all, more than the {fmt_bytes(cap)} "
                                "allowed", file=where)
            out = {}
            for info in infos:
                with z.open(info) as member:
                    raw = member.read(info.file_size + 1)    # zipfile also stops at the recorded size
                if len(raw) != info.file_size:
                    raise ValueError(f"member {info.filename} is not the size its directory records")
                name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                out[name] = load_npy(io.BytesIO(raw), len(raw), f"{where} ({info.filename})")
            return out
    except SpecError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError, RuntimeError) as e:
        raise SpecError(f"unreadable (truncated or corrupted?): {e.__class__.__name__}: "
                        f"{(str(e).splitlines() or [''])[0]}", file=where) from None


# ----------------------------------------------------------------------------- writing
def check_write_target(path: str | Path, key: str | None = None) -> None:
    """Refuse to replace ``path`` unless it is absent or a regular file: a symlink (whose target would be
    at stake), a device such as /dev/null, a FIFO or a folder are one line naming it."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):     # absent (the parent's checks say why it cannot be)
        return
    except OSError as e:
        raise SpecError(f"cannot write there: {e.strerror or e}", file=str(path), key=key) from None
    if not stat.S_ISREG(st.st_mode):
        raise SpecError(f"is {_kind_of(st.st_mode)}; refusing to replace it (give the path of a regular file)",
                        file=str(path), key=key)


def check_dir_target(path: str | Path, key: str | None = None) -> None:
    """Refuse a results folder path that exists as anything but a folder: a file, a device, a FIFO, or a
    symbolic link (to a folder too: kl-bench never writes through a link, whose target would be at
    stake; give the folder itself)."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):     # absent, or under a file: the parent's checks say so
        return
    except OSError as e:
        raise SpecError(f"cannot write there: {e.strerror or e}", file=str(path), key=key) from None
    if stat.S_ISLNK(st.st_mode):
        target = os.path.realpath(path)
        if not os.path.exists(target):
            raise SpecError("is a dangling symbolic link", file=str(path), key=key)
        raise SpecError(f"is a symbolic link (to {target}); kl-bench never writes through a link: give the folder "
                        "itself", file=str(path), key=key)
    if not stat.S_ISDIR(st.st_mode):
        raise SpecError(f"exists and is not a folder ({_kind_of(st.st_mode)})", file=str(path), key=key)


def check_folder_entries(folder: str | Path, names, key: str | None = None) -> None:
    """Refuse to replace what stands at an output's name inside an existing results folder unless it is of
    the output's kind: a regular file where a file is written, a folder (not a link to one) where a folder
    of files is ("figures/a.png"). A folder, a FIFO, a device or a symlink where kl-bench writes a file
    would otherwise be swapped out with the old folder, and what it held lost."""
    wants_dir: dict[str, bool] = {}
    for name in names:
        top, sep, _ = str(name).partition("/")
        wants_dir[top] = wants_dir.get(top, False) or bool(sep)
    for top, is_dir in wants_dir.items():
        path = Path(folder) / top
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as e:
            raise SpecError(f"cannot write there: {e.strerror or e}", file=str(path), key=key) from None
        if not (stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)):
            raise SpecError(f"is {_kind_of(st.st_mode)} where kl-bench writes {'a folder' if is_dir else 'a file'}; "
                            "refusing to replace it (move it away, or choose another --out)", file=str(path), key=key)


def open_lock_file(path: str | Path) -> BinaryIO:
    """Open (creating if needed) a lock file without following a symlink at ``path`` and without
    blocking on a FIFO; refuse anything but a regular file."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError:
        if os.path.islink(path):
            raise SpecError("the lock file is a symbolic link; refusing to follow it (remove it)",
                            file=str(path)) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SpecError(f"the lock file is {_kind_of(st.st_mode)}, not a regular file (remove it)", file=str(path))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "r+b")
