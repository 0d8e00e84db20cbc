"""What one streamed audit call computes (:class:`Plan`: its estimators, polynomials and sampling
families) and what a position chunk carries from the first pass to the second (:class:`Chunk`, one
:class:`Sampled` per family)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from ..foundation.errors import SpecError
from ..core.estimators import resolve_estimator
from .exact import SamplerValues
from .polymoments import Basis, degree
from .generation import Sampler


def _function_of_log_r(item):
    est = resolve_estimator(item)
    if est.analytic:
        raise SpecError(f"'{est.name}' is not a function of log r: the exact KL is always reported")
    return est


@dataclass(frozen=True)
class Family:
    """One sampling distribution the audit sums under: ``name`` "b" (the sampler on the scored policy's
    logits) or "g" (on the logits of the pass that drew the tokens); ``kind`` "same" (b = q), "full" (its
    own weights over every id) or "cut" (it truncates: candidates); ``keep``: candidates per row."""
    name: str
    kind: str
    keep: int

    @staticmethod
    def of(name: str, sampler: Sampler, vocab: int, candidates: int) -> "Family":
        if sampler.truncates:
            # top-k alone needs its k scores and one more (a tie at the k-th shows there); top-p and min-p a list
            only_k = sampler.p is None and sampler.mp is None
            keep = min(vocab, sampler.k + 1 if only_k else max((sampler.k or 0) + 1, candidates))
            return Family(name, "cut", keep)
        return Family(name, "same" if sampler.is_identity and name == "b" else "full", 0)

    @property
    def source(self) -> str:
        """Whose logits its scores come from: "zq" (the scored pass) or "zg" (the sampling pass)."""
        return "zg" if self.name == "g" else "zq"


@dataclass(frozen=True)
class Outputs:
    """What a call computes beyond KL, E_q[f], E_b[f], the q-mass b never draws and the sampled token's
    values, which it always computes. What is not wanted is left NaN ("not computed") and costs nothing; the
    default is everything. A step audit reads only part of the rest (kl_bench.audit.session): the statistics
    of the family that drew the tokens, and the rollout-engine columns where an engine drew them.

    ``spread``: the families ("b", "g") whose Var[f], P(f < 0) and E, Var of log b are wanted (with b = q,
    Var_b[f] is Var_q[f]: b's spread brings q's variance with it); ``var_q``: Var_q[f]; ``against_q``: each
    family's KL(b‖q), χ² and E|log b − log q| (the rollout-engine audit)."""
    spread: frozenset = frozenset({"b", "g"})
    var_q: bool = True
    against_q: bool = True


EVERYTHING = Outputs()


@dataclass(frozen=True)
class Plan:
    """What one call computes and how. ``poly``: per estimator, its polynomial (None: second pass);
    ``sign``: per estimator, whether it changes sign (P(f < 0) then needs log r itself); ``outputs``: what
    beyond the always-computed values is wanted."""
    names: tuple[str, ...]
    fns: tuple
    poly: tuple
    sign: tuple[bool, ...]
    basis: Basis
    sampler: Sampler
    families: tuple[Family, ...]
    vocab: int
    negative: bool = True
    outputs: Outputs = EVERYTHING
    half: int = 1
    fused: bool = False

    @staticmethod
    def of(estimators: Sequence, sampler: Sampler, vocab: int, candidates: int, negative: bool,
           sampling: bool, outputs: Outputs = EVERYTHING, fused: bool = False) -> "Plan":
        ests = [_function_of_log_r(e) for e in estimators]
        polys = tuple(e.poly for e in ests)
        top = max([1] + [2 * degree(p) for p in polys if p is not None])
        half = max([1] + [degree(p) for p in polys if p is not None])
        fams = tuple(Family.of(name, sampler, vocab, candidates) for name in ("b", "g")[:1 + sampling])
        return Plan(tuple(e.name for e in ests), tuple(e.fn for e in ests), polys,
                     tuple(not e.nonnegative for e in ests), Basis(top), sampler,
                     fams, vocab, negative, outputs, half, fused)

    def spread(self, fam: Family) -> bool:
        """The family's Var[f], P(f < 0) and log-b statistics are wanted."""
        return fam.name in self.outputs.spread

    def var_q(self) -> bool:
        """Var_q[f] is wanted: asked for, or it is Var_b[f] of a wanted b = q."""
        return self.outputs.var_q or any(f.kind == "same" and self.spread(f) for f in self.families)

    def weight_degree(self, fam: Family | None) -> int:
        """The highest monomial degree summed under q's weights (``fam`` None) or a full-support family's:
        2·degree f for a variance, degree f (at least 1: KL = −E_q[log r]) for means alone."""
        full = self.var_q() if fam is None else self.spread(fam)
        return self.basis.degree if full else min(self.half, self.basis.degree)

    def take(self, fam: Family) -> int:
        """Candidates each tile gives: all ``keep`` for top-k alone (the row's top k + 1 are among every
        tile's top k + 1), else at most 128 (a tile holding more of a large nucleus sends its row to
        the second pass, see :class:`_Candidates`)."""
        only_k = self.sampler.p is None and self.sampler.mp is None
        return fam.keep if only_k else min(fam.keep, 128)

    def needs_lse(self, fam: Family) -> bool:
        """The family's full normaliser is needed: it has full support, or top-p without top-k
        normalises over every id."""
        return fam.kind != "cut" or (self.sampler.p is not None and self.sampler.k is None)

    def second_pass_columns(self, fam: Family) -> list[int]:
        """Estimators whose values under ``fam`` need a second pass: non-polynomial ones (always: also
        their q moments), sign-changing ones for P(f < 0) under a family that does not truncate."""
        return [j for j, (p, s) in enumerate(zip(self.poly, self.sign))
                if p is None or (s and fam.kind != "cut" and self.negative and self.spread(fam))]



