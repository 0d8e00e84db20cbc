"""The ``[train]`` table of a spec → a frozen :class:`TrainConfig` (unknown keys rejected with "did you mean",
every bad value one line naming the file and the key)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..foundation.typed_toml import Table, at_most, check_seed, positive, typename
from ..foundation.errors import SpecError
from ..foundation.registry import did_you_mean, plugin_path
from .combos import check_combination
from .optim import OPTIMIZERS, Optimizer
from .sequences import SEQUENCE_REWARDS, SequenceReward

GRADIENTS = ("exact", "sampled")
REWARD_KINDS = ("random", "file", "tokens", "sequence")
MAX_STEPS = 1 << 20            # steps are sequential: a million is already hours


@dataclass(frozen=True)
class RewardSpec:
    """``kind``: "none" (pure regularisation towards p), "random" (N(0, scale²) per (context, token), drawn
    from ``seed``; −|N(0, scale²)| with ``penalty``: a cost on every token), "file" (a [B, V] / [C, V]
    table in .npy/.pt/.safetensors, ``key`` inside it), "tokens" (``value`` on the token ids ``tokens`` in every
    context, 0 elsewhere), "sequence" (``function``: R(y) of a rollout's whole sequence, from
    :data:`kl_bench.training.sequences.SEQUENCE_REWARDS`; on a categorical, R([x]) is a table)."""
    kind: str = "none"
    scale: float = 1.0
    seed: int = 0
    penalty: bool = False
    file: Path | None = None
    key: str | None = None
    tokens: tuple[int, ...] = ()
    value: float = 1.0
    function: SequenceReward | None = None
    cases: tuple[str, ...] = ()    # the cases that get the reward (default: all; the others get none)

    def applies_to(self, case: str) -> bool:
        """Whether ``case`` gets this reward (not "none", and listed in ``cases`` when that is given)."""
        return self.kind != "none" and (not self.cases or case in self.cases)


@dataclass(frozen=True)
class TrainConfig:
    optimizer: Optimizer
    steps: int
    beta: float
    combinations: tuple[str, ...]
    reward: RewardSpec = RewardSpec()
    gradients: tuple[str, ...] = ("exact",)
    draws: int | None = None       # per step of a sampled run (default: [experiment] draws)
    seeds: int = 8                 # sampled runs per combination (bands)
    chunk: int = 1 << 20           # draws searched at once (memory only: never changes a byte)
    record_every: int = 1          # write every k-th step (and the last)
    cases: tuple[str, ...] = ()    # the cases to train (default: all)
    sampled_combinations: tuple[str, ...] = ()   # those with sampled runs (default: all combinations)


def _str_list(t: Table, k: str, allowed: tuple[str, ...] | None, default: tuple[str, ...]) -> tuple[str, ...]:
    raw = t.raw(k)
    if raw is None:
        return default
    vals = (raw,) if isinstance(raw, str) else t.get(k, "str_list")
    if not vals:
        raise t.error("must not be empty", key=t.key(k))
    for v in vals:
        if allowed is not None and v not in allowed:
            raise t.error(f"unknown value '{v}'{did_you_mean(v, list(allowed))}; allowed: {', '.join(allowed)}",
                          key=t.key(k))
    if len(set(vals)) != len(vals):
        raise t.error("lists a value twice", key=t.key(k))
    return tuple(vals)


def _token_ids(r: Table) -> tuple[int, ...]:
    toks = r.raw("tokens")
    ok = isinstance(toks, list) and toks and all(not isinstance(x, bool) and isinstance(x, int) and x >= 0 for x in toks)
    if not ok:
        raise r.error(f"must be a non-empty list of token ids (integers ≥ 0), got {toks!r}", key=r.key("tokens"))
    return tuple(toks)


def _sequence_reward(r: Table, spec_dir: Path) -> SequenceReward:
    """A registered name or a ``"module:object"`` plug-in (imported now, found beside the spec too)."""
    name = r.get("sequence", "str")
    try:
        with plugin_path(spec_dir):
            return SEQUENCE_REWARDS[name]
    except SpecError as e:
        raise e.located(file=r.file, key=r.key("sequence")) from None


def _parse_reward(t: Table, spec_dir: Path) -> RewardSpec:
    raw = t.raw("reward")
    if raw is None or raw == "none":
        return RewardSpec()
    if not isinstance(raw, dict):
        raise t.error(f"must be \"none\" or a table with one of {', '.join(REWARD_KINDS)}, got {typename(raw)} {raw!r}",
                      key=t.key("reward"))
    r = t.sub("reward")
    kinds = [k for k in REWARD_KINDS if r.has(k)]
    if len(kinds) != 1:
        unknown = next((k for k in raw if k not in REWARD_KINDS), None)
        hint = did_you_mean(unknown, list(REWARD_KINDS)) if unknown else ""
        raise r.error(f"needs exactly one of {', '.join(REWARD_KINDS)}{hint}", key=t.key("reward"))
    spec = _reward_of(kinds[0], r, spec_dir)
    cases = r.get("cases", "str_list", ())
    r.finish()
    return dataclasses.replace(spec, cases=cases)


def _reward_of(kind: str, r: Table, spec_dir: Path) -> RewardSpec:
    """The [train.reward] table's keys of its one reward kind."""
    if kind == "random":
        return RewardSpec("random", scale=r.get("random", "float", check=positive),
                          seed=r.get("seed", "int", 0, check_seed), penalty=r.bool("penalty", False))
    if kind == "file":
        f = Path(r.get("file", "str"))
        return RewardSpec("file", file=f if f.is_absolute() else spec_dir / f, key=r.get("key", "str", None))
    if kind == "tokens":
        return RewardSpec("tokens", tokens=_token_ids(r), value=r.get("value", "float", 1.0))
    return RewardSpec("sequence", function=_sequence_reward(r, spec_dir))


