"""The names of reservoir.npz's arrays: one array of per-draw values per (case, row), named ``case|row``
(``row``: the row's key within its case, kl_bench.core.draws.row_key). A run makes the names when it writes
its folder (kl_bench.experiment.case), the report finds a row's draws by them (its ECDF figures): both
through :func:`reservoir_key`; :func:`split_reservoir_key` reads a name back."""
from __future__ import annotations

SEPARATOR = "|"


def reservoir_key(case: str, row: str) -> str:
    """The name of a row's per-draw values in reservoir.npz: ``case|row``."""
    return f"{case}{SEPARATOR}{row}"


def split_reservoir_key(key: str) -> tuple[str, str]:
    """(case, row) of a name made by :func:`reservoir_key`: split at its last |, since a case's name may
    hold one and a row key (estimator, λ, aggregate) holds none."""
    case, _, row = key.rpartition(SEPARATOR)
    return case, row
