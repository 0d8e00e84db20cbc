"""Exact multinomial count vectors drawn with torch, on the device of their probabilities.

A count vector c ~ Multinomial(n, w) over M outcomes is drawn down a binary tree over the outcomes: the
root holds n; a node holding N splits into Binomial(N, w_left / (w_left + w_right)) for its left child and
the rest for its right one. Every count is an exact int64 and a node's children sum to it exactly, so the
leaves sum to n; the law is Multinomial(n, w) exactly, as conditional binomials are (numpy's sequential
multinomial is the same identity along a chain instead of a tree), with each split probability rounded
to float64 (as any sampler's probabilities are). The tree has ⌈log2 M⌉ levels; each
level is one vectorised binomial draw over all its nodes of all batches at once: O(M) work and O(log M)
sequential steps per call, whatever n (n ≤ 2^62).

Binomial(N, p), p ≤ ½ (the larger side is drawn as N minus the smaller), exact in law up to float64
rounding of the acceptance tests (no approximating distribution):
- N·p < 10: inversion by sequential search from 0, one uniform;
- N·p ≥ 10: BTRS (Hörmann 1993, "The generation of binomial random variates", transformed rejection with
  squeeze), two uniforms an attempt. Written here for int64 N up to 2^62: N·p is split exactly into an
  int64 part and a fraction (:func:`exact_product`), so that the proposal k = ⌊N·p + offset⌋ is an exact
  integer (a float64 N·p has an ulp of 512 near 2^61: numpy's own binomial returns multiples of 256 at
  n = 2^62), and the log-ratio log f(k)/f(m) of the
  probability mass function at k and at the mode m is written in terms of k − m with log1p and
  (1 + x)·log1p(x) − x, so that no term of size N cancels (the textbook form loses N·2^-53 there).

Random numbers: node j of a level takes a row of :data:`SLOTS` uniforms (slot 0 for inversion, slots
2t and 2t + 1 for BTRS attempt t). Each batch draws its rows from its own generator, one call per group
of levels (three at M = 50,257; and one more, rare, for the batch's nodes that used all :data:`ATTEMPTS`
attempts), so a batch's counts
depend on its generator alone: the same whether it is drawn alone or with other batches, hence whatever the
chunk size or the number of processes. The generator lives on the device; only the batch sizes are
host numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

ATTEMPTS = 12             # BTRS attempts per node drawn up front (acceptance ≥ 0.69 each: 1 node in 10^6 needs more)
SLOTS = 2 * ATTEMPTS      # uniforms per node and level
SMALL_MEAN = 10.0         # BTRS needs N·p ≥ 10 (Hörmann); inversion below
MAX_N = 1 << 62           # exact_product splits N in two 31-bit halves
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
TAIL_SERIES_FROM = 20     # Stirling tail from lgamma below (error ~1e-15), from its series (< 2e-17) above
SERIES_BELOW = 0.01       # (1 + x)·log1p(x) − x by its series for |x| below this (9 terms: error < 1e-17)
SERIES_TERMS = 9
INVERSION_BLOCK = 16      # values of k the inversion tries at once per row still searching (P(X ≥ 16) < 0.05 at n·p < 10)
CALL_BYTES = 1 << 33      # memory one draw_counts call may use (a chunk's batches are split to fit); a GPU's
                          # call also stays within a quarter of the device's memory (call_bytes). Each call
                          # costs ~440 operations a level whatever its batches (issue 33: launches on a GPU),
                          # so fewer, larger calls: 8 GiB holds 222 batches at M = 50,257 (4 GiB held 111)
NODE_BYTES = 1536         # peak bytes per node of the widest level (measured ≤ 1,490 on the CPU, n from 10^4 to
                          # 4·10^18 a batch: the rows of uniforms, BTRS's constants and the log-ratio's
                          # temporaries on every node at once)
CALL_BATCHES = 1024       # at most, whatever the memory (a chunk is also when progress and checkpoints happen)


# ----------------------------------------------------------------------------- float64 helpers
def stirling_tail(k: torch.Tensor) -> torch.Tensor:
    """log k! − [(k + ½)·log(k + 1) − (k + 1) + ½·log 2π] for int64 k ≥ 0 (any shape), float64 on k's
    device: lgamma below 20, the Stirling series 1/(12z) − 1/(360z³) + 1/(1260z⁵) − 1/(1680z⁷) + 1/(1188z⁹)
    (z = k + 1) above, whose first omitted term, 691/(360360 z¹¹), is below 2e-17 there."""
    z = k.to(torch.float64) + 1
    small = torch.lgamma(z) - (z - 0.5) * torch.log(z) + z - HALF_LOG_2PI
    inv2 = 1 / (z * z)
    large = (1 / 12 - inv2 * (1 / 360 - inv2 * (1 / 1260 - inv2 * (1 / 1680 - inv2 / 1188)))) / z
    return torch.where(k < TAIL_SERIES_FROM, small, large)


def log1p_excess(x: torch.Tensor) -> torch.Tensor:
    """(1 + x)·log1p(x) − x for x > −1, float64: by its series Σ_{j≥2} (−x)^j / (j(j − 1)) where |x| < 0.01
    (the direct form loses the x²/2 that is left once x cancels: its relative error is ~2^-52/|x|, below
    5e-14 from 0.01 on), directly elsewhere."""
    direct = (1 + x) * torch.log1p(x) - x
    s = torch.zeros_like(x)
    for j in range(SERIES_TERMS + 1, 1, -1):                 # x²·Σ (−x)^(j−2)/(j(j − 1)), Horner
        s = 1.0 / (j * (j - 1)) - x * s
    series = s * x * x
    return torch.where(x.abs() < SERIES_BELOW, series, direct)


def exact_product(n: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """n·p as (⌊n·p⌋ int64, n·p − ⌊n·p⌋ float64) for int64 0 ≤ n ≤ 2^62 and float64 0 ≤ p ≤ 1.

    n = hi·2^31 + lo with hi, lo < 2^31 (hi ≤ 2^31 at n = 2^62), and p = p2 + p1 + p0 cut at 2^-21 and
    2^-42 (each cut exact): hi·p2, hi·p1, lo·p2, lo·p1 are products of ≤ 31- and ≤ 21-bit integers
    (times powers of two), exact in float64; hi·p0·2^31 and lo·p0 are below 2^20 and 2^-11, rounded by at
    most 2^-33. Each part's integer part is summed in int64, the fractions in float64: the integer part
    is exact and the fraction within ~2^-33."""
    hi, lo = (n >> 31).to(torch.float64), (n & ((1 << 31) - 1)).to(torch.float64)
    p2 = torch.floor(p * 2.0**21) * 2.0**-21
    r = p - p2
    p1 = torch.floor(r * 2.0**42) * 2.0**-42
    # The six products at once, [6, ...] (each exact as above but hi·p0·2^31 and lo·p0): a few operations
    # whatever their number (on a GPU each is a kernel launch).
    parts = (torch.stack([hi * 2.0**31, lo])[:, None] * torch.stack([p2, p1, r - p1])[None]).flatten(0, 1)
    fl = torch.floor(parts)
    whole = fl.to(torch.int64).sum(0)
    frac = (parts - fl).sum(0)
    carry = torch.floor(frac)
    return whole + carry.to(torch.int64), frac - carry


# ----------------------------------------------------------------------------- binomials
def binomial_inversion(n: torch.Tensor, p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Binomial(n, p) [R] int64 from one uniform u [R] each, by inversion: the number of k < n whose CDF
    F(k) = Σ_{j≤k} f(j) is below u, with f(k + 1) = f(k)·(n − k)/(k + 1)·p/(1 − p) from f(0) = (1 − p)^n.
    For n·p < 10, p ≤ ½ (n·p + 1 steps on average).

    The search runs :data:`INVERSION_BLOCK` values of k at a time on every row still searching ([R, K]: the
    mass function by a running product, the CDF by a running sum), so that a level of the tree costs a
    few dozen operations and one host check per block rather than ~10 operations and a check every few
    steps (on a GPU each operation is a kernel launch: issue 33). A row stops counting where f underflows
    (a tail below 1e-300 that float64 rounding of F could otherwise leave above u)."""
    nd = n.to(torch.float64)
    ratio = p / (1 - p)
    f = torch.exp(nd * torch.log1p(-p))                    # f(k0) of each row still searching
    below_k0 = torch.zeros_like(nd)                        # F(k0 − 1)
    x = torch.zeros_like(n)
    rows = None                                            # the rows still searching (None: all)
    k0 = 0
    while True:
        k = torch.arange(k0, k0 + INVERSION_BLOCK, dtype=torch.float64, device=nd.device)
        # f(k0 + j) = f(k0)·Π_{i<j} (n − k0 − i)/(k0 + i + 1)·p/(1 − p): a running product along the block
        # (in place where it can: the block's [R, K] matrices are a level's largest tensors)
        step = (nd[:, None] - k[:-1]).div_(k[:-1] + 1).mul_(ratio[:, None])
        mass = torch.cat([f[:, None], step], 1).cumprod_(1)
        del step
        cdf = mass.cumsum(1).add_(below_k0[:, None])
        below = (u[:, None] > cdf).logical_and_(nd[:, None] > k).logical_and_(mass > 0)   # F(k) < u: X > k
        found = below.sum(1)
        if rows is None:
            x += found
        else:
            x.index_add_(0, rows, found)
        more = torch.nonzero(below[:, -1]).squeeze(1)
        if not more.numel():
            return x
        last = k0 + INVERSION_BLOCK - 1                  # f(last + 1) from f(last)
        nd, ratio, u = nd[more], ratio[more], u[more]
        f = mass[more, -1] * ((nd - last) / (last + 1) * ratio)
        below_k0 = cdf[more, -1]
        rows = more if rows is None else rows[more]
        k0 += INVERSION_BLOCK


