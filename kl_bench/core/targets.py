"""Targets: what an estimator estimates. A typed registry, so that a row is never compared with the
truth of another quantity: every pair states the targets it has exact values for, and asking it for
another one is an error (see :meth:`kl_bench.kinds.defaults.Pair.true_value`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..foundation.registry import Registry


@dataclass(frozen=True)
class Target:
    name: str          # as written in summary.csv's `target` column
    formula: str
    description: str


TARGETS: Registry[Target] = Registry("target")

# The reverse KL that trainers penalise, and the forward KL estimated from the same draws x ~ q.
REVERSE = TARGETS.add("KL(q||p)", Target("KL(q||p)", "E_q[log q/p] = E_q[−log r]", "reverse KL: what RL trainers penalise")).name
FORWARD = TARGETS.add("KL(p||q)", Target("KL(p||q)", "E_p[log p/q] = E_q[r log r]", "forward KL, from the same draws x ~ q")).name


def check_target(name: str) -> str:
    """Return ``name`` if it is a registered target (else UnknownName with a suggestion)."""
    return TARGETS[name].name
# Total variation, per context: ½ Σ_x |q(x|c) − p(x|c)|, averaged over the contexts a draw meets (a categorical's
# B contexts; along a rollout, summed over the steps like the per-step KLs, E_q[Σ_t TV(c_t)], which for T > 1 is
# not the TV of the two sequence laws: the trainers that gate by TV gate each token by its own context's).
TV = TARGETS.add("TV(q,p)", Target("TV(q,p)", "½ Σ_x |q(x) − p(x)| per context", "total variation of each token's context")).name
