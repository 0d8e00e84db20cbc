"""User-facing errors: one line, exit code 2, no traceback.

Every bad input (spec file, case, key, CLI flag) raises :class:`SpecError`. The CLI prints
``str(err)`` on one line and exits with code 2; nothing is written before validation ends.
"""
from __future__ import annotations

import re


class SpecError(Exception):
    """A bad spec or bad input, located as precisely as possible.

    Rendered as ``FILE: case 'NAME': key 'KEY': MESSAGE`` with absent parts left out.
    """

    def __init__(self, message: str, *, file: str | None = None, case: str | None = None,
                 key: str | None = None):
        self.message = message
        self.file = file
        self.case = case
        self.key = key
        super().__init__(str(self))

    def located(self, *, file: str | None = None, case: str | None = None,
                key: str | None = None) -> "SpecError":
        """Return a copy with missing location parts filled in."""
        return SpecError(self.message, file=self.file or file, case=self.case or case,
                         key=self.key or key)

    def __str__(self) -> str:
        parts = []
        if self.file:
            parts.append(self.file)
        if self.case:
            parts.append(f"case '{self.case}'")
        if self.key and self.key.endswith("="):        # an argument of the Python API (:func:`argument`)
            parts.append(f"argument '{self.key[:-1]}'")
        elif self.key:
            parts.append(f"key '{self.key}'")
        parts.append(self.message)
        return ": ".join(parts).replace("\n", " ")

    def as_flags(self) -> "SpecError":
        """The error as the command line says it: an API argument (``draws=``) named by its flag (``--draws``);
        the API's own errors never name a flag its caller never typed."""
        if not (self.key and self.key.endswith("=")):
            return self
        return SpecError(self.message, file=self.file, case=self.case, key="--" + self.key[:-1].replace("_", "-"))


def argument(name: str) -> str:
    """The key of an error in an argument of the Python API (``draws``): said as "argument 'draws'", and as its
    flag ``--draws`` by the command line (:meth:`SpecError.as_flags`)."""
    return name + "="


class ShapeError(SpecError, ValueError):
    """Tensors of the wrong shape handed to the Python API (e.g. :func:`kl_bench.estimate`): a
    ``ValueError`` as numerical code expects, and a :class:`SpecError` (one line) for the CLI."""


class OutOfMemory(SpecError, MemoryError):
    """An allocation that failed, said as input errors are (one line naming the file and case, what was being
    done and what to change: exit 2), and a :class:`MemoryError` for code that catches those
    (kl_bench.foundation.memory.out_of_memory_said raises it)."""


def is_out_of_memory(e: BaseException) -> bool:
    """A failed allocation: Python's MemoryError, torch's on the host (DefaultCPUAllocator) or on a GPU."""
    text = str(e)
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or \
        "can't allocate memory" in text or "out of memory" in text.lower()


def memory_words(e: BaseException) -> str:
    """The failed allocation in a few words: "could not allocate 1.1 GiB" (on the GPU: "CUDA could not
    allocate 2.00 GiB") where the message says how much, else its own words on one line, short
    ("MemoryError" for a bare one)."""
    words = " ".join(str(e).split())
    asked = re.search(r"tried to allocate (\d+ bytes|[\d.]+ ?[KMGTP]i?B)", words, re.IGNORECASE)
    if asked:
        size = asked.group(1)
        if size.endswith("bytes"):
            from .formatting import fmt_bytes
            size = fmt_bytes(int(size.split()[0]))
        return f"{'CUDA ' if 'CUDA' in words else ''}could not allocate {size}"
    return (words[:117] + "…" if len(words) > 120 else words) or type(e).__name__
