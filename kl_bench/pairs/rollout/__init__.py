"""Case kind ``rollout`` (a package: the pair and its config in :mod:`.pair`, gradient oracles in
:mod:`.gradients`; the generic dynamic program is kl_bench.rollout_dp)."""
from .pair import RolloutCase, RolloutPair, brute_force_sequences, read_bucket_map

__all__ = ["RolloutCase", "RolloutPair", "brute_force_sequences", "read_bucket_map"]
