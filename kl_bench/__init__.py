"""kl-bench: Monte Carlo KL-estimator benchmarking against exact oracles."""
__version__ = "0.1.0"

from .errors import SpecError  # noqa: E402
from .estimators import ESTIMATORS, Estimator  # noqa: E402
from .spec import Spec, load_spec, parse_spec  # noqa: E402

__all__ = ["ESTIMATORS", "Estimator", "Spec", "SpecError", "load_spec", "parse_spec", "__version__"]
