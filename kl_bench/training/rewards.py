"""The spec's reward, made for a case: a per-token table of the kind's shape, or a function of whole sequences
(kl_bench.kinds.trainable.Reward, what a kind's training problem is built from)."""
from __future__ import annotations

import torch

from ..foundation.errors import SpecError
from ..kinds.trainable import Reward
from ..sampling.logits_files import read_logits_file
from ..sampling.seeding import batch_generator
from .config import RewardSpec
from ..kinds.trainable import SEQUENCE_REWARD_KEY as KEY
from .sequences import categorical_table, rewards_of


def reward_table(spec: RewardSpec, shape: tuple[int, int], case: str, seed: int) -> torch.Tensor:
    """The reward [rows, V] (float64) of one case: rows = contexts (categorical) or buckets (rollout)."""
    rows, vocab = shape
    if not spec.applies_to(case):
        return torch.zeros(shape, dtype=torch.float64)  # host: a reward table from the spec
    if spec.kind == "sequence":           # a categorical's sequence is one token: R([x]) is a table
        try:
            return categorical_table(spec.function, rows, vocab)
        except SpecError as e:
            raise e.located(case=case, key=KEY) from None
    if spec.kind == "random":
        return _random_table(spec, shape, case, seed)
    if spec.kind == "tokens":
        return _token_table(spec, shape, case)
    return _file_table(spec, shape, case)


def _random_table(spec: RewardSpec, shape: tuple[int, int], case: str, seed: int) -> torch.Tensor:
    # Its own stream (seed, case/reward): the reward does not move when draws or steps change.
    g = batch_generator(seed + spec.seed, f"{case}/reward", 0, torch.device("cpu"))
    r = spec.scale * torch.randn(shape, dtype=torch.float64, generator=g)  # host: a reward table from the spec
    return -r.abs() if spec.penalty else r


def _token_table(spec: RewardSpec, shape: tuple[int, int], case: str) -> torch.Tensor:
    """``value`` on the listed tokens in every row, 0 elsewhere."""
    bad = [t for t in spec.tokens if t >= shape[1]]
    if bad:
        raise SpecError(f"token id {bad[0]} is outside the vocabulary (V = {shape[1]})", case=case,
                        key="train.reward.tokens")
    out = torch.zeros(shape, dtype=torch.float64)  # host: a reward table from the spec
    out[:, list(spec.tokens)] = spec.value
    return out


def _file_table(spec: RewardSpec, shape: tuple[int, int], case: str) -> torch.Tensor:
    """The table of a file, [rows, V] or one row [V] repeated, finite."""
    rows, vocab = shape
    try:
        t = read_logits_file(spec.file, spec.key, what="reward table")
    except SpecError as e:
        raise e.located(case=case, key="train.reward.file") from None
    if tuple(t.shape) != (rows, vocab) and not (t.shape[0] == 1 and t.shape[1] == vocab):
        raise SpecError(f"reward table has shape {list(t.shape)}, needs [{rows}, {vocab}] or [{vocab}]", case=case,
                        key="train.reward.file")
    if not bool(torch.isfinite(t).all()):
        raise SpecError("reward table must be finite", case=case, key="train.reward.file")
    return t.expand(rows, vocab).to(torch.float64).clone()


def reward_for(spec: RewardSpec, case: str, seed: int) -> Reward:
    """The reward of one case: its table for a given shape (zeros where the case gets none), and R(tokens, mask)
    where the spec's reward is a function of whole sequences (its errors name the case and the key)."""
    def sequence(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        try:
            return rewards_of(spec.function, tokens, mask)
        except SpecError as e:
            raise e.located(case=case, key=KEY) from None
    per_sequence = spec.kind == "sequence" and spec.applies_to(case)
    return Reward(lambda shape: reward_table(spec, shape, case, seed), sequence if per_sequence else None)
