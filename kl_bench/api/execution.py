"""Sampling a spec: :func:`run` (prepare, then :func:`execute` with a progress line).

The Python API does everything the command line does, from a script.

>>> import kl_bench
>>> spec = {"spec_version": 1,
...         "experiment": {"name": "doc", "draws": 20_000, "batches": 20, "device": "cpu",
...                        "estimators": ["k1", "k3"]},
...         "case": [{"name": "g", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0},
...                   "p": {"mean": 0.5, "std": 1.0}}]}
>>> result = kl_bench.run(spec)
>>> result.summary[["estimator", "true_kl"]].values.tolist()
[['k1', 0.125], ['k3', 0.125]]
>>> bool((result.summary["z"].abs() < 5).all())
True
>>> kl_bench.exact(spec)["exact_mean"].round(6).tolist()
[0.125, 0.125]

The command line is a thin layer over :func:`run`, :func:`exact` and :func:`check`:
``kl_bench.run(path, draws=N, seed=S).summary`` equals the ``summary.csv`` that
``kl-bench run path --draws N --seed S`` writes, and :meth:`Result.write` writes that very folder.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..foundation.threads import single_threaded
from .inputs import progress_argument
from .preparation import Prepared, prepare
from .result import Result


@single_threaded
def execute(prep: Prepared, *, progress=None, resume: dict[str, torch.Tensor] | None = None,
            on_sums: Callable[[str, torch.Tensor], None] | None = None, ranks=None) -> "Result | None":
    """Sample a prepared spec. ``progress``: a :class:`kl_bench.foundation.progress.LazyProgress` (or anything with
    ``advance(n)`` and ``label(text)``); ``resume``/``on_sums``: checkpointing (kl_bench.engine.monte_carlo.run_case).
    ``ranks``: this process's place in a multi-process job (:func:`kl_bench.engine.distributed.start`); rank 0
    gets the Result, byte for byte the one-process Result, and the other ranks None."""
    from ..engine.distributed import SINGLE
    from ..experiment.case import run_spec
    outcome = run_spec(prep.spec, prep.pairs, prep.device, progress=None if progress is None else progress.advance,
                       resume=resume, on_sums=on_sums, on_phase=None if progress is None else progress.label,
                       ranks=ranks or SINGLE)
    return None if outcome is None else Result(prep.spec, prep.pairs, outcome, prep.device, resumed=bool(resume))


def run(spec, *, draws: int | None = None, seed: int | None = None, device: str | None = None,
        progress: bool | None = None) -> "Result":
    """Run every case of ``spec`` (a path, a :class:`Spec`, or a dict with the TOML's structure in which
    a categorical or rollout side may be a tensor or ndarray of logits). ``draws``, ``seed`` and
    ``device`` override the spec exactly as the CLI's flags do. Nothing is written: see
    :meth:`Result.write`. ``progress``: a progress line once the run has lasted 2 s (on a terminal's
    stderr, or in the cell of a notebook; never in a pipe or a file); None, the default: on in a Jupyter
    notebook, off elsewhere."""
    from ..experiment.case import total_draws
    from ..foundation.progress import LazyProgress, wanted
    progress_argument(progress)
    prep = prepare(spec, draws=draws, seed=seed, device=device)
    bar = LazyProgress(total_draws(prep.spec), enabled=wanted(progress))
    try:
        return execute(prep, progress=bar)
    finally:
        bar.close()
