"""The pieces both streaming passes of the audit share (kl_bench.audit.stream): the output layer
(:class:`Head`), the chunk and tile sizes, the matmul precision, the checks of a call's inputs, one position
chunk's tiles (:class:`Scan`), and the float64 merges of per-tile sums (row maxima, log-sum-exps, Chan's
combination) and a truncating sampler's threshold τ from sorted scores."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..foundation.errors import SpecError
from .generation import Sampler, sampler_scores

COMPUTE_DTYPES = (torch.float32, torch.float64)
# Positions per chunk and vocabulary ids per tile, by the hidden states' device type, when the caller names
# none. The work is the same whatever the pieces (chunk × tile elements a buffer, ~12 buffers); the number
# of operations is not: each tile costs ~60 of them, and on a GPU each is about one kernel launch. The
# CPU's 256 × 4,096 keep the buffers in cache (4 MiB each; ~100 MiB in all at V = 151,936). On an H100 they
# left stream_values launch-bound (8,827 launches per 1,024 positions, issue 32); 1,024 × 8,192 make 1,252
# operations there instead of 8,760 (counted on the CPU, benchmarks/launches.py) for ~380 MiB of
# buffers, chosen by that count and that memory inside a trainer's process: not yet timed on a GPU
# (benchmarks/bench_gpu.py --audit-pieces times both).
PIECES = {"cpu": (256, 4096), "cuda": (1024, 8192)}
def pieces(device: torch.device, chunk: int | None = None, tile: int | None = None) -> tuple[int, int]:
    """(chunk, tile): the caller's where given (each ≥ 1), else :data:`PIECES` of ``device``'s type."""
    c, t = PIECES.get(torch.device(device).type, PIECES["cpu"])
    for key, value in (("chunk", chunk), ("tile", tile)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SpecError(f"must be an integer ≥ 1, got {value!r}", key=key)
    return c if chunk is None else chunk, t if tile is None else tile


@dataclass(frozen=True)
class Head:
    """An output layer: logits = softcap(multiplier · (h @ weight.T + bias)) · scale. ``weight`` [V, d],
    ``bias`` [V] or None; ``multiplier``: a model's own logit scale (config ``logit_scale``), applied
    first; ``softcap``: Gemma's ``final_logit_softcapping`` c, z ← c·tanh(z / c); ``scale``: 1/T for
    trainers that divide the logits by the sampling temperature (TRL), applied last, as TRL's kernel does.
    A final norm (if the model has one after its body) is applied by the caller to the hidden states."""
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None
    multiplier: float = 1.0

    def __post_init__(self):
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise SpecError(f"the logit soft-cap must be a finite number > 0, got {self.softcap}", key="softcap")
        if not math.isfinite(self.multiplier) or not math.isfinite(self.scale):
            raise SpecError(f"logit scales must be finite, got {self.multiplier} and {self.scale}", key="scale")

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    def logits_at(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits of the ids ``ids`` [m] (any, in order) for hidden states ``h`` [n, d]: [n, m], as :meth:`logits`."""
        w = self.weight.index_select(0, ids)
        z = h @ (w if w.dtype == h.dtype else w.to(h.dtype)).T
        if self.bias is not None:
            z.add_(self.bias.index_select(0, ids).to(h.dtype))
        if self.multiplier != 1.0:
            z.mul_(self.multiplier)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z if self.scale == 1.0 else z.mul_(self.scale)

    def logits(self, h: torch.Tensor, lo: int, hi: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ids [lo, hi) for hidden states ``h`` [n, d] (already in the compute dtype, on the
        head's device): [n, hi − lo], written into ``out`` when given. Only this tile of a 16-bit head is
        up-cast; the bias, cap and scales act in place, elementwise in h's dtype."""
        w = self.weight[lo:hi]
        z = torch.matmul(h, (w if w.dtype == h.dtype else w.to(h.dtype)).T, out=out)
        if self.bias is not None:
            z.add_(self.bias[lo:hi].to(h.dtype))
        if self.multiplier != 1.0:
            z.mul_(self.multiplier)
        if self.softcap is not None:
            z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z if self.scale == 1.0 else z.mul_(self.scale)


@contextlib.contextmanager
def matmul_precision(tf32: bool = False):
    """float32 matmuls at full float32 precision unless ``tf32``: TF32 on CUDA (and bf16 passes on some
    CPUs under "medium") round the logits to ~1e-3 relative. The previous global setting is restored."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def check_inputs(policy_hidden, reference_hidden, policy_head: Head, reference_head: Head, dtype) -> None:
    if policy_head.vocab != reference_head.vocab:
        raise SpecError(f"policy and reference vocabularies differ: {policy_head.vocab} and {reference_head.vocab}")
    if policy_hidden.shape[0] != reference_hidden.shape[0]:
        raise SpecError(f"policy and reference hidden states cover {policy_hidden.shape[0]} and "
                        f"{reference_hidden.shape[0]} positions")
    for key, h, head in (("policy_hidden", policy_hidden, policy_head), ("reference_hidden", reference_hidden,
                                                                          reference_head)):
        if h.dim() != 2 or h.shape[-1] != head.weight.shape[-1]:
            raise SpecError(f"hidden states {list(h.shape)} do not fit the output layer [V, d] = "
                            f"{list(head.weight.shape)}: [N, {head.weight.shape[-1]}] expected", key=key)
    if dtype not in COMPUTE_DTYPES:      # the tile sums run in dtype: 16-bit ones would round them
        raise SpecError(f"the audit computes in float32 or float64, not {dtype}", key="dtype")
    devices = {t.device for t in (policy_hidden, reference_hidden, policy_head.weight, reference_head.weight)}
    if len(devices) > 1:
        raise SpecError("hidden states and output layers must be on one device, got "
                        + ", ".join(sorted(str(d) for d in devices)), key="device")



class Scan:
    """One position chunk: hidden states in the compute dtype (``hg``: the sampling pass's, or None),
    its sampler inputs, the sampled ids."""

    def __init__(self, hq, hp, hg, heads, sampler, tile, eos_banned, context_ids, ids):
        self.hq, self.hp, self.hg, self.heads, self.sampler, self.tile = hq, hp, hg, heads, sampler, tile
        self.eos_banned, self.context_ids, self.ids = eos_banned, context_ids, ids
        self._hqg = None

    @property
    def n(self) -> int:
        return self.hq.shape[0]

    @property
    def banned(self) -> bool:
        """The EOS ban is on somewhere (scores of −inf at EOS ids)."""
        return self.eos_banned is not None and bool(self.sampler.eos_token_id)

    def rows(self, rows: torch.Tensor) -> "Scan":
        """The same chunk restricted to ``rows`` (an index tensor)."""
        def pick(x):
            return None if x is None else x[rows]
        return Scan(self.hq[rows], self.hp[rows], pick(self.hg), self.heads, self.sampler, self.tile,
                     pick(self.eos_banned), pick(self.context_ids), pick(self.ids))

    def logits(self, lo: int, hi: int, out_qg: torch.Tensor | None = None, out_p: torch.Tensor | None = None,
               policy_only: bool = False) -> dict[str, torch.Tensor]:
        """{"zq", "zp", "zg"} of ids [lo, hi) in the compute dtype (z_p absent when ``policy_only``, z_g
        without sampling-pass hidden states), written into ``out_qg`` ([2n, t] or more rows: z_q above z_g)
        and ``out_p`` where given. z_q and z_g come from one matmul of the policy's head over both passes'
        hidden states: its weight tile is read once (on a CPU ~10% of two matmuls' time), and each row's
        logits are those of the row's own product (every pass makes them the same way, so the second
        pass sees the very same rounded scores as the first)."""
        n, head = self.n, self.heads[0]
        both = self.hq if self.hg is None else self.hqg
        out = None if out_qg is None else out_qg[:both.shape[0]]
        zqg = head.logits(both, lo, hi, out=out)
        z = {"zq": zqg[:n]}
        if self.hg is not None:
            z["zg"] = zqg[n:]
        if not policy_only:
            z["zp"] = self.heads[1].logits(self.hp, lo, hi, out=out_p)
        return z

    @property
    def hqg(self) -> torch.Tensor:
        """The policy's and the drawing pass's hidden states, one above the other [2n, d] (made once)."""
        if self._hqg is None:
            self._hqg = torch.cat([self.hq, self.hg])
        return self._hqg

    def tiles(self, policy_only: bool = False):
        """{"lo", "zq", "zp", "zg"} for each vocabulary tile, in the compute dtype (new tensors; z_p absent
        when ``policy_only``, z_g without sampling-pass hidden states)."""
        vocab = self.heads[0].vocab
        for lo in range(0, vocab, self.tile):
            yield {"lo": lo, **self.logits(lo, min(lo + self.tile, vocab), policy_only=policy_only)}

    def scores(self, z: torch.Tensor, lo: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """b's score s of a tile of policy logits (:func:`~.generation.sampler_scores`): z itself without a
        temperature, penalty or EOS ban, z/T into ``out`` with only a temperature, else a new tensor."""
        sp = self.sampler
        plain = sp.repetition_penalty == 1.0 and not self.banned
        if plain and sp.temperature == 1.0:
            return z
        if plain and out is not None:
            return torch.div(z, sp.temperature, out=out)
        return sampler_scores(z, sp, lo=lo, eos_banned=self.eos_banned, context_ids=self.context_ids)

    def gather(self, lo: int, tiles: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The tiles' values at the sampled ids [n, len(tiles)] and where the id lies in this tile [n]."""
        if self.ids is None:
            return None
        j = self.ids - lo
        here = (j >= 0) & (j < tiles[0].shape[-1])
        jj = torch.where(here, j, 0).unsqueeze(-1)
        return torch.cat([t.gather(-1, jj) for t in tiles], dim=-1), here



def row_max(z: torch.Tensor) -> torch.Tensor:
    """Row maxima [n, 1]; 0 for a row of −inf (its weights are then all 0, not NaN)."""
    m = z.amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))



def logsum(scale: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """log Σ_t e^{scale_t} total_t over tiles [T, n] → [n], float64."""
    return torch.logsumexp(scale.to(torch.float64) + torch.log(total.to(torch.float64)), dim=0)


def chan(scale, total, mean, m2) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles' (log-scale, Σ w, mean, Σ w (x − mean)²) [T, ...] combined: (mean, variance) (Chan, Golub
    and LeVeque's pairwise update, all tiles at once)."""
    log_w = scale.to(torch.float64) + torch.log(total.to(torch.float64))
    lse = torch.logsumexp(log_w, dim=0)
    share = torch.nan_to_num(torch.exp(log_w - lse))
    mean64 = mean.to(torch.float64)
    mu = (share * mean64).sum(0)
    within = torch.nan_to_num(torch.exp(scale.to(torch.float64) - lse) * m2.to(torch.float64))
    return mu, (within + share * (mean64 - mu).square()).sum(0)



def _top_p_threshold(cand: torch.Tensor, norm: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """τ of top-p from the sorted (descending) candidate scores [n, K] and the log-normaliser [n] of the
    distribution top-p acts on; and the rows [n] where the candidates' mass is below p (τ unknown)."""
    probs = torch.exp(cand - norm.unsqueeze(-1))
    cum = torch.cumsum(probs, dim=-1)
    keep = (cum - probs) < p                               # the mass of the more likely tokens is below p
    count = keep.sum(dim=-1).clamp(min=1)
    tau = cand.gather(-1, (count - 1).unsqueeze(-1)).squeeze(-1)
    return tau, cum[:, -1] < p


def threshold(sp: Sampler, cand: torch.Tensor, lse_s: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """τ [n] of a truncating b from sorted candidate scores [n, K], and the rows [n] where b's support may
    reach beyond the candidates: a nucleus larger than them, or the last candidate still ≥ τ (a tie at
    the k-th score, or a min-p/top-p set as large as the list) while ids remain outside it."""
    tau = torch.full(cand.shape[:1], -torch.inf, dtype=cand.dtype, device=cand.device)
    unknown = torch.zeros(cand.shape[:1], dtype=torch.bool, device=cand.device)
    if sp.k is not None and sp.k < vocab:
        tau = torch.maximum(tau, cand[:, sp.k - 1])
    if sp.p is not None:
        top = cand[:, :sp.k] if sp.k is not None else cand
        norm = torch.logsumexp(top, dim=-1) if sp.k is not None else lse_s
        tau_p, short = _top_p_threshold(top, norm, sp.p)
        tau = torch.maximum(tau, tau_p)
        if sp.k is None:
            unknown |= short
    if sp.mp is not None:
        tau = torch.maximum(tau, cand[:, 0] + math.log(sp.mp))
    if cand.shape[-1] < vocab:
        unknown |= cand[:, -1] >= tau
    return tau, unknown

