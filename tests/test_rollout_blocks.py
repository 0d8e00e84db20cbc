"""Blocks of steps in the rollout sampler (kl_bench.sampling.seeding.STEP_BLOCKS, issue 33): on a GPU the
per-step sums (L, the analytic KL, the token rows) are added once per block of steps, so that each
estimator runs once a block and the sampler makes half the operations (kernel launches there). The CPU
keeps blocks of one step, and its bytes. Tested here on the CPU with the CUDA setting forced: the same
sums as step by step up to the order of float64 additions, whatever the sampler options; the same bytes
whatever the chunk; and the operation count."""
import pytest
import torch

from kl_bench.core.draws import Row
from kl_bench.core.estimators import ESTIMATORS, FULL, make_cv
from kl_bench.core.rejection import CRITERIA, Criterion, Rejection
from kl_bench.engine.monte_carlo import run_case
from kl_bench.results import to_frame
from kl_bench.experiment.rows import summarize
from kl_bench.kinds import RolloutPair
from kl_bench.kinds.rollout.model import RolloutModel
from kl_bench.kinds.rollout.sampler import _uniforms, simulate
from kl_bench.sampling import seeding
from kl_bench.sampling.logits import zipf_logits

from .bench_tools import launches
from .conftest import CPU

count_ops = launches.count_ops

C, V, T, EOS = 3, 12, 11, 11          # T = 11: blocks of 3 and of 8 end on a partial block
ROWS = [Row(ESTIMATORS[n], "tok") for n in ("k1", "k2", "k3", "fwd_k3")] + [Row(FULL, "tok"), Row(make_cv(0.5), "tok")]
OPTIONS = {
    "on-policy": {},
    "token-weights-capped": dict(behaviour=True, weights="token", weight_cap=2.0, min_length=2),
    "sequence-weights-rejection": dict(behaviour=True, weights="sequence",
                                       rejection=Rejection((Criterion(next(k for k in CRITERIA if k.endswith("max_k3")),
                                                                      2.0),))),
}


def _log_softmax(g: torch.Generator, scale: float) -> torch.Tensor:
    return torch.log_softmax(scale * torch.randn(C, V, generator=g, dtype=torch.float64), -1)


def _model(options: dict) -> RolloutModel:
    kw = dict(options)
    g = torch.Generator().manual_seed(4)
    lq, lp = _log_softmax(g, 1.5), _log_softmax(g, 1.5)
    log_b = _log_softmax(g, 1.0) if kw.pop("behaviour", False) else None
    return RolloutModel.build(lq, lp, torch.arange(V) % C, T, EOS, log_b=log_b, **kw)


def _draws(model: RolloutModel, block: int, monkeypatch, device: torch.device = CPU):
    monkeypatch.setitem(seeding.STEP_BLOCKS, device.type, block)
    gens = [torch.Generator(device=device).manual_seed(s) for s in (1, 2)]
    return simulate(model, [700, 300], gens, device, ROWS)


DEVICES = [CPU, pytest.param(torch.device("cuda"), marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                            reason="no CUDA device"))]


@pytest.mark.parametrize("device", DEVICES, ids=["cpu", "cuda"])
@pytest.mark.parametrize("block", [3, 8, 16])
@pytest.mark.parametrize("options", list(OPTIONS), ids=list(OPTIONS))
def test_blocks_of_steps_give_the_per_step_sums(block, options, device, monkeypatch):
    """The same paths (the uniforms do not depend on the block), the same sums up to the order of T = 11
    float64 additions: each within (T − 1)·2^-52·Σ_t |term_t| ≤ T²·2^-52·(the largest term), bounded here by
    the largest sum's magnitude times T (terms of one sign dominate); the weights and the rejection mask,
    multiplied or decided step by step in both, are identical."""
    model = _model(OPTIONS[options])
    one, blocked = _draws(model, 1, monkeypatch, device), _draws(model, block, monkeypatch, device)
    for field in ("logr", "full", "tok", "tok_b"):
        a, b = getattr(one, field), getattr(blocked, field)
        scale = T * max(1.0, float(a.abs().max()))
        assert float((a - b).abs().max()) <= T * T * 2.0**-52 * scale, field
    assert not torch.equal(one.tok, torch.zeros_like(one.tok))
    for field in ("weight", "log_weight", "keep"):
        a, b = getattr(one, field), getattr(blocked, field)
        assert (a is None and b is None) or torch.equal(a, b), field


