"""gates.csv: every case's gates at every threshold of ``[experiment] gates``, exact (kl_bench.core.gates)."""
from __future__ import annotations

import dataclasses

import pandas as pd

from ..core.gates import GATES
from ..kinds.protocols import CasePair
from ..results.schema import GATE_SCHEMA


def check_gates(spec, pair: CasePair) -> None:
    """Refuse (SpecError, from the pair) a case whose kind has no exact gate rates, before any sampling."""
    for name, deltas in spec.experiment.gates[:1]:
        pair.gate_rates(GATES[name], deltas[0])


def gate_frame(spec, pairs: list[CasePair]) -> pd.DataFrame | None:
    """gates.csv's rows: case × gate × δ, in the spec's order (None without ``[experiment] gates``)."""
    if not spec.experiment.gates:
        return None
    rows = []
    for pair in pairs:
        for name, deltas in spec.experiment.gates:
            gate = GATES[name]
            for delta in deltas:
                rates = dataclasses.asdict(pair.gate_rates(gate, delta))
                rows.append({**rates, "case": pair.name, "formula": gate.formula})
    return pd.DataFrame(rows, columns=list(GATE_SCHEMA))
