"""A progress bar that appears only once a run has lasted a couple of seconds (rich, on stderr). It names
the case and phase being sampled and shows the rate with thousands separators. Where stderr is not a
terminal (a CI log, a file), one plain line per case and phase instead, from the same moment on."""
from __future__ import annotations

import time

# Show the progress bar only once a run has lasted this long.
PROGRESS_AFTER_S = 2.0


class LazyProgress:
    """``advance(n)`` after every chunk of draws, ``label(text)`` when a case or phase starts, ``close()``
    at the end. Silent when not ``enabled``."""

    def __init__(self, total: int, enabled: bool, console=None, unit: str = "draws"):
        self.total, self.enabled, self.done, self.unit = total, enabled, 0, unit
        self.console = console
        self.text = ""
        self.t0 = time.perf_counter()
        self.bar = None
        self.said = ""

    def _console(self):
        if self.console is None:
            from rich.console import Console
            self.console = Console(stderr=True)
        return self.console

    def set_total(self, total: int) -> None:
        """The total, once it is known (dump-logits: after the prompts are read)."""
        self.total = total
        if self.bar is not None:
            self.bar.update(self.task, total=total)

    def label(self, text: str) -> None:
        self.text = text
        self._update()
        if self.enabled and not self._console().is_terminal:
            self._line()

    def _line(self) -> None:
        """A log line for a case or phase (no bar where nothing redraws it), once the run has lasted."""
        elapsed = time.perf_counter() - self.t0
        if self.text == self.said or elapsed <= PROGRESS_AFTER_S:
            return
        self.said = self.text
        self._console().print(f"progress: {self.text}: {self.done:,}/{self.total:,} {self.unit} done, "
                              f"{self.done / elapsed:,.0f} {self.unit}/s, {elapsed:.1f} s", markup=False, soft_wrap=True)

    def advance(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        if not self._console().is_terminal:
            self._line()
            return
        if self.bar is None and time.perf_counter() - self.t0 > PROGRESS_AFTER_S:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
            self.bar = Progress(TextColumn("{task.fields[label]}"), BarColumn(),
                                TextColumn("{task.fields[count]}"), TextColumn("{task.fields[rate]}"),
                                TimeRemainingColumn(), console=self._console(), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("run", total=self.total, completed=self.done, label="", count="", rate="")
        self._update()

    def _update(self) -> None:
        if self.bar is None:
            return
        rate = self.done / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.update(self.task, completed=min(self.done, self.total), label=self.text,
                        count=f"{self.done:,}/{self.total:,} {self.unit}", rate=f"{rate:,.0f} {self.unit}/s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