def _column(matrix: str, i: int) -> property:
    return property(lambda self: getattr(self, matrix)[:, i:i + 1], doc=f"column {i} of {matrix}: [R, 1]")


@dataclass
class _Btrs:
    """The constants of BTRS (Hörmann 1993, algorithm BTRS) of the nodes still drawing, in two matrices (the
    int64 ones [R, 3], the float64 ones [R, 14]) so that keeping the nodes still drawing is two gathers, not
    thirteen (on a GPU each is a kernel launch). Each constant reads as a column view [R, 1] that broadcasts
    over a node's attempts [R, A]:
    n (trials), whole = ⌊n·p⌋ and frac = n·p − whole (so that n·p + ½ = whole + frac + ½ exactly),
    mode m = ⌊(n + 1)·p⌋; p (≤ ½), low = −⌊n·p⌋ − 1 and high = n − ⌊n·p⌋ + 1 (bounds of the proposal's offset),
    Hörmann's a, b, α, v_r, log_slope = log[r·(n − m + 1)/(m + 1)] (r = p/(1 − p)),
    tails_m = stirling_tail(m) + stirling_tail(n − m), and for :meth:`log_ratio` A = m + 1, B = n − m + 1,
    1/A and −1/B (float64)."""
    ints: torch.Tensor      # int64 [R, 3]
    floats: torch.Tensor    # float64 [R, 14]
    n, whole, mode = (_column("ints", i) for i in range(3))
    p, frac, low, high, a, b, alpha, v_r, log_slope, tails_m = (_column("floats", i) for i in range(10))

    @property
    def ab(self) -> torch.Tensor:
        """A and B as [2, R, 1] (a view), to broadcast over the stacked halves of :meth:`log_ratio`."""
        return self.floats[:, 10:12].T[:, :, None]

    @property
    def inv_ab(self) -> torch.Tensor:
        """1/A and −1/B as [2, R, 1] (a view)."""
        return self.floats[:, 12:14].T[:, :, None]

    @classmethod
    def of(cls, n: torch.Tensor, p: torch.Tensor) -> "_Btrs":
        """From n [R] int64 and p [R] float64."""
        n, p = n[:, None], p[:, None]
        spq = torch.sqrt(n.to(torch.float64) * p * (1 - p))
        b = 1.15 + 2.53 * spq
        whole, frac = exact_product(n, p)
        carry = torch.floor(frac + p)                        # (n + 1)·p = whole + frac + p
        mode = whole + carry.to(torch.int64)
        # r·(n − m + 1)/(m + 1) = 1 + δ/((1 − p)(m + 1)) with δ = (n + 2)p − m − 1, computed from the exact split
        delta = (whole - mode - 1).to(torch.float64) + frac + 2 * p
        log_slope = torch.log1p(delta / ((1 - p) * (mode + 1).to(torch.float64)))
        ab = torch.cat([mode + 1, n - mode + 1], 1).to(torch.float64)     # A, B: exact below 2^53
        floats = (p, frac, (-whole - 1).to(torch.float64), (n - whole + 1).to(torch.float64),
                  -0.0873 + 0.0248 * b + 0.01 * p, b, (2.83 + 5.1 / b) * spq, 0.92 - 4.2 / b, log_slope,
                  stirling_tail(torch.stack([mode, n - mode])).sum(0), ab, ab.reciprocal() * ab.new_tensor([1, -1]))
        return cls(torch.cat([n, whole, mode], 1), torch.cat(floats, 1))

    def keep(self, index: torch.Tensor) -> "_Btrs":
        return _Btrs(self.ints[index], self.floats[index])

    def log_ratio(self, k: torch.Tensor) -> torch.Tensor:
        """log f(k)/f(m) of the binomial mass function, float64, for 0 ≤ k ≤ n: with d = k − m, A = m + 1,
        B = n − m + 1 it is d·log(r·B/A) − A·h(d/A) − B·h(−d/B) + ½[log1p(d/A) + log1p(−d/B)] + the
        Stirling tails, h(x) = (1 + x)·log1p(x) − x: every term is O(d²/N) or smaller, none cancels."""
        d = (k - self.mode).to(torch.float64)
        # x = d/A and y = −d/B stacked [2, R, A] (d times 1/A and −1/B, made once per level: within 2 ulps of
        # the quotients), and the tails of k and n − k: each helper runs once on both halves (the same values
        # as two calls, in half the operations: on a GPU each one is a kernel launch).
        xy = d * self.inv_ab
        h, tails = log1p_excess(xy), stirling_tail(torch.stack([k, self.n - k]))
        return (d * self.log_slope - (self.ab * h - 0.5 * torch.log1p(xy)).sum(0)
                + self.tails_m - tails.sum(0))

    def attempt(self, u: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """BTRS attempts from uniforms u, v [R, A] (A attempts per node): (accepted [R, A] bool, k [R, A])."""
        us0 = u - 0.5
        us = 0.5 - us0.abs()
        safe_us = torch.where(us > 0, us, 1.0)
        # k = ⌊n·p + ½ + (2a/us + b)·U⌋ = whole + ⌊frac + ½ + (2a/us + b)·U⌋: the float part stays small
        off = (2 * self.a / safe_us + self.b) * us0 + self.frac + 0.5
        inside = (us > 0) & (off >= self.low) & (off <= self.high)
        k = self.whole + torch.floor(torch.where(inside, off, 0.0)).to(torch.int64)
        inside &= (k >= 0) & (k <= self.n)
        squeeze = inside & (us >= 0.07) & (v <= self.v_r)
        # Outside the squeeze: accept iff log(v·α/(a/us² + b)) ≤ log f(k)/f(m) (Hörmann's test, in logs)
        hat = torch.log(v * self.alpha / (self.a / (safe_us * safe_us) + self.b))
        kk = torch.where(inside, k, self.mode)
        return squeeze | (inside & (hat <= self.log_ratio(kk))), k


def binomial_btrs(n: torch.Tensor, p: torch.Tensor, slots: torch.Tensor,
                  more: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Binomial(n, p) [R] int64 for n·p ≥ 10, p ≤ ½, n ≤ 2^62, from rows of uniforms ``slots`` [R, SLOTS]:
    attempt t takes slots 2t and 2t + 1, and a node's draw is its first accepted attempt. Attempt 0 runs on
    every node; the rest of a row's attempts at once ([R', ATTEMPTS − 1]) on the nodes it rejected (most
    are accepted at once: few launches and two host syncs a level). A node rejected by every attempt gets
    a fresh row from ``more(positions)`` ([len(positions), SLOTS], positions sorted) and starts again."""
    state = _Btrs.of(n, p)
    ok, k = state.attempt(slots[:, 0:1], slots[:, 1:2])
    out = torch.where(ok[:, 0], k[:, 0], 0)
    left = torch.nonzero(~ok[:, 0]).squeeze(1)
    state, rows, first = state.keep(left), slots[left], 1
    while left.numel():
        if 2 * first < rows.shape[1]:
            ok, k = state.attempt(rows[:, 2 * first::2], rows[:, 2 * first + 1::2])
            hit = ok.any(1)
            pick = torch.argmax(ok.to(torch.int8), 1, keepdim=True)        # the first accepted attempt
            out[left] = torch.where(hit, k.gather(1, pick)[:, 0], out[left])
            miss = torch.nonzero(~hit).squeeze(1)
            left, state = left[miss], state.keep(miss)
        if left.numel():
            rows, first = more(left), 0
    return out


def binomial(n: torch.Tensor, p: torch.Tensor, slots: torch.Tensor,
             more: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Binomial(n, p) [R] int64 for int64 0 ≤ n ≤ 2^62 and float64 0 ≤ p ≤ ½ [R], from the uniform rows
    ``slots`` [R, SLOTS] (and ``more``, see :func:`binomial_btrs`). p = 0 or n = 0 gives 0."""
    mean = n.to(torch.float64) * p
    x = torch.zeros_like(n)
    small = torch.nonzero((mean > 0) & (mean < SMALL_MEAN)).squeeze(1)
    if small.numel():
        x[small] = binomial_inversion(n[small], p[small], slots[small, 0])
    big = torch.nonzero(mean >= SMALL_MEAN).squeeze(1)
    if big.numel():
        x[big] = binomial_btrs(n[big], p[big], slots[big], lambda rows: more(big[rows]))
    return x


