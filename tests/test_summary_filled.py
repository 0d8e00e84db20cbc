"""Every column of summary.csv's schema (kl_bench.results.schema.SCHEMA) is filled by a fresh run of each kind, unless
the allow-list below says why that kind leaves it blank (issue 41): a column added to the schema that no code
fills fails here, without this file being edited. One small run: an on-policy case and a case drawn from a
sampler b ≠ q with importance weights per kind (the columns of a sampler, and the cv(λ) columns, which need
x ~ q, need both), and a trainer's log (kind logprobs: the Monte Carlo reference columns)."""
import pandas as pd
import pytest
import torch

import kl_bench
from kl_bench.results.schema import COLUMNS, TEXT_COLUMNS

from .conftest import logged_logprobs

ON_POLICY = {
    # p's std 1.5 > √2·q's: k3's variance is infinite (heavy_tail is filled)
    "gaussian": {"q": {"mean": 0.0, "std": 1.0}, "p": {"mean": 0.3, "std": 1.5}},
    "categorical": {"vocab": 50, "q": {"logits": "zipf", "exponent": 1.1, "seed": 1},
                    "p": {"from": "q", "noise": 0.3, "seed": 2}},
    "rollout": {"vocab": 20, "buckets": 3, "length": 4, "eos": 19, "q": {"logits": "zipf", "exponent": 1.1, "seed": 1},
                "p": {"from": "q", "noise": 0.2, "seed": 2}},
}
SAMPLER = {
    "gaussian": {"std_scale": 1.3, "weights": "token"},
    "categorical": {"top_k": 40, "weights": "token"},          # b misses q's support: support_miss > 0
    "rollout": {"min_length": 2, "behavior": {"from": "q", "noise": 0.1, "seed": 5}, "weights": "token"},
}

# Columns a kind leaves blank in every row, and why. Every other column must be filled in at least one of its rows.
REFERENCE = {"ref_kl", "ref_se", "ref_diff", "ref_diff_se", "z_ref"}
BLANK = {
    # single draws: no rollout aggregate (seq, tok, ...); an exact truth, so no Monte Carlo reference
    "gaussian": {"aggregate"} | REFERENCE,
    "categorical": {"aggregate"} | REFERENCE,
    # an exact truth (the dynamic program): no Monte Carlo reference
    "rollout": REFERENCE,
    # a trainer's log has no exact truth: what is measured against it is empty (its rows are measured against
    # ref_kl, the Rao–Blackwellised row's mean; exact_mean is the mean over the log), and so is the planning
    # built on it; the log is its own sampler (no b, no weights); heavy_tail: every moment over a finite log is
    # finite, and this log's kurtosis is far below the draws
    "logprobs": {"true_kl", "bias", "rel_bias", "rel_std", "exact_rel_bias", "exact_rel_std", "n_for_10pct",
                 "rmse_b64", "rmse_b1024", "rmse_b16384", "sampler", "ess", "heavy_tail"},
}


def _blank(column: pd.Series, text: bool) -> bool:
    return bool((column.fillna("") == "").all()) if text else bool(pd.to_numeric(column, errors="coerce").isna().all())


@pytest.fixture(scope="module")
def summary(tmp_path_factory) -> pd.DataFrame:
    log = tmp_path_factory.mktemp("log") / "log.pt"
    torch.save(logged_logprobs(64, 8), log)
    cases = []
    for kind, keys in ON_POLICY.items():
        cases += [{"name": kind, "kind": kind, **keys}, {"name": f"{kind}-b", "kind": kind, **keys, "sampler": SAMPLER[kind]}]
    cases.append({"name": "log", "kind": "logprobs", "file": str(log)})
    spec = {"spec_version": 1, "case": cases,
            "experiment": {"name": "filled", "draws": 20_000, "batches": 20, "device": "cpu", "seed": 0,
                           "estimators": ["k1", "k2", "k3", "abs", "fwd_k1", "fwd_k3", "full"],
                           "lambdas": [0.5, "optimal"]}}
    return kl_bench.run(spec).summary


@pytest.mark.parametrize("kind", [*ON_POLICY, "logprobs"])
def test_every_summary_column_is_filled_by_a_run_of_each_kind(summary, kind):
    rows = summary[summary["kind"] == kind]
    assert len(rows) and list(summary.columns) == COLUMNS
    blank = {c for c in COLUMNS if _blank(rows[c], c in TEXT_COLUMNS)}
    assert blank - BLANK[kind] == set(), f"{kind}: columns no row fills (fill them, or say why in BLANK)"
    # the allow-list stays true: a column it excuses is blank (else take it off the list)
    assert BLANK[kind] - blank == set(), f"{kind}: columns BLANK excuses that are filled"
    assert BLANK[kind] <= set(COLUMNS)


# Registered kinds not run here, and why.
NOT_RUN = {"model": "needs the hf extra and model folders; tests/test_model.py checks its summary"}


def test_every_registered_kind_is_run_here_or_excused():
    """A new kind is either run above (a case in ON_POLICY and its BLANK entry) or excused in NOT_RUN."""
    from kl_bench.kinds.protocols import CASE_KINDS
    assert set(CASE_KINDS.names()) == set(BLANK) | set(NOT_RUN)
    assert not set(BLANK) & set(NOT_RUN)


def test_the_check_can_fail(summary):
    """A column of the schema that no code fills is found blank for every kind."""
    filled = summary.assign(new_column=float("nan"), new_text="")
    for kind in BLANK:
        rows = filled[filled["kind"] == kind]
        assert _blank(rows["new_column"], False) and _blank(rows["new_text"], True)
        assert not _blank(rows["estimator"], True) and not _blank(rows["mean"], False)
