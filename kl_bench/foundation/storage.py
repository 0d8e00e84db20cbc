"""Folder swaps: a whole results folder replaced atomically, under its lock (atomic files:
kl_bench.foundation.atomic; the lock: kl_bench.foundation.locks; checks of an output path before any work:
kl_bench.foundation.output_paths; attributes kept across a rewrite: kl_bench.foundation.attributes;
checkpoints for --resume: kl_bench.results.checkpoint).

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
import os
import shutil
import stat
from pathlib import Path

from . import signals
from .atomic import atomic_write_bytes, fs_error, make_parents, remove_made, stage_file
from .attributes import FILE_BITS, FOLDER_BITS, keep_attributes, keep_group, stat_of
from .locks import FolderLock
from .output_paths import check_output_dir, output_dir, same_path
from .safe_io import check_dir_target, check_folder_entries

# check_output_dir and same_path: imported from here by kl_bench/kinds/model/dump.py and
# kl_bench/present/report.py (their home is kl_bench.foundation.output_paths).
__all__ = ["FolderLock", "check_output_dir", "clean_stale", "committed", "fs_error", "link_or_copy", "mark_written",
           "remove", "same_path", "stage_file", "staging_dir", "write_folder", "write_locked", "written_folders"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


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
    check_dir_target(out_dir, key="out=")
    _check_entries(out_dir, list(files))
    stage = staging_dir(out_dir)
    remove(stage)
    made = make_parents(stage)
    old = stat_of(out_dir, stat.S_ISDIR)
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
    check_folder_entries(folder, names, key="out=")
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
    keep_group(old, stage)
    os.chmod(stage, 0o700 | (old.st_mode & stat.S_ISGID))


def _keep_old_attributes(out_dir: Path, stage: Path, names: list[str], old: os.stat_result) -> None:
    """Each file this write replaces takes the old file's permission bits and group, each subfolder it
    writes in the old subfolder's mode and group, deepest first, and the staging folder the old folder's:
    what the user set (a private folder, a shared one, a results file made private) survives a rewrite."""
    folders = sorted({"/".join(n.split("/")[:i]) for n in names for i in range(1, n.count("/") + 1)},
                     key=lambda f: -f.count("/"))
    for rel, kind, bits in [*((n, stat.S_ISREG, FILE_BITS) for n in names),
                            *((f, stat.S_ISDIR, FOLDER_BITS) for f in folders)]:
        was = stat_of(out_dir / rel, kind)
        if was is not None:
            keep_attributes(was, stage / rel, bits)
    keep_attributes(old, stage, FOLDER_BITS)


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
