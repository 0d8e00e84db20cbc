"""A rollout case in a spec: its keys (:class:`RolloutCase`, :func:`parse`) and the model they describe
(:func:`model_of`: reads the logits sources and the bucket map; every input error a SpecError naming its
key)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...foundation.typed_toml import MAX_LENGTH, Table, at_most, positive
from ...foundation.errors import SpecError
from ...sampling.logits import LogitsSource, check_table_size, parse_pair_sources, resolve_pair_source_logits
from ...sampling.logits_files import read_logits_file
from ...core.precision import Precision, parse_precision
from ...core.weights import WeightCorrection
from ..protocols import CaseConfig
from .model import RolloutModel

MAX_TOKEN_MEAN_BATCH = 4096        # B of tok_batch rows (groups never span batches or pieces: see kl_bench.core.aggregates)
MAX_TOKEN_MEAN_TOKENS = 2**22      # B × T: the size of the FFT behind the exact moments


@dataclass(frozen=True, kw_only=True)
class RolloutCase(CaseConfig):
    """Two autoregressive token models whose next-token logits depend on the previous token only
    through its bucket: q and p are [C, V] logits."""
    vocab: int
    buckets: int
    bucket_of: str | Path       # "mod" (x mod C) or a .npy/.pt file with an int array [V]
    length: int                 # T, the maximum number of generated tokens
    eos: int | None
    q: LogitsSource
    p: LogitsSource
    eos_prob: float | None = None   # sets q(eos|c) = p(eos|c) = eos_prob in every bucket
    precision: Precision | None = None   # log-probs as a trainer rounds them (kl_bench.core.precision)
    per_sequence_mean: bool = False      # also tok_mean rows: Σ_t f / |y| per sequence
    token_mean_batch: int | None = None  # also tok_batch rows: Σ f / Σ |y| over batches of B sequences


def read_bucket_map(path, vocab: int, buckets: int) -> torch.Tensor:
    """An int array [V] with values in [0, C) from .npy or .pt."""
    t = read_logits_file(path, what="bucket map")    # same loader: checks existence, format and readability
    if t.shape[0] != 1 or t.shape[1] != vocab:
        raise SpecError(f"{path}: bucket map must have shape [{vocab}], got {list(t.shape[1:]) if t.shape[0] == 1 else list(t.shape)}")
    t = t[0]
    if not torch.equal(t, t.round()):
        raise SpecError(f"{path}: bucket map must hold integers")
    if t.min() < 0 or t.max() >= buckets:
        raise SpecError(f"{path}: bucket map values must lie in [0, {buckets}), got [{int(t.min())}, {int(t.max())}]")
    return t.long()


def _bucket_of(t: Table, spec_dir: Path) -> str | Path:
    """``bucket_of``: "mod" or {file = "..."} (a path relative to the spec)."""
    if not t.has("bucket_of"):
        return "mod"
    if isinstance(t.data["bucket_of"], dict):
        sub = t.sub("bucket_of")
        path = spec_dir / sub.get("file", "str")
        sub.finish()
        return path
    return t.get("bucket_of", "str", check=lambda v: None if v == "mod" else
                 f"must be \"mod\" or {{file = \"...\"}}, got '{v}'")


def parse(t: Table, common: dict[str, Any], spec_dir: Path) -> RolloutCase:
    """The case's keys (kl_bench.kinds.protocols.CaseParser.parse)."""
    vocab = t.get("vocab", "int", check=positive)
    buckets = t.get("buckets", "int", check=positive)
    if buckets > vocab:
        raise t.error(f"must be ≤ vocab ({vocab}), got {buckets}", key="buckets")
    bucket_of = _bucket_of(t, spec_dir)
    length = t.get("length", "int", check=lambda v: f"must be ≥ 1, got {v}" if v < 1 else
                   at_most(MAX_LENGTH, "2^20: every rollout and every exact moment takes T sequential steps")(v))
    eos = t.get("eos", "int", None, lambda v: None if 0 <= v < vocab else
                f"must be a token id in [0, {vocab}), got {v}")
    eos_prob = t.get("eos_prob", "float", None, lambda v: None if 0 < v < 1 else f"must lie in (0, 1), got {v}")
    if eos_prob is not None and eos is None:
        raise t.error("needs an eos token", key="eos_prob")
    precision = parse_precision(t)          # before the sources, which finish the table
    per_sequence_mean = t.bool("per_sequence_mean", False)

    def batch_ok(b: int) -> str | None:
        if not 1 <= b <= MAX_TOKEN_MEAN_BATCH:
            return f"must lie in [1, {MAX_TOKEN_MEAN_BATCH}], got {b}"
        if b * length > MAX_TOKEN_MEAN_TOKENS:
            return (f"times length must be ≤ 2^22 (the exact moments convolve B length distributions), "
                    f"got {b} × {length}")
        return None
    token_mean_batch = t.get("token_mean_batch", "int", None, batch_ok)
    q, p = parse_pair_sources(t, spec_dir)
    check_table_size(t, vocab, q, p, contexts=buckets, what="buckets")
    return RolloutCase(vocab=vocab, buckets=buckets, bucket_of=bucket_of, length=length, eos=eos, q=q, p=p,
                       eos_prob=eos_prob, precision=precision,
                       per_sequence_mean=per_sequence_mean, token_mean_batch=token_mean_batch, **common)


