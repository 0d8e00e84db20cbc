"""Exact per-position values streamed from hidden states and output layers, never an [N, V] tensor
(docs/audit.md §2: the one pass, the second pass, dtypes, devices and the float32 bound).

Positions are taken ``chunk`` at a time and the vocabulary ``tile`` ids at a time; each tile's logits
z = h Wᵀ (+ bias) are made, used and dropped, so memory is O(N + chunk × tile) whatever V is. One pass
(:mod:`~.first_pass`) gives the normalisers, the polynomial estimators' moments (:mod:`~.polymoments`)
and a truncating sampler's candidates; a second pass (:mod:`~.second_pass`) only what one cannot give;
flat rows under top-p take two passes of their own (:mod:`~.nucleus`). Which rows need what is read
from the device once per call.

Ties at a top-k or top-p boundary: the threshold keeps every token tied with the last kept one, as
transformers' top-k does; its top-p keeps a prefix of an arbitrary sort order. Logits of real models are
continuous, so a tie at the boundary has probability zero.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..foundation.errors import SpecError
from .exact import PositionValues, SamplerValues
from .first_pass import Buffers, first_pass
from .nucleus import applies, flat_rows, flat_values
from .polymoments import scratch_needed
from .generation import Sampler
from .second_pass import negative_pass, redo_columns, redo_rows, redo_spoiled, spoiled
from .stream_plan import EVERYTHING, Chunk, Outputs, Plan
from .tiling import Head, Scan, check_inputs, matmul_precision, pieces


def _sign_columns(plan: Plan) -> list:
    """(family, columns) of the sign-changing polynomial estimators whose P(f < 0) needs a second pass."""
    signs = [(fam, [j for j in plan.second_pass_columns(fam) if plan.poly[j] is not None]) for fam in plan.families]
    return [(fam, cols) for fam, cols in signs if cols]


def _every_row(scan: Scan, plan: Plan, out: Chunk) -> None:
    """The second passes a chunk's every row needs (decided by the plan, not by values), each one pass
    shared by the families that need it."""
    signs = _sign_columns(plan)
    if signs:
        negative_pass(scan, plan, out, signs)
    for fam in plan.families:
        cols = plan.second_pass_columns(fam)
        if any(plan.poly[j] is None for j in cols):
            redo_columns(scan, plan, fam, out, cols)


def _host_rows(flags: torch.Tensor) -> list[list[int]]:
    """The rows where each of ``flags`` [k, N] (bool) is true, read in one host transfer: the call's one
    synchronisation, whatever the number of rows and chunks (a meta tensor has no values: none)."""
    if flags.device.type == "meta" or flags.numel() == 0:
        return [[] for _ in range(flags.shape[0])]
    return [[i for i, f in enumerate(row) if f] for row in flags.tolist()]


def _some_rows(scan: Scan, plan: Plan, out: Chunk, chunk: int, centre: torch.Tensor | None) -> None:
    """The second passes only some rows need, decided from the first pass's values of every chunk at once:
    rows whose truncating support the candidates may not cover (where two passes serve the call,
    kl_bench.audit.nucleus, those first; the rows they leave are widened), then rows a float32 moment
    spoiled. Each runs over those rows, ``chunk`` of them at a time (as a chunk of their own)."""
    cut = [fam for fam in plan.families if fam.kind == "cut"]
    need_rows, bad_rows = _host_rows(torch.stack([_unknown(out, cut), spoiled(plan, out)]))
    device = out.kl.device
    if need_rows and centre is not None:
        for rows in _batches(len(need_rows), chunk, pick=need_rows, device=device):
            out.assign(rows, flat_values(scan.rows(rows), plan, centre[rows]))
        need_rows = _host_rows(_unknown(out, cut).unsqueeze(0))[0]
    unknown = [out.fam[fam.name].unknown for fam in cut]
    for rows in _batches(len(need_rows), chunk, pick=need_rows, device=device):
        redo_rows(scan, plan, out, cut, unknown, rows)
    for rows in _batches(len(bad_rows), chunk, pick=bad_rows, device=device):
        redo_spoiled(scan, plan, out, rows)


def _unknown(out: Chunk, cut: list) -> torch.Tensor:
    """Rows [n] whose support a truncating family's candidates may not cover."""
    if not cut:
        return torch.zeros_like(out.kl, dtype=torch.bool)
    return torch.stack([out.fam[fam.name].unknown for fam in cut]).any(0)


def _flat(scan: Scan, plan: Plan, chunk: int) -> tuple[list[int], torch.Tensor | None]:
    """The rows a top-p sampler's nucleus makes flat (kl_bench.audit.nucleus), read in one host transfer,
    and every row's centre for their second pass; none where two passes do not serve the call."""
    if not applies(plan) or scan.hq.device.type == "meta":
        return [], None
    keep = next(f.keep for f in plan.families if f.kind == "cut")
    flags, centre = flat_rows(scan, plan, chunk, keep)
    return _host_rows(flags.unsqueeze(0))[0], centre