@dataclass
class Sampled:
    """One family's finished values (float64, on the device): SamplerValues' fields, its normaliser
    ``lse`` [n], threshold ``tau`` [n] (−inf: none), the rows its candidates may not cover, and the sampled
    token's score ``tok_score`` [n]."""
    mean: torch.Tensor
    var: torch.Tensor
    neg: torch.Tensor
    miss: torch.Tensor
    log_mean: torch.Tensor
    log_var: torch.Tensor
    tok_log: torch.Tensor
    lse: torch.Tensor
    tau: torch.Tensor
    unknown: torch.Tensor
    kl_q: torch.Tensor
    chi2: torch.Tensor
    gap_abs: torch.Tensor
    tok_score: torch.Tensor

    def values(self) -> SamplerValues:
        return SamplerValues(self.mean, self.var, self.neg, self.miss, self.log_mean, self.log_var, self.tok_log,
                             self.kl_q, self.chi2, self.gap_abs, self.tok_score, self.tau)

    @staticmethod
    def cat(parts: Sequence["Sampled"]) -> "Sampled":
        return Sampled(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Sampled)))

    def select(self, rows: torch.Tensor) -> "Sampled":
        return Sampled(*(getattr(self, f.name)[rows] for f in fields(Sampled)))


@dataclass
class Chunk:
    """A chunk's finished values: q's, and one :class:`Sampled` per family."""
    kl: torch.Tensor
    lse_q: torch.Tensor
    lse_p: torch.Tensor
    mean_q: torch.Tensor
    var_q: torch.Tensor
    tok: torch.Tensor
    fam: dict

    @staticmethod
    def cat(parts: Sequence["Chunk"]) -> "Chunk":
        """Chunks' rows as one (the whole call's positions, in order)."""
        if len(parts) == 1:
            return parts[0]
        tensors = [torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Chunk) if f.name != "fam"]
        return Chunk(*tensors, {name: Sampled.cat([p.fam[name] for p in parts]) for name in parts[0].fam})

    def assign(self, rows: torch.Tensor, other: "Chunk") -> None:
        """Rows ``rows`` (an index tensor) take ``other``'s values (its rows in that order)."""
        for f in fields(Chunk):
            if f.name != "fam":
                getattr(self, f.name)[rows] = getattr(other, f.name)
        for name, sampled in self.fam.items():
            for f in fields(Sampled):
                getattr(sampled, f.name)[rows] = getattr(other.fam[name], f.name)

    def select(self, rows: torch.Tensor) -> "Chunk":
        """The rows ``rows`` (an index tensor), in its order."""
        tensors = [getattr(self, f.name)[rows] for f in fields(Chunk) if f.name != "fam"]
        return Chunk(*tensors, {name: x.select(rows) for name, x in self.fam.items()})

