"""A spec made ready to sample: loaded with the command line's overrides, its device resolved, its pairs
built and its exact oracles validated, before any draw (:func:`prepare`)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..experiment.spec import Spec, load_spec, spec_from_dict, with_overrides
from ..foundation.errors import SpecError, argument
from ..foundation.threads import single_threaded
from ..kinds import Pair, build_pair


def load(spec, *, draws: int | None = None, seed: int | None = None, device: str | None = None) -> Spec:
    """A :class:`Spec` from a path, a Spec, or a dict with the TOML's structure (tensors allowed as
    logits), with overrides applied exactly as the command line's flags."""
    if isinstance(spec, Spec):
        sp = spec
    elif isinstance(spec, (str, os.PathLike)) and not isinstance(os.fspath(spec), bytes):
        sp = load_spec(spec)
    else:
        sp = spec_from_dict(spec)
    return with_overrides(sp, draws=draws, seed=seed, device=device)


def resolve_device(name: str, where: str | None = None, key: str = "experiment.device") -> torch.device:
    """'auto' → CUDA when available, else CPU. Asking for CUDA without one is an input error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecError(f"device '{name}' requested but CUDA is not available here", file=where, key=key)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SpecError(f"device '{name}' requested but only {torch.cuda.device_count()} GPU(s) exist",
                            file=where, key=key)
    return dev


@dataclass
class Prepared:
    """A validated spec with its pairs built (files read) and its device resolved: ready to sample."""
    spec: Spec
    pairs: list[Pair]
    device: torch.device

    @property
    def file(self) -> str:
        return str(self.spec.path)


@single_threaded
def prepare(spec, *, draws: int | None = None, seed: int | None = None, device: str | None = None) -> Prepared:
    """Load and validate everything before any sampling: spec, flags, device, pairs, exact oracles."""
    from ..experiment.case import check_group_draws
    sp = load(spec, draws=draws, seed=seed, device=device)
    dev = resolve_device(sp.experiment.device, str(sp.path), argument("device") if device is not None else "experiment.device")
    pairs = build_pairs(sp)
    check_group_draws(sp, pairs, str(sp.path))
    return Prepared(sp, pairs, dev)


def build_pairs(sp: Spec, bar=None) -> list[Pair]:
    """Every case's pair (its files read), then their exact oracles validated: what a run and the exact table
    both need before any number. ``bar``: a LazyProgress, labelled and advanced once a case."""
    from ..experiment.case import validate_oracles
    from ..foundation.memory import out_of_memory_said
    pairs = []
    for c in sp.cases:
        if bar is not None:
            bar.label(f"{c.name}: building")
        with out_of_memory_said(f"building the case ({case_size(c)})", "a smaller case", file=str(sp.path),
                                case=c.name):
            pairs.append(build_pair(c, str(sp.path)))
        if bar is not None:
            bar.advance(1)
    validate_oracles(sp, pairs, str(sp.path))
    return pairs


# A case's size, in the keys a spec gives it (those a kind has: vocab, buckets, length, contexts).
_SIZE_KEYS = ("vocab", "buckets", "length", "contexts")


def case_size(case) -> str:
    """A case's kind and size, for a message: "categorical, vocab 20,000,000" (vocab from a file: the kind
    alone)."""
    from ..foundation.formatting import fmt_count
    sizes = [f"{k} {fmt_count(v)}" for k in _SIZE_KEYS
             if isinstance(v := getattr(case, k, None), int) and not isinstance(v, bool)]
    return ", ".join([case.kind or "case", *sizes])
