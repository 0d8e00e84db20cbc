"""gates.csv: every case's gates at every threshold of ``[experiment] gates``, exact (kl_bench.core.gates)."""
from __future__ import annotations

import dataclasses

import pandas as pd

from ..core.gates import gate as gate_named
from ..foundation.errors import SpecError
from ..kinds.protocols import CasePair
from ..results.schema import GATE_SCHEMA


def check_gates(spec, pair: CasePair) -> None:
    """Refuse (SpecError) a case whose kind has no exact gate rates, or a top-K gate with K beyond its
    vocabulary, before any sampling (each gate at its first δ: cheap, and the rollout's visits are cached)."""
    for name, deltas in spec.experiment.gates:
        try:
            pair.gate_rates(gate_named(name), deltas[0])
        except ValueError as e:
            raise SpecError(f"gate '{name}': {e}", key="experiment.gates") from None


def gate_frame(spec, pairs: list[CasePair]) -> pd.DataFrame | None:
    """gates.csv's rows: case × gate × δ, in the spec's order (None without ``[experiment] gates``)."""
    if not spec.experiment.gates:
        return None
    rows = []
    for pair in pairs:
        for name, deltas in spec.experiment.gates:
            gate = gate_named(name)
            for delta in deltas:
                rates = dataclasses.asdict(pair.gate_rates(gate, delta))
                rows.append({**rates, "case": pair.name, "formula": gate.formula})
    return pd.DataFrame(rows, columns=list(GATE_SCHEMA))
