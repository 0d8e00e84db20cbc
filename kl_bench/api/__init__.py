"""The Python API, one module per job (names loaded on first use, so that ``kl_bench.estimate`` loads no
case kind and the command line starts before torch):

- :mod:`.preparation`: a spec loaded, checked and its pairs built (``load``, ``prepare``, ``resolve_device``)
- :mod:`.execution`: sampling it (``run``, ``execute``) → :class:`.result.Result` (``load_results`` reads a folder)
- :mod:`.exact_table`: the exact table, no sampling (``exact``)
- :mod:`.checking`: the regression gate (``check`` → ``CheckReport``)
- :mod:`.trajectories`: optimisation trajectories (``train``)
- :mod:`.estimation`: per-token values on a trainer's tensors (``estimate``)
- :mod:`.folders`: a run or a training written to its folder, as the command line does it (locks,
  checkpoints, resume, the torchrun handshake)
- :mod:`.provenance`: run.json's fields on where and with what a result was made
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "load": "preparation", "prepare": "preparation", "resolve_device": "preparation", "Prepared": "preparation",
    "run": "execution", "execute": "execution", "Result": "result", "load_results": "result",
    "exact": "exact_table", "check": "checking", "CheckReport": "checking", "train": "trajectories",
    "estimate": "estimation", "run_to_folder": "folders", "train_to_folder": "folders",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kl_bench.api' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
