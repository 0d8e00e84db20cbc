"""Typed TOML tables: read keys with conversion and checks, remember which were used, reject the rest
with "did you mean". Every error is a :class:`SpecError` naming the file, the case and the key.

Spec parsing (kl_bench.experiment.spec) and every case kind's parser (kl_bench.kinds.<kind>) read through this.
"""
from __future__ import annotations

import math
import re
import sys
import unicodedata
from typing import Any, Callable

from .errors import SpecError
from .formatting import fmt_count
from .registry import did_you_mean

MISSING = object()
DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


def typename(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(v), type(v).__name__)


def shown(v: Any, most: int = 60) -> str:
    """``repr(v)`` for a message, cut to ``most`` characters (a 10,000-item list stays one short line)."""
    text = repr(v)
    return text if len(text) <= most else text[:most - 1] + "…"


def _to_int(v: Any, err: Callable[[str], SpecError]) -> int:
    # Integral floats are accepted so that `draws = 1e7` works.
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise err(f"must be an integer, got {typename(v)} {shown(v)}")
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        raise err(f"must be an integer, got {shown(v)}")
    return int(v)


def _to_float(v: Any, err: Callable[[str], SpecError]) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise err(f"must be a number, got {typename(v)} {shown(v)}")
    if isinstance(v, int) and abs(v) > 1e308:       # float(v) would raise OverflowError
        raise err("must be a finite number, got an integer beyond float64's range")
    if not math.isfinite(v):
        raise err(f"must be finite, got {shown(v)}")
    # Subnormal numbers (0 < |v| < 2.2e-308) have lost precision, and 1/v overflows float64: no
    # parameter means such a value (a temperature of 1e-320 would divide logits by zero).
    if v != 0 and abs(v) < sys.float_info.min:
        raise err(f"must be 0 or at least {sys.float_info.min:.3g} in magnitude (a subnormal number), got {v!r}")
    return float(v)


def _to_str(v: Any, err: Callable[[str], SpecError]) -> str:
    if not isinstance(v, str):
        raise err(f"must be a string, got {typename(v)} {shown(v)}")
    return v


def _to_float_or_list(v: Any, err: Callable[[str], SpecError]) -> tuple[float, ...]:
    if isinstance(v, list) and not v:
        raise err("must not be an empty list")
    return tuple(convert(x, "float", err) for x in (v if isinstance(v, list) else [v]))


def _to_str_list(v: Any, err: Callable[[str], SpecError]) -> tuple[str, ...]:
    if not isinstance(v, list):
        raise err(f"must be a list of strings, got {typename(v)}")
    return tuple(convert(x, "str", err) for x in v)


CONVERTERS: dict[str, Callable[[Any, Callable[[str], SpecError]], Any]] = {
    "int": _to_int, "float": _to_float, "str": _to_str, "float_or_list": _to_float_or_list, "str_list": _to_str_list}


def convert(v: Any, kind: str, err: Callable[[str], SpecError]) -> Any:
    """``v`` as 'int', 'float', 'str', 'float_or_list' (a tuple) or 'str_list' (a tuple) (:data:`CONVERTERS`)."""
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0 and not isinstance(v, (bool, int, float, str)):
        v = v.item()                  # a numpy or torch scalar from a dict spec
    return CONVERTERS[kind](v, err)


# ----------------------------------------------------------------------------- size limits
# Draws are counted and summed in float64 (batch sizes, bincount totals, the sums of features): beyond
# 2^53 a count is no longer exact. No realistic run comes near it (10^8 draws take seconds).
MAX_DRAWS = 1 << 53
# Batch means are kept in memory (one row of sums each) and seeded one by one.
MAX_BATCHES = 1 << 20
# Rollout length T: every rollout and every exact dynamic-programming moment takes T sequential steps.
MAX_LENGTH = 1 << 20
def at_most(bound: int, why: str) -> Callable[[Any], str | None]:
    """A check: an integer in [1, bound]."""
    def check(v: Any) -> str | None:
        if v <= 0:
            return f"must be > 0, got {fmt_count(v)}"
        if v > bound:
            return f"must be ≤ {fmt_count(bound)} ({why}), got {fmt_count(v)}"
        return None
    return check


