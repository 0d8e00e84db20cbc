"""Arguments of the Python API checked at the door: a path that is not one, a number that is not one, a
results folder the command line would refuse. Each is one :class:`SpecError` naming the argument, as the
command line's flags get, never a TypeError from pathlib or a comparison deep inside."""
from __future__ import annotations

import math
import os
from pathlib import Path

from ..foundation.errors import SpecError


def path_argument(value, key: str, what: str = "a path (a str or pathlib.Path)") -> Path:
    """``value`` (a str or an os.PathLike) as a Path; anything else (an int, None, bytes) is refused naming
    ``key`` and saying it must be ``what``. Bytes are refused too: every path kl-bench writes or prints is
    text."""
    if isinstance(value, (str, os.PathLike)) and not isinstance(os.fspath(value), bytes):
        return Path(value)
    raise SpecError(f"must be {what}, got {type(value).__name__}", key=key)


def results_folder(value, key: str) -> Path:
    """A folder the API is asked to write: a path (:func:`path_argument`) that the command line's ``--out``
    would accept (not '', '.' or '..', no file, no symbolic link, a writable place:
    :func:`kl_bench.foundation.output_paths.check_output_dir`). Writing '.' swaps the working folder itself, and
    '..' its parent, for the results: refused before anything is staged."""
    from ..foundation.output_paths import check_output_dir
    return check_output_dir(path_argument(value, key), key)


def number_argument(value, key: str, *, integer: bool = False) -> float | int:
    """``value`` if it is a real number (an int, or a float unless ``integer``; numpy and torch scalars as
    their Python number), else one SpecError naming ``key``. A bool is refused: True is an int to Python,
    but ``alpha=True`` is a mistake, not 1. NaN is refused: every comparison with it is false."""
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:        # numpy / torch 0-d scalars
        value = item()
    types = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, types):
        what = "a whole number" if integer else "a number"
        raise SpecError(f"must be {what}, got {type(value).__name__} {value!r}", key=key)
    if isinstance(value, float) and math.isnan(value):
        raise SpecError("must be a number, got NaN", key=key)
    return value


def progress_argument(value, key: str = "progress") -> bool | None:
    """A ``progress`` switch: True, False or None (None: on in a notebook), else one SpecError naming it
    (``progress="yes"`` had been taken as true, ``progress=0.5`` too)."""
    if value is None or isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_":                              # numpy's bool
        return bool(value)
    raise SpecError(f"must be True, False or None (None: on in a notebook), got {type(value).__name__} {value!r}",
                    key=key)
