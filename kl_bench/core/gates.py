"""Gates: a threshold on a per-token divergence statistic, used as a mask, with its exact rates and biases.
The gates (``bin_kl``, ``bin_tv``, ``k3``, ``ratio``, ``topk_kl@K``, ``topk_tv@K``, ``kl``), the trainers and
papers they come from, and every rate's formula: docs/gates.md.

In kl-bench's notation the token is x ~ q and the other policy is p, r = p(x)/q(x); a gate masks the token
when its statistic exceeds δ, and a masked token contributes nothing. Every rate below is a sum over the
vocabulary of each context, weighted by how many generated tokens meet that context (``visits``: 1/B per
context for a categorical of B contexts, E_q[#steps in context c] along a rollout). Exact, for any δ, in one
pass over the tables per δ; a rollout's share of sequences with at least one masked token is the dynamic
program with the per-token factor 1{kept} (the caller supplies it: :func:`kl_bench.kinds.rollout.gates`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import torch

from ..foundation.registry import Registry
from .estimators import bin_kl, bin_tv, k3
from .targets import REVERSE, TV
from .oracles import context_tv
from .topk import topk_union_divergences


@dataclass(frozen=True)
class Gate:
    """A per-token statistic s ≥ 0 as a table: ``table(log_q, log_p)`` maps normalised float64 log-probs [C, V] to
    s(c, x) [C, V]; a token is masked when s > δ. ``target``: the divergence the statistic stands for (its
    share of it is reported), None where it is not an estimate of one."""
    name: str
    table: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    formula: str
    source: str
    target: str | None = None


def _token(fn):
    """A statistic of the sampled token's log r and log q as a table."""
    return lambda log_q, log_p: fn(log_p - log_q, log_q)


