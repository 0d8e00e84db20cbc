"""Counts and tokens are the same distribution: every categorical case of every committed experiment, run
both ways, agrees with its exact moments (|z| < 5 for every row with an exact value; variances where the
fourth moment is finite)."""
import dataclasses
from pathlib import Path

import pytest

from kl_bench.kinds import build_pair
from kl_bench.experiment.spec import load_spec

from .conftest import mc_frame

ROOT = Path(__file__).resolve().parent.parent
# Rounded log-probs (precision) change the feature table, not how the ids are drawn: those cases are
# covered by their unrounded twins; a sweep's grid is one pair at many settings (its base case is enough).
SPECS = {path: load_spec(path) for path in sorted((ROOT / "experiments").glob("*.toml"))}
CASES, _seen = [], set()
for _path, _spec in SPECS.items():
    for _case in _spec.cases:
        if _case.kind != "categorical":
            continue
        _key = repr((_case.vocab, _case.q, _case.p, _case.sampler))        # the same pair in two experiments
        if _case.precision is None and _case.name not in _spec.sweep_values and _key not in _seen:
            _seen.add(_key)
            CASES.append((_path, _case))
ROWS = ["k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3", "full"]


@pytest.mark.slow
@pytest.mark.parametrize("path,case", CASES, ids=[f"{p.stem}/{c.name}" for p, c in CASES])
def test_every_categorical_case_matches_exact_both_ways(path, case):
    pair = build_pair(dataclasses.replace(case, sampling="counts"), str(path))
    for sampling in ("counts", "tokens"):
        pair.sampler.sampling = sampling                       # the same tables, the other path
        assert pair.sampler.uses_counts(2000) == (sampling == "counts")
        df = mc_frame(pair, ROWS, draws=200_000, seed=1, batches=100)
        checked = df[df["exact_mean"].notna()]
        assert (checked["z"].abs() < 5).all(), (sampling, checked[["estimator", "mean", "exact_mean", "z"]])
        light = checked[checked["heavy_tail"] == ""]
        assert (light["z_var"].abs() < 5).all(), (sampling, light[["estimator", "std", "exact_std", "z_var"]])
