"""Audit a trainer's KL: exact per-position values from its own logits or hidden states, step audits
of its estimate, and an accumulator that pools steps into a results folder (docs/audit.md)."""
from .aggregate import LOSS_AGGREGATIONS, aggregate, aggregation_weights
from .exact import PositionValues, position_values
from .generation import Sampler, sampler_logprobs
from .step import AUDIT_COLUMNS, AuditLog, StepAudit, audit_step, step_sums
from .stream import stream_kl, stream_values
from .stream_plan import Outputs
from .tiling import Head

__all__ = ["LOSS_AGGREGATIONS", "AUDIT_COLUMNS", "AuditLog", "Head", "Outputs", "PositionValues", "Sampler", "StepAudit",
           "aggregate", "aggregation_weights", "audit_step", "position_values", "sampler_logprobs", "step_sums",
           "stream_kl", "stream_values"]
