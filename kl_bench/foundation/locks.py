"""The lock against two runs writing one results folder: a lock file beside it, held with flock, which
the kernel releases however the process dies."""
from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from .atomic import fs_error, make_parents, remove_made
from .errors import SpecError
from .safe_io import open_lock_file


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
