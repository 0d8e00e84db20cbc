"""Optimisation trajectories from a script (:func:`train`): train.csv's rows and run.json's envelope in
memory (kl_bench.training, docs/training.md)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..foundation.errors import SpecError
from ..foundation.threads import single_threaded
from .inputs import progress_argument
from .preparation import load, resolve_device
from .provenance import device_name, git_commit, now, versions

if TYPE_CHECKING:
    from ..training import TrainResult


@single_threaded
def train(spec, *, seed: int | None = None, device: str | None = None, ranks=None, progress: bool | None = None,
          console=None) -> "TrainResult | None":
    """Optimisation trajectories of a spec with a ``[train]`` table (kl_bench.training, docs/training.md):
    train.csv's rows and run.json's envelope, in memory; :meth:`TrainResult.write` writes the folder.
    ``ranks``: a torchrun job's :class:`kl_bench.engine.distributed.Ranks` (``kl-bench train`` under torchrun passes
    it): the units are split across the processes and rank 0 gets the result (the others None). Without it,
    a call under torchrun is refused in one line (each process would train everything). ``progress``: as
    :func:`run`'s, in steps of this process's trajectories, on ``console`` (default stderr).

    Arguments of the wrong type (``ranks`` that is not a Ranks, ``progress`` that is not True, False or
    None, ``console`` that is not a rich Console; ``seed`` and ``device`` as the command line's flags) are
    one :class:`SpecError` naming the argument, before anything is read or started."""
    from ..engine.distributed import SINGLE, one_process
    from ..foundation.progress import LazyProgress, wanted
    from ..training import TrainResult, train_rows
    _check_arguments(ranks, progress, console)
    if ranks is None:
        one_process("kl_bench.train", str(spec) if isinstance(spec, (str, Path)) else None)
    sp = load(spec, seed=seed, device=device)
    dev = resolve_device(sp.experiment.device, str(sp.path), "--device" if device is not None else "experiment.device")
    bar = LazyProgress(0, enabled=wanted(progress), console=console, unit="steps")
    try:
        # A diverged trajectory's non-finite values are named per trajectory (TrainResult.warnings), not
        # as numpy's overflow warnings from deep inside the means and spreads over seeds.
        with np.errstate(all="ignore"):
            rows, cfg, wall = train_rows(sp, dev, ranks or SINGLE, bar)
    finally:
        bar.close()
    if rows is None:
        return None
    exp = sp.experiment
    envelope = {
        "kl_bench_train": 1,
        "created": now(),
        "spec_path": str(sp.path), "spec_sha256": sp.sha256, "spec_text": sp.text,
        "experiment": exp.name, "seed": exp.seed, "device": str(dev), "device_name": device_name(dev),
        "versions": versions(), "git_commit": git_commit(), "wall_seconds": round(wall, 3),
        "world_size": 1 if ranks is None else ranks.world_size,
        "train": {"optimizer": cfg.optimizer.name, "lr": cfg.optimizer.lr, "steps": cfg.steps, "beta": cfg.beta,
                  "gradients": list(cfg.gradients), "draws_per_step": cfg.draws or exp.draws, "seeds": cfg.seeds,
                  "reward": cfg.reward.kind, "combinations": list(cfg.combinations)},
    }
    if cfg.reward.function is not None:           # a per-sequence reward: its registry name or plug-in reference
        envelope["train"]["reward_function"] = cfg.reward.function.name
    return TrainResult(rows, envelope)


def _check_arguments(ranks, progress, console) -> None:
    """:func:`train`'s ``ranks``, ``progress`` and ``console``, each of its type or one SpecError naming it
    (``ranks=(0, 2)`` had been an AttributeError from deep inside the training loop)."""
    from ..engine.distributed import Ranks
    if ranks is not None and not isinstance(ranks, Ranks):
        raise SpecError(f"must be a kl_bench.engine.distributed.Ranks (this process's place in a torchrun job, "
                        f"from kl_bench.engine.distributed.start) or None, got {type(ranks).__name__} {ranks!r}",
                        key="ranks")
    progress_argument(progress)
    if console is not None:
        from rich.console import Console
        if not isinstance(console, Console):
            raise SpecError(f"must be a rich.console.Console or None (None: stderr), got {type(console).__name__}",
                            key="console")
