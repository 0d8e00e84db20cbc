"""Case kind ``rollout``, in parts (docs/rollouts.md, docs/architecture.md):

- :mod:`.model`: the frozen tables (log q, log p, buckets, EOS, the sampler's phases, importance weights and
  their corrections, the rejection mask, alias tables);
- :mod:`.dp`: the one phased dynamic program over a model (numerics: kl_bench.core.rollout_dp);
- :mod:`.oracle`: exact values by aggregate; :mod:`.aggregates`: the kind's table of its aggregates;
- :mod:`.sampler`: paths → draws; :mod:`.gradients`: exact gradients and the token forms' table;
  :mod:`.accumulator`: Monte Carlo gradients from recorded paths; :mod:`.baselines`: group baselines;
- :mod:`.config`: the case's keys and the model they describe; :mod:`.pair`: the pair that composes them.
"""
from .config import RolloutCase, read_bucket_map
from .model import RolloutModel, brute_force_sequences
from .pair import RolloutPair

__all__ = ["RolloutCase", "RolloutModel", "RolloutPair", "brute_force_sequences", "read_bucket_map"]
