"""A report's input: results folders read back and verified (:func:`load_results`), named so that a
report of several tells them apart (:func:`run_labels`), and their summary rows as one frame
(:func:`report_frame`), which the tables, the figures and the differences between runs are made from."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..core.draws import row_label
from ..results.verify import read_results_folder


@dataclass
class Results:
    """One results folder written by `kl-bench run`."""
    path: Path
    name: str
    summary: pd.DataFrame
    envelope: dict
    sweep: pd.DataFrame | None
    batches: pd.DataFrame | None
    reservoir: dict[str, np.ndarray] | None
    gradients: pd.DataFrame | None = None
    group_baselines: pd.DataFrame | None = None
    gates: pd.DataFrame | None = None


def load_results(path: Path) -> Results:
    """Read and verify a results folder (kl_bench.results.verify: sha256 of every data file against run.json,
    schema and dtypes of every table, consistent cases); a missing, incomplete or corrupted folder is a
    one-line SpecError."""
    got = read_results_folder(path)          # in today's format (kl_bench.results.migrate)
    name = got.envelope.get("experiment") if isinstance(got.envelope.get("experiment"), str) else got.path.name
    return Results(got.path, name, got.summary, got.envelope, got.sweep, got.batches, got.reservoir,
                   got.gradients, got.group_baselines, got.gates)


def run_labels(results: list[Results]) -> list[str]:
    """How each folder is named in a report of several: its experiment; with its seed where experiments
    repeat; with its folder's name where those repeat too; numbered as a last resort (never a full path)."""
    exp = [r.name for r in results]
    seeded = [f"{r.name} seed {r.envelope.get('seed')}" for r in results]
    folders = [f"{r.name} ({r.path.name})" for r in results]
    for labels in (exp, seeded, folders):
        if len(set(labels)) == len(labels):
            return labels
    return [f"{lab} #{i + 1}" for i, lab in enumerate(folders)]


def load_report_results(dirs: list[Path]) -> list[Results]:
    """Every folder of a report, read and verified (:func:`load_results`), each named by :func:`run_labels`
    where there are several."""
    results = [load_results(d) for d in dirs]
    if len(results) > 1:
        for r, label in zip(results, run_labels(results)):
            r.name = label
    return results


def report_frame(results: list[Results]) -> pd.DataFrame:
    """Every summary row of every run, with the run's name (``run``), the paper table's case key (``key``:
    the case, prefixed with its run's name where there are several) and the row's label (``label``)."""
    frames = []
    for res in results:
        d = res.summary.copy()
        d["run"] = res.name
        d["key"] = f"{res.name}/" + d["case"] if len(results) > 1 else d["case"]
        d["label"] = [row_label(r) for _, r in d.iterrows()]
        frames.append(d)
    return pd.concat(frames, ignore_index=True)