# Seeds are 64-bit everywhere they are stored or handed on (checkpoints, numpy and torch generators).
MAX_SEED = (1 << 64) - 1


def check_seed(v: int) -> str | None:
    """The check of every seed a spec or a flag holds: a whole number in [0, 2^64)."""
    if v < 0:
        return f"must be ≥ 0, got {fmt_count(v)}"
    return f"must be < 2^64 (seeds are 64-bit), got {fmt_count(v)}" if v > MAX_SEED else None


def positive(v: Any) -> str | None:
    vals = v if isinstance(v, tuple) else (v,)
    return None if all(x > 0 for x in vals) else f"must be > 0, got {v if not isinstance(v, tuple) or len(v) > 1 else v[0]}"


def nonnegative(v: Any) -> str | None:
    return None if v >= 0 else f"must be ≥ 0, got {v}"


def check_device(v: str) -> str | None:
    return None if DEVICE_RE.match(v) else f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got '{v}'"


def check_case_name(v: str) -> str | None:
    # Names label rows and figure files: any printable text without slashes.
    if not v or not v.isprintable() or "/" in v or "\\" in v or v != v.strip():
        return f"must be non-empty printable text without slashes or surrounding spaces, got {shown(v)}"
    # Unicode's composed form only: 'café' with a combining accent (NFD) printed exactly like the composed one
    # in every table, so two cases could not be told apart; one spelling per name that looks the same.
    if unicodedata.normalize("NFC", v) != v:
        return (f"must be written in Unicode's composed form (NFC), got {ascii(v)}: write "
                f"{ascii(unicodedata.normalize('NFC', v))}")
    return None


class Table:
    """Reads keys from one TOML table (a dict), remembering which were used, to reject the rest."""

    def __init__(self, data: Any, file: str, case: str | None, prefix: str):
        self.file, self.case, self.prefix = file, case, prefix
        if not isinstance(data, dict):
            raise self.error(f"must be a table, got {typename(data)}", key=prefix.rstrip(".") or None)
        self.data = data
        self.used: set[str] = set()
        self.known: set[str] = set()     # keys the parser asked about (has) without reading: still allowed

    def error(self, message: str, key: str | None = None) -> SpecError:
        return SpecError(message, file=self.file, case=self.case, key=key)

    def key(self, k: str) -> str:
        return f"{self.prefix}{k}"

    def has(self, k: str) -> bool:
        self.known.add(k)
        return k in self.data

    def raw(self, k: str) -> Any:
        """The value of key ``k`` as given (marking it used), or None."""
        self.used.add(k)
        return self.data.get(k)

    def get(self, k: str, kind: str, default: Any = MISSING,
            check: Callable[[Any], str | None] | None = None) -> Any:
        """Return key ``k`` converted to ``kind`` (see :func:`convert`), or ``default``; ``check``
        returns an error message or None."""
        self.used.add(k)
        if k not in self.data:
            if default is MISSING:
                raise self._missing(k)
            return default
        value = convert(self.data[k], kind, lambda m: self.error(m, key=self.key(k)))
        if check is not None:
            msg = check(value)
            if msg:
                raise self.error(msg, key=self.key(k))
        return value

    def _missing(self, k: str) -> SpecError:
        """A required key that is absent: a misspelt key is the likelier story than a forgotten one."""
        typo = [x for x in self.data if x not in self.used and did_you_mean(x, [k])]
        if typo:
            return self.error(f"unknown key (did you mean '{k}'?)", key=self.key(typo[0]))
        return self.error("missing required key", key=self.key(k))

    def bool(self, k: str, default: bool) -> bool:
        self.used.add(k)
        v = self.data.get(k, default)
        if not isinstance(v, bool):
            raise self.error(f"must be true or false, got {typename(v)} {shown(v)}", key=self.key(k))
        return v

    def sub(self, k: str) -> "Table":
        self.used.add(k)
        if k not in self.data:
            raise self._missing(k)
        return Table(self.data[k], self.file, self.case, f"{self.key(k)}.")

    def finish(self, allowed: list[str] | None = None) -> None:
        allowed = list(self.used | self.known) if allowed is None else allowed
        for k in self.data:
            if k not in self.used:
                raise self.error(f"unknown key{did_you_mean(k, allowed)}; allowed: "
                                 f"{', '.join(sorted(allowed))}", key=self.key(k))
