"""Experiment specs: TOML → frozen, validated dataclasses.

Every error is a :class:`SpecError` naming the file, the case and the key. Unknown keys are
rejected with a "did you mean" suggestion. See README.md ("Spec format") for a complete example.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import SpecError
from .estimators import DEFAULT_ESTIMATORS, ESTIMATORS
from .registry import did_you_mean

SPEC_VERSION = 1
_MISSING = object()
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


# ----------------------------------------------------------------------------- dataclasses
@dataclass(frozen=True)
class GaussianParams:
    """A diagonal Gaussian; ``mean`` and ``std`` have one entry per dimension."""
    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass(frozen=True)
class ZipfLogits:
    """LLM-like rank-frequency logits: logit(x) = −exponent · log rank(x), ranks a seeded
    random permutation (one per context when ``contexts`` > 1). Shape [V] or [contexts, V]."""
    exponent: float
    seed: int
    contexts: int | None = None    # None: 1 for categoricals, the bucket count for rollouts


@dataclass(frozen=True)
class FileLogits:
    """Unnormalised logits from a .npy or .pt file, shape [V] or [B, V]."""
    path: Path


@dataclass(frozen=True)
class DerivedLogits:
    """The other side's logits, divided by ``temperature``, plus N(0, noise²) noise."""
    source: str            # "q" or "p"
    noise: float = 0.0
    temperature: float = 1.0
    seed: int = 0


LogitsSource = ZipfLogits | FileLogits | DerivedLogits


@dataclass(frozen=True)
class EstimatorOption:
    """A registry estimator with the clamps trainers apply: log r clamped to ±logr_clamp before the
    estimator, the estimate clamped to ±clamp after. Reported under ``label``."""
    name: str
    label: str
    logr_clamp: float | None = None
    clamp: float | None = None


@dataclass(frozen=True)
class SamplerSpec:
    """Draws come from b instead of q; the estimators still use q's and p's log-probs.

    b is q (or ``behavior``, a stale policy) with ``temperature``, then ``top_k``, then ``top_p``
    applied, and EOS suppressed for the first ``min_length`` tokens (rollouts); for Gaussians
    b = N(μq, (std_scale·σq)²). ``weights`` multiplies estimates by q/b: per token ("token") or by the
    product over the sequence ("sequence"); ``weight_cap`` caps each token's q/b.
    """
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_length: int = 0
    std_scale: float = 1.0
    behavior: "LogitsSource | None" = None
    weights: str = "none"
    weight_cap: float | None = None

    def describe(self) -> str:
        bits = []
        if self.behavior is not None:
            bits.append("stale behavior policy")
        if self.temperature != 1.0:
            bits.append(f"T={self.temperature:g}")
        if self.top_k is not None:
            bits.append(f"top-k={self.top_k}")
        if self.top_p is not None:
            bits.append(f"top-p={self.top_p:g}")
        if self.min_length:
            bits.append(f"EOS suppressed for {self.min_length} tokens")
        if self.std_scale != 1.0:
            bits.append(f"std×{self.std_scale:g}")
        if self.weights != "none":
            bits.append(f"{self.weights} IS weights" + (f" capped at {self.weight_cap:g}" if self.weight_cap else ""))
        return "sampler b: " + (", ".join(bits) or "q itself")


@dataclass(frozen=True)
class GaussianCase:
    name: str
    q: GaussianParams
    p: GaussianParams
    kind: str = "gaussian"
    draws: int | None = None
    sampler: SamplerSpec | None = None    # overrides [experiment] draws for this case


@dataclass(frozen=True)
class CategoricalCase:
    name: str
    vocab: int | None
    q: LogitsSource
    p: LogitsSource
    kind: str = "categorical"
    draws: int | None = None
    sampler: SamplerSpec | None = None


