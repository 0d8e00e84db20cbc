"""Results that are never lost: atomic files, an atomic swap of the whole results folder, a lock
against two runs writing one folder (checkpoints for --resume: kl_bench.results.checkpoint).

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
import functools
import os
import shutil
import stat
from pathlib import Path



from . import signals
from .errors import SpecError
from .safe_io import check_dir_target, check_folder_entries, check_write_target, open_lock_file

_UMASK = os.umask(0)
os.umask(_UMASK)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _write_file(fh, data: bytes) -> None:
    """The one place result bytes reach the disk (tests inject ENOSPC and EROFS here)."""
    fh.write(data)
    fh.flush()
    os.fsync(fh.fileno())


def fs_error(err: OSError, target: Path, what: str = "cannot write results", key: str | None = None) -> SpecError:
    """An OSError while writing results as a one-line input error naming the path."""
    reason = err.strerror or err.__class__.__name__
    return SpecError(f"{what}: {reason}", file=str(target), key=key)


def _os_errors_as_input_errors(check):
    """A path check that meets an OSError (a folder it may not search: EACCES on stat, ELOOP, ENAMETOOLONG)
    says so in one line naming the path, as every other refusal does."""
    @functools.wraps(check)
    def wrapped(path: Path, key: str = "--out", *args, **kwargs) -> Path:
        try:
            return check(path, key, *args, **kwargs)
        except OSError as e:
            raise fs_error(e, Path(path), "cannot be written", key=key) from None
    return wrapped


@_os_errors_as_input_errors
def check_output_file(path: Path, key: str = "--out", inputs=()) -> Path:
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


def _check_name_length(path: Path, key: str = "--out") -> None:
    """An output name too long for the file system once kl-bench's temporary prefix is added."""
    size = len(os.fsencode(path.name))
    if size + _TMP_EXTRA > _NAME_MAX:
        raise SpecError(f"the name is {size} bytes; at most {_NAME_MAX - _TMP_EXTRA} bytes are allowed "
                        f"(file names are limited to {_NAME_MAX} bytes)", file=str(path)[:120] + "…", key=key)


@_os_errors_as_input_errors
def output_dir(path: Path, key: str = "--out") -> Path:
    """The folder results go to (never through a symbolic link: :func:`check_output_dir` refuses one)."""
    path = Path(path)
    _check_name_length(path, key)
    return path


@_os_errors_as_input_errors
def check_output_dir(path: Path, key: str = "--out") -> Path:
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


def _check_parent_writable(path: Path, key: str = "--out") -> None:
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
    replaced = _stat_of(path, stat.S_ISREG)
    # The name is bound before the file exists (temp_name), inside the try: a signal at any moment leaves
    # nothing behind. O_EXCL | O_NOFOLLOW: the temporary file is new and ours.
    tmp = temp_name(path.parent, f".tmp-{path.name[:100]}.")
    try:
        fd = os.open(tmp, NEW_FILE, 0o600)
        with os.fdopen(fd, "wb") as fh:
            _write_file(fh, data)
        if replaced is not None:            # the file it replaces keeps the permissions its owner gave it
            keep_attributes(replaced, tmp, _FILE_BITS)
        else:
            os.chmod(tmp, 0o666 & ~_UMASK)  # made 0600; results are for sharing
        check_write_target(path)            # again: a link or device may have appeared meanwhile
        os.replace(tmp, path)
    except BaseException:
        unlink_temp(tmp)
        remove_made(made)
        raise


# The mode bits a replacement takes from what it replaces: a file its permissions (never set-id bits: the
# contents are new), a folder all of them (setgid keeps a shared folder's group on new files, sticky).
_FILE_BITS = 0o777
_FOLDER_BITS = 0o7777


