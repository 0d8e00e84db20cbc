"""Case kind ``model``: a policy q and a reference p that are causal LMs saved in local folders.

- ``length = 1``: the next-token distributions of the prompts are a categorical case with one context
  per prompt (:class:`NextTokenPair`): exact truth, moments, λ*, planning and gradients as for
  ``categorical``.
- ``length = T > 1``: continuations of up to T tokens are sampled from q (or the sampler b) with both
  models' KV caches (:class:`ModelPair`); at every step both full next-token distributions are computed,
  so each path gives L = Σ_t log r_t, every per-token estimator and the analytic per-step KL (``full``).
  The sequence KL(q‖p) has no exact value here: the reference is the Rao–Blackwellised ``full`` mean with
  its standard error (``reference_row``; summary columns ``ref_kl``, ``ref_se``, ``z_ref``), never
  called exact.

A draw picks a prompt uniformly (as a categorical draw picks a context), then a continuation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...foundation.typed_toml import Table, at_most
from ...core.draws import Draws, Row
from ...foundation.errors import SpecError
from ...core.estimators import RowSource
from ...sampling.mismatch import LOGIT_KEYS, WEIGHT_KEYS
from ...core.targets import FORWARD, REVERSE, TV
from ..protocols import CaseConfig, JointMoments, register_kind
from ..defaults import Pair
from ..categorical import CategoricalPair
from . import lm

MAX_MODEL_LENGTH = 1 << 16
# Rows whose spread the growth figure shows against the prefix length t (the last one is the reference).
GROWTH_ROWS = ("seq k1", "seq k3", "tok k3", "tok full")


@dataclass(frozen=True, kw_only=True)
class ModelCase(CaseConfig):
    policy: Path                 # q: a folder saved with save_pretrained (tokenizer too for a .txt prompts file)
    reference: Path              # p
    prompts: Path                # .txt (one prompt a line) or .jsonl ({"input_ids": [...]} a line)
    length: int = 1              # T: 1 = next token (exact); > 1 = sampled continuations
    eos: int | None = None       # a continuation ends at this token (included)
    dtype: str = "float32"       # the models' dtype; statistics are float64 whatever it is
    batch_size: int = 64         # prompts per forward pass, continuations generated together


def check_vocabularies(policy, reference, key: str = "reference") -> int:
    """The vocabulary both models share; a reference whose output layer has another size is refused in one
    line naming ``key`` (the spec's ``reference``, dump-logits' ``--reference``): its log-probs [B, V'] could
    not be compared with the policy's token for token."""
    v, w = lm.vocab_size(policy), lm.vocab_size(reference)
    if w != v:
        raise SpecError(f"the reference has vocabulary {w} but the policy has {v}", key=key)
    return v


def _device_for_forward() -> torch.device:
    """Next-token log-probs are computed once, at build time: on the GPU when there is one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@register_kind("model", description="a policy and a reference causal LM (local folders, transformers): next token "
               "(exact) or sampled continuations (reference: the full mean ± SE)",
               sampler_keys=(*LOGIT_KEYS, "min_length", *WEIGHT_KEYS),
               weight_kinds=("token", "sequence"))
class ModelPair(Pair):
    """Sampled continuations of T > 1 tokens (module docstring)."""
    aggregates = ("seq", "tok")
    expensive_draws = True
    supplies_logq = True

    def __init__(self, name: str, policy, reference, prompts: list[list[int]], length: int, eos: int | None,
                 batch_size: int, label: str = "", sampler=None):
        """``policy``, ``reference``: causal LMs (CPU; moved to the run's device on first use);
        ``prompts``: token ids; ``sampler``: a SamplerSpec (temperature, top-k/p, min_length, weights)."""
        self.name, self.label = name, label
        self.policy, self.reference, self.prompts = policy, reference, prompts
        self.length, self.eos, self.batch_size = int(length), eos, int(batch_size)
        self.vocab = lm.vocab_size(policy)
        self.sampler = sampler
        sp = sampler
        self.min_length = sp.min_length if sp is not None and eos is not None else 0
        self.reshape = sp is not None and sp.reshapes
        self.has_sampler = self.reshape or self.min_length > 0 or (sp is not None and sp.weights != "none")
        self.weights = sp.weights if sp is not None else "none"
        self.weight_cap = sp.weight_cap if sp is not None else None
        self.sampler_label = sp.describe() if self.has_sampler else ""
        self._device: torch.device | None = None
        # Growth in T from the prefixes of the main pass's paths (the draws summary.csv uses; never the
        # pilot, small-batch or other streams): per main-stream batch index i, (draws, float64 [T, R, 2] sums
        # of v and v² of GROWTH_ROWS at every step). growth() adds them in batch order, so the figure
        # depends on (seed, case, i) alone, never on chunking; see batch_sums().
        self.growth_batches: dict[int, tuple[int, torch.Tensor]] = {}

    # ------------------------------------------------------------------ spec → pair
    @classmethod
    def parse(cls, t: Table, common: dict[str, Any], spec_dir: Path) -> ModelCase:
        paths = {k: spec_dir / t.get(k, "str") for k in ("policy", "reference", "prompts")}
        length = t.get("length", "int", 1, lambda v: None if 1 <= v <= MAX_MODEL_LENGTH else
                       f"must lie in [1, {MAX_MODEL_LENGTH}], got {v}")
        eos = t.get("eos", "int", None, lambda v: None if v >= 0 else f"must be a token id ≥ 0, got {v}")
        dtype = t.get("dtype", "str", "float32", lambda v: None if v in lm.DTYPES else
                      f"must be one of {', '.join(lm.DTYPES)}, got '{v}'")
        batch_size = t.get("batch_size", "int", 64, at_most(lm.MAX_BATCH_SIZE, "2^20 prompts per forward pass"))
        t.finish()
        sp = common.get("sampler")
        if sp is not None and sp.min_length and (eos is None or length == 1):
            raise t.error("min_length needs an eos token and length > 1", key="sampler.min_length")
        return ModelCase(length=length, eos=eos, dtype=dtype, batch_size=batch_size, **paths, **common)

    @classmethod
    def from_config(cls, case: ModelCase) -> Pair:
        policy = lm.load_model(case.policy, case.dtype, "policy")
        reference = lm.load_model(case.reference, case.dtype, "reference")
        check_vocabularies(policy, reference)
        prompts = lm.read_prompts(case.prompts, case.policy)
        lm.check_prompts(prompts, case.prompts, [policy, reference], case.length, case.eos)
        label = f"policy {case.policy.name}, reference {case.reference.name}, {len(prompts)} prompts"
        if case.length == 1:
            return NextTokenPair.build(case, policy, reference, prompts, label)
        return cls(case.name, policy, reference, prompts, case.length, case.eos, case.batch_size, label=label,
                   sampler=case.sampler)

    def metadata(self) -> dict[str, Any]:
        # No exact value: the summary's reference is the `full` row's mean (reference_row).
        return {**super().metadata(), "label": self.label, "length": self.length,
                "reference": "full mean ± SE (Rao–Blackwellised Monte Carlo, not exact)" if self.has_reference else
                "none: draws from a sampler without sequence IS weights, so the full mean is not KL(q‖p)",
                "growth": self.growth()}

    def growth(self) -> dict[str, Any]:
        """std/ref of GROWTH_ROWS at prefix lengths t = 1, 2, 4, ..., T of the main pass's paths (the
        draws of summary.csv; ref: the mean of the `full` prefix, Monte Carlo; std: the population std of
        the paths' prefix values): {"T": [...], "paths": n, row: [...]}."""
        if not self.growth_batches:
            return {}
        ts = sorted({min(1 << k, self.length) for k in range(self.length.bit_length() + 1)})
        n = sum(m for m, _ in self.growth_batches.values())
        # host: growth sums are gathered on the host (small: [T, R, 2])
        sums = torch.zeros(self.length, len(GROWTH_ROWS), 2, dtype=torch.float64)
        for i in sorted(self.growth_batches):                # batch order: independent of chunking
            sums += self.growth_batches[i][1]
        mean = sums[:, :, 0] / n
        std = (sums[:, :, 1] / n - mean ** 2).clamp(min=0).sqrt()
        ref = mean[:, -1]
        out: dict[str, Any] = {"T": ts, "paths": n}
        for j, row in enumerate(GROWTH_ROWS):
            out[row] = [float(std[t - 1, j] / ref[t - 1]) if ref[t - 1] > 0 else None for t in ts]
        return out

    def aggregates_for(self, source: RowSource) -> tuple[str, ...]:
        return ("tok",) if source.token_only else self.aggregates

    # ------------------------------------------------------------------ truth: none exists
    def true_values(self) -> dict[str, float]:
        # Sampled continuations of real models: no exact value of either KL (reference_row instead).
        return {REVERSE: math.nan, FORWARD: math.nan, TV: math.nan}

    def exact_moments(self, est: RowSource, aggregate: str = "seq") -> tuple[float, float]:
        return math.nan, math.nan

    def exact_joint(self, aggregate: str = "seq") -> JointMoments:
        return JointMoments(math.nan, math.nan, math.nan, math.nan, math.nan)

    def reference_row(self) -> str | None:
        # Under a sampler b ≠ q the full mean is E_b[Σ_t KL(q‖p)(h_t)], not KL(q‖p), unless every row
        # carries the sequence weight Π_t q/b (per-token weights do not reweight the history).
        return "tok:full" if self.has_reference else None

    @property
    def has_reference(self) -> bool:
        return not self.has_sampler or self.weights == "sequence"

    def describe(self) -> str:
        eos = f", eos={self.eos}" if self.eos is not None else ""
        return (f"model continuations V={self.vocab}, T={self.length}{eos}: {self.label}"
                + (f"; {self.sampler_label}" if self.sampler_label else ""))

    # ------------------------------------------------------------------ sampling
    def piece_draws(self, device: torch.device) -> int:
        # A piece is one generation batch: memory is batch_size × (KV caches + a few [V] rows).
        return self.batch_size

    def _models_on(self, device: torch.device):
        if self._device != device:
            self.policy.to(device)
            self.reference.to(device)
            self._device = device
        return self.policy, self.reference

    def batch_sums(self, features, tok_rows: list[Row], device: torch.device):
        """As Pair.batch_sums; batches of the main stream (tag = the case name: not the pilot or any other
        stream) also record their paths' prefix sums for growth(), keyed by batch index."""
        piece = self.piece_draws(device)

        def run(batches) -> torch.Tensor:
            out = []
            for batch in batches:
                # host: growth sums are gathered on the host (small: [T, R, 2])
                grow = (torch.zeros(self.length, len(GROWTH_ROWS), 2, dtype=torch.float64)
                        if batch.tag == self.name and not self.has_sampler else None)
                total = None
                for m, g in batch.pieces(piece):
                    s = features(self.sample_draws(m, g, device, tok_rows, growth=grow)).sum(0)
                    total = s if total is None else total + s
                out.append(total)
                if grow is not None:
                    self.growth_batches[batch.index] = (batch.size, grow)
            return torch.stack(out)
        return run

    def sample_draws(self, n: int, generator: torch.Generator, device: torch.device,
                     tok_rows: list[Row] = (), growth: torch.Tensor | None = None) -> Draws:
        """``n`` continuations, generated ``batch_size`` at a time from ``generator`` (in order).
        ``growth``: a float64 [T, R, 2] CPU tensor that receives the prefix sums of GROWTH_ROWS."""
        parts = [self.generate(min(self.batch_size, n - i), generator, device, tok_rows, growth=growth)
                 for i in range(0, n, self.batch_size)]
        if len(parts) == 1:
            return parts[0]
        cat = {k: (None if getattr(parts[0], k) is None else torch.cat([getattr(p, k) for p in parts]))
               for k in ("logr", "full", "tok", "tok_b", "weight")}
        return Draws(**cat, tok_weighted=parts[0].tok_weighted)

    def behaviour(self, lq: torch.Tensor, t: int) -> torch.Tensor:
        """log b(·|h_t) [n, V] float64: q reshaped by temperature/top-k/top-p, EOS suppressed while t <
        min_length (renormalised)."""
        sp = self.sampler
        lb = sp.reshape(lq) if self.reshape else lq
        if t < self.min_length:
            lb = lb.clone()
            lb[:, self.eos] = -torch.inf
            lb = torch.log_softmax(lb, dim=-1)
        return lb

    @torch.no_grad()
    def generate(self, n: int, generator: torch.Generator, device: torch.device, tok_rows: list[Row] = (),
                 prefixes: torch.Tensor | None = None, record: list | None = None,
                 growth: torch.Tensor | None = None) -> Draws:
        """``n`` ≤ batch_size continuations: prompts drawn uniformly, then up to T tokens x_t ~ b(·|h_t) by
        inverse CDF on float64 uniforms from ``generator`` (never the global RNG), with both models' KV
        caches. Per path (float64 [n]): L = Σ_t log r_t, full = Σ_t KL(q(·|h_t) ‖ p(·|h_t)), token sums.
        ``prefixes``: a float64 [T, n, 2] tensor that receives (L, full) after each step (growth in T).
        ``record``: a list that receives, per step, (token, log q, log p, KL(q‖p) at h_t, alive) [n] each,
        and first the prompt indices (kl-bench dump-logits).
        ``growth``: a float64 [T, R, 2] CPU tensor to which the sums of v and v² of GROWTH_ROWS over the
        paths' prefixes are added (growth in T; only the main pass passes one)."""
        q_model, p_model = self._models_on(device)
        idx = torch.randint(len(self.prompts), (n,), generator=generator, device=device).tolist()
        ids, mask = lm.left_pad([self.prompts[i] for i in idx], device)
        sq, sp = lm.Step(q_model, ids, mask), lm.Step(p_model, ids, mask)
        if record is not None:
            record.append(torch.tensor(idx))  # host: dump-logits writes host tensors
        f64 = dict(dtype=torch.float64, device=device)
        paths = _Paths.start(n, len(tok_rows), self.weights != "none", self.length if growth is not None else 0, f64)
        rows = torch.arange(n, device=device)
        for t in range(self.length):
            # [n, V] float64, renormalised in float64 like a next-token case's tables (NextTokenPair.build)
            lq = torch.log_softmax(lm.log_probs64(sq.last), dim=-1)
            lp = torch.log_softmax(lm.log_probs64(sp.last), dim=-1)
            lb = self.behaviour(lq, t) if self.has_sampler else lq
            u = torch.rand(n, 1, generator=generator, **f64)
            cdf = lb.exp().cumsum(-1)
            # Inverse CDF: the first token whose cumulative mass exceeds u·total; a zero-probability
            # token has an empty interval and is never drawn.
            x = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=self.vocab - 1)
            kl_t = self._step(paths, t, lq[rows, x], lp[rows, x], lb[rows, x], (lq.exp() * (lq - lp)).sum(-1),
                              tok_rows)
            if prefixes is not None:
                prefixes[t, :, 0], prefixes[t, :, 1] = paths.logr, paths.full
            if record is not None:
                record.append((x, lq[rows, x], lp[rows, x], kl_t, paths.alive.clone()))
            if self.eos is not None:
                paths.alive = paths.alive * (x != self.eos)
            if t + 1 < self.length:
                if not bool(paths.alive.any()):
                    paths.hold(t, prefixes)
                    break
                sq.advance(x)
                sp.advance(x)
        if paths.grow is not None:        # the caller passes one for draws from q only (the reference is an E_q)
            growth += paths.grow.cpu()
        return Draws(paths.logr, paths.full, paths.tok, paths.tok_b, weight=paths.weight,
                     tok_weighted=self.weights == "token")

    def _step(self, paths: "_Paths", t: int, lq_x: torch.Tensor, lp_x: torch.Tensor, lb_x: torch.Tensor,
              kl_t: torch.Tensor, tok_rows: list[Row]) -> torch.Tensor:
        """Add step t's drawn tokens (their log q, log p, log b [n]; the analytic KL(q‖p) at h_t [n]) to the
        paths that are still alive; returns kl_t."""
        alive = paths.alive
        g = lp_x - lq_x                                                          # log r_t
        paths.logr += alive * g
        paths.full += alive * kl_t
        paths.tok_b += alive * torch.expm1(g)
        paths.tok_k3 += alive * (torch.expm1(g) - g)
        # Prefix t + 1 of every path (a path that ended keeps its values): seq k1, seq k3, tok k3, full.
        if paths.grow is not None:
            v = torch.stack([-paths.logr, torch.expm1(paths.logr) - paths.logr, paths.tok_k3, paths.full], -1)
            paths.grow[t, :, 0], paths.grow[t, :, 1] = v.sum(0), (v * v).sum(0)
        step_w = None
        if paths.weight is not None:               # q/b of the drawn token, capped
            w_t = torch.exp(lq_x - lb_x)
            if self.weight_cap is not None:
                w_t = w_t.clamp(max=self.weight_cap)
            paths.weight = paths.weight * torch.where(alive > 0, w_t, torch.ones_like(w_t))
            step_w = w_t if self.weights == "token" else None
        if tok_rows:
            vals = torch.stack([kl_t if r.est.analytic else r.est.on(g, lq_x) for r in tok_rows], dim=-1)
            paths.tok += (alive if step_w is None else alive * step_w)[:, None] * vals
        return kl_t


@dataclass
class _Paths:
    """Running per-path sums of one :meth:`ModelPair.generate` call: float64 [n] each (tok [n, R], the token
    rows; grow [T, len(GROWTH_ROWS), 2], prefix sums of v and v², or None)."""
    logr: torch.Tensor
    full: torch.Tensor
    tok_b: torch.Tensor
    tok_k3: torch.Tensor
    tok: torch.Tensor
    alive: torch.Tensor
    weight: torch.Tensor | None
    grow: torch.Tensor | None

    @classmethod
    def start(cls, n: int, tok_rows: int, weighted: bool, grow_length: int, f64: dict) -> "_Paths":
        return cls(torch.zeros(n, **f64), torch.zeros(n, **f64), torch.zeros(n, **f64), torch.zeros(n, **f64),
                   torch.zeros(n, tok_rows, **f64), torch.ones(n, **f64), torch.ones(n, **f64) if weighted else None,
                   torch.zeros(grow_length, len(GROWTH_ROWS), 2, **f64) if grow_length else None)

    def hold(self, t: int, prefixes: torch.Tensor | None) -> None:
        """Every path ended at step t: the later prefixes keep step t's values."""
        if prefixes is not None:
            prefixes[t + 1:] = prefixes[t]
        if self.grow is not None:
            self.grow[t + 1:] = self.grow[t]


class NextTokenPair(CategoricalPair):
    """``length = 1``: the prompts' next-token distributions as a categorical with one context a prompt."""
    kind = "model"

    @classmethod
    def build(cls, case: ModelCase, policy, reference, prompts: list[list[int]], label: str) -> "NextTokenPair":
        dev = _device_for_forward()
        # The float32 log-softmax cast to float64 sums to 1 only to float32 rounding (Σ exp ≈ 1 ± 1e-7), so
        # a truth Σ q (log q − log p) and exact means weighted by exp(log q) would disagree at ~1e-8 (k3's
        # exact mean picks up Σp − Σq). Renormalise once in float64: the truth, the exact moments and the
        # sampling all use these tables, the very ones a categorical case reads from dump-logits' file.
        lq = torch.log_softmax(lm.next_token_logprobs(policy.to(dev), prompts, case.batch_size, dev), dim=-1)
        lp = torch.log_softmax(lm.next_token_logprobs(reference.to(dev), prompts, case.batch_size, dev), dim=-1)
        sp = case.sampler
        if sp is None:
            return cls(case.name, lq, lp, label=label)
        log_b = sp.reshape(lq)
        # One token: sequence weights are token weights.
        return cls(case.name, lq, lp, label=label, log_b=log_b, weights="none" if sp.weights == "none" else "token",
                   weight_cap=sp.weight_cap, sampler_label=sp.describe())

    def describe(self) -> str:
        # The label already names the prompts' count (ModelPair.from_config).
        return f"model next token, V={self.model.vocab}: {self.label}" + (
            f"; {self.sampler_label}" if self.sampler_label else "")