def _batches(n: int, chunk: int, skip: list[int] = (), pick: list[int] | None = None, device=None):
    """Row selections of at most ``chunk`` rows: slices of 0..n−1 (none skipped), else index tensors of
    the rows not in ``skip`` or of ``pick``."""
    if pick is None and not skip:
        yield from (slice(i, i + chunk) for i in range(0, n, chunk))
        return
    if pick is None:
        gone = set(skip)
        pick = [i for i in range(n) if i not in gone]
    for i in range(0, len(pick), chunk):
        # host: row numbers made on the host (read back once in _flat)
        yield torch.tensor(pick[i:i + chunk], dtype=torch.long, device=device)


def _position_values(plan: Plan, out: Chunk) -> PositionValues:
    g = out.fam["g"].values() if "g" in out.fam else None
    return PositionValues(plan.names, out.kl, out.mean_q, out.var_q, out.tok[:, 0] - out.lse_q,
                          out.tok[:, 1] - out.lse_p, out.fam["b"].values(), g)


# ----------------------------------------------------------------------------- the public functions
def _empty(names: tuple[str, ...], like: torch.Tensor, sampling: bool) -> PositionValues:
    e = torch.zeros(0, dtype=torch.float64, device=like.device)
    ef = e.view(0, 1).expand(0, len(names))
    sv = SamplerValues(ef, ef, ef, e, e, e, e, e, e, e, e, e)
    return PositionValues(names, e, ef, ef, e, e, sv, sv if sampling else None)


@torch.no_grad()
def stream_values(policy_hidden: torch.Tensor, reference_hidden: torch.Tensor, policy_head: Head, reference_head: Head,
                  estimators: Sequence = ("k1", "k3"), sampler: Sampler | None = None, *,
                  ids: torch.Tensor | None = None, eos_banned: torch.Tensor | None = None,
                  context_ids: torch.Tensor | None = None, sampling_hidden: torch.Tensor | None = None,
                  chunk: int | None = None, tile: int | None = None, candidates: int = 2048,
                  dtype: torch.dtype = torch.float32, tf32: bool = False, negative: bool = True,
                  outputs: Outputs = EVERYTHING, fused: bool = False) -> PositionValues:
    """:func:`kl_bench.audit.exact.position_values` from hidden states [N, d] (each model's own, any float
    dtype, on the heads' device) and output layers, streamed: the same values, in O(N + chunk × tile)
    memory, as [N] / [N, F] float64 tensors on that device. ``chunk``, ``tile``: positions per chunk and ids
    per tile (None: :data:`PIECES` of the device).

    ``sampling_hidden`` [N, d]: the policy's hidden states in the pass that drew the tokens, when it
    differs from the scored one (its values are ``g``; one more matmul per tile). ``dtype``: the tile
    matmuls' and tile sums' dtype (float32: the model's own rounding, ~1e-7 relative of each logit;
    float64: exact to rounding); the merges are float64 either way. ``candidates``: the scores kept per
    position for a top-p or min-p sampler (a larger support is found by widening; 2,048 hold the nucleus of
    p = 0.9 at V = 151,936 up to logits of standard deviation ~4, where it reaches ~1,760 ids). ``negative``: P(f < 0)
    of estimators that change sign (k1, fwd_k1) under a sampler that does not truncate needs a second
    pass (two more forwards); False leaves those entries NaN (not computed). ``outputs``
    (:class:`~.stream_plan.Outputs`): which of the values beyond KL and the means are wanted (default: all);
    the others are NaN and cost nothing (a step audit reads only those of the family that drew). ``fused``:
    the first pass's elementwise work compiled by torch.compile (:mod:`~.fused`: a ~30 s compile once per process, then
    GRPO's audited step ~3.1 instead of ~3.9 head forwards on a CPU thread)."""
    check_inputs(policy_hidden, reference_hidden, policy_head, reference_head, dtype)
    if sampling_hidden is not None and sampling_hidden.shape != policy_hidden.shape:
        raise SpecError(f"the sampling pass's hidden states must be {list(policy_hidden.shape)}, got "
                        f"{list(sampling_hidden.shape)}", key="sampling_hidden")
    if not isinstance(fused, bool):
        raise SpecError(f"fused must be True or False, got {fused!r}", key="fused")
    sampler = sampler or Sampler()
    chunk, tile = pieces(policy_hidden.device, chunk, tile)
    plan = Plan.of(estimators, sampler, policy_head.vocab, candidates, negative, sampling_hidden is not None, outputs,
                   fused=fused)
    n_all, parts = policy_hidden.shape[0], []
    if n_all == 0:
        return _empty(plan.names, policy_hidden, sampling_hidden is not None)
    bufs = Buffers(scratch_needed(plan.basis), min(chunk, n_all), min(tile, plan.vocab),
                   policy_hidden.new_empty(0, dtype=dtype))

    def to(x, dt=None):
        return x if x is None or dt is None else x.to(dt)
    whole = Scan(to(policy_hidden, dtype), to(reference_hidden, dtype), to(sampling_hidden, dtype),
                 (policy_head, reference_head), sampler, tile, eos_banned, context_ids, to(ids, torch.long))
    with matmul_precision(tf32):
        flat, centre = _flat(whole, plan, chunk)
        for rows in _batches(n_all, chunk, skip=flat, device=policy_hidden.device):
            scan = whole.rows(rows)
            parts.append(first_pass(scan, plan, bufs))
            _every_row(scan, plan, parts[-1])
        for rows in _batches(len(flat), chunk, pick=flat, device=policy_hidden.device):
            parts.append(flat_values(whole.rows(rows), plan, centre[rows]))
        out = Chunk.cat(parts)
        if flat:                                            # back to the rows' own order
            gone = set(flat)
            order = [i for i in range(n_all) if i not in gone] + flat
            # host: the inverse of the order above
            out = out.select(torch.tensor(sorted(range(n_all), key=order.__getitem__), device=policy_hidden.device))
        _some_rows(whole, plan, out, chunk, centre)
    return _position_values(plan, out)