@dataclass(frozen=True)
class RolloutCase:
    """Two autoregressive token models whose next-token logits depend on the previous token only
    through its bucket: q and p are [C, V] logits."""
    name: str
    vocab: int
    buckets: int
    bucket_of: str | Path       # "mod" (x mod C) or a .npy/.pt file with an int array [V]
    length: int                 # T, the maximum number of generated tokens
    eos: int | None
    q: LogitsSource
    p: LogitsSource
    kind: str = "rollout"
    eos_prob: float | None = None   # sets q(eos|c) = p(eos|c) = eos_prob in every bucket
    draws: int | None = None
    sampler: SamplerSpec | None = None


Case = GaussianCase | CategoricalCase | RolloutCase


@dataclass(frozen=True)
class Experiment:
    name: str
    draws: int
    seed: int = 0
    device: str = "auto"
    estimators: tuple[str | EstimatorOption, ...] = DEFAULT_ESTIMATORS
    batches: int = 200      # batch means for standard errors
    chunk: int = 1 << 22    # draws held in memory at once
    lambdas: tuple[float, ...] = ()   # λ values of cv(λ) = −log r + λ(r − 1)
    optimal: bool = False             # "optimal" in lambdas: add cv_opt with λ from a pilot pass
    gradients: bool = False           # also write gradients.csv (kl_bench.gradients)


@dataclass(frozen=True)
class Spec:
    experiment: Experiment
    cases: tuple[Case, ...]
    path: Path
    text: str = field(repr=False)
    spec_version: int = SPEC_VERSION

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


# ----------------------------------------------------------------------------- key reader
class _Table:
    """Reads keys from one TOML table, remembering which were used, to reject the rest."""

    def __init__(self, data: Any, file: str, case: str | None, prefix: str):
        self.file, self.case, self.prefix = file, case, prefix
        if not isinstance(data, dict):
            raise self.error(f"must be a table, got {_typename(data)}", key=prefix.rstrip(".") or None)
        self.data = data
        self.used: set[str] = set()

    def error(self, message: str, key: str | None = None) -> SpecError:
        return SpecError(message, file=self.file, case=self.case, key=key)

    def key(self, k: str) -> str:
        return f"{self.prefix}{k}"

    def has(self, k: str) -> bool:
        return k in self.data

    def get(self, k: str, kind: str, default: Any = _MISSING,
            check: Callable[[Any], str | None] | None = None) -> Any:
        """Return key ``k`` converted to ``kind`` ('int', 'float', 'str', 'float_or_list',
        'str_list', 'table'), or ``default``; ``check`` returns an error message or None."""
        self.used.add(k)
        if k not in self.data:
            if default is _MISSING:
                # A misspelt key is the likelier story than a forgotten one: say so.
                typo = [x for x in self.data if x not in self.used and did_you_mean(x, [k])]
                if typo:
                    raise self.error(f"unknown key (did you mean '{k}'?)", key=self.key(typo[0]))
                raise self.error("missing required key", key=self.key(k))
            return default
        value = _convert(self.data[k], kind, lambda m: self.error(m, key=self.key(k)))
        if check is not None:
            msg = check(value)
            if msg:
                raise self.error(msg, key=self.key(k))
        return value

    def sub(self, k: str) -> "_Table":
        self.used.add(k)
        if k not in self.data:
            raise self.error("missing required key", key=self.key(k))
        return _Table(self.data[k], self.file, self.case, f"{self.key(k)}.")

    def finish(self, allowed: list[str] | None = None) -> None:
        allowed = list(self.used) if allowed is None else allowed
        for k in self.data:
            if k not in self.used:
                raise self.error(f"unknown key{did_you_mean(k, allowed)}; allowed: "
                                 f"{', '.join(sorted(allowed))}", key=self.key(k))


def _typename(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(v), type(v).__name__)


