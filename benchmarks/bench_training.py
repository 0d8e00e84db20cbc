"""Training-trajectory throughput: exact steps per second against a plain autograd baseline, in one process.

Both pipelines take Adam ascent steps (the same pure kl_bench.training.adam) on the same exact objective
J(θ) = E_q[reward] − β KL(q‖p), from the same start:

  kl-bench   the trainer's expected update of a combination, in closed form (categorical: q ⊙ a − q(q·a)
             with a = reward − β c(log r)) or by the counting dynamic program (rollout:
             kl_bench.kinds.rollout.gradients.exact_mean plus the reward's score function)
  autograd   J(θ) written as a differentiable float64 expression (categorical: the vocabulary sums;
             rollout: the forward dynamic program) and torch.autograd.grad of it

k1/reward has E[update] = ∇J, so the two trajectories must agree: the largest |Δθ| after the run is printed.
One intra-op thread (as every kl-bench entry point).

A per-sequence reward (kl_bench.training.sequences; R = distinct tokens) on a rollout near the enumeration's
limit: kl-bench's update (the reward's score function summed over every sequence, plus the counting dynamic
program for the KL term) against autograd of J written over the same enumerated sequences, and the cost of
one step's exact values (evaluate: KL both ways, entropy, E[R], J, KL(q‖q*), ∇J).

    python benchmarks/bench_training.py [--smoke] [--steps 50] [--rollout-steps 5] [--sequence-steps 5]
"""
from __future__ import annotations

import argparse
import functools
import platform
import time

import torch

from kl_bench.sampling.logits import zipf_logits
from kl_bench.kinds.rollout import RolloutModel, dp
from kl_bench.kinds.categorical.training import CategoricalProblem
from kl_bench.kinds.rollout.training import RolloutProblem, SequenceRolloutProblem
from kl_bench.training import SEQUENCE_REWARDS, Optimizer, parse_combination, trajectory
from kl_bench.kinds.rollout.sequences import enumerate_sequences
from kl_bench.training.sequences import rewards_of