def _parse_optimizer(t: Table) -> Optimizer:
    name = t.get("optimizer", "str", "adam")
    if name not in OPTIMIZERS:
        raise t.error(f"unknown optimizer '{name}'{did_you_mean(name, list(OPTIMIZERS))}; known: {', '.join(OPTIMIZERS)}",
                      key=t.key("optimizer"))
    for k in ("betas", "eps"):        # Adam's constants: given with sgd they would be ignored in silence
        if name != "adam" and t.has(k):
            raise t.error(f"is one of Adam's constants: optimizer '{name}' has none; remove it", key=t.key(k))
    betas = t.get("betas", "float_or_list", (0.9, 0.999))
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise t.error(f"must be two numbers in [0, 1), got {list(betas)}", key=t.key("betas"))
    return Optimizer(name, t.get("lr", "float", check=positive), (betas[0], betas[1]),
                     t.get("eps", "float", 1e-8, positive))


# Draws of one sampled step (train.draws, else [experiment] draws): drawn token by token, in pieces, at about
# 5·10^7 a second on one CPU core: 2^40 is hours a step, and beyond it the pieces' own bookkeeping no longer
# fits in memory (1e15 had ended in an out-of-memory line naming no key).
MAX_STEP_DRAWS = 1 << 40
STEP_DRAWS_WHY = "2^40 draws a sampled step: each is drawn as a token (hours a step at that size)"


def check_step_draws(cfg: TrainConfig, experiment_draws: int, file: str) -> int:
    """The draws of one sampled step: ``train.draws``, else [experiment] draws, which a spec for runs may set
    far larger (refused here, naming that key, when the [train] table asks for sampled gradients)."""
    draws = cfg.draws or experiment_draws
    if "sampled" in cfg.gradients and draws > MAX_STEP_DRAWS:
        raise SpecError(f"gives each sampled step of the [train] table {draws:,} draws: at most {MAX_STEP_DRAWS:,} "
                        f"({STEP_DRAWS_WHY}); set train.draws", file=file, key="experiment.draws")
    return draws


def parse_train(raw: Any, file: str, spec_dir: Path) -> TrainConfig:
    """The ``[train]`` table (a dict) of the spec ``file``."""
    if raw is None:
        raise SpecError("needs a [train] table (optimizer, lr, steps, beta, combinations)", file=file, key="train")
    t = Table(raw, file, None, "train.")
    if "combinations" not in raw:
        t.get("combinations", "str_list")      # missing: says so, or names the misspelt key
    cfg = TrainConfig(
        optimizer=_parse_optimizer(t),
        steps=t.get("steps", "int", check=at_most(MAX_STEPS, "2^20: steps run one after another")),
        beta=t.get("beta", "float", check=positive),
        combinations=_str_list(t, "combinations", None, ()),
        reward=_parse_reward(t, spec_dir),
        gradients=_str_list(t, "gradients", GRADIENTS, ("exact",)),
        draws=t.get("draws", "int", None, at_most(MAX_STEP_DRAWS, STEP_DRAWS_WHY)),
        seeds=t.get("seeds", "int", 8, at_most(1 << 16, "2^16: one trajectory per seed")),
        chunk=t.get("chunk", "int", 1 << 20, positive),
        record_every=t.get("record_every", "int", 1, positive),
        cases=_str_list(t, "cases", None, ()),
    )
    for text in cfg.combinations:      # the estimator and mode now (a case's aggregates when it is built)
        try:
            check_combination(text)
        except SpecError as e:
            raise e.located(file=file, key="train.combinations") from None
    if t.has("sampled_combinations"):
        sub = _str_list(t, "sampled_combinations", cfg.combinations, ())
        cfg = dataclasses.replace(cfg, sampled_combinations=sub)
    t.finish()
    return cfg
