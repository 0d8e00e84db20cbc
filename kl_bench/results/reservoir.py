"""The names of reservoir.npz's arrays: one array of per-draw values per (case, row), named ``case|row``
(``row``: the row's key within its case, kl_bench.core.draws.row_key). A run makes the names when it writes
its folder (kl_bench.experiment.case), the report finds a row's draws by them (its ECDF figures): both
through :func:`reservoir_key`."""
from __future__ import annotations

SEPARATOR = "|"


def reservoir_key(case: str, row: str) -> str:
    """The name of a row's per-draw values in reservoir.npz: ``case|row``."""
    return f"{case}{SEPARATOR}{row}"