def _convert(v: Any, kind: str, err: Callable[[str], SpecError]) -> Any:
    if kind == "int":
        # Integral floats are accepted so that `draws = 1e7` works.
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise err(f"must be an integer, got {_typename(v)} {v!r}")
        if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
            raise err(f"must be an integer, got {v!r}")
        return int(v)
    if kind == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise err(f"must be a number, got {_typename(v)} {v!r}")
        if not math.isfinite(v):
            raise err(f"must be finite, got {v!r}")
        return float(v)
    if kind == "str":
        if not isinstance(v, str):
            raise err(f"must be a string, got {_typename(v)} {v!r}")
        return v
    if kind == "float_or_list":
        items = v if isinstance(v, list) else [v]
        if isinstance(v, list) and not v:
            raise err("must not be an empty list")
        return tuple(_convert(x, "float", err) for x in items)
    if kind == "str_list":
        if not isinstance(v, list):
            raise err(f"must be a list of strings, got {_typename(v)}")
        return tuple(_convert(x, "str", err) for x in v)
    raise AssertionError(kind)


def _positive(v: Any) -> str | None:
    vals = v if isinstance(v, tuple) else (v,)
    return None if all(x > 0 for x in vals) else f"must be > 0, got {v if not isinstance(v, tuple) or len(v) > 1 else v[0]}"


def _nonnegative(v: Any) -> str | None:
    return None if v >= 0 else f"must be ≥ 0, got {v}"


# ----------------------------------------------------------------------------- case kinds
def _gaussian_params(t: _Table) -> GaussianParams:
    mean = t.get("mean", "float_or_list")
    std = t.get("std", "float_or_list", check=_positive)
    t.finish()
    return GaussianParams(mean, std)


def _parse_gaussian(t: _Table, name: str, spec_dir: Path) -> GaussianCase:
    q = _gaussian_params(t.sub("q"))
    p = _gaussian_params(t.sub("p"))
    t.finish()
    lengths = {len(x) for x in (q.mean, q.std, p.mean, p.std)}
    dim = max(lengths)
    if lengths - {1, dim}:
        raise t.error(f"q.mean, q.std, p.mean, p.std must be scalars or lists of one length; "
                      f"got lengths {len(q.mean)}, {len(q.std)}, {len(p.mean)}, {len(p.std)}",
                      key="q/p")

    def broadcast(g: GaussianParams) -> GaussianParams:
        return GaussianParams(g.mean * dim if len(g.mean) == 1 else g.mean,
                              g.std * dim if len(g.std) == 1 else g.std)
    return GaussianCase(name, broadcast(q), broadcast(p))


def _logits_source(t: _Table, side: str, spec_dir: Path) -> LogitsSource:
    """``side``: "q", "p", or "b" (a sampler's behavior policy, derived from either side)."""
    if t.has("file"):
        path = spec_dir / t.get("file", "str")
        t.finish()
        return FileLogits(path)
    if t.has("logits"):
        gen = t.get("logits", "str")
        if gen != "zipf":
            raise t.error(f"unknown logits generator '{gen}'{did_you_mean(gen, ['zipf'])}; known: zipf",
                          key=t.key("logits"))
        src = ZipfLogits(exponent=t.get("exponent", "float", 1.1, _positive),
                         seed=t.get("seed", "int", 0, _nonnegative),
                         contexts=t.get("contexts", "int", None, _positive))
        t.finish()
        return src
    if t.has("from"):
        source = t.get("from", "str")
        if side == "b":
            if source not in ("q", "p"):
                raise t.error(f"must be 'q' or 'p', got '{source}'", key=t.key("from"))
        else:
            other = "p" if side == "q" else "q"
            if source != other:
                raise t.error(f"must name the other side, '{other}', got '{source}'", key=t.key("from"))
        src = DerivedLogits(source=source,
                            noise=t.get("noise", "float", 0.0, _nonnegative),
                            temperature=t.get("temperature", "float", 1.0, _positive),
                            seed=t.get("seed", "int", 0, _nonnegative))
        t.finish()
        return src
    raise t.error("needs one of 'file', 'logits' (a generator) or 'from' (the other side)",
                  key=t.prefix.rstrip("."))


def _pair_sources(t: _Table, spec_dir: Path) -> tuple[LogitsSource, LogitsSource]:
    """q and p logits sources of a case (the last keys read: this finishes the table)."""
    q = _logits_source(t.sub("q"), "q", spec_dir)
    p = _logits_source(t.sub("p"), "p", spec_dir)
    t.finish()
    if isinstance(q, DerivedLogits) and isinstance(p, DerivedLogits):
        raise t.error("q and p cannot both be derived from each other; give one a 'file' or 'logits'",
                      key="q.from")
    return q, p


