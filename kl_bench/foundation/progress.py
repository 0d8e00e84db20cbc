"""A progress line that appears only once a command has lasted a couple of seconds: a rich bar on a
terminal's stderr, one line updated in place in a Jupyter notebook, and nothing at all where stderr is
not a terminal (a pipe, a file, a CI log) or with ``-q``. It names the case, phase or figure being worked
on, the count with thousands separators, the rate and the time left.

A step that runs past the threshold without reporting (a case's exact moments, a model's first forward) gets
the line all the same: a timer started with the first label or piece of work draws it at the threshold on a
terminal, so that no command sits silent for more than a couple of seconds.

The rate counts only the work of this process: draws restored from a checkpoint (``--resume``) move the
count, never the rate or the time left."""
from __future__ import annotations

import sys
import threading
import time

# Show progress only once a command has lasted this long.
PROGRESS_AFTER_S = 2.0
# A notebook's line is redrawn at most this often (each redraw is a message to the front end).
NOTEBOOK_EVERY_S = 0.25


def in_notebook() -> bool:
    """Whether this process is a Jupyter (or Colab) kernel: IPython is loaded and its shell is a kernel's.
    IPython is never imported here: a script that did not load it is not in a notebook."""
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    shell = get() if callable(get) else None
    if shell is None:
        return False
    name = type(shell).__name__
    return name == "ZMQInteractiveShell" or "google.colab" in str(type(shell))


def wanted(progress: bool | None) -> bool:
    """``progress=`` of the Python API: True or False as given; None (the default) is on in a notebook
    and off elsewhere (a script prints nothing it was not asked for)."""
    return in_notebook() if progress is None else bool(progress)


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"


class LazyProgress:
    """``advance(n)`` after every piece of work (``restored=True``: work restored from a checkpoint, which
    moves the count but not the rate), ``label(text)`` when a case, phase or figure starts, ``close()`` at
    the end. Silent when not ``enabled``, and where ``console`` (default: stderr) is neither a terminal nor
    a notebook's."""

    def __init__(self, total: int, enabled: bool, console=None, unit: str = "draws"):
        self.total, self.enabled, self.unit = total, enabled, unit
        self.done = 0            # the count shown, restored work included
        self.fresh = 0           # work done by this process: the rate
        self.console = console
        self.text = ""
        self.t0 = time.perf_counter()
        self.bar = None          # rich's Progress on a terminal
        self.cell = None         # IPython's display handle in a notebook
        self.drawn_at = 0.0
        self.timer = None        # draws the bar at PROGRESS_AFTER_S if no call has by then
        self.closed = False
        self.lock = threading.RLock()

    def _console(self):
        if self.console is None:
            from rich.console import Console
            self.console = Console(stderr=True)
        return self.console

    def set_total(self, total: int) -> None:
        """The total, once it is known (dump-logits: after the prompts are read)."""
        self.total = total
        self._update(force=True)

    def label(self, text: str) -> None:
        with self.lock:
            self.text = text
            self._due()
            self._update(force=True)

    def advance(self, n: int, restored: bool = False) -> None:
        with self.lock:
            self.done += n
            if not restored:
                self.fresh += n
            self._due()
            self._update()

    def _due(self) -> None:
        """Start the line once the threshold has passed; before, arm the timer that starts it then."""
        if not self.enabled or self.closed or self.bar is not None or self.cell is not None:
            return
        left = PROGRESS_AFTER_S - (time.perf_counter() - self.t0)
        if left <= 0:
            self._start()
        elif self.timer is None:
            self.timer = threading.Timer(left, self._late)
            self.timer.daemon = True
            self.timer.start()

    def _late(self) -> None:
        """The timer's thread: a terminal's bar only (a notebook's line is drawn from the kernel's own thread)."""
        with self.lock:
            if not self.closed and self.bar is None and self._console().is_terminal:
                self._start()

    def _start(self) -> None:
        """The bar on a terminal, the line in a notebook, nothing elsewhere."""
        console = self._console()
        if console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn
            self.bar = Progress(TextColumn("{task.fields[label]}"), BarColumn(), TextColumn("{task.fields[count]}"),
                                TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[left]}"),
                                console=console, transient=True)
            self.bar.start()
            self.task = self.bar.add_task("run", total=self.total, completed=self.done, **self._fields())
        elif in_notebook():          # a kernel's stderr is no terminal: the line goes in the cell's output
            from IPython.display import display
            self.cell = display(self._plain(), display_id=True)

    def _fields(self) -> dict[str, str]:
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        rate = self.fresh / elapsed
        left = (self.total - self.done) / rate if rate > 0 else float("nan")
        return {"label": self.text, "count": f"{min(self.done, self.total):,}/{self.total:,} {self.unit}",
                "rate": f"{rate:,.0f} {self.unit}/s" if rate >= 10 else f"{rate:,.1f} {self.unit}/s",
                "left": f"{_duration(left)} left"}

    def _plain(self) -> str:
        f = self._fields()
        return "  ".join(v for v in (f["label"], f["count"], f["rate"], f["left"]) if v)

    def _update(self, force: bool = False) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=min(self.done, self.total), total=self.total, **self._fields())
        elif self.cell is not None:
            now = time.perf_counter()
            if force or now - self.drawn_at >= NOTEBOOK_EVERY_S:
                self.drawn_at = now
                self.cell.update(self._plain())

    def close(self) -> None:
        with self.lock:
            self._close()

    def _close(self) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
        if self.cell is not None:        # the last count drawn (updates are throttled), then cleared: transient
            self.cell.update(self._plain())
            self.cell.update("")
            self.cell = None
