"""Exact moments of rollout functionals by forward dynamic programming over bucket states.

Model: x_t ~ q(·|c_{t−1}), c_t = bucket(x_t), c_0 = 0, at most T tokens; the token ``eos`` (if any) ends
the sequence and is included in it. For a per-step multiplicative weight m(c, x) and an additive
increment h(c, x), with M = Π_t m(c_{t−1}, x_t) and S = Σ_t h(c_{t−1}, x_t), we want E_q[M · S^k].

State after t steps: V_k[c] = E[M_t S_t^k ; alive with bucket c]. One step multiplies by the moment
matrices  A_j[c, c'] = Σ_{x: bucket(x) = c', x ≠ eos} q(x|c) m(c, x) h(c, x)^j  (O(C·V) each) and
binomially mixes the orders:  V'_k = Σ_j C(k, j) V_{k−j} A_j  (O(K² C²) per step). EOS moves mass to
an absorbing "ended" accumulator with the same rule. Sequence-level estimators need E[R^s L^k]
(m = r^s, h = log r); token sums need E[S^k] with h = f(log r) and m = 1. See docs/rollouts.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def moment_matrices(q: torch.Tensor, m: torch.Tensor, h: torch.Tensor, bucket: torch.Tensor, buckets: int,
                    eos: int | None, kmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [kmax+1, C, C], E [kmax+1, C]) for q, m, h of shape [C, V] (float64) and bucket [V] (int64)."""
    c, v = q.shape
    keep = torch.arange(v, device=q.device)        # the tokens that continue the sequence (all but EOS), in order
    if eos is not None:
        keep = torch.cat([keep[:eos], keep[eos + 1:]])
    target = bucket[keep]
    a = torch.zeros(kmax + 1, c, buckets, dtype=torch.float64, device=q.device)
    e = torch.zeros(kmax + 1, c, dtype=torch.float64, device=q.device)
    w = q * m
    for j in range(kmax + 1):
        wj = w * h**j if j else w
        a[j].index_add_(1, target, wj[:, keep])
        if eos is not None:
            e[j] = wj[:, eos]
    return a, e


def propagate(a: torch.Tensor, e: torch.Tensor, length: int, start: int = 0) -> list[float]:
    """E[M · S^k] for k = 0..K after at most ``length`` steps, from bucket ``start``."""
    return propagate_phases([(a, e, length)], start)


def propagate_phases(phases: list[tuple[torch.Tensor, torch.Tensor, int]], start: int = 0) -> list[float]:
    """Like :func:`propagate` with step-dependent matrices: ``phases`` = [(A, E, steps), ...] in order
    (e.g. EOS suppressed for the first min_length steps, then allowed)."""
    return propagate_tensor(phases, start).tolist()


def propagate_tensor(phases: list[tuple[torch.Tensor, torch.Tensor, int]], start: int = 0) -> torch.Tensor:
    """:func:`propagate_phases` as a tensor [K+1], differentiable with autograd through A and E (the
    rollout gradients differentiate it with respect to the sampling logits)."""
    state, ended = _start(phases, start), None
    for a, e, steps in phases:
        for _ in range(steps):
            state, ended = _step(state, a, e, ended)
    return state.sum(dim=1) if ended is None else ended + state.sum(dim=1)


def propagate_by_length(phases: list[tuple[torch.Tensor, torch.Tensor, int]], start: int = 0) -> torch.Tensor:
    """Like :func:`propagate_phases`, split by the sequence's final length: [T, K+1] with entry
    [ℓ − 1, k] = E[M · S^k ; |y| = ℓ] (EOS at step ℓ, or no EOS and ℓ = T). Summing over ℓ gives
    :func:`propagate_phases`. Per-sequence means (S/|y|) and length-dependent weights (W^{1/|y|}) are
    then exact sums over ℓ: docs/trainers.md."""
    state, out = _start(phases, start), []
    for a, e, steps in phases:
        for _ in range(steps):
            state, ended = _step(state, a, e, None)
            out.append(ended)
    out[-1] = out[-1] + state.sum(dim=1)        # still alive after T steps: length T
    return torch.stack(out)


def _start(phases: list[tuple[torch.Tensor, torch.Tensor, int]], start: int) -> torch.Tensor:
    """The state before the first step, V_k[c] = 1 for k = 0 and c = ``start``: [K+1, C] on A's device."""
    a0 = phases[0][0]
    state = torch.zeros(a0.shape[0], a0.shape[1], dtype=torch.float64, device=a0.device)
    state[0, start] = 1.0
    return state