def _set_eos_prob(log_probs: torch.Tensor, eos: int, prob: float) -> torch.Tensor:
    """Give EOS probability ``prob`` in every bucket, rescaling the other tokens to 1 − prob."""
    others = log_probs.clone()
    others[:, eos] = -torch.inf
    out = torch.log_softmax(others, -1) + math.log1p(-prob)
    out[:, eos] = math.log(prob)
    return out


def _tables(case: RolloutCase) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(log q, log p) [C, V] and the sources' logits (their per-row offsets kept), checked."""
    zq, zp = resolve_pair_source_logits(case.q, case.p, case.vocab, contexts=case.buckets)
    lq, lp = torch.log_softmax(zq, -1), torch.log_softmax(zp, -1)
    if case.eos_prob is not None:
        # the source's per-row offset (its log-normaliser) kept on the EOS-adjusted log-probs
        zq, zp = (_set_eos_prob(t.log_softmax(-1), case.eos, case.eos_prob) + t.logsumexp(-1, keepdim=True)
                  for t in (zq, zp))
        lq, lp = (_set_eos_prob(t, case.eos, case.eos_prob) for t in (lq, lp))
    for side, t in (("q", lq), ("p", lp)):
        if t.shape != (case.buckets, case.vocab):
            raise SpecError(f"rollout logits must have shape [C, V] = [{case.buckets}, {case.vocab}], "
                            f"got {list(t.shape)}", key=side)
        if not torch.isfinite(t).all():
            raise SpecError("rollout logits must be finite (zero probabilities are not supported "
                            "for rollouts)", key=side)
    return lq, lp, (zq, zp)


def _bucket(case: RolloutCase, device: torch.device) -> torch.Tensor:
    """The bucket map [V] int64: x mod C, or the case's file."""
    if case.bucket_of == "mod":
        return torch.arange(case.vocab, device=device) % case.buckets
    try:
        return read_bucket_map(case.bucket_of, case.vocab, case.buckets)
    except SpecError as e:
        raise e.located(key="bucket_of.file") from None


def model_of(case: RolloutCase) -> RolloutModel:
    """The model a case describes (validated)."""
    lq, lp, logits = _tables(case)
    bucket, sp = _bucket(case, lq.device), case.sampler
    options = dict(precision=case.precision, per_sequence_mean=case.per_sequence_mean,
                   token_mean_batch=case.token_mean_batch, logits=logits)
    if sp is None:
        return RolloutModel.build(lq, lp, bucket, case.length, case.eos, **options).validate()
    if sp.min_length and case.eos is None:
        raise SpecError("min_length needs an eos token", key="sampler.min_length")
    return RolloutModel.build(lq, lp, bucket, case.length, case.eos, log_b=sp.logprobs(lq, lp) if sp.reshapes else None,
                              min_length=sp.min_length, weights=sp.weights, weight_cap=sp.weight_cap,
                              correction=WeightCorrection.of(sp), rejection=sp.reject, **options).validate()