def test_blocks_of_steps_keep_the_bytes_whatever_the_chunk(monkeypatch):
    """With the CUDA setting (blocks of 8) on the CPU, the run's per-batch sums are byte-identical for any
    chunk (1, 3 and all 30 uneven batches a call): a block's steps are added in an order that depends on the
    step count alone. (A plain reduction would pass here too: the CPU's sums over a dimension of 8 do not
    follow the tensor's width; CUDA's may, and tests/test_cuda.py runs the rollout case's chunks there.)"""
    monkeypatch.setitem(seeding.STEP_BLOCKS, "cpu", seeding.STEP_BLOCKS["cuda"])
    pair = _chunked_pair()
    assert pair.batches_per_chunk(201, 2500) == 3
    _same_bytes_whatever_the_chunk(pair)


def _chunked_pair() -> RolloutPair:
    """A rollout pair (V = 200, C = 4, T = 13) whose 6,007 draws in 30 uneven batches take 1, 3 or 30 batches
    a call with chunks of 1, 2,500 and 2^22 draws."""
    lq = torch.log_softmax(zipf_logits(200, 1.1, 1, 4), -1)
    g = torch.Generator().manual_seed(2)
    lp = torch.log_softmax(lq + 0.4 * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    return RolloutPair("r", lq, lp, torch.arange(200) % 4, 13, 199)


def _same_bytes_whatever_the_chunk(pair: RolloutPair) -> None:
    runs = [run_case(pair, ["k1", "k3", "full"], draws=6007, seed=1, batches=30, chunk=chunk, device=CPU, joint=True)
            for chunk in (1, 2500, 1 << 22)]
    assert all(torch.equal(runs[0].sums, r.sums) for r in runs[1:])


@pytest.mark.parametrize("uniforms", [4, 64])
def test_uniform_blocks_keep_the_bytes_whatever_the_chunk_and_are_the_law(uniforms, monkeypatch):
    """With a block of uniforms per batch (seeding.UNIFORM_STEPS: CUDA's 64, and 4, where T = 13 ends on a
    partial block) and CUDA's blocks of sums, forced on the CPU: the per-batch sums are byte-identical for
    chunks of 1, 3 and all 30 uneven batches a call (a batch's uniforms come from its generator in one call
    a block, whatever its neighbours), and the estimates agree with the exact values (|z| < 5)."""
    monkeypatch.setitem(seeding.STEP_BLOCKS, "cpu", seeding.STEP_BLOCKS["cuda"])
    monkeypatch.setitem(seeding.UNIFORM_STEPS, "cpu", uniforms)
    pair = _chunked_pair()
    _same_bytes_whatever_the_chunk(pair)
    df = to_frame(summarize(run_case(pair, ["k1", "k2", "k3"], draws=40_000, seed=5, batches=40, chunk=1 << 22,
                                     device=CPU)))
    assert (df["z"].abs() < 5).all(), df[["estimator", "z"]]


def test_uniform_blocks_make_one_call_a_batch_and_block(monkeypatch):
    """The batches' generators are called once per block of steps (⌈T/U⌉ calls each), not once a step: a
    chunk of many small batches (200 of 5,000 paths in one GPU piece) made a kernel per batch at every
    step, ~9× the rest of a step's kernels. A batch's block is its generator's next k·U numbers, path-major,
    whatever its neighbours; one row a call (the CPU) is the stream one call a step drew before blocks."""
    model = _model(OPTIONS["on-policy"])
    sizes = [20] * 50

    def gens(n: int = len(sizes)):
        return [torch.Generator().manual_seed(s) for s in range(n)]

    def calls(steps: int) -> int:
        monkeypatch.setitem(seeding.UNIFORM_STEPS, "cpu", steps)
        return count_ops(lambda: simulate(model, sizes, gens(), CPU, ROWS))[1]["uniform_"]
    for steps in (1, 4, 64):
        assert calls(steps) == len(sizes) * -(-T // steps)
    sizes = [7, 20, 3]
    for steps in (1, 4):
        together = _uniforms(sizes, gens(3), steps, CPU)
        alone = [torch.rand(k, steps, dtype=torch.float64, generator=g) for k, g in zip(sizes, gens(3))]
        assert torch.equal(together, torch.cat(alone))
    one_a_step = [torch.cat([torch.rand(k, dtype=torch.float64, generator=g)[:, None] for _ in range(3)], 1)
                  for k, g in zip(sizes, gens(3))]
    rows = gens(3)
    assert torch.equal(torch.cat(one_a_step), torch.cat([_uniforms(sizes, rows, 1, CPU) for _ in range(3)], 1))


def test_blocks_of_steps_halve_the_operations(monkeypatch):
    """Operations the sampler dispatches (benchmarks/launches.py; about one kernel launch each on a
    GPU): with blocks of 8 steps at most 60% of those step by step (measured 31 against 69 a step with
    six token rows)."""
    model = _model(OPTIONS["on-policy"])

    def ops(block: int) -> int:
        return sum(count_ops(lambda: _draws(model, block, monkeypatch))[1].values())
    assert ops(seeding.STEP_BLOCKS["cuda"]) <= 0.6 * ops(1)
