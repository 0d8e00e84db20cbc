"""What an audit says in words: the warnings of a step and of the steps so far, one line each, naming the
part of the bias split that explains the gap (kl_bench.audit.step) and what to do about it.

The same rules serve the TRL callback and ``kl-bench audit DIR``, so both say the same things.

Thresholds. Under an unbiased estimate each step's z is ≈ N(0, 1), so |z| > 5 at one step is a
1-in-1.7-million event; pooled over S steps the z is N(0, 1) again and a smaller threshold (4: 1 in
16,000) keeps false alarms rare while catching a bias that no single step shows (a pooled −4.7 from
top_k = 20 in a live run). A consistency failure that persists: |z| > 2 at each of the last 3 audited
steps happens by chance with probability 0.0455³ ≈ 1e-4 (independent steps), while a real mismatch
of 2–4 per step (left padding) shows up at every step.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..foundation.formatting import fmt, measured_cells, plural
from .rollout_engine import EngineAudit
from .step import StepAudit, formula_name, pooled_row, step_line


@dataclass(frozen=True)
class Thresholds:
    """``z``: one step's |z|; ``pooled``: |z| pooled over steps (bias and consistency); ``sampler``: the
    sampler's share of the estimator's mean; ``persistent``/``run``: a consistency |z| above it at each
    of the last ``run`` audited steps."""
    z: float = 5.0
    pooled: float = 4.0
    sampler: float = 0.05
    persistent: float = 2.0
    run: int = 3


@dataclass(frozen=True)
class Warning:
    """One warning line. ``key``: its kind; ``once``: said once per run for each ``scope`` (a source for
    the pooled bias, an estimator for the sampler and the drawing pass, which every source of one
    estimator shares; a step for that step's consistency check, a property of its tokens that every
    source shares), else every time it holds (a failed check at that step); ``check``: a statistical
    check failed (``kl-bench audit`` then exits 1), not advice about a setting."""
    key: str
    message: str
    once: bool = False
    scope: str = ""
    check: bool = False


class Voice:
    """What an audit prints, each line once: the TRL callback and ``kl-bench audit DIR`` both print through
    one, so the same run gives the same lines both ways. ``notes``: the trainer's settings that the audit
    cannot see in the tensors (dropout, bf16 autocast, unmodelled generation options), each said once;
    :meth:`step`: a step audit's line and the warnings not said before; ``failed``: a check failed."""

    def __init__(self):
        self.said: set[tuple[str, str]] = set()
        self.failed = False

    def notes(self, notes) -> list[str]:
        """The (key, message) notes not said before, as warning lines."""
        out = []
        for key, message in notes:
            if ("note", key) not in self.said:
                self.said.add(("note", key))
                out.append(f"warning: {message}")
        return out

    def warnings(self, warnings) -> list[str]:
        out = []
        for w in warnings:
            self.failed |= w.check
            if w.once and (w.key, w.scope) in self.said:
                continue
            self.said.add((w.key, w.scope))
            out.append(f"warning: {w.message}")
        return out

    def step(self, a: StepAudit, warnings) -> list[str]:
        """The step's line, then its warnings not said before."""
        return [step_line(a)] + self.warnings(warnings)


def pooled_line(source: str, p: dict) -> str:
    """The pooled verdict of one source (kl_bench.audit.step.pooled_row), one line, in the one vocabulary of
    numbers (kl_bench.foundation.formatting: the bias to its SE's precision)."""
    bias, se, _ = measured_cells(p["mean_bias"], p["se"], sign=True)
    return (f"pooled {source} over {plural(p['steps'], 'step')}: mean bias {bias} ± {se} "
            f"(z = {fmt(p['z'], 2, sign=True)}), sampler {fmt(p['mean_bias_sampler'], 3, sign=True)}, "
            f"consistency z = {fmt(p['consistency_z'], 2, sign=True)}")


PARTS = (("bias_estimator", "the estimator's own bias (its formula is not unbiased for KL(q||p))"),
         ("bias_sampler", "the sampler (top-k/top-p/min-p: tokens come from another distribution; sample with "
                          "top_k=0, top_p=1, min_p=0 or weight by q/b)"),
         ("bias_mismatch", "the pass that drew the tokens differs from the scored one (dropout in generation, "
                           "position ids, the KV cache, precision: see consistency)"),
         ("bias_formula", "the trainer's formula: its values are not its declared estimator of its own log-probs "
                          "(see the formula warning)"),
         ("bias_precision", "the trainer's log-probs (bf16/fp16 autocast: compute them in float32)"))


