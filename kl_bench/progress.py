"""A progress bar that appears only once a run has lasted a couple of seconds (rich, on stderr)."""
from __future__ import annotations

import time

# Show the progress bar only once a run has lasted this long.
PROGRESS_AFTER_S = 2.0


class LazyProgress:
    """``advance(n)`` after every chunk of draws; ``close()`` at the end. Silent when not ``enabled``."""

    def __init__(self, total: int, enabled: bool, console=None):
        self.total, self.enabled, self.done = total, enabled, 0
        self.console = console
        self.t0 = time.perf_counter()
        self.bar = None

    def advance(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is None and time.perf_counter() - self.t0 > PROGRESS_AFTER_S:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self.bar = Progress(TextColumn("draws"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                console=self.console or Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("run", total=self.total, completed=self.done)
        elif self.bar is not None:
            self.bar.update(self.task, completed=self.done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
