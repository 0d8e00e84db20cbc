"""Exact gradients of a categorical case and their per-draw estimate, for θ = q's logits [B, V] flattened row
by row (docs/gradients.md): every per-draw gradient is c(x)·s(x) with s = e_x − q_b in row b, so every
expectation is a sum over the drawn (context, token) ids, and a batch's sum is one product of its count
vector with a per-id table."""
from __future__ import annotations

import numpy as np
import torch

from ...core.modes import derivative
from ...core.targets import FORWARD, REVERSE
from ...sampling.seeding import BatchStream
from ..protocols import ExactGrad, GradBatch, GradientAccumulator, GradItem
from .model import CategoricalModel
from .sampler import CategoricalSampler


def gradient_references(m: CategoricalModel) -> dict[str, np.ndarray]:
    """∇θ KL(q‖p) and ∇θ KL(p‖q) for θ = q's logits, averaged over contexts: rows (1/B) q⊙(log q −
    log p − KL) and (1/B)(q − p)."""
    q, lq, lp = m.log_q.exp(), m.log_q, m.log_p
    b = m.contexts
    kl = (q * (lq - lp)).sum(-1, keepdim=True)
    return {REVERSE: (q * (lq - lp - kl) / b).reshape(-1).numpy(),
            FORWARD: ((q - lp.exp()) / b).reshape(-1).numpy()}


def coefficient_table(m: CategoricalModel, item: GradItem) -> torch.Tensor:
    """c(log r) on every drawn id [M], times the detached q/b of a weighted sampler. NeMo-RL's order
    (loss_is_nemo) under a weighted sampler is its use_on_policy_kl_approximation: w = q/b enters
    before the output clamp, so the clamp's test sees w·f (kl_bench.core.presets.WeightedClamp)."""
    if m.is_weight is None:
        return item.coef(m.logr)
    if item.weighted is not None:               # the mode takes the weight inside its clamp (Mode.weighted)
        return item.weighted(item.est, m.logr, m.is_weight)
    if m.correction.clips(item.mode):        # the PPO surrogate (kl_bench.core.weights)
        return m.correction.coefficient(item.est, item.mode, m.logr, m.raw_weight)
    return item.coef(m.logr) * m.is_weight


def gradient_exact(m: CategoricalModel, item: GradItem, directions: dict[str, np.ndarray]) -> ExactGrad:
    """E[c s] for s = e_x − q_b (in row b), under the mixture (1/B) b_b(x) (b = q without a sampler)."""
    return exact_gradient_of_table(m, coefficient_table(m, item), directions)


def gradient_self(m: CategoricalModel, item: GradItem) -> np.ndarray | None:
    """∇θ E_q[f(log r)] = E_q[(f − f′)(log r)·s] (the score rule; ∇ log r = −s), whatever the sampler:
    rows (1/B)(q⊙c − q⟨q, c⟩) over q's support, with log r as the estimators see it. Under a sampler
    with rounded log-probs (the rounded table covers b's ids only) there is none."""
    if m.precision is not None and (m.log_b is not None):
        return None
    q = m.log_q.exp()
    if m.precision is None:
        ctx, tok = torch.nonzero(q > 0, as_tuple=True)
        logr = m.log_p[ctx, tok] - m.log_q[ctx, tok]
    else:
        (ctx, tok), logr = m.ids, m.logr
    d = derivative(item.est, "self")
    c = torch.zeros_like(q)
    c[ctx, tok] = item.est.fn(logr) - d(logr)
    qc = q * torch.where(q > 0, c, torch.zeros_like(c))
    return ((qc - q * qc.sum(-1, keepdim=True)) / m.contexts).reshape(-1).numpy()


def gradient_ukl(m: CategoricalModel) -> np.ndarray | None:
    """∇θ Σ_{x∈S} [q log(q/p) − q + p], S = b's support (q's without a sampler): with ∂q_x/∂z_j =
    q_x(δ_xj − q_j) the +1 and −1 of the derivative cancel, leaving rows (1/B)(q⊙g·1_S − q Σ_S q g),
    g = log q − log p. It is ∇KL(q‖p) when S holds all of q's mass (Σ_x ∇q_x = 0); a truncating
    sampler (top-k, top-p) leaves out the mass outside S, and the rows that see only S follow this."""
    q = m.log_q.exp()
    inside = q > 0 if m.log_b is None else m.log_b > -torch.inf
    g = torch.where(inside, m.log_q - m.log_p, torch.zeros_like(q))
    qg = q * g
    out = ((qg - q * qg.sum(-1, keepdim=True)) / m.contexts).reshape(-1).numpy()
    return out if np.isfinite(out).all() else None