def _parse_categorical(t: _Table, name: str, spec_dir: Path) -> CategoricalCase:
    vocab = t.get("vocab", "int", None, _positive)
    q, p = _pair_sources(t, spec_dir)
    if vocab is None and not (isinstance(q, FileLogits) or isinstance(p, FileLogits)):
        raise t.error("missing required key (needed unless logits come from a file)", key="vocab")
    return CategoricalCase(name, vocab, q, p)


def _parse_rollout(t: _Table, name: str, spec_dir: Path) -> RolloutCase:
    vocab = t.get("vocab", "int", check=_positive)
    buckets = t.get("buckets", "int", check=_positive)
    if buckets > vocab:
        raise t.error(f"must be ≤ vocab ({vocab}), got {buckets}", key="buckets")
    bucket_of: str | Path = "mod"
    if t.has("bucket_of"):
        raw = t.data["bucket_of"]
        if isinstance(raw, dict):
            sub = t.sub("bucket_of")
            bucket_of = spec_dir / sub.get("file", "str")
            sub.finish()
        else:
            bucket_of = t.get("bucket_of", "str", check=lambda v: None if v == "mod" else
                              f"must be \"mod\" or {{file = \"...\"}}, got '{v}'")
    length = t.get("length", "int", check=lambda v: None if v >= 1 else f"must be ≥ 1, got {v}")
    eos = t.get("eos", "int", None, lambda v: None if 0 <= v < vocab else
                f"must be a token id in [0, {vocab}), got {v}")
    eos_prob = t.get("eos_prob", "float", None, lambda v: None if 0 < v < 1 else f"must lie in (0, 1), got {v}")
    if eos_prob is not None and eos is None:
        raise t.error("needs an eos token", key="eos_prob")
    q, p = _pair_sources(t, spec_dir)
    return RolloutCase(name, vocab, buckets, bucket_of, length, eos, q, p, eos_prob=eos_prob)


CASE_PARSERS: dict[str, Callable[[_Table, str, Path], Case]] = {
    "gaussian": _parse_gaussian,
    "categorical": _parse_categorical,
    "rollout": _parse_rollout,
}


# ----------------------------------------------------------------------------- top level
def _parse_experiment(t: _Table, stem: str) -> Experiment:
    names = _parse_estimators(t)
    lambdas, optimal = _parse_lambdas(t)
    exp = Experiment(
        name=t.get("name", "str", stem, lambda v: None if re.fullmatch(r"[\w.\-]+", v) else
                   "must use only letters, digits, '_', '-', '.'"),
        draws=t.get("draws", "int", check=_positive),
        seed=t.get("seed", "int", 0, _nonnegative),
        device=t.get("device", "str", "auto", _check_device),
        estimators=names,
        batches=t.get("batches", "int", 200, lambda v: None if v >= 2 else f"must be ≥ 2, got {v}"),
        chunk=t.get("chunk", "int", 1 << 22, _positive),
        lambdas=lambdas,
        optimal=optimal,
        gradients=_get_bool(t, "gradients", False),
    )
    t.finish()
    return exp


