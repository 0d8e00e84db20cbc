"""The Python API, one module per job (names loaded on first use, so that ``kl_bench.estimate`` loads no
case kind and the command line starts before torch):

- :mod:`.preparation`: a spec loaded, checked and its pairs built (``load``, ``prepare``, ``resolve_device``)
- :mod:`.execution`: sampling it (``run``, ``execute``) → :class:`.result.Result` (``load_results`` reads a folder)
- :mod:`.exact_table`: the exact table, no sampling (``exact``)
- :mod:`.checking`: the regression gate (``check`` → ``CheckReport``)
- :mod:`.trajectories`: optimisation trajectories (``train``)
- :mod:`.estimation`: per-token values on a trainer's tensors (``estimate``)
- :mod:`.run_folder`: a run or a training written to its folder, as the command line does it (locks,
  checkpoints, resume, the torchrun handshake)
- :mod:`.provenance`: run.json's fields on where and with what a result was made
"""
from __future__ import annotations

from ..foundation.lazy import lazy_names

_EXPORTS = {
    "load": "preparation", "prepare": "preparation", "resolve_device": "preparation", "Prepared": "preparation",
    "run": "execution", "execute": "execution", "Result": "result", "load_results": "result",
    "exact": "exact_table", "check": "checking", "CheckReport": "checking", "train": "trajectories",
    "estimate": "estimation", "run_to_folder": "run_folder", "train_to_folder": "run_folder",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