def largest_part(a: StepAudit) -> tuple[str, str]:
    """The named part of the bias split with the largest magnitude, and what it means."""
    return max(PARTS, key=lambda p: abs(getattr(a, p[0])))


def step_warnings(a: StepAudit, history: list[StepAudit], sampler: str, t: Thresholds = Thresholds()) -> list[Warning]:
    """Warnings about step ``a``; ``history``: this source's audited steps so far, ``a`` last."""
    out = []
    if abs(a.z) > t.z:
        name, why = largest_part(a)
        unmeasured = "" if a.sampling_pass else "; the sampling pass was not captured, so a mismatch shows as noise"
        out.append(Warning("z", f"step {a.step} {a.source}: the logged KL {a.logged:.4g} is {a.bias:+.3g} from the "
                                f"exact {a.exact:.4g} (z = {a.z:+.1f}); the largest part is {name} "
                                f"({getattr(a, name):+.3g}): {why}{unmeasured}", check=True))
    if a.formula_fit:
        out.append(Warning("formula", _formula(a), once=True, scope=a.source, check=True))
    if abs(a.expected_b - a.expected_q) > t.sampler * abs(a.expected_q):
        out.append(Warning("sampler", f"step {a.step} {a.source}: the sampler ({sampler}) moves the estimator's mean by "
                                      f"{(a.expected_b - a.expected_q) / abs(a.expected_q):+.0%}: the logged KL is of "
                                      "another distribution; sample with top_k=0, top_p=1, min_p=0 or weight by q/b",
                           once=True, scope=a.estimator))
    if a.sampling_pass and abs(a.bias_mismatch) > t.sampler * abs(a.expected_q):
        out.append(Warning("mismatch", f"step {a.step} {a.source}: the pass that drew the tokens differs from the "
                                       f"scored one and moves the estimator's mean by "
                                       f"{a.bias_mismatch / abs(a.expected_q):+.0%} (bias_mismatch "
                                       f"{a.bias_mismatch:+.3g}); likely causes: position ids (left padding "
                                       "without position_ids in the loss pass), dropout, the KV cache or precision "
                                       "of generation", once=True, scope=a.estimator))
    if abs(a.consistency_z) > t.z:
        out.append(Warning("consistency", _consistency(f"step {a.step}", a.consistency_z, a.impossible,
                                                       a.sampling_pass > 0), once=True, scope=f"step {a.step}",
                           check=True))
    return out + _pooled_warnings(history, t)


def _formula(a: StepAudit) -> str:
    fits = (f"they fit {formula_name(a.estimator, a.formula_fit)} instead" if a.formula_fit > 0 else
            "no formula we know fits (k1, k2, k3, the declared one, of either sign) and the gap is over 100 times "
            "what the dtype of its values explains" + ("" if a.own_logprobs else ": another formula, or log-probs "
                                                         "not from the logits the audit was given (save the trainer's "
                                                         "own policy_logprobs and reference_logprobs to tell)"))
    return (f"step {a.step} {a.source}: the trainer's values are not {a.estimator} of its own log r = log p − log q: "
            f"{fits} (bias_formula {a.bias_formula:+.3g}, precision only {a.bias_precision:+.2g}); fix the formula "
            "or declare the estimator it computes (a swapped sign is log q − log p, or log-prob arguments in the "
            "other order)")


def _consistency(where: str, z: float, impossible: int, captured: bool) -> str:
    causes = ("the sampling pass was captured, so: a generation option the audit does not model, or another "
              "engine drew the tokens (vLLM)" if captured else
              "position ids (left padding without position_ids), dropout in the loss pass, bf16/fp16 log-probs, "
              "an unmodelled generation option")
    return (f"{where}: the sampled tokens do not fit the distribution that should have drawn them (consistency "
            f"z = {z:+.1f}, {impossible} impossible tokens); likely causes: {causes}")


