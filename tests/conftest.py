import textwrap
from pathlib import Path

import pytest
import torch

from kl_bench.engine import run_case
from kl_bench.results import summarize, to_frame

CPU = torch.device("cpu")


@pytest.fixture
def write_spec(tmp_path: Path):
    """Write a spec file from (dedented) text; returns its path."""
    def write(text: str, name: str = "spec.toml") -> Path:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path
    return write


def mc_frame(pair, estimators, draws=200_000, seed=0, batches=100, chunk=1 << 20):
    """Run one pair on the CPU and return its summary rows as a DataFrame."""
    return to_frame(summarize(run_case(pair, list(estimators), draws=draws, seed=seed, batches=batches,
                                       chunk=chunk, device=CPU)))