def _pair_logits(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lq = torch.log_softmax(zipf_logits(vocab, 1.1, 1).expand(rows, vocab)
                           + 0.5 * torch.randn(rows, vocab, generator=g, dtype=torch.float64), -1)
    lp = torch.log_softmax(lq + 0.5 * torch.randn(rows, vocab, generator=g, dtype=torch.float64), -1)
    return lq, lp


def categorical(vocab: int) -> CategoricalProblem:
    lq, lp = _pair_logits(1, vocab, 2)
    r = -torch.randn(1, vocab, generator=torch.Generator().manual_seed(3), dtype=torch.float64).abs()
    return CategoricalProblem("bench", lq, lp, r, 0.5)


def rollout(c: int, vocab: int, length: int) -> RolloutProblem:
    lq, lp = _pair_logits(c, vocab, 4)
    r = -torch.randn(c, vocab, generator=torch.Generator().manual_seed(5), dtype=torch.float64).abs()
    return RolloutProblem("bench", lq, lp, r, 0.5, torch.arange(vocab) % c, length, 0)


def sequence_rollout(c: int, vocab: int, length: int) -> SequenceRolloutProblem:
    lq, lp = _pair_logits(c, vocab, 6)
    bucket = torch.arange(vocab) % c
    seqs = enumerate_sequences(bucket, vocab, length, 0)
    fn = SEQUENCE_REWARDS["distinct"]
    return SequenceRolloutProblem("bench", lq, lp, torch.zeros_like(lq), 1.0, bucket, length, 0, functools.partial(rewards_of, fn), seqs,
                                  rewards_of(fn, seqs.tokens, seqs.mask))


def seq_objective(pb: SequenceRolloutProblem, theta: torch.Tensor) -> torch.Tensor:
    """J = Σ_y q(y)(R(y) − β log(q(y)/p(y))) over the enumerated sequences, differentiable in θ."""
    s, lq = pb.seqs, torch.log_softmax(theta, -1)
    lq_y = torch.where(s.mask, lq.reshape(-1)[s.keys], 0.0).sum(-1)
    lp_y = torch.where(s.mask, pb.log_p.reshape(-1)[s.keys], 0.0).sum(-1)
    return (lq_y.exp() * (pb.values - pb.beta * (lq_y - lp_y))).sum()


def evaluate_rate(pb, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        pb.evaluate(pb.theta0)
    return repeats / (time.perf_counter() - t0)


def cat_objective(pb: CategoricalProblem, theta: torch.Tensor) -> torch.Tensor:
    lq = torch.log_softmax(theta, -1)
    q = lq.exp()
    return ((q * pb.reward).sum(-1) - pb.beta * (q * (lq - pb.log_p)).sum(-1)).mean()


def roll_objective(pb: RolloutProblem, theta: torch.Tensor) -> torch.Tensor:
    lq = torch.log_softmax(theta, -1)
    model = RolloutModel.build(lq.detach(), pb.log_p, pb.bucket, pb.length, pb.eos)
    return dp.path_moments(model, theta, torch.ones_like(lq), pb.reward - pb.beta * (lq - pb.log_p))[1]


def autograd_direction(objective):
    def direction(theta: torch.Tensor, t: int) -> torch.Tensor:
        th = theta.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(objective(th), th)
        return g
    return direction


def timed(pb, direction, steps: int) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    last = None
    for _, theta, _ in trajectory(pb.theta0, Optimizer("adam", 0.05), steps, direction):
        last = theta
    return steps / (time.perf_counter() - t0), last


def bench(name: str, pb, objective, labels: list[str], aggregates: tuple[str, ...], steps: int) -> None:
    base_rate, base_theta = timed(pb, autograd_direction(lambda th: objective(pb, th)), steps)
    print(f"{name}: autograd of J            {base_rate:9.1f} steps/s")
    for label in labels:
        combo = parse_combination(label, aggregates)
        rate, theta = timed(pb, lambda th, t: pb.expected_update(th, combo), steps)
        agree = f"   max |Δθ| vs autograd after {steps} steps: {float((theta - base_theta).abs().max()):.1e}" \
            if label.startswith("k1/reward") else ""
        print(f"{name}: kl-bench {label:<16} {rate:9.1f} steps/s  ({rate / base_rate:.2f}× autograd){agree}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps (CI)")
    ap.add_argument("--steps", type=int, default=50, help="categorical steps per pipeline")
    ap.add_argument("--rollout-steps", type=int, default=5, help="rollout steps per pipeline")
    ap.add_argument("--sequence-steps", type=int, default=5, help="per-sequence reward steps per pipeline")
    a = ap.parse_args()
    torch.set_num_threads(1)
    v, (c, rv, t) = (50257, (32, 5000, 64)) if not a.smoke else (500, (4, 50, 6))
    steps, rsteps, ssteps = (a.steps, a.rollout_steps, a.sequence_steps) if not a.smoke else (5, 2, 2)
    sc, sv, st = (4, 16, 5) if not a.smoke else (2, 4, 3)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    bench(f"categorical V={v}", categorical(v), cat_objective, ["k1/reward", "k2/loss", "k3/loss"], (), steps)
    bench(f"rollout C={c} V={rv} T={t}", rollout(c, rv, t), roll_objective, ["k1/reward/seq", "k1/reward/tok",
                                                                            "k3/loss/tok"], ("tok", "seq"), rsteps)
    pb = sequence_rollout(sc, sv, st)
    name = f"sequence reward C={sc} V={sv} T={st} ({pb.seqs.tokens.shape[0]:,} sequences)"
    bench(name, pb, seq_objective, ["k1/reward/seq", "k3/loss/tok"], ("tok", "seq"), ssteps)
    print(f"{name}: exact values (evaluate)  {evaluate_rate(pb, ssteps):9.1f} per s")


if __name__ == "__main__":
    main()
