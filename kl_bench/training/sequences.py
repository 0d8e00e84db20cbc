"""A per-sequence reward R(y) of a rollout's whole token sequence y = (x_1, …, x_|y|): the registry of
reward functions (built-in names, ``"module:object"`` plug-ins found beside the spec too, and the entry-point
group ``kl_bench.sequence_rewards``), the enumeration of every sequence of a small rollout, and the rollout
problem that trains against R (docs/training.md, "A per-sequence reward").

A reward function is called as ``fn(tokens, mask)``: ``tokens`` int64 [N, T] (T the case's length) with −1
past each sequence's end, ``mask`` bool [N, T], True on the sequence's tokens (EOS included). It returns N
finite numbers (a tensor, an array or a list), one per sequence. It must be deterministic: the exact values
call it once on every sequence, the sampled updates on the sampled paths.

Exact: R is not a sum over steps, so no dynamic program applies; E_q[R], J, ∇J and the optimum
q*(y) ∝ p(y)·exp(R(y)/β) come from enumerating every sequence, at most :data:`MAX_SLOTS` token slots
(sequences × T): V^T ≤ 2^22 / T without EOS.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..foundation.errors import SpecError
from ..foundation.registry import Registry
from .rollout import RolloutProblem

MAX_SLOTS = 1 << 22            # sequences × T enumerated (int64 tokens and keys: 64 MiB)
KEY = "train.reward.sequence"


@dataclass(frozen=True)
class SequenceReward:
    """A named reward of whole sequences: ``fn(tokens, mask) -> [N]`` (module docstring)."""
    name: str
    fn: Callable[[torch.Tensor, torch.Tensor], Any]


def _adapt(ref: str, obj: Any) -> SequenceReward:
    if isinstance(obj, SequenceReward):
        return obj
    if not callable(obj):
        raise SpecError(f"sequence reward plug-in '{ref}' is a {type(obj).__name__}, not a function of "
                        "(tokens, mask)")
    return SequenceReward(ref, obj)


SEQUENCE_REWARDS: Registry[SequenceReward] = Registry("sequence reward", entry_points="kl_bench.sequence_rewards",
                                                      adapt=_adapt)


def _length(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """|y|, the number of tokens (EOS included); additive: a per-token table of ones gives the same."""
    return mask.sum(-1).to(torch.float64)


def _distinct(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The number of distinct token ids in y; not a sum over steps."""
    s = torch.sort(tokens, -1).values                  # −1 (past the end) sorts first
    new = torch.ones_like(s, dtype=torch.bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    return (new & (s >= 0)).sum(-1).to(torch.float64)


SEQUENCE_REWARDS.add("length", SequenceReward("length", _length))
SEQUENCE_REWARDS.add("distinct", SequenceReward("distinct", _distinct))


def rewards_of(reward: SequenceReward, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """R on N sequences, float64 [N]; an exception, a wrong shape or a non-finite value is one line."""
    n = tokens.shape[0]
    try:
        out = reward.fn(tokens.clone(), mask.clone())
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever the plug-in raised is the user's input error
        first = (str(e).strip().splitlines() or [""])[0]
        raise SpecError(f"sequence reward '{reward.name}' raised {type(e).__name__}: {first}") from None
    try:
        # host: a user's reward values, checked on the host (then moved with the problem's tables)
        values = torch.as_tensor(out.detach() if isinstance(out, torch.Tensor) else out).to("cpu", torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise SpecError(f"sequence reward '{reward.name}' returned a {type(out).__name__}, not {n} numbers") from None
    if tuple(values.shape) != (n,):
        raise SpecError(f"sequence reward '{reward.name}' returned shape {list(values.shape)} for {n} sequences; "
                        f"it must return one number per sequence, shape [{n}]")
    bad = (~torch.isfinite(values)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise SpecError(f"sequence reward '{reward.name}' returned {float(values[i])} for the sequence "
                        f"{tokens[i][mask[i]].tolist()}: rewards must be finite")
    return values


def count_sequences(vocab: int, length: int, eos: int | None) -> int:
    """How many sequences a rollout has: V^T without EOS; with it, those ending in EOS before step T
    (Σ_{t<T−1} (V−1)^t) and those of length T ((V−1)^{T−1}·V)."""
    if eos is None:
        return vocab ** length
    k = vocab - 1
    return sum(k ** t for t in range(length - 1)) + k ** (length - 1) * vocab


@dataclass(frozen=True)
class Sequences:
    """Every sequence of a rollout: ``tokens`` int64 [M, T] (−1 past the end), ``mask`` bool [M, T] and
    ``keys`` int64 [M, T], c·V + x of each step (c the bucket it was drawn in; 0 past the end)."""
    tokens: torch.Tensor
    mask: torch.Tensor
    keys: torch.Tensor


def enumerate_sequences(bucket: torch.Tensor, vocab: int, length: int, eos: int | None) -> Sequences:
    """Every sequence, shortest first, extending every live prefix by every token in turn (step 1 is drawn
    in bucket 0, step t + 1 in the bucket of x_t, as the rollout kind's sampler draws them)."""
    dev = bucket.device
    x = torch.arange(vocab, device=dev)
    tok, key = torch.zeros(1, 0, dtype=torch.int64, device=dev), torch.zeros(1, 0, dtype=torch.int64, device=dev)
    ctx = torch.zeros(1, dtype=torch.int64, device=dev)
    done_tok, done_key = [], []
    for t in range(length):
        a = tok.shape[0]
        nxt = x.repeat(a)
        tok = torch.cat([tok.repeat_interleave(vocab, 0), nxt[:, None]], 1)
        key = torch.cat([key.repeat_interleave(vocab, 0), (ctx.repeat_interleave(vocab) * vocab + nxt)[:, None]], 1)
        end = torch.full((tok.shape[0],), t == length - 1, device=dev) if eos is None or t == length - 1 else nxt == eos
        pad = length - t - 1
        done_tok.append(torch.nn.functional.pad(tok[end], (0, pad), value=-1))
        done_key.append(torch.nn.functional.pad(key[end], (0, pad), value=0))
        tok, key = tok[~end], key[~end]
        ctx = bucket[tok[:, -1]] if tok.numel() else ctx[:0]
    tokens = torch.cat(done_tok)
    return Sequences(tokens, tokens >= 0, torch.cat(done_key))


def enumerate_checked(bucket: torch.Tensor, vocab: int, length: int, eos: int | None, case: str) -> Sequences:
    """:func:`enumerate_sequences`, or one line when the case has more than :data:`MAX_SLOTS` token slots."""
    m = count_sequences(vocab, length, eos)
    if m * length > MAX_SLOTS:
        shape = f"V = {vocab}, T = {length}" + (", with EOS" if eos is not None else "")
        raise SpecError(f"a per-sequence reward is computed exactly by enumerating every sequence, and this case has "
                        f"{m:,} ({shape}): sequences × T must be ≤ 2^22 = {MAX_SLOTS:,}; use a smaller vocab or "
                        "length, or a per-token reward (random, file, tokens)", case=case, key=KEY)
    return enumerate_sequences(bucket, vocab, length, eos)


def categorical_table(reward: SequenceReward, rows: int, vocab: int) -> torch.Tensor:
    """A categorical's "sequence" is one token: R([x]) in every context is a reward table [rows, V]."""
    tokens = torch.arange(vocab)[:, None]  # host: a spec's reward table
    return rewards_of(reward, tokens, torch.ones_like(tokens, dtype=torch.bool)).expand(rows, vocab).clone()


@dataclass(frozen=True)
class SequenceRolloutProblem(RolloutProblem):
    """A rollout case trained against R(y) (its per-token ``reward`` table is zero): ``seqs`` every
    sequence, ``values`` R on each [M]."""
    sequence_reward: SequenceReward | None = None
    seqs: Sequences | None = None
    values: torch.Tensor | None = None

    @property
    def has_reward(self) -> bool:
        return True

    def _log_probs(self, lq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log q(y), log p(y)) of every sequence, [M] each."""
        s = self.seqs
        lq_y = torch.where(s.mask, lq.reshape(-1)[s.keys], 0.0).sum(-1)
        lp_y = torch.where(s.mask, self.log_p.reshape(-1)[s.keys], 0.0).sum(-1)
        return lq_y, lp_y

    def _score(self, lq: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Σ_y w(y) S(y), [C, V], with S(y) = ∇θ log q(y) = Σ_t e_{c_{t−1}, x_t} − q(·|c_{t−1}) in row c_{t−1}."""
        s = self.seqs
        # Past a sequence's end the key is 0 and the weight 0.0: adding it changes nothing.
        acc = torch.zeros(lq.numel(), dtype=torch.float64, device=lq.device).index_add_(
            0, s.keys.reshape(-1), (w[:, None] * s.mask).reshape(-1))
        acc = acc.reshape(lq.shape)
        return acc - acc.sum(-1, keepdim=True) * lq.exp()

    def evaluate(self, theta: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
        """Exact values at θ and ∇J = Σ_y q(y)(R(y) − β log(q(y)/p(y))) S(y), by enumeration. KL(q‖q*) is
        summed directly (log q* = log p + R/β − log Z), not as log Z − J/β."""
        lq = torch.log_softmax(theta.detach(), -1)
        lq_y, lp_y = self._log_probs(lq)
        q_y, r = lq_y.exp(), self.values
        log_opt = lp_y + r / self.beta
        log_opt = log_opt - torch.logsumexp(log_opt, 0)
        kl_rev, reward = float((q_y * (lq_y - lp_y)).sum()), float((q_y * r).sum())
        out = {"kl_rev": kl_rev, "kl_fwd": float((lp_y.exp() * (lp_y - lq_y)).sum()),
               "entropy": float(-(q_y * lq_y).sum()), "reward": reward, "objective": reward - self.beta * kl_rev,
               "kl_opt": float((q_y * (lq_y - log_opt)).sum())}
        return out, self._score(lq, q_y * (r - self.beta * (lq_y - lp_y)))

    def reward_gradient(self, lq: torch.Tensor) -> torch.Tensor:
        """∇θ E_q[R] = Σ_y q(y) R(y) S(y), exact by enumeration, [C, V]."""
        lq = lq.detach()
        return self._score(lq, self._log_probs(lq)[0].exp() * self.values)

    def path_rewards(self, keys: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        """R of each sampled path (the plug-in called on the paths' tokens), [n]."""
        mask = alive > 0
        tokens = torch.where(mask, keys % self.log_p.shape[1], -1)
        try:
            return rewards_of(self.sequence_reward, tokens, mask)
        except SpecError as e:
            raise e.located(case=self.name, key=KEY) from None