# ----------------------------------------------------------------------------- the tree
@dataclass(frozen=True)
class MultinomialTree:
    """The split probabilities of a binary tree over M outcomes, root first: level i holds, for each of its
    S nodes, the probabilities (left [S], right [S]) of its two children given the node (float64, on the
    probabilities' device), and the number of nodes of the next level (2S, or 2S − 1 when the last node
    has one child)."""
    levels: tuple[tuple[torch.Tensor, torch.Tensor, int], ...]
    size: int
    device: torch.device

    @classmethod
    def of(cls, probs: torch.Tensor) -> "MultinomialTree":
        """From non-negative weights ``probs`` [M] (normalised here: only ratios matter), on their device."""
        w = probs.to(torch.float64)
        if w.dim() != 1 or not w.shape[0] or not bool(torch.isfinite(w).all() and (w >= 0).all() and w.sum() > 0):
            raise ValueError("a multinomial needs finite non-negative weights [M] with a positive sum")
        masses = [w]
        while masses[-1].shape[0] > 1:
            m = masses[-1]
            if m.shape[0] % 2:
                m = torch.cat([m, torch.zeros(1, dtype=m.dtype, device=m.device)])
            masses.append(m[0::2] + m[1::2])
        levels = []
        for parent, child in zip(reversed(masses[1:]), reversed(masses[:-1])):
            c = child if child.shape[0] == 2 * parent.shape[0] else torch.cat(
                [child, torch.zeros(1, dtype=child.dtype, device=child.device)])
            safe = torch.where(parent > 0, parent, torch.ones_like(parent))
            levels.append((c[0::2] / safe, c[1::2] / safe, child.shape[0]))
        return cls(tuple(levels), w.shape[0], w.device)