def _pooled_warnings(history: list[StepAudit], t: Thresholds) -> list[Warning]:
    out = []
    if len(history) < 2:
        return out
    p, source = pooled_row(history), history[-1].source
    if abs(p["z"]) > t.pooled:
        out.append(Warning("z_pooled", f"{source}: over {p['steps']} audited steps the logged KL is biased: mean bias "
                                       f"{p['mean_bias']:+.3g} ± {p['se']:.2g} (pooled z = {p['z']:+.1f}, threshold "
                                       f"{t.pooled:g})", once=True, scope=source, check=True))
    if abs(p["consistency_z"]) > t.pooled:
        out.append(Warning("consistency_pooled", _consistency(f"over {p['steps']} audited steps", p["consistency_z"],
                                                              p["impossible"], history[-1].sampling_pass > 0) +
                           " (pooled)", once=True, check=True))
    last = history[-t.run:]
    if len(last) == t.run and all(abs(r.consistency_z) > t.persistent for r in last):
        out.append(Warning("consistency_persistent",
                           f"the consistency check has failed at each of the last {t.run} audited steps (|z| > "
                           f"{t.persistent:g}: {', '.join(f'{r.consistency_z:+.1f}' for r in last)}): a mismatch "
                           "that persists, not chance", once=True, check=True))
    return out


def engine_warnings(a: EngineAudit, t: Thresholds = Thresholds()) -> list[Warning]:
    """Warnings of a step's rollout-engine audit: a processed engine's sampler gap in the importance
    ratio, and an engine that differs from the trainer beyond its sampler."""
    out = []
    if a.convention == "processed" and abs(a.sampler_gap) > 1e-3:
        out.append(Warning("engine_processed", f"step {a.step}: the rollout engine returns processed log-probs "
                                               f"(renormalised after truncation): old − sampling carries "
                                               f"{-a.sampler_gap:+.3g} per token from the sampler alone (−log kept "
                                               "mass; TRL issue #6789): an importance ratio built on them is biased",
                           once=True))
    if a.cause:
        out.append(Warning("engine", _engine_message(a, t.z), once=True, scope="engine", check=True))
    return out


# What each cause means and what to do (kl_bench.audit.rollout_engine.cause_of).
CAUSES = {
    "sampler": "another sampler: the engine samples with settings other than the ones the audit was given (its "
               "top_k, top_p, min_p, temperature, repetition penalty or min_new_tokens): make them equal",
    "precision": "precision: the engine computes in {dtype}, whose rounding moves each token's log-prob; an engine "
                 "in float32 at the same weights should pass this check (run it once to tell precision from "
                 "another model version), or correct for the gap with an importance ratio",
    "version": "another model version: the engine computes in {dtype}, whose rounding cannot explain this, so its "
               "weights are not the trainer's (not synced after the last step, another checkpoint, an adapter not "
               "merged) or its kernels compute something else; a sampler setting that keeps the support (a "
               "narrower top_k/top_p, another temperature) reads the same",
    "precision or version": "precision, if the engine computes in bfloat16 or float16, else another model version "
                            "(weights not synced, another checkpoint); declare the engine's dtype "
                            "(engine_dtype) to tell, or certify an engine in float32 at the same weights",
}


def _engine_message(a: EngineAudit, z: float) -> str:
    """The engine warning: what departs (KL(engine‖trainer) measured against the sampler alone, the metric that
    departs most), the tokens outside the trainer-side support, and the cause that fits."""
    m = a.worst()
    parts = [f"step {a.step}: the rollout engine differs from the trainer beyond its sampler" if a.departs(z) else
             f"step {a.step}: the rollout engine drew tokens the trainer-side sampler cannot draw",
             f"KL(engine‖trainer) {a.kl_engine:.3g} ± {a.kl_engine_se:.2g} measured against {a.kl_sampler:.3g} from "
             f"the sampler alone (excess {a.kl_excess:+.3g}); {m} {getattr(a, m):.3g} ± {getattr(a, m + '_se'):.2g} "
             f"against {getattr(a, m + '_exact'):.3g} (z = {a.departure(m):+.1f})"]
    if a.outside_beyond:
        how = ("far beyond the engine's own log-prob noise" if a.cause == "sampler" else
               "within the engine's own log-prob noise: flips at the truncation boundary")
        parts.append(f"{a.outside_beyond} of {a.tokens} tokens lie outside the support the settings' sampler gives on "
                     f"the trainer's logits, up to {a.outside_depth:.3g} below its threshold ({how}, SD "
                     f"{a.spread:.2g} per token)")
    return "; ".join(parts) + ". Cause that fits: " + CAUSES[a.cause].format(dtype=a.engine_dtype or "?")
