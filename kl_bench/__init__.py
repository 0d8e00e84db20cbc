"""kl-bench: Monte Carlo KL-estimator benchmarking against exact oracles.

The Python API (see README "Python API" and :mod:`kl_bench.api`):

- :func:`run` (a spec path, :class:`Spec` or dict → :class:`Result`), :meth:`Result.write`,
  :meth:`Result.report`
- :func:`exact` (the exact table, no sampling) and :func:`check` (the regression gate → CheckReport)
- :func:`estimate` (per-token values of any estimator on a trainer's log-prob tensors)
- :data:`ESTIMATORS` (a read-only mapping) and :func:`register_estimator` (plug-ins)
"""
from .version import __version__
from .api import CheckReport, Result, check, estimate, exact, load, run  # noqa: E402
from .errors import SpecError  # noqa: E402
from .estimators import ESTIMATORS, Estimator, register_estimator  # noqa: E402
from .pairs import CASE_KINDS, Pair, register_kind  # noqa: E402
from .spec import Spec, load_spec, parse_spec  # noqa: E402
from .targets import TARGETS  # noqa: E402

__all__ = ["CASE_KINDS", "CheckReport", "ESTIMATORS", "Estimator", "Pair", "Result", "Spec", "SpecError", "TARGETS",
           "__version__", "check", "estimate", "exact", "load", "load_spec", "parse_spec", "register_estimator",
           "register_kind", "run"]
