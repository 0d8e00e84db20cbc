"""A stored CSV table checked as it is read back: its structure (UTF-8, a newline at the end, every row as
wide as the header, no duplicate column), its required columns and rows, numbers where numbers belong, and
whole numbers where counts belong; each failure one line naming the file, the column and the row."""
from __future__ import annotations

import codecs
import csv
import io
from pathlib import Path

import numpy as np

from ..foundation.errors import SpecError
from .frames import read_frame

BOM = codecs.BOM_UTF8    # what a spreadsheet puts before the header of a CSV it saves as UTF-8


def check_csv_structure(data: bytes, p: Path) -> list[str]:
    """The header; every row has as many fields as it, and the file ends with a newline. A UTF-8 byte-order
    mark before the header (a spreadsheet's "CSV UTF-8") is read past, as the table's reader (pandas) does:
    kl-bench writes none, so such a file has been saved by another program, and its recorded sha256 refuses
    it first (:func:`check_hashes` says so) unless run.json's was updated to match."""
    skip = len(BOM) if data.startswith(BOM) else 0
    try:
        text = data[skip:].decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"not UTF-8 text at byte {e.start + skip} (corrupted?)", file=str(p)) from None
    if "\x00" in text:
        raise SpecError("contains NUL bytes (corrupted?)", file=str(p))
    if not text.strip():
        raise SpecError("is empty (truncated?)", file=str(p))
    if not text.endswith("\n"):
        raise SpecError("does not end with a newline (truncated?)", file=str(p))
    rows = csv.reader(io.StringIO(text))
    try:
        header = next(rows)
        for i, row in enumerate(rows, start=2):
            if len(row) != len(header):
                raise SpecError(f"line {i} has {len(row)} fields, the header {len(header)} (truncated or corrupted?)",
                                file=str(p))
    except csv.Error as e:
        raise SpecError(f"malformed CSV: {e}", file=str(p)) from None
    dupes = sorted({c for c in header if header.count(c) > 1})
    if dupes:
        raise SpecError(f"duplicate columns {', '.join(dupes)}", file=str(p))
    return header


def first_bad(df, c: str, bad, what: str, p: Path) -> None:
    """One line for the first row where ``bad`` (a bool array over ``df``'s rows) holds: the file, the column,
    the row and its line, its case where the table has one, and the value as read."""
    rows = np.flatnonzero(bad)
    if len(rows):
        i = int(rows[0])
        case = f" (case {df['case'].iloc[i]!r})" if "case" in df.columns else ""
        value = df[c].iloc[i]
        value = value.item() if isinstance(value, np.generic) else value     # nan, -1: not np.float64(nan)
        raise SpecError(f"column '{c}' {what}, but row {i + 1} (line {i + 2}){case} has {value!r}", file=str(p))


# The whole-number columns of a train or an audit folder's tables (parsed as numbers only): a blank, NaN or inf
# step read back would fail far from the file, in a figure's axis or int(nan).
WHOLE_COLUMNS = {"train.csv": ("step", "draws", "seeds"), "audit.csv": ("step",), "engine.csv": ("step",)}


def check_whole_columns(name: str, df, p: Path) -> None:
    """The :data:`WHOLE_COLUMNS` of table ``name`` hold a whole number ≥ 0 on every row; else one line naming
    the file, the column and the row (and its line)."""
    check_whole(df, WHOLE_COLUMNS.get(name, ()), p)


def check_whole(df, columns, p: Path) -> None:
    """Each of ``columns`` that ``df`` has holds a whole number ≥ 0 on every row (:func:`first_bad`)."""
    for c in columns:
        if c in df.columns:
            v = df[c].to_numpy(dtype=float)
            first_bad(df, c, ~np.isfinite(v) | (v < 0) | (v != np.round(v)), "must be a whole number ≥ 0", p)


def parse_csv(data: bytes, p: Path, required: list[str]):
    """A CSV table's DataFrame: its structure, its ``required`` columns and at least one row checked."""
    header = check_csv_structure(data, p)
    missing = [c for c in required if c not in header]
    if missing:
        raise SpecError(f"missing columns {', '.join(missing)} (not a kl-bench {p.name}?)", file=str(p))
    try:
        df = read_frame(data)
    except Exception as e:      # noqa: BLE001 - pandas raises many kinds; all mean "cannot parse"
        raise SpecError(f"cannot parse: {e.__class__.__name__}: {(str(e).splitlines() or [''])[0]}",
                        file=str(p)) from None
    if df.empty:
        raise SpecError("has a header but no rows (truncated?)", file=str(p))
    return df


def check_numeric_columns(df, numeric: list[str], p: Path) -> None:
    """Each of ``numeric`` parsed as numbers (not booleans, not text); one line naming the first bad cell."""
    import pandas as pd
    for c in numeric:
        col = df[c]
        if pd.api.types.is_bool_dtype(col) or not pd.api.types.is_numeric_dtype(col):
            values = pd.to_numeric(col.astype("string"), errors="coerce")
            bad = col[values.isna() & col.notna()]
            i = int(bad.index[0]) if len(bad) else 0
            shown = bad.iloc[0] if len(bad) else col.iloc[0]
            raise SpecError(f"column '{c}' must hold numbers, but row {i + 1} (line {i + 2}) has {str(shown)[:40]!r}",
                            file=str(p))