def _step(state: torch.Tensor, a: torch.Tensor, e: torch.Tensor,
          ended: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the program: the new state V'_k = Σ_j C(k, j) V_{k−j} A_j [K+1, C], and ``ended`` [K+1]
    (zeros when None) plus this step's EOS mass Σ_j C(k, j) V_{k−j} E_j, added term by term."""
    kmax = state.shape[0] - 1
    ended = torch.zeros(kmax + 1, dtype=torch.float64, device=state.device) if ended is None else ended
    new = torch.zeros_like(state)
    for k in range(kmax + 1):
        for j in range(k + 1):
            new[k] += math.comb(k, j) * (state[k - j] @ a[j])
            ended[k] += math.comb(k, j) * (state[k - j] @ e[j])
    return new, ended


@dataclass(frozen=True)
class LengthSpectra:
    """The spectra of P^{B−1} and P^{B−2} (P: the length's generating function) on an FFT grid, shared by
    every token-mean row of a case: see :func:`token_mean_moments`."""
    size: int                    # B·T + 1 coefficients, z^0..z^{B·T}
    n: int                       # FFT length: the next power of two ≥ size (a length with large prime
                                 # factors, such as B·T + 1, makes the FFT several times slower)
    lo: int                      # B·ℓ_min and B·ℓ_max: the support of the sum of B lengths
    hi: int
    power1: torch.Tensor         # spectrum of P^{B−1}, complex [n/2 + 1]
    power2: torch.Tensor         # spectrum of P^{B−2} (B ≥ 2), else of 1


def length_spectra(p_length: torch.Tensor, group: int) -> LengthSpectra:
    """``p_length`` [T]: P(|y| = ℓ) for ℓ = 1..T; ``group`` = B ≥ 1."""
    t, b = p_length.shape[0], int(group)
    # On the host: a [T] law in, two spectra out (the FFTs' bytes then do not depend on the device).
    host = p_length.to(torch.float64).cpu()
    p = torch.cat([torch.zeros(1, dtype=torch.float64, device=host.device), host])
    size = b * t + 1
    n = 1 << (size - 1).bit_length()
    f_p = torch.fft.rfft(p, n)

    def power(k):                # by repeated squaring: O(log k) roundings, not z**k's exp(k log z)
        out, base = torch.ones_like(f_p), f_p
        while k:
            if k & 1:
                out = out * base
            base, k = base * base, k >> 1
        return out
    power2 = power(max(b - 2, 0))
    power1 = power2 * f_p if b >= 2 else power2
    support = (p > 0).nonzero()
    return LengthSpectra(size, n, b * int(support.min()), b * int(support.max()), power1, power2)


def token_mean_moments(by_length: torch.Tensor, group: int,
                       spectra: LengthSpectra | None = None) -> tuple[float, float]:
    """(mean, variance) of the token-mean v = Σ_i S_i / Σ_i |y_i| over a batch of ``group`` = B independent
    sequences, from ``by_length`` [T, 3] = :func:`propagate_by_length` with m = 1 and k ≤ 2: entry [ℓ − 1, k]
    = E[S^k ; |y| = ℓ]. ``spectra``: :func:`length_spectra` of by_length[:, 0], when already computed.

    With generating functions over the total length, P(z) = Σ_ℓ P(|y| = ℓ) z^ℓ and A_k(z) = Σ_ℓ E[S^k ; |y| = ℓ] z^ℓ,
    exchangeability gives E[v] = B Σ_x [z^x](A_1 P^{B−1}) / x. For the variance, with μ = E[v] and
    D_i = S_i − μ|y_i| (so v − μ = Σ_i D_i / Σ_i |y_i|, no cancellation against μ²):
        E[(v − μ)²] = B Σ_x [z^x](A_2^D P^{B−1}) / x² + B(B−1) Σ_x [z^x]((A_1^D)² P^{B−2}) / x²,
    A_1^D = A_1 − μ ℓ P and A_2^D = A_2 − 2μ ℓ A_1 + μ² ℓ² P coefficient by coefficient. The products are
    polynomial products of degree ≤ B·T, done by real FFTs in float64 (docs/trainers.md#6-aggregations
    has the rounding: ~1e-12 relative in ordinary cases, up to ~1e-8 in the variance when T is long and
    sequences ending at step 1 are rare)."""
    if not bool(torch.isfinite(by_length).all()):
        return math.inf, math.inf
    t, b = by_length.shape[0], int(group)
    sp = spectra if spectra is not None else length_spectra(by_length[:, 0], b)
    host = by_length.to(torch.float64).cpu()                            # [T, 3]: a small result
    p, a1, a2 = (torch.cat([torch.zeros(1, dtype=torch.float64, device=host.device), host[:, k]])
                 for k in range(3))                                     # coefficients of z^0..z^T
    fft = torch.fft.rfft

    # B lengths in [ℓ_min, ℓ_max] sum to [B·ℓ_min, B·ℓ_max]: every coefficient outside is exactly 0. The
    # FFT leaves rounding noise there (≈ 1e-16 of the largest coefficient), which 1/x and 1/x² would
    # amplify at small x: set it to 0.
    def coef(spectrum):          # the polynomial's coefficients of z^1..z^{B·T}, zero off the support
        c = torch.fft.irfft(spectrum, sp.n)[:sp.size]
        c[:sp.lo] = 0.0
        c[sp.hi + 1:] = 0.0
        return c[1:]
    x = torch.arange(1, sp.size, dtype=torch.float64, device=host.device)
    mean = b * float((coef(fft(a1, sp.n) * sp.power1) / x).sum())
    ell = torch.arange(t + 1, dtype=torch.float64, device=host.device)
    a1d = a1 - mean * ell * p
    a2d = a2 - 2 * mean * ell * a1 + mean * mean * ell * ell * p
    second = b * float((coef(fft(a2d, sp.n) * sp.power1) / x**2).sum())
    if b > 1:
        f_a1d = fft(a1d, sp.n)
        second += b * (b - 1) * float((coef(f_a1d * f_a1d * sp.power2) / x**2).sum())
    return mean, max(second, 0.0)


def inverse_total_length(p_length: torch.Tensor, group: int) -> torch.Tensor:
    """γ(ℓ) = B · E[1/(ℓ + L′)] for ℓ = 1..T, [T], where L′ is the sum of B − 1 independent lengths with
    P(|y| = ℓ) = ``p_length`` [T] and B = ``group``: the factor a token-mean over B sequences,
    Σ_i Σ_t g_{i,t} / Σ_i |y_i|, puts on one sequence of length ℓ (by exchangeability the group's value
    has the mean B·E[Σ_t g_{1,t} / (|y_1| + L′)]). L′'s law is the coefficients of P^{B−1}
    (:func:`length_spectra`, zeroed off its support (B−1)·[ℓ_min, ℓ_max]); the sums over it for every ℓ
    at once are one FFT correlation with 1/x, float64 (rounding ~1e-16 of the largest term)."""
    t, b = p_length.shape[0], int(group)
    if b == 1:
        return 1.0 / torch.arange(1, t + 1, dtype=torch.float64, device=p_length.device)
    sp = length_spectra(p_length, b)            # on the host (its FFTs); the [T] result goes back
    size = (b - 1) * t + 1                                  # coefficients z^0..z^{(B−1)T} of P^{B−1}
    c = torch.fft.irfft(sp.power1, sp.n)[:size]
    support = (p_length > 0).nonzero()
    lo, hi = (b - 1) * (int(support.min()) + 1), (b - 1) * (int(support.max()) + 1)
    c[:lo] = 0.0
    c[hi + 1:] = 0.0
    # γ(ℓ)/B = Σ_k c_k / (ℓ + k): the correlation of c with h(x) = 1/x, x = 1..size + T.
    h = 1.0 / torch.arange(1, size + t + 1, dtype=torch.float64, device=c.device)
    n = 1 << (size + h.shape[0]).bit_length()
    corr = torch.fft.irfft(torch.fft.rfft(h, n) * torch.conj(torch.fft.rfft(c, n)), n)
    return (b * corr[:t]).to(p_length.device)


# ----------------------------------------------------------------------------- per-step expectations
@dataclass(frozen=True)
class StepTables:
    """One step's tables [C, V] for :func:`step_expectations`: the sampling law b, the multiplicative
    weight m (a sequence importance weight's factor; 1 for none), the additive increment f (the per-token
    estimator, times a token weight where the caller wants one) and u (a weight on the step's own count:
    a token importance weight of the score's step; 1 for none)."""
    b: torch.Tensor
    m: torch.Tensor
    f: torch.Tensor
    u: torch.Tensor


# F_t of :func:`step_expectations` by ``part``: the step's term from α_{t−1} (``a`` [C, 1]), β_{t−1} [C, 1],
# the step's f [C, V] and the continuation values (zc, vc) [C, V] after its token.
_TERMS = {
    "one": lambda a, beta, f, zc, vc: a * zc,                           # F_t = 1
    "all": lambda a, beta, f, zc, vc: beta * zc + a * (f * zc + vc),    # F_t = Σ_s f_s
    "to_go": lambda a, beta, f, zc, vc: a * (f * zc + vc),              # F_t = Σ_{s≥t} f_s
}
SUMS = tuple(_TERMS)


def not_eos_mask(vocab: int, eos: int | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[V] 1 for a token after which a sequence goes on, 0 for EOS (all 1 without one)."""
    mask = torch.ones(vocab, dtype=dtype, device=device)
    if eos is not None:
        mask[eos] = 0.0
    return mask


def step_expectations(steps: list[StepTables], bucket: torch.Tensor, eos: int | None, part: str,
                      gamma: torch.Tensor | None = None) -> torch.Tensor:
    """E[Σ_t u_t · N_t(c, x) · M · γ(|y|) · F_t] for every (c, x) at once, [C, V] (float64), where
    N_t(c, x) = 1 if step t drew x from bucket c, M = Π_s m_s, and F_t is 1 (``part = "one"``), the
    whole sum Σ_s f_s (``"all"``) or the sum still to come Σ_{s≥t} f_s (``"to_go"``, reward-to-go).
    ``steps``: one :class:`StepTables` per step t = 1..T (phases repeat the same object); ``gamma`` [T]:
    a factor of the final length, γ(ℓ) = gamma[ℓ − 1] (None: 1).

    A forward pass carries α_t[c] = E[M_{≤t}; alive at c after t steps] and β_t[c] = E[M_{≤t} Σ_{s≤t} f_s;
    alive at c]; a backward pass carries Z_t[c] = E[M_{>t} γ(|y|) | alive at c after t] and
    V_t[c] = E[M_{>t} γ(|y|) Σ_{s>t} f_s | alive at c]. The draw of x from c at step t then contributes
    b m u (α_{t−1} F-part), with the continuation (Z, V) after x: (γ(t), 0) when x is EOS or t = T, else
    (Z_t, V_t)[bucket(x)]. O(T·C·V); no autograd. Used for reward-to-go and length-normalised gradient
    rows (kl_bench.kinds.rollout.gradients), whose weights are not products over steps."""
    if part not in SUMS:
        raise ValueError(f"part must be one of {SUMS}")
    length = len(steps)
    c, v = steps[0].b.shape
    dt, dev = torch.float64, steps[0].b.device
    gam = torch.ones(length, dtype=dt, device=dev) if gamma is None else gamma.to(dev, dt)
    not_eos = not_eos_mask(v, eos, dt, dev)
    # Backward: the continuation values (zc, vc) [C, V] of drawing x from c at step t.
    cont: list[tuple[torch.Tensor, torch.Tensor]] = [None] * length      # type: ignore[list-item]
    z_next = gam[length - 1].expand(c).clone()
    v_next = torch.zeros(c, dtype=dt, device=dev)
    for t in range(length, 0, -1):
        st = steps[t - 1]
        if t == length:
            zc, vc = gam[t - 1].expand(c, v).clone(), torch.zeros(c, v, dtype=dt, device=dev)
        else:
            zc = not_eos * z_next[bucket][None, :] + (1 - not_eos) * gam[t - 1]
            vc = not_eos * v_next[bucket][None, :]
        cont[t - 1] = (zc, vc)
        bm = st.b * st.m
        z_next, v_next = (bm * zc).sum(-1), (bm * (st.f * zc + vc)).sum(-1)
    # Forward: accumulate the contributions.
    alpha = torch.zeros(c, dtype=dt, device=dev)
    alpha[0] = 1.0
    beta = torch.zeros(c, dtype=dt, device=dev)
    out = torch.zeros(c, v, dtype=dt, device=dev)
    for t in range(1, length + 1):
        st = steps[t - 1]
        zc, vc = cont[t - 1]
        bm = st.b * st.m
        a = alpha[:, None]
        out += bm * st.u * _TERMS[part](a, beta[:, None], st.f, zc, vc)
        # Move on (EOS draws leave the alive states).
        go = bm * not_eos
        new_alpha = torch.zeros(c, dtype=dt, device=dev).index_add_(0, bucket, (a * go).sum(0))
        new_beta = torch.zeros(c, dtype=dt, device=dev).index_add_(0, bucket, (go * (beta[:, None] + a * st.f)).sum(0))
        alpha, beta = new_alpha, new_beta
    return out