def _parse_estimators(t: _Table) -> tuple[str | EstimatorOption, ...]:
    """Registry names, or tables {name, logr_clamp, clamp, label} for clamped variants."""
    t.used.add("estimators")
    key = t.key("estimators")
    raw = t.data.get("estimators", list(DEFAULT_ESTIMATORS))
    if not isinstance(raw, list):
        raise t.error(f"must be a list of estimator names or tables, got {_typename(raw)}", key=key)
    if not raw:
        raise t.error("must name at least one estimator", key=key)
    out: list[str | EstimatorOption] = []
    for i, item in enumerate(raw):
        if isinstance(item, dict):
            sub = _Table(item, t.file, t.case, f"{key}[{i + 1}].")
            name = sub.get("name", "str")
            opt = EstimatorOption(name=name, label="",
                                  logr_clamp=sub.get("logr_clamp", "float", None, _positive),
                                  clamp=sub.get("clamp", "float", None, _positive))
            label = sub.get("label", "str", None)
            sub.finish()
            if opt.logr_clamp is None and opt.clamp is None:
                raise sub.error("needs logr_clamp or clamp (or use the plain name)", key=f"{key}[{i + 1}]")
            if label is None:
                label = name + (f"|logr|≤{opt.logr_clamp:g}" if opt.logr_clamp else "") + \
                    (f"|est|≤{opt.clamp:g}" if opt.clamp else "")
            item_name, out_item = name, dataclasses.replace(opt, label=label)
        else:
            item_name = out_item = _convert(item, "str", lambda m: t.error(m, key=key))
        if item_name not in ESTIMATORS:
            raise t.error(f"unknown estimator '{item_name}'{did_you_mean(item_name, ESTIMATORS.names())}; known: "
                          f"{', '.join(ESTIMATORS.names())}", key=key)
        if isinstance(out_item, EstimatorOption) and item_name == "full":
            raise t.error("'full' does not depend on log r: clamps do not apply", key=key)
        out.append(out_item)
    labels = [o.label if isinstance(o, EstimatorOption) else o for o in out]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup is not None:
        raise t.error(f"lists '{dup}' twice (give clamped variants distinct labels)", key=key)
    return tuple(out)


_SAMPLER_KEYS = {
    "gaussian": ["std_scale", "weights", "weight_cap"],
    "categorical": ["temperature", "top_k", "top_p", "behavior", "weights", "weight_cap"],
    "rollout": ["temperature", "top_k", "top_p", "min_length", "behavior", "weights", "weight_cap"],
}


def _parse_sampler(t: _Table, kind: str, spec_dir: Path) -> SamplerSpec:
    allowed = _SAMPLER_KEYS[kind]
    for k in t.data:
        if k not in allowed:
            others = [kk for kk, v in _SAMPLER_KEYS.items() if k in v]
            hint = f" (only for {' and '.join(others)} cases)" if others else did_you_mean(k, allowed)
            raise t.error(f"unknown key for a {kind} sampler{hint}; allowed: {', '.join(allowed)}", key=t.key(k))
    behavior = _logits_source(t.sub("behavior"), "b", spec_dir) if t.has("behavior") else None
    weight_kinds = ["none", "token", "sequence"] if kind == "rollout" else ["none", "token"]
    sampler = SamplerSpec(
        temperature=t.get("temperature", "float", 1.0, _positive),
        top_k=t.get("top_k", "int", None, lambda v: None if v >= 1 else f"must be ≥ 1, got {v}"),
        top_p=t.get("top_p", "float", None, lambda v: None if 0 < v <= 1 else f"must lie in (0, 1], got {v}"),
        min_length=t.get("min_length", "int", 0, _nonnegative),
        std_scale=t.get("std_scale", "float", 1.0, _positive),
        behavior=behavior,
        weights=t.get("weights", "str", "none", lambda v: None if v in weight_kinds else
                      f"must be one of {', '.join(weight_kinds)}, got '{v}'{did_you_mean(v, weight_kinds)}"),
        weight_cap=t.get("weight_cap", "float", None, _positive),
    )
    t.finish()
    if sampler.weight_cap is not None and sampler.weights == "none":
        raise t.error("weight_cap needs weights = \"token\" or \"sequence\"", key=t.key("weight_cap"))
    return sampler


def _get_bool(t: _Table, key: str, default: bool) -> bool:
    t.used.add(key)
    v = t.data.get(key, default)
    if not isinstance(v, bool):
        raise t.error(f"must be true or false, got {_typename(v)} {v!r}", key=t.key(key))
    return v


