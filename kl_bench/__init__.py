"""kl-bench: Monte Carlo KL-estimator benchmarking against exact oracles.

The Python API (see README "Python API" and :mod:`kl_bench.api`, one module per job):

- :func:`run` (a spec path, :class:`Spec` or dict → :class:`Result`), :meth:`Result.write`,
  :meth:`Result.report`
- :func:`exact` (the exact table, no sampling) and :func:`check` (the regression gate → CheckReport)
- :func:`load_results` (a results folder → :class:`Result`, with its advice and report)
- :func:`estimate` (per-token values of any estimator on a trainer's log-prob tensors)
- the trainer audit (:mod:`kl_bench.audit`): :func:`position_values`, :func:`stream_values`,
  :class:`Sampler` and :func:`sampler_logprobs` (generation's b, exactly), :class:`AuditLog`
- :data:`ESTIMATORS` (a read-only mapping) and :func:`register_estimator` (plug-ins)

Names are loaded on first use (PEP 562), so that importing the package is instant and the command line
can install its signal handlers before torch loads.
"""
from .foundation.lazy import lazy_names
from .foundation.version import __version__  # noqa: F401  (in __all__)

_EXPORTS = {
    "CheckReport": "api.checking", "Result": "api.result", "check": "api.checking", "estimate": "api.estimation",
    "exact": "api.exact_table", "load": "api.preparation", "load_results": "api.result", "run": "api.execution",
    "train": "api.trajectories", "SpecError": "foundation.errors", "ShapeError": "foundation.errors",
    "ESTIMATORS": "core.estimators", "Estimator": "core.estimators", "register_estimator": "core.estimators",
    "CASE_KINDS": "kinds", "Pair": "kinds", "register_kind": "kinds",
    "Spec": "experiment.spec", "load_spec": "experiment.spec", "parse_spec": "experiment.spec",
    "TARGETS": "core.targets",
    # the trainer audit (docs/audit.md)
    "AuditLog": "audit", "Sampler": "audit", "sampler_logprobs": "audit", "position_values": "audit",
    "stream_values": "audit",
}

__all__ = sorted(["__version__", *_EXPORTS])


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
