"""A categorical case's keys: the config dataclass and its parser (``[[case]] kind = "categorical"``,
docs/spec.md)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.precision import Precision, parse_precision
from ...foundation.typed_toml import Table, positive
from ...sampling.logits import LogitsSource, check_table_size, has_vocab_of_its_own, parse_pair_sources
from ..protocols import CaseConfig
from .sampler import SAMPLING


@dataclass(frozen=True, kw_only=True)
class CategoricalCase(CaseConfig):
    vocab: int | None
    q: LogitsSource
    p: LogitsSource
    sampling: str = "auto"     # how a batch's count vector is drawn (kl_bench.kinds.categorical's docstring)
    precision: Precision | None = None   # log-probs as a trainer rounds them (kl_bench.core.precision)


def parse(t: Table, common: dict[str, Any], spec_dir: Path) -> CategoricalCase:
    vocab = t.get("vocab", "int", None, positive)
    sampling = t.get("sampling", "str", "auto")
    if sampling not in SAMPLING:
        raise t.error(f"must be one of {', '.join(SAMPLING)}, got {sampling!r}", key="sampling")
    precision = parse_precision(t)          # before the sources, which finish the table
    q, p = parse_pair_sources(t, spec_dir)
    if vocab is None and not (has_vocab_of_its_own(q) or has_vocab_of_its_own(p)):
        raise t.error("missing required key (needed unless logits come from a file or a tensor)", key="vocab")
    check_table_size(t, vocab, q, p)
    return CategoricalCase(vocab=vocab, q=q, p=p, sampling=sampling, precision=precision, **common)
