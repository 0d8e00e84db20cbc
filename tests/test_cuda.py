"""The engine on a GPU: the same properties as on the CPU (bytes independent of chunk, Monte Carlo within
its standard errors of the exact values). Skipped cleanly where no CUDA device is present."""
import pytest
import torch

from kl_bench import seeding
from kl_bench.api import prepare
from kl_bench.engine import run_case
from kl_bench.results import to_frame
from kl_bench.results.rows import summarize

from .test_chunking import CASES, ROWS, _spec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("case", CASES)
def test_chunk_never_changes_the_sums_on_the_gpu(case, monkeypatch):
    monkeypatch.setitem(seeding.PIECE_DRAWS, "cuda", 1000)
    pair = prepare(_spec(1 << 22, {case: CASES[case]})).pairs[0]
    runs = [run_case(pair, ROWS, draws=20_000, seed=3, batches=4, chunk=chunk, device=CUDA, joint=True)
            for chunk in (1, 777, 1 << 22)]
    assert all(torch.equal(runs[0].sums, r.sums) for r in runs[1:]), case


@pytest.mark.parametrize("case", CASES)
def test_gpu_monte_carlo_matches_exact(case):
    pair = prepare(_spec(1 << 22, {case: CASES[case]})).pairs[0]
    df = to_frame(summarize(run_case(pair, ROWS, draws=400_000, seed=5, batches=200, chunk=1 << 22, device=CUDA)))
    checked = df[df["exact_mean"].notna() & df["z"].notna()]
    assert len(checked) and (checked["z"].abs() < 5).all(), checked[["estimator", "z"]]