def _more(generators: list[torch.Generator], nodes: int, device: torch.device):
    """Fresh uniform rows for the flat positions ``rows`` (sorted) of a level of ``nodes`` nodes per batch:
    each batch's rows from its own generator, in position order."""
    def more(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], SLOTS, dtype=torch.float64, device=device)
        batch = rows // nodes
        present, sizes = torch.unique_consecutive(batch, return_counts=True)
        start = 0
        for b, k in zip(present.tolist(), sizes.tolist()):
            out[start:start + k].uniform_(generator=generators[b])
            start += k
        return out
    return more


def _slot_groups(widths: list[int]) -> list[int | None]:
    """For each level (node counts ``widths``, root first): the node count of the group of levels whose
    uniform rows are drawn at that level (None: drawn with an earlier level's group). Groups are runs of
    consecutive levels of at most max(widths) nodes (three groups at M = 50,257)."""
    groups: list[list[int]] = []
    for s in widths:
        if groups and sum(groups[-1]) + s <= max(widths):
            groups[-1].append(s)
        else:
            groups.append([s])
    return [x for group in groups for x in [sum(group)] + [None] * (len(group) - 1)]


def draw_counts(tree: MultinomialTree, sizes: list[int], generators: list[torch.Generator]) -> torch.Tensor:
    """Count vectors [G, M] int64 on the tree's device, row g ~ Multinomial(sizes[g], w) drawn from
    ``generators[g]`` alone (module docstring): one call for all G batches."""
    if len(sizes) != len(generators):
        raise ValueError("one generator per batch")
    if any(not 0 <= n <= MAX_N for n in sizes):
        raise ValueError(f"multinomial sizes must be in [0, 2^62], got {sizes}")
    device, g = tree.device, len(sizes)
    counts = torch.tensor(sizes, dtype=torch.int64, device=device).reshape(g, 1)
    # The levels' rows of uniforms, one call per batch for a group of levels (rather than per batch and
    # level: on a GPU each call is a kernel launch, and the tree has ⌈log2 M⌉ levels). A group holds at
    # most as many nodes as the widest level, so the rows alive never exceed twice that level's (at
    # M = 50,257: groups of 12,573, 12,565 and 25,129 nodes).
    widths = [left_p.shape[0] for left_p, _, _ in tree.levels]
    every = slots = start = None
    for (left_p, right_p, next_size), s, group in zip(tree.levels, widths, _slot_groups(widths)):
        if group is not None:
            every = slots = None                                              # the last group's rows freed
            start = 0
            every = torch.empty(g, group, SLOTS, dtype=torch.float64, device=device)
            for i, gen in enumerate(generators):
                every[i].uniform_(generator=gen)
        slots = every[:, start:start + s].reshape(g * s, SLOTS)
        start += s
        n = counts.reshape(-1)
        pl, pr = left_p.repeat(g), right_p.repeat(g)
        small_left = pl <= pr
        x = binomial(n, torch.where(small_left, pl, pr), slots, _more(generators, s, device))
        left = torch.where(small_left, x, n - x)
        counts = torch.stack([left, n - left], 1).reshape(g, 2 * s)[:, :next_size]
    return counts


def call_bytes(device: torch.device) -> int:
    """The memory one :func:`draw_counts` call may use on ``device``: :data:`CALL_BYTES`, and on a GPU at most a
    quarter of its memory (a smaller card splits a chunk into more calls; the counts do not change)."""
    device = torch.device(device)
    if device.type == "cuda":
        return min(CALL_BYTES, torch.cuda.get_device_properties(device).total_memory // 4)
    return CALL_BYTES


def batches_per_call(outcomes: int, budget: int = CALL_BYTES) -> int:
    """How many batches' count vectors over ``outcomes`` outcomes one :func:`draw_counts` call draws within
    ``budget`` bytes (the widest level has ⌈M/2⌉ nodes of :data:`NODE_BYTES`), at most :data:`CALL_BATCHES`:
    222 at M = 50,257 with :data:`CALL_BYTES`."""
    return max(1, min(CALL_BATCHES, budget // (NODE_BYTES * ((outcomes + 1) // 2))))
