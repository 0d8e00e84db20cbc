"""User-facing errors: one line, exit code 2, no traceback.

Every bad input (spec file, case, key, CLI flag) raises :class:`SpecError`. The CLI prints
``str(err)`` on one line and exits with code 2; nothing is written before validation ends.
"""
from __future__ import annotations


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
        if self.key:
            parts.append(f"key '{self.key}'")
        parts.append(self.message)
        return ": ".join(parts).replace("\n", " ")


class ShapeError(SpecError, ValueError):
    """Tensors of the wrong shape handed to the Python API (e.g. :func:`kl_bench.estimate`): a
    ``ValueError`` as numerical code expects, and a :class:`SpecError` (one line) for the CLI."""
