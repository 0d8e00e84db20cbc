"""The exact cases of a check: a grid of log-ratios for pointwise values, small categoricals enumerated
token by token for expectations and expected gradients, and the padded positions of masked tokens.
Nothing is sampled: every number is a closed form of its index, so the cases are the same everywhere.

Shapes: a categorical's ``logits_q``, ``logits_p`` are [V]; the grid is [n] pairs (log q, log p).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

F64 = torch.float64

# Log-ratios of the pointwise grid: 0, tiny (k3's cancellation regime), moderate, and the extremes
# |log r| up to 50 that overflow e^ℓ in float16 (ℓ > 11.1) and that clamps at ±10 or ±20 cut. Values
# such as 2.3 are not representable in bfloat16, so a cast to bfloat16 shows up as an error.
GRID_LOGR = (0.0, 1e-6, 1e-3, 0.1, 0.7, 1.3, 2.3, 4.6, 9.1, 15.7, 20.1, 33.3, 50.0)
# Each log-ratio is placed at two heights: near the mode (the larger log-prob is −0.25) and 60 nats
# lower, where exp(log q) underflows float32 (e^−103 is its smallest subnormal) while log r is the same.
# A function that forms r as exp(log p)/exp(log q) gives 0/0 or x/0 there; one that forms r as
# exp(log p − log q) does not.
GRID_HEIGHTS = (-0.25, -60.25)


def value_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """(log q, log p), float64 [n], n = 2·(2·len(GRID_LOGR) − 1): every ±ℓ of GRID_LOGR at every height;
    both log-probs are ≤ 0 (valid log-probabilities), the larger one at the height."""
    logr = sorted({s * x for x in GRID_LOGR for s in (-1.0, 1.0)})
    lq, lp = [], []
    for h in GRID_HEIGHTS:
        for x in logr:
            lq.append(h - max(x, 0.0))
            lp.append(h + min(x, 0.0))
    # host: the exact cases are small float64 tables on the CPU, whatever device the function under test uses
    return torch.tensor(lq, dtype=F64), torch.tensor(lp, dtype=F64)


@dataclass(frozen=True)
class Categorical:
    """q = softmax(logits_q), p = softmax(logits_p) over V tokens, every token enumerated. ``what`` says
    why the case is there."""
    name: str
    logits_q: tuple[float, ...]
    logits_p: tuple[float, ...]
    what: str
    gradients: bool = True    # a case for the expected gradients: ∇KL(q‖p), ∇KL(p‖q) and 0 far apart

    def log_q(self) -> torch.Tensor:
        return torch.log_softmax(torch.tensor(self.logits_q, dtype=F64), -1)  # host: an exact case's table

    def log_p(self) -> torch.Tensor:
        return torch.log_softmax(torch.tensor(self.logits_p, dtype=F64), -1)  # host: an exact case's table

    def kl(self) -> dict[str, float]:
        """{"KL(q||p)": Σ q log(q/p), "KL(p||q)": Σ p log(p/q)}, float64 sums."""
        lq, lp = self.log_q(), self.log_p()
        return {"KL(q||p)": float((lq.exp() * (lq - lp)).sum()), "KL(p||q)": float((lp.exp() * (lp - lq)).sum())}

    def kl_gradients(self) -> dict[str, torch.Tensor]:
        """The exact gradients with respect to q's logits z [V] (docs/gradients.md, softmax):
        ∂KL(q‖p)/∂z_j = q_j (log q_j − log p_j − KL(q‖p)), ∂KL(p‖q)/∂z_j = q_j − p_j."""
        lq, lp = self.log_q(), self.log_p()
        q = lq.exp()
        return {"KL(q||p)": q * (lq - lp - (q * (lq - lp)).sum()), "KL(p||q)": q - lp.exp()}


def _wave(v: int, amplitude: float, freq: float, phase: float = 0.0) -> tuple[float, ...]:
    return tuple(amplitude * math.cos(freq * k + phase) for k in range(v))


def _add(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(x + y for x, y in zip(a, b))


CASES: tuple[Categorical, ...] = (
    Categorical("near-V8", _wave(8, 0.8, 1.7), _add(_wave(8, 0.8, 1.7), _wave(8, 0.15, 2.3, 0.4)),
                "p close to q: KL ≈ 0.007, where k1's and k3's values differ by second-order terms (no gradient "
                "check: ∇KL(q‖p) and ∇KL(p‖q) agree to first order here)", gradients=False),
    Categorical("moderate-V8", _wave(8, 1.0, 1.1), _add(_wave(8, 1.0, 1.1), _wave(8, 1.2, 2.9, 1.0)),
                "KL ≈ 0.5, |log r| ≤ 2.5: no clamp at ±10 or ±20 fires; the gradients' reference directions "
                "are far apart"),
    Categorical("peaked-V16", _wave(16, 3.0, 0.9), _add(_wave(16, -1.5, 0.9), _wave(16, 0.5, 2.1, 0.3)),
                "q and p peaked on different tokens: KL(q‖p) ≈ 2.4, KL(p‖q) ≈ 3.8, log r from −3.5 to +5.9"),
    Categorical("rare-p-V4", (0.0, 0.5, -0.3, 0.2), (-40.0, 0.4, -0.1, 0.3),
                "a token with p ≪ q (log r ≈ −40): k3 ≈ 39 there, so a clamp at ±10 changes the expectation"),
    Categorical("rare-q-V6", (-30.0, 0.2, 0.1, -0.4, 0.3, 0.0), (0.0, 0.2, 0.1, -0.4, 0.3, 0.0),
                "a token with q ≪ p (log r ≈ +30): r ≈ 10^13, finite in float32, inf in float16 (no gradient "
                "check: p ∝ q on the other tokens, so ∇KL(q‖p) ≈ 0 here)", gradients=False),
)
CASE_NAMES = tuple(c.name for c in CASES)


# ----------------------------------------------------------------------------- masked positions
MASK_FILLS = {"zero": 0.0, "-inf": -math.inf}
# The log-prob beside a padded one: near the mode, in the tail, and far enough that e^{0 − (−100)}
# overflows float32 (a zero-filled reference next to a policy log-prob of −100 gives r = e^100).
MASK_PARTNERS = (-0.5, -30.0, -100.0)


def masked_rows(fill: str) -> list[tuple[str, float, float]]:
    """(where, log q, log p) of the padded positions to check for a fill ("zero": 0.0 or "-inf"): the fill
    in logprobs, in ref_logprobs, and (zero fill only) in both. Both −inf is not a row: −inf − (−inf) is
    NaN in every formula, so code that pads both sides with −inf must mask before it subtracts."""
    v = MASK_FILLS[fill]
    rows = [(f"logprobs = {v:g}", v, x) for x in MASK_PARTNERS] + [(f"ref_logprobs = {v:g}", x, v) for x in MASK_PARTNERS]
    return rows + ([(f"logprobs = ref_logprobs = {v:g}", v, v)] if math.isfinite(v) else [])


@dataclass(frozen=True)
class Placement:
    """Where a trainer puts the per-token value f (docs/gradients.md): the objective whose gradient with
    respect to q's logits z is the expected gradient, as a function of (q held fixed, f, log q(z))."""
    name: str
    words: str
    objective: object   # Callable[[q, f, log_q], scalar]; q detached, f and log_q depend on z


def _loss(q, f, lq):
    return (q * f).sum()                          # Σ_x sg(q) f: the sample held fixed


def _reward(q, f, lq):
    return (q * f.detach() * lq).sum()            # Σ_x q sg(f) log q: REINFORCE, f detached


def _loss_is(q, f, lq):
    return (q * f * torch.exp(lq - lq.detach())).sum()   # f · q/sg(q): TRL's use_bias_correction_kl on-policy


PLACEMENTS = {p.name: p for p in (
    Placement("loss", "in the loss (sample held fixed)", _loss),
    Placement("reward", "in the reward (score function, value detached)", _reward),
    Placement("loss_is", "in the loss times q/sg(q) (TRL's use_bias_correction_kl, on-policy)", _loss_is),
)}
