"""Liu et al. (arXiv 2510.01555): k3 used as a loss has a relative error ≈ √KL at small KL. Its expected
gradient E_q[(1 − r)∇log q] is ∇KL(p‖q), which differs from ∇KL(q‖p) at second order in log r, so
|E[g] − ∇KL(q‖p)| / |∇KL(q‖p)| scales as KL^(1/2). Checked on experiments/papers_liu.toml's cases."""
import math

import numpy as np

from kl_bench.experiment import gradient_rows as G
from kl_bench.core.estimators import ESTIMATORS
from kl_bench.core.modes import GradItem
from kl_bench.kinds import CategoricalPair
from kl_bench.experiment.spec import load_spec
from kl_bench.core.targets import FORWARD, REVERSE

from .conftest import CPU


def _pairs():
    spec = load_spec("experiments/papers_liu.toml")
    return [CategoricalPair.from_config(c) for c in spec.cases]


def _relerr(pair) -> float:
    refs = pair.gradient_references()
    g = pair.gradient_exact(GradItem.of(ESTIMATORS["k3"], "loss"), {}).mean
    assert np.linalg.norm(g - refs[FORWARD]) <= 1e-12 * np.linalg.norm(refs[FORWARD])    # it is ∇KL(p‖q)
    return float(np.linalg.norm(g - refs[REVERSE]) / np.linalg.norm(refs[REVERSE]))


def test_k3_as_a_loss_has_relative_error_of_order_sqrt_kl():
    pairs = _pairs()
    kl = np.array([p.kl() for p in pairs])
    err = np.array([_relerr(p) for p in pairs])
    assert (np.diff(kl) < 0).all()                        # the cases go down in KL, ≈ 4× per step
    slopes = np.diff(np.log(err)) / np.diff(np.log(kl))
    # Exponent 1/2, up to the next order in the noise scale (≈ 4% at the largest KL here, 0.1% at the smallest).
    assert np.abs(slopes - 0.5).max() < 0.03 and abs(slopes[-1] - 0.5) < 0.005, slopes
    ratio = err / np.sqrt(kl)
    assert 0.1 < ratio[-1] < 10, ratio                      # "≈ √KL": a constant of order one


def test_the_measured_relative_error_agrees_with_the_exact_one():
    pair = _pairs()[-1]
    rows = G.gradient_rows(pair, [ESTIMATORS["k3"]], draws=5_000, seed=0, batches=20, device=CPU)
    row = next(r for r in rows if r["mode"] == "loss")
    assert row["equals"] == "forward"
    assert abs(row["z_reverse"]) < 5 and abs(row["z_forward"]) < 5
    assert math.isclose(row["exact_relerr_reverse"], _relerr(pair), rel_tol=1e-12)
