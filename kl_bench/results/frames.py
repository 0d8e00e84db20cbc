"""Results tables as bytes and back: the one writer and the one reader of every results CSV."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .schema import COLUMNS, TEXT_COLUMNS

if TYPE_CHECKING:
    import pandas as pd


def to_frame(rows: list[dict[str, Any]]) -> "pd.DataFrame":
    import pandas as pd
    return pd.DataFrame(rows, columns=COLUMNS)


def frame_to_csv_bytes(df: "pd.DataFrame") -> bytes:
    # repr-exact floats (17 significant digits) so that re-reading gives identical numbers;
    # NaN is written as an empty field, ±inf as inf/-inf.
    return df.to_csv(index=False, float_format="%.17g").encode()




def read_frame(source) -> "pd.DataFrame":
    """A results CSV (bytes or a path) as written by :func:`frame_to_csv_bytes`: text columns as strings
    with "" for empty cells, numbers as float64 or int64. The one reader of results tables, so that a
    DataFrame in memory and the file on disk read back identically."""
    import io

    import pandas as pd
    data = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    head = pd.read_csv(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source, nrows=0)
    text = [c for c in TEXT_COLUMNS if c in head.columns]
    df = pd.read_csv(data, dtype={c: object for c in text})
    for c in text:
        df[c] = df[c].fillna("")
    return df