def exact_gradient_of_table(m: CategoricalModel, c_table: torch.Tensor, directions: dict[str, np.ndarray]) -> ExactGrad:
    """E[c s] for per-id coefficients ``c_table`` [M] (sums over the vocabulary)."""
    b, v = m.contexts, m.vocab
    q = m.log_q.exp()
    w = m.weights()
    ctx, tok = m.ids
    cw = torch.zeros(b, v, dtype=torch.float64)  # host: the pair's exact tables live on the host
    cw[ctx, tok] = w * c_table                            # (1/B) b_b(x) c(x)
    mean = cw - q * cw.sum(-1, keepdim=True)              # row b: (1/B)(b⊙c − q Σ b c)
    s_norm2 = 1 - 2 * q[ctx, tok] + (q * q).sum(-1)[ctx]  # |e_x − q_b|²
    second = float((w * c_table**2 * s_norm2).sum())
    proj_var = {}
    for name, u in directions.items():
        ut = torch.as_tensor(u, dtype=torch.float64).reshape(b, v)  # host: the pair's exact tables live on the host
        su = ut[ctx, tok] - (q * ut).sum(-1)[ctx]        # s·u for each id
        m1 = float((w * c_table * su).sum())
        proj_var[name] = float((w * (c_table * su - m1) ** 2).sum())
    return ExactGrad(mean.reshape(-1).numpy(), second, proj_var)


class CategoricalGradients(GradientAccumulator):
    """Every per-draw quantity is a table over the drawn (context, token) ids, so a batch is one
    bincount and one matrix product; the total gradient follows from the total counts."""

    def __init__(self, sampler: CategoricalSampler, items: list[GradItem], directions: dict[str, np.ndarray], device):
        self.model, self.sampler, self.device, self.nj = sampler.model, sampler, device, len(items)
        q = self.model.log_q.exp()
        ctx, tok = self.model.ids
        self.c_tab = torch.stack([coefficient_table(self.model, it) for it in items])     # [J, M]
        # host: gradient tables on the host (issue 33: counts cross per batch)
        su = torch.stack([torch.as_tensor(u, dtype=torch.float64).reshape(q.shape)[ctx, tok]
                          - (q * torch.as_tensor(u, dtype=torch.float64).reshape(q.shape)).sum(-1)[ctx]  # host: gradient tables on the host
                          for u in directions.values()])                                # [D, M]
        s_norm2 = 1 - 2 * q[ctx, tok] + (q * q).sum(-1)[ctx]
        self.nd = su.shape[0]
        self.table = torch.cat([(self.c_tab[:, None, :] * su[None]).reshape(-1, self.c_tab.shape[1]),
                                self.c_tab**2 * s_norm2])
        self.counts = torch.zeros(self.c_tab.shape[1], dtype=torch.float64)  # host: total counts, gathered on the host

    def add(self, batch: BatchStream) -> GradBatch:
        ids, counts = self.sampler.batch_counts(batch, self.device)
        ids, counts = (None if ids is None else ids.cpu()), counts.cpu()
        # Fixed shapes per batch (as in batch_sums): the bytes never depend on the grouping.
        out = (self.table @ counts if ids is None else self.table[:, ids] @ counts).numpy()
        if ids is None:
            self.counts += counts
        else:
            self.counts.index_add_(0, ids, counts)
        return GradBatch(out[: self.nd * self.nj].reshape(self.nj, self.nd), out[self.nd * self.nj:])

    # Counts are whole numbers (exact in float64 below 2^53), so any grouping of batches sums them exactly.
    splittable = True

    def partial(self) -> torch.Tensor:
        return self.counts

    def merge(self, partials: list[torch.Tensor]) -> None:
        self.counts = torch.zeros_like(self.counts)
        for c in partials:
            self.counts += c

    def total(self) -> np.ndarray:
        p = self.model
        q = p.log_q.exp()
        ctx, tok = p.ids
        total = np.zeros((self.nj, p.contexts * p.vocab))
        for j in range(self.nj):
            cw = torch.zeros(p.contexts, p.vocab, dtype=torch.float64)  # host: the pair's exact tables live on the host
            cw[ctx, tok] = self.counts * self.c_tab[j]
            total[j] = (cw - q * cw.sum(-1, keepdim=True)).reshape(-1).numpy()
        return total
