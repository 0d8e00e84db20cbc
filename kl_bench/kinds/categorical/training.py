"""Training a categorical policy (the categorical kind's :class:`kl_bench.kinds.trainable.TrainingOracle`):
θ = q's logits [B, V] (B contexts, drawn uniformly), exact in float64.

Every trainer's per-draw gradient is a(x)·∇θ log q(x) with ∇θ log q(x) = e_x − q_b in row b, so its
expectation is, per context, (1/B)(q ⊙ a − q·(q·a)) (:func:`expected_score_gradient`). The trainer's
ascent direction takes a = reward − β·c(log r), c the estimator × mode coefficient
(:func:`kl_bench.core.modes.coefficient`): the reward by the score function, the KL term as the combination
puts it. The true objective J(θ) = (1/B) Σ_b E_{q_b}[reward] − β KL(q_b‖p_b) has ∇J of the same form
with a = reward − β(log q − log p) (k1 in the reward is exact), and its optimum is
q* ∝ p·exp(reward/β) in every context (docs/training.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.modes import has_nonfinite, q_times_coefficient
from ...sampling.seeding import BatchStream
from ..trainable import Combo


def expected_score_gradient(q: torch.Tensor, a: torch.Tensor, qa: torch.Tensor | None = None) -> torch.Tensor:
    """E_x[a(x)(e_x − q_b)] averaged over the B contexts: (1/B)(q ⊙ a − q·(q·a)). q, a: [B, V] → [B, V].
    ``qa``: q ⊙ a computed exactly where q ⊙ a is not finite in float64
    (:func:`kl_bench.core.modes.q_times_coefficient`), None where it is."""
    # The score has zero mean (Σ_x q(x)(e_x − q) = 0), so shifting a by a constant per context changes
    # nothing in exact arithmetic. Shifting by a's first entry makes a constant a (k1 in the loss) give an
    # exact zero by construction: a − a₀ is 0.0 in every entry, whatever the CPU's vector width or
    # summation order (⟨q, a⟩/Σq cancelled only up to the last bit, and Adam turns 1e-17 into a step).
    shift = a[..., :1]
    if qa is not None:
        # a is infinite where q underflowed (r = p/q beyond float64): shift by a's entry at q's largest
        # token (finite) where the first entry is not, and take q ⊙ (a − shift) from the exact product.
        shift = torch.where(torch.isfinite(shift), shift, a.gather(-1, q.argmax(-1, keepdim=True)))
    d = q * (a - shift)
    if qa is not None:
        d = torch.where(torch.isfinite(d), d, qa - q * shift)
    return (d - q * (d.sum(-1, keepdim=True) / q.sum(-1, keepdim=True))) / q.shape[0]


def count_gradient(q: torch.Tensor, counts: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The mean per-draw gradient of n draws from their counts N [B, V] (n = ΣN):
    (1/n) Σ_b (N_b ⊙ a_b − q_b (N_b·a_b)) in row b. q, counts, a: [B, V] → [B, V]."""
    na = counts * a
    if has_nonfinite(na):
        # A token never drawn adds nothing, even where its a is infinite (r = p/q beyond float64): 0, not 0·inf.
        na = torch.where(counts > 0, na, torch.zeros_like(na))
    return (na - q * na.sum(-1, keepdim=True)) / counts.sum()


def cdf_counts(q: torch.Tensor, batch: BatchStream, piece: int, chunk: int) -> torch.Tensor:
    """Counts [B, V] (float64 holding integers) of ``batch.size`` draws from the mixture (1/B) q_b.

    Piece j of the batch has its own generator (kl_bench.sampling.seeding), one uniform per draw, mapped to an id
    by inverse CDF over the flattened mixture: ids of zero mass are never hit (an empty CDF interval).
    ``chunk`` pieces' worth of draws are searched at once (memory); the counts are integers, so they do
    not depend on ``chunk``."""
    w = (q / q.shape[0]).reshape(-1)
    # The CDF in float64; the uniforms are scaled by its last entry (1 up to rounding), so that no
    # uniform falls past the end.
    cdf = torch.cumsum(w, 0)
    counts = torch.zeros_like(w)
    group: list[torch.Tensor] = []

    def flush():
        u = torch.cat(group) * cdf[-1]
        ids = torch.searchsorted(cdf, u, right=True).clamp_(max=w.numel() - 1)
        counts.add_(torch.bincount(ids, minlength=w.numel()).to(counts.dtype))
        group.clear()
    for m, g in batch.pieces(piece):
        group.append(torch.rand(m, dtype=torch.float64, generator=g, device=q.device))
        if sum(x.numel() for x in group) >= chunk:
            flush()
    if group:
        flush()
    return counts.reshape(q.shape)


@dataclass(frozen=True)
class CategoricalProblem:
    """One categorical case to train: θ0 = log q [B, V], the reference log p, a reward table [B, V], β."""
    name: str
    theta0: torch.Tensor
    log_p: torch.Tensor
    reward: torch.Tensor
    beta: float

    @property
    def log_opt(self) -> torch.Tensor:
        """log q* = log softmax(log p + reward/β) per context, [B, V]: the maximiser of J."""
        return torch.log_softmax(self.log_p + self.reward / self.beta, -1)

    def evaluate(self, theta: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
        """Exact values at θ (averaged over contexts) and ∇J [B, V]."""
        lq = torch.log_softmax(theta, -1)
        q, lp = lq.exp(), self.log_p
        b = q.shape[0]
        kl_rev = float((q * (lq - lp)).sum() / b)
        kl_fwd = float((lp.exp() * (lp - lq)).sum() / b)
        reward = float((q * self.reward).sum() / b)
        out = {"kl_rev": kl_rev, "kl_fwd": kl_fwd, "entropy": float(-(q * lq).sum() / b), "reward": reward,
               "objective": reward - self.beta * kl_rev,
               # Summed directly (not log Z − J/β): no cancellation as q approaches q*.
               "kl_opt": float((q * (lq - self.log_opt)).sum() / b)}
        return out, expected_score_gradient(q, self.reward - self.beta * (lq - lp))

    def _table(self, lq: torch.Tensor, combo: Combo) -> torch.Tensor:
        """a = reward − β c(log r) on every (context, token), [B, V]."""
        return self.reward - self.beta * combo.item.coef(self.log_p - lq)

    def expected_update(self, theta: torch.Tensor, combo: Combo) -> torch.Tensor:
        """The trainer's expected ascent direction at θ, exact, [B, V]."""
        lq = torch.log_softmax(theta, -1)
        q, a = lq.exp(), self._table(lq, combo)
        qa = None
        if combo.item.cpoly is not None and has_nonfinite(a):       # q ≤ 1 finite: q ⊙ a is finite where a is
            qa = q * self.reward - self.beta * q_times_coefficient(lq, self.log_p - lq, combo.item.cpoly)
        return expected_score_gradient(q, a, qa)

    def sampled_update(self, theta: torch.Tensor, combo: Combo, batch: BatchStream, piece: int,
                       chunk: int) -> torch.Tensor:
        """The trainer's ascent direction from ``batch.size`` draws of q_θ, [B, V]."""
        lq = torch.log_softmax(theta, -1)
        q = lq.exp()
        return count_gradient(q, cdf_counts(q, batch, piece, chunk), self._table(lq, combo))
