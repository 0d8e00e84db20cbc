"""Attribute keeping: a file or folder that replaces another takes its group and mode bits (a private
folder, a shared group folder, a results file made private keep that across a rewrite)."""
from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

# The mode bits a replacement takes from what it replaces: a file its permissions (never set-id bits: the
# contents are new), a folder all of them (setgid keeps a shared folder's group on new files, sticky).
FILE_BITS = 0o777
FOLDER_BITS = 0o7777


def stat_of(path: Path, kind) -> os.stat_result | None:
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
    bits); see :func:`keep_group` where it cannot be set."""
    keep_group(old, path)
    os.chmod(path, stat.S_IMODE(old.st_mode) & bits)


def keep_group(old: os.stat_result, path: Path) -> None:
    """``path`` takes ``old``'s group where the process may set it (it owns ``path``, so it may when it is a
    member of that group, or is root); where it may not, ``path`` keeps the group it was made with, and the
    write goes on silently (the results matter more than the group; the kernel then drops a setgid bit
    that the process could not have set either)."""
    if os.stat(path).st_gid != old.st_gid:
        with contextlib.suppress(OSError):      # EPERM: not a member of that group; EINVAL: an unmapped id
            os.chown(path, -1, old.st_gid)