def _kl_tile(zq: torch.Tensor, zp: torch.Tensor, diff: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One tile's (m_q, S_q, A, m_p, S_p) [n] for KL = A/S_q − lse_q + lse_p, in place on the three
    [n, t] buffers (overwritten): S = Σ e^{z − m}, A = Σ e^{z_q − m_q}(z_q − z_p); six elementwise passes
    and four row reductions, no allocation of tile size."""
    torch.sub(zq, zp, out=diff)                            # z_q − z_p, before z_q is overwritten
    mq, mp = zq.amax(dim=-1, keepdim=True), zp.amax(dim=-1, keepdim=True)
    eq, ep = zq.sub_(mq).exp_(), zp.sub_(mp).exp_()      # e^{z − m_t} ∈ (0, 1]
    return mq.squeeze(-1), eq.sum(dim=-1), diff.mul_(eq).sum(dim=-1), mp.squeeze(-1), ep.sum(dim=-1)


@torch.no_grad()
def stream_kl(policy_hidden: torch.Tensor, reference_hidden: torch.Tensor, policy_head: Head, reference_head: Head,
              *, chunk: int | None = None, tile: int | None = None, dtype: torch.dtype = torch.float32,
              tf32: bool = False) -> torch.Tensor:
    """KL(q‖p) [N] only (float64, on the hidden states' device), in one pass: E_q[z_q − z_p] − lse_q + lse_p.

    The matmuls write into three buffers of chunk × tile elements made once (no allocation, hence no
    page faults, per tile) and each tile is reduced in place in ``dtype``; the tiles' sums are merged in
    float64. With float32 each tile sum of t terms in (0, 1] carries ≲ log2(t)·2⁻²⁴ relative error
    (pairwise summation), below the float32 logits' own rounding."""
    check_inputs(policy_hidden, reference_hidden, policy_head, reference_head, dtype)
    n_all, vocab = policy_hidden.shape[0], policy_head.vocab
    device = policy_hidden.device
    chunk, tile = pieces(device, chunk, tile)
    size = min(chunk, n_all) * min(tile, vocab)
    flat = [torch.empty(size, dtype=dtype, device=device) for _ in range(3)]
    out = []
    with matmul_precision(tf32):
        for i in range(0, n_all, chunk):
            hq, hp = policy_hidden[i:i + chunk].to(dtype), reference_hidden[i:i + chunk].to(dtype)
            n = hq.shape[0]
            parts = []
            for lo in range(0, vocab, tile):
                hi = min(lo + tile, vocab)
                zq, zp, diff = (b[:n * (hi - lo)].view(n, hi - lo) for b in flat)
                parts.append(_kl_tile(policy_head.logits(hq, lo, hi, out=zq), reference_head.logits(hp, lo, hi, out=zp),
                                      diff))
            mq, sq, a, mp, sp = (torch.stack(x).to(torch.float64) for x in zip(*parts))
            lse_q, lse_p = torch.logsumexp(mq + torch.log(sq), 0), torch.logsumexp(mp + torch.log(sp), 0)
            out.append((torch.exp(mq - lse_q) * a).sum(0) - lse_q + lse_p)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64, device=device)