def _parse_lambdas(t: _Table) -> tuple[tuple[float, ...], bool]:
    """`lambdas = [0.0, 0.5, 1.0, "optimal"]`: numbers, and the word "optimal" at most once."""
    t.used.add("lambdas")
    raw = t.data.get("lambdas", [])
    key = t.key("lambdas")
    if not isinstance(raw, list):
        raise t.error(f"must be a list of numbers and \"optimal\", got {_typename(raw)}", key=key)
    values, optimal = [], False
    for v in raw:
        if isinstance(v, str):
            if v != "optimal":
                raise t.error(f"unknown entry '{v}'{did_you_mean(v, ['optimal'])}: "
                              f"use numbers or \"optimal\"", key=key)
            if optimal:
                raise t.error("lists \"optimal\" twice", key=key)
            optimal = True
        else:
            values.append(_convert(v, "float", lambda m: t.error(m, key=key)))
    if len(set(values)) != len(values):
        raise t.error("lists a λ twice", key=key)
    return tuple(values), optimal


def _check_case_name(v: str) -> str | None:
    # Names label rows and (later) figure files: any printable text without slashes.
    if not v or not v.isprintable() or "/" in v or "\\" in v or v != v.strip():
        return f"must be non-empty printable text without slashes or surrounding spaces, got {v!r}"
    return None


def _check_device(v: str) -> str | None:
    return None if _DEVICE_RE.match(v) else f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got '{v}'"


def parse_spec(text: str, path: Path) -> Spec:
    """Parse and validate spec ``text`` read from ``path`` (used for messages and relative files)."""
    file = str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"TOML syntax error: {e}", file=file) from None
    top = _Table(data, file, None, "")
    version = top.get("spec_version", "int")
    if version != SPEC_VERSION:
        raise top.error(f"unsupported spec_version {version}; this kl-bench reads {SPEC_VERSION}",
                        key="spec_version")
    exp = _parse_experiment(top.sub("experiment"), path.stem)
    top.used.add("case")
    raw_cases = data.get("case")
    if not isinstance(raw_cases, list) or not raw_cases:
        raise top.error("needs at least one [[case]] table", key="case")
    top.finish(["spec_version", "experiment", "case"])

    cases: list[Case] = []
    for i, raw in enumerate(raw_cases):
        label = raw.get("name") if isinstance(raw, dict) and isinstance(raw.get("name"), str) else f"#{i + 1}"
        t = _Table(raw, file, label, "")
        name = t.get("name", "str", check=_check_case_name)
        if any(c.name == name for c in cases):
            raise t.error("duplicate case name", key="name")
        kind = t.get("kind", "str")
        if kind not in CASE_PARSERS:
            raise t.error(f"unknown case kind '{kind}'{did_you_mean(kind, list(CASE_PARSERS))}; "
                          f"known: {', '.join(CASE_PARSERS)}", key="kind")
        case_draws = t.get("draws", "int", None, _positive)
        sampler = _parse_sampler(t.sub("sampler"), kind, path.parent) if t.has("sampler") else None
        cases.append(dataclasses.replace(CASE_PARSERS[kind](t, name, path.parent), draws=case_draws,
                                         sampler=sampler))
    return Spec(exp, tuple(cases), path, text)


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError("spec file not found", file=str(path)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"cannot read spec file: {e.__class__.__name__}: {e}", file=str(path)) from None
    return parse_spec(text, path)


def with_overrides(spec: Spec, *, draws: int | None = None, seed: int | None = None,
                   device: str | None = None) -> Spec:
    """Apply command-line overrides (validated like the spec's own fields)."""
    exp = spec.experiment
    if draws is not None:
        if draws <= 0:
            raise SpecError(f"must be > 0, got {draws}", key="--draws")
        exp = dataclasses.replace(exp, draws=draws)
        # --draws sets every case, per-case overrides included.
        spec = dataclasses.replace(spec, cases=tuple(dataclasses.replace(c, draws=None) for c in spec.cases))
    if seed is not None:
        if seed < 0:
            raise SpecError(f"must be ≥ 0, got {seed}", key="--seed")
        exp = dataclasses.replace(exp, seed=seed)
    if device is not None:
        msg = _check_device(device)
        if msg:
            raise SpecError(msg, key="--device")
        exp = dataclasses.replace(exp, device=device)
    return dataclasses.replace(spec, experiment=exp)
