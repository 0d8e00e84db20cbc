"""A spec end to end: parsing (:mod:`.spec`), one case's passes and summary rows (:mod:`.case`), the λ sweep
(:mod:`.lambdas`), gradient rows (:mod:`.gradient_rows`) and group baselines (:mod:`.group_baselines`).

``kl_bench.experiment`` was a module before the package tree (issue 34); its names still resolve here, with
a DeprecationWarning, for one release."""
from .._moved import forward as _forward

__getattr__ = _forward(__name__, "kl_bench.experiment.case")
