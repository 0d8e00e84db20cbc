"""Older results folders brought to today's format when read (kl_bench.results.schema.FORMAT_VERSION).

One function per version step, applied in order to what :func:`kl_bench.results.verify.read_results_folder`
read (after the files were verified against their recorded hashes: a migration never hides damage). The
folder on disk is never rewritten.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from .folders import FORMATS, version_of
from ..core.targets import REVERSE
from .schema import COLUMNS, FORMAT_VERSION, TEXT_COLUMNS

RUN = FORMATS["run"]          # a run's folder (kl_bench.results.folders); train and audit folders have one version


def with_every_column(contents: Any) -> Any:
    """Every summary column of SCHEMA, in its order: those a folder lacks (added since it was written) empty
    (text "" and numbers NaN). Applied to every folder read, whatever its version, so that a new column is one
    entry in SCHEMA (and its value in kl_bench.experiment.rows): no version step, no migration to write."""
    summary = contents.summary.copy()
    for c in COLUMNS:
        if c not in summary.columns:
            summary[c] = "" if c in TEXT_COLUMNS else np.nan
    return dataclasses.replace(contents, summary=summary[COLUMNS + [c for c in summary.columns if c not in COLUMNS]])


def _from_2(contents: Any) -> Any:
    """2 → 3: ess, ref_diff and ref_diff_se, which version 2 did not write; planning columns of rows whose
    truth is unknown become empty (version 2 wrote inf, as if no batch size could ever do).

    ref_diff is the row's best-known mean minus ref_kl: the exact one where it exists (logged log-probs: the
    log's own mean, which version 2's z_ref already used), else the measured one; ref_diff_se follows from
    version 2's z_ref = ref_diff / ref_diff_se where z_ref is finite and not 0 (empty elsewhere). ess stays
    empty: version 2 did not keep the weights' sums."""
    summary = with_every_column(contents).summary.copy()
    ref = summary["ref_kl"].astype(float)
    best = summary["exact_mean"].where(np.isfinite(summary["exact_mean"].astype(float)), summary["mean"]).astype(float)
    diff = (best - ref).where(summary["z_ref"].notna())
    z = summary["z_ref"].astype(float)
    summary["ref_diff"] = summary["ref_diff"].astype(float).fillna(diff)
    summary["ref_diff_se"] = summary["ref_diff_se"].astype(float).fillna((diff / z).abs().where(np.isfinite(z) & (z != 0)))
    unknown = summary["true_kl"].isna()
    for c in ("n_for_10pct", "rmse_b64", "rmse_b1024", "rmse_b16384"):
        summary.loc[unknown, c] = np.nan
    return dataclasses.replace(contents, summary=summary)


def without_forward_reference(contents: Any) -> Any:
    """ref_kl and ref_se on KL(q||p) rows only: folders written before issue 44 gave a KL(p||q) row the
    reverse KL's reference as its own (the tables then divided its std by it); no reference exists for the
    forward KL of those cases, so its ref columns are empty. Applied to every folder read (new ones have none)."""
    summary = contents.summary
    forward = (summary["target"] != REVERSE) & summary["ref_kl"].notna()
    if not forward.any():
        return contents
    summary = summary.copy()
    summary.loc[forward, ["ref_kl", "ref_se", "ref_diff", "ref_diff_se", "z_ref"]] = np.nan
    return dataclasses.replace(contents, summary=summary)


# MIGRATIONS[v] turns a folder of version v into one of version v + 1.
MIGRATIONS: dict[int, Callable[[Any], Any]] = {1: with_every_column, 2: _from_2}


def migrate(contents: Any, where: str) -> Any:
    """``contents`` (a FolderContents of any version we read) in today's format, its envelope saying so."""
    version = version_of(contents.envelope, RUN, where)
    for v in range(version, FORMAT_VERSION):
        contents = MIGRATIONS[v](contents)
    if version != FORMAT_VERSION:
        contents = dataclasses.replace(contents, envelope={**contents.envelope, RUN.version_key: FORMAT_VERSION,
                                                           "migrated_from": version})
    return without_forward_reference(with_every_column(contents))