def _context_kl(log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """KL(q(·|c) ‖ p(·|c)) per context [C], as Σ_x q·k3(log r) (terms ≥ 0: no cancellation)."""
    return (log_q.exp() * k3(log_p - log_q)).sum(-1)


def _per_context(k: int, which: int):
    """The top-K coarsened KL (which = 0) or TV (1) of each context, the same for all its tokens."""
    return lambda log_q, log_p: topk_union_divergences(log_q, log_p, k)[which][:, None].expand_as(log_q)


GATES: Registry[Gate] = Registry("gate")
GATES.add("bin_kl", Gate("bin_kl", _token(bin_kl), "D(q(x) ‖ p(x)) > δ", "DPPO, arXiv 2602.04879 (binary KL)", REVERSE))
GATES.add("bin_tv", Gate("bin_tv", _token(bin_tv), "|q(x) − p(x)| > δ", "DPPO, arXiv 2602.04879 (binary TV)", TV))
GATES.add("k3", Gate("k3", _token(lambda logr, logq: k3(logr)), "r − 1 − log r > δ", "ATR-GRPO, arXiv 2602.05494",
                     REVERSE))
GATES.add("ratio", Gate("ratio", _token(lambda logr, logq: logr.abs()), "|log r| > δ (r outside [e^−δ, e^δ])",
                        "IcePop-style ratio band"))
# Trust Region Masking (Li et al., arXiv 2512.23075): a sequence is masked when any of its positions' token-level
# KL, the whole next-token distribution's KL(q(·|c) ‖ p(·|c)), exceeds δ: the context KL as a gate, whose
# seq_masked is TRM's masked share (its tokens_masked: the tokens of contexts beyond the trust region).
GATES.add("kl", Gate("kl", lambda log_q, log_p: _context_kl(log_q, log_p)[:, None].expand_as(log_q),
                     "KL(q(·|c) ‖ p(·|c)) > δ (the token's context; a sequence: its largest)",
                     "Trust Region Masking, arXiv 2512.23075", REVERSE))
TOPK = re.compile(r"topk_(kl|tv)@([1-9][0-9]*)")


def gate(name: str) -> Gate:
    """A registered gate, or a top-K one named ``topk_kl@K`` / ``topk_tv@K``: the context's KL or TV of q and p
    coarsened to their K most likely tokens each plus one bucket for the rest (DPPO's top-K mask), which
    masks every token of a context whose value exceeds δ."""
    m = TOPK.fullmatch(name)
    if m is None:
        return GATES[name]
    k, which = int(m.group(2)), 0 if m.group(1) == "kl" else 1
    what = ("KL", REVERSE) if which == 0 else ("TV", TV)
    return Gate(name, _per_context(k, which), f"top-{k} {what[0]} of the context > δ",
                "DPPO, arXiv 2602.04879 (top-K)", what[1])


def gate_names() -> list[str]:
    """The names a spec may give: the registered gates and the top-K patterns."""
    return GATES.names() + ["topk_kl@K", "topk_tv@K"]


def k3_band(delta: float) -> tuple[float, float]:
    """The ratios w with w − 1 − log w ≤ δ: [w₋, w₊], w₋ < 1 < w₊, solved by Newton's method from each side
    (the function is convex with its minimum 0 at w = 1; in log space u = log w: e^u − 1 − u = δ)."""
    if not delta > 0:
        raise ValueError(f"δ must be > 0, got {delta}")
    out = []
    for u in (-math.sqrt(2 * delta) - delta, math.sqrt(2 * delta)):   # start outside the root: Newton then converges monotonically
        for _ in range(100):
            step = (math.expm1(u) - u - delta) / math.expm1(u)
            u -= step
            if abs(step) < 1e-15 * max(1.0, abs(u)):
                break
        out.append(math.exp(u))
    return out[0], out[1]


@dataclass(frozen=True)
class GateRates:
    """One gate at one δ, exact (docs/gates.md). Shares are of generated tokens (a rollout's: of all the
    tokens of all sequences, E_q[#masked]/E_q|y|); ``kl_unseen``: the share of KL(q‖p) the masked tokens carry
    (k3 splits each context's KL into per-token parts ≥ 0 that sum to it: Σ_x q(r − 1) = 0); ``k1_bias`` and
    ``k3_bias``: the relative bias of k1 and k3 summed over the kept tokens only; ``weight_bias``: E_q[r·1{kept}] − 1
    per token = −P_p(masked), the importance weight's lost mean (the policy gradient's weight);
    ``worst_context``: the largest share masked in any one context; ``seq_masked``: the share of sequences with a
    masked token (NaN for single tokens); ``sees``: E_q[s] over the gate's target (the share of its divergence
    the statistic sees; NaN for a statistic that stands for none). Rollouts, where a masked token masks its whole
    sequence (TRM, a sequence mask): ``seq_kl_unseen`` the share of KL(q‖p) the masked sequences carry,
    ``seq_weight_bias`` E_q[W·1{kept}] − 1 = −P_p(masked) of the sequence weight W = Π_t r_t (NaN for single
    tokens)."""
    gate: str
    delta: float
    tokens_masked: float
    kl_unseen: float
    k1_bias: float
    k3_bias: float
    weight_bias: float
    worst_context: float
    seq_masked: float = math.nan
    sees: float = math.nan
    seq_kl_unseen: float = math.nan
    seq_weight_bias: float = math.nan


# Rollouts: keep table [C, V] → (P_q(K), E_q[K·Σ_t k3_t], E_q[K·W]) for K = Π_t keep(c_t, x_t), W = Π_t r_t.
SequenceMoments = Callable[[torch.Tensor], tuple[float, float, float]]


def context_parts(log_q: torch.Tensor, log_p: torch.Tensor, table: torch.Tensor, delta: float) -> dict[str, torch.Tensor]:
    """Per context [C]: Σ_x q·1m, Σ_x q·k1·1m, Σ_x q·k3·1m, Σ_x p·1m with 1m = 1{s > δ}; and the keep table
    1 − 1m [C, V] (float64). ``log_q``, ``log_p``: normalised float64 log-probs [C, V]; ``table``: the gate's
    statistic s [C, V] (:attr:`Gate.table`, made once by the caller)."""
    logr = log_p - log_q
    q = log_q.exp()
    masked = table > delta
    m = masked.to(torch.float64)

    def total(v: torch.Tensor) -> torch.Tensor:
        # a token q never draws carries nothing (where q = 0 its k1 may be ±inf: never 0·inf)
        return torch.where((q > 0) & masked, q * v, torch.zeros_like(q)).sum(-1)
    return {"q": total(torch.ones_like(q)), "k1": total(-logr), "k3": total(k3(logr)),
            "p": (log_p.exp() * m).sum(-1), "keep": 1.0 - m}


def gate_rates(log_q: torch.Tensor, log_p: torch.Tensor, visits: torch.Tensor, gate: Gate, delta: float,
               seq: SequenceMoments | None = None) -> GateRates:
    """The exact :class:`GateRates` of ``gate`` at ``delta`` on the tables ``log_q``, ``log_p`` [C, V] whose contexts
    generated tokens meet ``visits`` [C] times per draw. ``seq``: the sequences' moments of the keep table
    (rollouts: :data:`SequenceMoments`), None for single tokens."""
    table = gate.table(log_q, log_p)                 # once: a top-K gate's table is a top-k over the vocabulary
    parts = context_parts(log_q, log_p, table, delta)
    n = visits.to(torch.float64)
    sees = math.nan
    if gate.target is not None:
        q = log_q.exp()
        mean = float((n * torch.where(q > 0, q * table, torch.zeros_like(q)).sum(-1)).sum())
        per_ctx = (q * k3(log_p - log_q)).sum(-1) if gate.target == REVERSE else context_tv(log_q, log_p)
        total = float((n * per_ctx).sum())
        sees = mean / total if total > 0 else math.nan
    tokens = float(n.sum())
    kl = float((n * (log_q.exp() * k3(log_p - log_q)).sum(-1)).sum())      # = Σ_c n_c KL(c): no cancellation

    def rel(v: torch.Tensor) -> float:
        s = float((n * v).sum())
        return s / kl + 0.0 if kl > 0 else (0.0 if s == 0 else math.nan)     # + 0.0: never a −0 below
    seen = n > 0
    seq_parts = (math.nan,) * 3
    if seq is not None:
        kept, kept_kl, kept_w = seq(parts["keep"])
        seq_parts = (1.0 - kept, 1.0 - kept_kl / kl if kl > 0 else math.nan, kept_w - 1.0)
    return GateRates(gate.name, float(delta), float((n * parts["q"]).sum()) / tokens, rel(parts["k3"]),
                     0.0 - rel(parts["k1"]), 0.0 - rel(parts["k3"]), 0.0 - float((n * parts["p"]).sum()) / tokens,
                     float(parts["q"][seen].max()) if bool(seen.any()) else math.nan, seq_parts[0], sees,
                     seq_parts[1] + 0.0, seq_parts[2] + 0.0)