def _stat_of(path: Path, kind) -> os.stat_result | None:
    """``path``'s lstat where it is of ``kind`` (stat.S_ISREG, stat.S_ISDIR); None otherwise or if absent."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if kind(st.st_mode) else None


def keep_attributes(old: os.stat_result, path: Path, bits: int) -> None:
    """Give ``path`` (a file or folder this process has just made, never a link) the group and the mode bits
    (``bits`` of them) of what it replaces, ``old``: a folder made private (chmod 700), shared with a group
    (chmod 2770) or a file made private keeps that. The group goes first (a change of group clears set-id
    bits); see :func:`_keep_group` where it cannot be set."""
    _keep_group(old, path)
    os.chmod(path, stat.S_IMODE(old.st_mode) & bits)


def _keep_group(old: os.stat_result, path: Path) -> None:
    """``path`` takes ``old``'s group where the process may set it (it owns ``path``, so it may when it is a
    member of that group, or is root); where it may not, ``path`` keeps the group it was made with, and the
    write goes on silently (the results matter more than the group; the kernel then drops a setgid bit
    that the process could not have set either)."""
    if os.stat(path).st_gid != old.st_gid:
        with contextlib.suppress(OSError):      # EPERM: not a member of that group; EINVAL: an unmapped id
            os.chown(path, -1, old.st_gid)


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


def remove(path: Path) -> None:
    """Remove ``path`` whatever it is, never following a link and never opening a FIFO (shutil.rmtree opens
    its argument before it checks it is a folder: on a FIFO planted at a staging path it waits forever)."""
    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:          # absent, or a name that cannot even be looked at: nothing to remove
        return
    if is_dir:
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def clean_stale(out_dir: Path) -> None:
    """Remove staging folders and temporary files left by killed runs (call under the lock)."""
    if out_dir.parent.exists():
        for p in out_dir.parent.glob(f".{out_dir.name}.staging-*"):
            remove(p)
    if out_dir.is_dir():
        for p in out_dir.glob(".tmp-*"):
            remove(p)


def write_locked(out_dir: Path, files: dict[str, bytes], replaces: tuple[str, ...] = ()) -> Path:
    """:func:`write_folder` under the folder's lock, after cleaning a crashed writer's leftovers: what
    every results folder (a run's, a training's, an audit's: ``files`` from
    kl_bench.results.folders.stored_files) is written with. Returns the folder. A full disk or a read-only
    mount is a one-line :class:`SpecError` (the old folder, if any, untouched)."""
    out_dir = Path(out_dir)
    try:
        with FolderLock(out_dir):
            clean_stale(out_dir)
            write_folder(out_dir, files, replaces)
    except OSError as e:
        raise fs_error(e, out_dir) from None
    return out_dir


# Folders this process has swapped in (resolved paths): what an interrupt's line may say was written.
_COMMITTED: set[str] = set()


def written_folders() -> list[str]:
    """Every folder this process has swapped new contents into, and every output file it has written
    whole (:func:`mark_written`): what the line an interrupt prints names."""
    return sorted(_COMMITTED)


def mark_written(path: Path) -> None:
    """Record an output file written whole (atomically) for the line an interrupt prints."""
    _COMMITTED.add(str(Path(path).absolute()))


def committed(out_dir: Path) -> bool:
    """Whether this process has swapped new contents into ``out_dir`` (see :func:`write_folder`)."""
    return str(Path(output_dir(Path(out_dir))).absolute()) in _COMMITTED


def write_folder(out_dir: Path, files: dict[str, bytes], replaces: tuple[str, ...] = ()) -> None:
    """Write ``files`` ({relative path: bytes}, "a/b.png" allowed) as the folder ``out_dir``, atomically:
    staged in a sibling folder, then exchanged with the old one in one call (or renamed into place).
    Entries of an old folder that this write does not make are carried over (a report, notes; and in a
    subfolder it writes, such as a report's figures/, the files it does not write), except those named in
    ``replaces``: the data files of an earlier write that this one does not make (a run without λ leaves no
    lambda_sweep.csv of an earlier run beside its run.json, unrecorded). The new folder, each subfolder it
    writes and each file it replaces keep the old one's mode and group (:func:`keep_attributes`). A path
    that exists as anything but a folder (a symlink included) is refused in one line, and so is an entry
    of the old folder at an output's name, at any depth, that is not of the output's kind
    (safe_io.check_folder_entries)."""
    out_dir = output_dir(Path(out_dir))
    check_dir_target(out_dir, key="--out")
    _check_entries(out_dir, list(files))
    stage = staging_dir(out_dir)
    remove(stage)
    made = make_parents(stage)
    old = _stat_of(out_dir, stat.S_ISDIR)
    try:
        _make_stage(stage, old)
        for name, data in files.items():
            stage_file(stage / name, data)
        if old is not None:
            _carry_over(out_dir, stage, set(files), set(replaces))
            _keep_old_attributes(out_dir, stage, list(files), old)
        signals.phase("staged")     # every file is on disk beside the folder, not yet swapped in
        key = str(out_dir.absolute())
        with signals.held():   # the line an interrupt prints must know whether the swap is done
            if not out_dir.exists():
                os.rename(stage, out_dir)
                _COMMITTED.add(key)
                return
            if _exchange(stage, out_dir):
                _COMMITTED.add(key)
                remove(stage)       # now holds the previous results
                return
        _write_in_place(out_dir, stage, list(files), replaces)
        _COMMITTED.add(key)
        remove(stage)
    except BaseException:
        remove(stage)
        remove_made(made)
        raise


def _check_entries(folder: Path, names: list[str]) -> None:
    """safe_io.check_folder_entries at every depth: in a subfolder that the write makes files in (a report's
    figures/), an entry at an output's name that is not a regular file (a folder, a link) is refused too,
    as at the top (it would otherwise be left behind with the old folder)."""
    check_folder_entries(folder, names, key="--out")
    below: dict[str, list[str]] = {}
    for name in names:
        top, sep, rest = name.partition("/")
        if sep:
            below.setdefault(top, []).append(rest)
    for top, rest in below.items():
        _check_entries(folder / top, rest)


def _make_stage(stage: Path, old: os.stat_result | None) -> None:
    """The staging folder: as any new folder where there is no old one; else private (0700) while it is
    filled, with the old folder's group and its setgid bit (files staged in it then get that group, as they
    would in the old folder). Its full mode comes last (:func:`_keep_old_attributes`)."""
    if old is None:
        stage.mkdir()
        return
    stage.mkdir(mode=0o700)
    _keep_group(old, stage)
    os.chmod(stage, 0o700 | (old.st_mode & stat.S_ISGID))


def _keep_old_attributes(out_dir: Path, stage: Path, names: list[str], old: os.stat_result) -> None:
    """Each file this write replaces takes the old file's permission bits and group, each subfolder it
    writes in the old subfolder's mode and group, deepest first, and the staging folder the old folder's:
    what the user set (a private folder, a shared one, a results file made private) survives a rewrite."""
    folders = sorted({"/".join(n.split("/")[:i]) for n in names for i in range(1, n.count("/") + 1)},
                     key=lambda f: -f.count("/"))
    for rel, kind, bits in [*((n, stat.S_ISREG, _FILE_BITS) for n in names),
                            *((f, stat.S_ISDIR, _FOLDER_BITS) for f in folders)]:
        was = _stat_of(out_dir / rel, kind)
        if was is not None:
            keep_attributes(was, stage / rel, bits)
    keep_attributes(old, stage, _FOLDER_BITS)


def stage_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "xb") as fh:        # O_CREAT | O_EXCL: a new file, never one a symlink points to
        _write_file(fh, data)


def _write_in_place(out_dir: Path, stage: Path, names: list[str], replaces: tuple[str, ...]) -> None:
    """The fallback where folders cannot be exchanged in one call: file by file, each atomically, an earlier
    write's data files removed, run.json last (until it is written, the old run.json's hashes refuse the mix)."""
    for name in [n for n in names if n != "run.json"]:
        atomic_write_bytes(out_dir / name, (stage / name).read_bytes())
    for name in set(replaces) - set(names):
        if (out_dir / name).is_file() and not (out_dir / name).is_symlink():
            (out_dir / name).unlink()
    for name in [n for n in names if n == "run.json"]:
        atomic_write_bytes(out_dir / name, (stage / name).read_bytes())


def _carry_over(old: Path, stage: Path, written: set[str], replaces: set[str], prefix: str = "") -> None:
    """Hard-link the old folder's entries that this write does not make into the staging folder (a report,
    notes): in a subfolder it writes files in (a report's figures/), its other entries, at any depth (a
    figure of the user's own). Not kl-bench's temporary files, nor a run's checkpoint (the run is done)."""
    for entry in old.iterdir():
        rel = prefix + entry.name
        if rel in written or rel in replaces or entry.name.startswith(".tmp-") or \
                (not prefix and entry.name.startswith(".checkpoint")):
            continue
        if any(name.startswith(rel + "/") for name in written):     # a real folder (_check_entries)
            _carry_over(entry, stage / entry.name, written, replaces, rel + "/")
        elif entry.is_symlink():
            os.symlink(os.readlink(entry), stage / entry.name)
        elif entry.is_dir():
            shutil.copytree(entry, stage / entry.name, copy_function=link_or_copy, symlinks=True)
        else:
            link_or_copy(entry, stage / entry.name)


def link_or_copy(src, dst) -> None:
    """Hard-link ``src`` at ``dst`` (no bytes copied), or copy it (contents, mode and times) where the kernel
    refuses the link: another user's file under fs.protected_hardlinks (EPERM) in a shared group folder, a
    file system without hard links, or a file at its link limit."""
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        shutil.copy2(src, dst, follow_symlinks=False)


class FolderLock:
    """An exclusive, non-blocking lock on a results folder (a lock file beside it, held with flock).

    The kernel releases it when the process dies, however it dies, so a killed run never leaves a
    stale lock behind."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir.parent / f".{self.out_dir.name}.lock"
        self.fh = None
        self.made: list[Path] = []

    def __enter__(self) -> "FolderLock":
        try:
            self.made = make_parents(self.path)
        except OSError as e:
            raise fs_error(e, self.out_dir) from None
        try:
            return self._take()
        except BaseException:
            self._release(failed=True)
            raise

    def _take(self) -> "FolderLock":
        for _ in range(100):
            try:
                self.fh = open_lock_file(self.path)      # never through a symlink, never a FIFO
            except SpecError as e:
                raise SpecError(f"{e.message} ({e.file})", file=str(self.out_dir)) from None
            except OSError as e:
                raise fs_error(e, self.out_dir) from None
            try:
                fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.fh.seek(0)
                holder = self.fh.read(64).decode("ascii", "replace").strip() or "?"
                self.fh.close()
                self.fh = None
                raise SpecError(f"results folder is being written by another kl-bench run (pid {holder}); "
                                f"wait for it to finish or choose another --out", file=str(self.out_dir)) from None
            # The holder before us may have unlinked the file we opened: lock the file at the path.
            try:
                same = os.fstat(self.fh.fileno()).st_ino == os.lstat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            self.fh.close()
            self.fh = None
        if self.fh is None:
            raise SpecError("cannot take the lock: its file keeps being replaced", file=str(self.out_dir))
        try:        # the holder's pid, for the line another run prints (a disk with no room: one line)
            self.fh.seek(0)
            self.fh.truncate()
            self.fh.write(str(os.getpid()).encode())
            self.fh.flush()
        except OSError as e:
            raise fs_error(e, self.out_dir) from None
        return self

    def __exit__(self, *exc) -> None:
        self._release(failed=exc[0] is not None)

    def _release(self, failed: bool) -> None:
        if self.fh is not None:
            # Remove the lock file while still holding the lock, whatever the outcome: nothing is left
            # beside the results. A run that opened the old file meanwhile sees it unlinked and retries.
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            fcntl.flock(self.fh.fileno(), fcntl.LOCK_UN)
            with contextlib.suppress(OSError):      # a pid that never reached the disk: nothing to flush
                self.fh.close()
            self.fh = None
        if failed:
            remove_made(self.made)          # a failed command leaves no folder it made behind
