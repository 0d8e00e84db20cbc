"""Logits for categorical and rollout cases: where they come from (a generator, a file, the other side,
an in-memory tensor), how a spec names them, and how they become normalised log-probabilities (files and in-memory arrays
are read and checked in :mod:`kl_bench.sampling.logits_files`).

All functions return float64 log-probabilities of shape [B, V] (B contexts; B = 1 for a single
distribution). float64 matters: p(x) can be 1e-13 where q(x) is not, and log r = log p − log q
must keep its digits there.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..foundation.typed_toml import Table, check_seed, nonnegative, positive
from ..foundation.memory import BYTES_PER_CELL, check_memory
from ..foundation.formatting import fmt_count
from ..foundation.errors import SpecError
from ..foundation.registry import did_you_mean
from ..core.logprob_checks import check_logits
from .logits_files import is_array, read_logits_file, unsupported_array


@dataclass(frozen=True)
class ZipfLogits:
    """LLM-like rank-frequency logits: logit(x) = offset − exponent · log rank(x), ranks a seeded
    random permutation (one per context when ``contexts`` > 1). Shape [V] or [contexts, V]. ``offset``
    (the top token's logit) changes nothing but what rounding the logits as given sees
    (kl_bench.core.precision): log-softmax is invariant to it."""
    exponent: float
    seed: int
    contexts: int | None = None    # None: 1 for categoricals, the bucket count for rollouts
    offset: float = 0.0

    def describe(self) -> str:
        return f"zipf(s={self.exponent:g}" + (f", offset {self.offset:g})" if self.offset else ")")


@dataclass(frozen=True)
class FileLogits:
    """Unnormalised logits from a .npy, .pt or .safetensors file, shape [V], [B, V] or [B, T, V].

    ``key``: the tensor's name in a .pt dict or a .safetensors file. ``mask``: a file with a [B, T] (or
    [B]) mask, 1 on the positions that are contexts (a trainer's attention/loss mask), ``mask_key`` its
    name; without a mask every position is a context."""
    path: Path
    key: str | None = None
    mask: Path | None = None
    mask_key: str | None = None

    def describe(self) -> str:
        return f"file {self.path.name}" + (f"[{self.key}]" if self.key else "") + (
            f" masked by {self.mask.name}" if self.mask else "")


@dataclass(frozen=True)
class TensorLogits:
    """Unnormalised logits given in memory (Python API), shape [V] or [B, V]; kept as float64 on the CPU."""
    tensor: torch.Tensor = field(compare=False, repr=False)
    sha256: str = ""

    @classmethod
    def of(cls, value) -> "TensorLogits":
        msg = unsupported_array(value)
        if msg:
            raise SpecError(msg)
        t = torch.as_tensor(value).detach().to("cpu", torch.float64).contiguous()  # host: a spec table, hashed from host bytes
        return cls(t, hashlib.sha256(t.numpy().tobytes()).hexdigest())

    def describe(self) -> str:
        return f"tensor {list(self.tensor.shape)}"


@dataclass(frozen=True)
class DerivedLogits:
    """The other side's logits, divided by ``temperature``, plus N(0, noise²) noise, plus ``offset`` (which
    only rounding the logits as given sees, kl_bench.core.precision)."""
    source: str            # "q" or "p"
    noise: float = 0.0
    temperature: float = 1.0
    seed: int = 0
    offset: float = 0.0

    def describe(self) -> str:
        bits = [self.source]
        if self.temperature != 1.0:
            bits.append(f"/T={self.temperature:g}")
        if self.noise > 0:
            bits.append(f"+N(0,{self.noise:g}²)")
        if self.offset:
            bits.append(f"{self.offset:+g}")
        return "".join(bits)


LogitsSource = ZipfLogits | FileLogits | TensorLogits | DerivedLogits


def parse_logits_source(t: Table, key: str, side: str, spec_dir: Path) -> LogitsSource:
    """Key ``key`` of table ``t``: {file}, {logits = "zipf", ...}, {from = "q"|"p", ...}, or a tensor.
    ``side``: "q", "p", or "b" (a sampler's behavior policy, derived from either side)."""
    raw = t.raw(key)
    if is_array(raw):
        try:
            return TensorLogits.of(raw)
        except SpecError as e:
            raise t.error(e.message, key=t.key(key)) from None
    t = t.sub(key)
    if t.has("file"):
        src = _file_source(t, spec_dir)
    elif t.has("logits"):
        src = _zipf_source(t)
    elif t.has("from"):
        src = _derived_source(t, side)
    else:
        raise t.error("needs one of 'file', 'logits' (a generator), 'from' (the other side) or a tensor",
                      key=t.prefix.rstrip("."))
    t.finish()
    return src


def _file_source(t: Table, spec_dir: Path) -> FileLogits:
    path = spec_dir / t.get("file", "str")
    mask = t.get("mask", "str", None)
    src = FileLogits(path, key=t.get("key", "str", None), mask=None if mask is None else spec_dir / mask,
                     mask_key=t.get("mask_key", "str", None))
    if src.mask_key is not None and src.mask is None:
        raise t.error("needs a mask file", key=t.key("mask_key"))
    return src


def _zipf_source(t: Table) -> ZipfLogits:
    gen = t.get("logits", "str")
    if gen != "zipf":
        raise t.error(f"unknown logits generator '{gen}'{did_you_mean(gen, ['zipf'])}; known: zipf",
                      key=t.key("logits"))
    return ZipfLogits(exponent=t.get("exponent", "float", 1.1, positive), seed=t.get("seed", "int", 0, check_seed),
                      contexts=t.get("contexts", "int", None, positive), offset=t.get("offset", "float", 0.0))


def _derived_source(t: Table, side: str) -> DerivedLogits:
    """{from = the other side (q, p; either for a sampler's b), noise, temperature, seed, offset}."""
    source = t.get("from", "str")
    if side == "b":
        if source not in ("q", "p"):
            raise t.error(f"must be 'q' or 'p', got '{source}'", key=t.key("from"))
    else:
        other = "p" if side == "q" else "q"
        if source != other:
            raise t.error(f"must name the other side, '{other}', got '{source}'", key=t.key("from"))
    return DerivedLogits(source=source, noise=t.get("noise", "float", 0.0, nonnegative),
                         temperature=t.get("temperature", "float", 1.0, positive),
                         seed=t.get("seed", "int", 0, check_seed), offset=t.get("offset", "float", 0.0))


def parse_pair_sources(t: Table, spec_dir: Path) -> tuple[LogitsSource, LogitsSource]:
    """q and p logits sources of a case (the last keys read: this finishes the table)."""
    q = parse_logits_source(t, "q", "q", spec_dir)
    p = parse_logits_source(t, "p", "p", spec_dir)
    t.finish()
    if isinstance(q, DerivedLogits) and isinstance(p, DerivedLogits):
        raise t.error("q and p cannot both be derived from each other; give one a 'file' or 'logits'",
                      key="q.from")
    return q, p


def check_table_size(t: Table, vocab: int | None, q: LogitsSource, p: LogitsSource, contexts: int = 1,
                     what: str = "contexts") -> None:
    """Refuse, before anything is allocated, generated logits whose [contexts, V] float64 tables (q, p,
    log r, the sampler's, the alias table; ~BYTES_PER_CELL bytes a cell) would not fit in memory.
    ``contexts``: the default number of contexts (rollouts: the bucket count, named by ``what``)."""
    if vocab is None:
        return
    rows, key = contexts, ("vocab" if vocab >= contexts else what)
    for side, src in (("q", q), ("p", p)):
        if isinstance(src, ZipfLogits) and src.contexts and src.contexts > rows:
            rows, key = src.contexts, ("vocab" if vocab >= src.contexts else f"{side}.contexts")
    msg = check_memory(rows * vocab * BYTES_PER_CELL,
                       f"{fmt_count(rows)} × {fmt_count(vocab)} (contexts × vocab) logits tables")
    if msg:
        raise t.error(msg, key=key)


def describe_sources(q: LogitsSource, p: LogitsSource) -> str:
    return f"q = {q.describe()}, p = {p.describe()}"


def has_vocab_of_its_own(src: LogitsSource) -> bool:
    """Whether the source fixes the vocabulary size (a file or a tensor)."""
    return isinstance(src, (FileLogits, TensorLogits))


def zipf_logits(vocab: int, exponent: float, seed: int, contexts: int = 1) -> torch.Tensor:
    """Rank-frequency logits, [contexts, vocab]: logit(x) = −exponent · log(rank(x)).

    Ranks are a seeded random permutation per context, so different contexts favour different
    tokens, as the next-token distributions of an LLM do.
    """
    g = torch.Generator().manual_seed(seed)  # host: tables are built on the host from their seed, then moved
    base = -exponent * torch.log(torch.arange(1, vocab + 1, dtype=torch.float64))  # host: a spec table
    perms = torch.stack([torch.randperm(vocab, generator=g) for _ in range(contexts)])  # host: a spec table
    return base[perms]


def _tensor_logits(t: torch.Tensor) -> torch.Tensor:
    # The shape as given is the one named: an empty [0] tensor is not reported as the [1, 0] it becomes.
    if t.ndim not in (1, 2) or 0 in t.shape:
        raise SpecError(f"logits must have shape [V] or [B, V] with V ≥ 1 (and B ≥ 1), got {list(t.shape)}")
    return t.unsqueeze(0) if t.ndim == 1 else t


# The standard errors of a variance use 4th powers of per-draw values: |log r| beyond (float64 max)^{1/4}
# ≈ 1.16e77 overflows them (and k2 = ½(log r)² squared), so the run would end in inf − inf = NaN.
MAX_ABS_LOG_RATIO = sys.float_info.max ** 0.25


def log_ratio_problem(logr: torch.Tensor) -> str | None:
    """Why finite log-ratios ``logr`` (any shape; ±inf entries are zero probabilities, allowed) cannot be
    benchmarked in float64, or None."""
    finite = logr[torch.isfinite(logr)]
    worst = float(finite.abs().max()) if finite.numel() else 0.0
    if worst >= MAX_ABS_LOG_RATIO:
        return (f"a log-ratio log p − log q reaches {worst:.3g}; beyond {MAX_ABS_LOG_RATIO:.3g} its 4th power "
                "overflows float64")
    return None


def check_derived(source: torch.Tensor, derived: torch.Tensor, side: str, src) -> None:
    """A table derived by temperature and noise must stay finite wherever its source is: a temperature
    near 0 or a huge noise overflows float64 to ±inf, and inf − inf in the softmax is NaN."""
    bad = torch.isfinite(source) & ~torch.isfinite(derived)
    if bool(bad.any()):
        key = f"{side}.noise" if src.noise > 0 and src.temperature == 1 else f"{side}.temperature"
        raise SpecError(f"the derived logits overflow float64 (temperature {src.temperature:g}, noise "
                        f"{src.noise:g}: |logit / temperature + noise·ε| must stay below 1.8e308)", key=key)


def resolve_pair_source_logits(q: LogitsSource, p: LogitsSource, vocab: int | None, contexts: int | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q's logits, p's logits) as the sources hold them, float64 [B, V], unnormalised (a generator's with
    its offset, a derived side's from the other's raw logits): what precision ``of = "logits"`` rounds."""
    raw: dict[str, torch.Tensor] = {}
    for side, src in (("q", q), ("p", p)):
        if not isinstance(src, DerivedLogits):
            raw[side] = _own_logits(side, src, vocab, contexts)
    for side, src in (("q", q), ("p", p)):
        if isinstance(src, DerivedLogits):
            base = _perturbed(raw[src.source], src)
            raw[side] = base + src.offset
            check_derived(raw[src.source], base, side, src)
    lq, lp = _broadcast(raw["q"], raw["p"])
    # Extreme derived logits (noise = 1e308, a temperature of 1e-310) give log-ratios whose moments
    # overflow: refused here, naming the key, rather than written as NaN statistics.
    nq, np_ = torch.log_softmax(lq, dim=-1), torch.log_softmax(lp, dim=-1)
    problem = log_ratio_problem(torch.where(torch.isfinite(nq), np_ - nq, torch.zeros_like(nq)))
    if problem:
        derived = next((side for side, src in (("p", p), ("q", q)) if isinstance(src, DerivedLogits)), None)
        src = {"p": p, "q": q}.get(derived)
        key = (f"{derived}.noise" if src.noise > 0 and src.temperature == 1 else f"{derived}.temperature") \
            if derived else "p"
        raise SpecError(f"{problem} (extreme logits?)", key=key)
    return lq, lp


def _own_logits(side: str, src: LogitsSource, vocab: int | None, contexts: int | None) -> torch.Tensor:
    """A side's logits [B, V] from a generator, a file or a tensor, checked (errors name the side's key)."""
    try:
        if isinstance(src, ZipfLogits):
            if vocab is None:
                raise SpecError("missing required key (needed for generated logits)")
            out = zipf_logits(vocab, src.exponent, src.seed, src.contexts or contexts or 1) + src.offset
        elif isinstance(src, FileLogits):
            out = read_logits_file(src.path, src.key, src.mask, src.mask_key)
        else:
            out = _tensor_logits(src.tensor)
        named = f"{side} ({src.path})" if isinstance(src, FileLogits) else side
        check_logits(out, named)
        if vocab is not None and out.shape[1] != vocab:
            raise SpecError(f"{named} has vocabulary {out.shape[1]} but vocab = {vocab}")
        return out
    except SpecError as e:
        raise e.located(key="vocab" if "vocab" in e.message else f"{side}.file"
                        if isinstance(src, FileLogits) else side) from None


def _perturbed(source: torch.Tensor, src: DerivedLogits) -> torch.Tensor:
    """source / temperature + noise·ε, ε ~ N(0, 1) from the source's own seed (before the offset)."""
    base = source / src.temperature
    if src.noise > 0:
        g = torch.Generator().manual_seed(src.seed)  # host: tables are built on the host from their seed, then moved
        base = base + src.noise * torch.randn(base.shape, generator=g, dtype=torch.float64)  # host: a spec table
    return base


