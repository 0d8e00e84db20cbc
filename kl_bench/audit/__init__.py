"""Audit a trainer's KL: exact per-position values from its own logits or hidden states, step audits
of its estimate, and an accumulator that pools steps into a results folder (docs/audit.md)."""
from .exact import PositionValues, position_values
from .sampler import Sampler, sampler_logprobs
from .stream import Head, stream_values

__all__ = ["Head", "PositionValues", "Sampler", "position_values", "sampler_logprobs", "stream_values"]
