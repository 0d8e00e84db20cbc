"""The engine: seeded batches and their feature sums (:mod:`.monte_carlo`) and torchrun ranks
(:mod:`.distributed`).

``kl_bench.engine`` was a module before the package tree (issue 34); its names still resolve here, with a
DeprecationWarning, for one release."""
from .._moved import forward as _forward

__getattr__ = _forward(__name__, "kl_bench.engine.monte_carlo")