def _broadcast(lq: torch.Tensor, lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q's and p's logits on the same [B, V]: a one-row side is shared by every context."""
    if lq.shape == lp.shape:
        return lq, lp
    if lq.shape[1] != lp.shape[1]:
        raise SpecError(f"q has vocabulary {lq.shape[1]} but p has {lp.shape[1]}", key="p")
    if lq.shape[0] != 1 and lp.shape[0] != 1:
        raise SpecError(f"q has {lq.shape[0]} contexts but p has {lp.shape[0]}", key="p")
    b = max(lq.shape[0], lp.shape[0])
    return lq.expand(b, -1), lp.expand(b, -1)


def behavior_logits(src: LogitsSource, log_q: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """A stale behavior policy's logits [B, V]: derived from q or p (noise, temperature) or a file."""
    if isinstance(src, (FileLogits, TensorLogits)):
        raw = (read_logits_file(src.path, src.key, src.mask, src.mask_key) if isinstance(src, FileLogits)
               else _tensor_logits(src.tensor))
        named = f"sampler.behavior ({src.path})" if isinstance(src, FileLogits) else "sampler.behavior"
        check_logits(raw, named)
        if raw.shape[1] != log_q.shape[1]:
            raise SpecError(f"{named}: behavior logits have vocabulary {raw.shape[1]} but q has {log_q.shape[1]}",
                            key="sampler.behavior.file")
        if raw.shape[0] not in (1, log_q.shape[0]):
            raise SpecError(f"behavior logits have {raw.shape[0]} rows but q has {log_q.shape[0]}",
                            key="sampler.behavior.file")
        return raw.expand_as(log_q)
    if isinstance(src, ZipfLogits):
        raise SpecError("a behavior policy is derived from q or p ({from = \"q\", noise = ...}) or read from a file",
                        key="sampler.behavior")
    source = log_q if src.source == "q" else log_p
    base = _perturbed(source, src)
    check_derived(source, base, "sampler.behavior", src)
    return base
