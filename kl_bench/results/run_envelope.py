"""run.json's envelope of a run, assembled: the spec, the experiment's settings, the device, provenance, the
timing and ranks of the passes, and each case's own description (kl_bench.results.schema.RUN_ENVELOPE
describes every field). Its inputs are duck-typed (a parsed spec, the case kinds' pairs, the run's outcome):
nothing of the engine or of torch is imported here."""
from __future__ import annotations

from typing import Any

from .schema import FORMAT_VERSION


def run_envelope(spec, pairs, outcome, *, created: str, device: str, device_name: str, versions: dict,
                 git_commit: str | None, resumed: bool = False) -> dict[str, Any]:
    """run.json's fields of a run (the file hashes are added on writing): ``spec`` (path, sha256, text,
    experiment, cases, case_draws()), ``pairs`` (name, metadata()) and ``outcome`` (cases' runs, wall,
    world_size, drawn) as :class:`kl_bench.api.Result` holds them; ``created``, ``device``,
    ``device_name``, ``versions`` and ``git_commit``: provenance the caller took."""
    runs = [o.run for o in outcome.cases]
    exp = spec.experiment
    return {
        "kl_bench_run": FORMAT_VERSION,        # the results format (kl_bench.results.schema)
        "created": created,
        "spec_path": str(spec.path), "spec_sha256": spec.sha256, "spec_text": spec.text,
        "experiment": exp.name, "seed": exp.seed,
        "draws_per_case": {c.name: n for c, n in zip(spec.cases, spec.case_draws())}, "batches": exp.batches,
        "device": device, "device_name": device_name, "versions": versions,
        "git_commit": git_commit, "wall_seconds": round(outcome.wall, 3), "resumed": resumed,
        # Processes that drew the batches, and per case and pass the [lo, hi) batch ranges of each rank
        # (batches restored from a checkpoint are in no range).
        "world_size": outcome.world_size, "rank_batches": outcome.drawn,
        # The rate of this process: draws restored from a checkpoint (--resume) took no sampling time.
        "sampling_seconds": round(sum(r.seconds for r in runs), 3),
        "draws_per_second": round(sum(r.draws - r.restored for r in runs) / max(sum(r.seconds for r in runs), 1e-9)),
        "restored_draws": sum(r.restored for r in runs),
        "cases": {p.name: {**p.metadata(), "seconds": round(r.seconds, 3)} for p, r in zip(pairs, runs)},
    }
