"""``chunk`` never changes a byte, and a batch is drawn one piece at a time: every registered kind.

The piece size is shrunk to 1,000 draws here so that batches of 5,000 draws span several pieces (and
the categorical ``auto`` path switches between tokens and counts by batch size) at test speed.
"""
import math

import numpy as np
import pytest
import torch

import kl_bench
from kl_bench.api import prepare
from kl_bench.foundation.errors import SpecError
from kl_bench.sampling.logits import zipf_logits
from kl_bench.sampling import seeding
from kl_bench.engine.monte_carlo import WEIGHT_FEATURES, run_case
from kl_bench.kinds import CASE_KINDS, CategoricalPair
from kl_bench.kinds.categorical.sampler import CategoricalSampler
from kl_bench.kinds.rollout import sampler as rollout_sampler
from kl_bench.sampling.seeding import BatchStream, batch_generator, batch_streams, piece_sizes

from .conftest import CPU, mc_frame

ZIPF = {"logits": "zipf", "exponent": 1.1, "seed": 1}
NOISY = {"from": "q", "noise": 0.3, "seed": 2}
# One case per kind and path: name → (kind, case keys).
CASES = {
    "gauss-IS": ("gaussian", {"q": {"mean": 0.0, "std": 1.0}, "p": {"mean": 0.3, "std": 1.1},
                              "sampler": {"std_scale": 1.2, "weights": "token"}}),
    "gauss-2d": ("gaussian", {"q": {"mean": [0.0, 0.2], "std": [1.0, 0.9]},
                              "p": {"mean": [0.3, 0.0], "std": [1.1, 1.0]}}),
    "cat-auto": ("categorical", {"vocab": 3000, "q": ZIPF, "p": NOISY}),
    "cat-counts-ctx-top-p": ("categorical", {"vocab": 700, "sampling": "counts", "p": NOISY,
                                             "q": {**ZIPF, "contexts": 3}, "sampler": {"top_p": 0.9}}),
    # p(x) = 0 < q(x) on five tokens: k1 is +inf there (summed apart from the finite features).
    "cat-tokens-inf": ("categorical", {"vocab": 500, "sampling": "tokens", "q": ZIPF,
                                       "p": torch.cat([torch.full((5,), -math.inf), zipf_logits(495, 1.1, 2)[0]])}),
    "rollout": ("rollout", {"vocab": 200, "buckets": 4, "length": 6, "eos": 199, "q": ZIPF, "p": NOISY,
                            "sampler": {"behavior": {"from": "q", "noise": 0.1, "seed": 5}, "weights": "token"}}),
    # Token-mean rows: one value per 7 sequences, groups within each piece (1000 draws here: leftovers).
    "rollout-token-mean": ("rollout", {"vocab": 200, "buckets": 4, "length": 6, "eos": 199, "eos_prob": 0.2,
                                       "q": ZIPF, "p": NOISY, "per_sequence_mean": True, "token_mean_batch": 7}),
    # Logged per-token log-probs (a trainer's view): tensors [B, T] with a mask and kl_full.
    "logprobs": ("logprobs", {"logp_policy": -torch.rand(40, 5, generator=torch.Generator().manual_seed(1)) - 0.1,
                              "logp_ref": -torch.rand(40, 5, generator=torch.Generator().manual_seed(2)) - 0.1,
                              "mask": (torch.arange(5)[None] < torch.arange(40)[:, None] % 5 + 1).double(),
                              "kl_full": torch.rand(40, 5, generator=torch.Generator().manual_seed(3)) * 0.2}),
}
# Kinds that need transformers are covered by tests/test_model.py (chunk independence included).
NEEDS_HF = {"model"}
ROWS = ["k1", "k2", "k3", "abs", "fwd_k3", "full"]


def _spec(chunk: int, cases=CASES, draws=20_000, batches=4) -> dict:
    return {"spec_version": 1,
            "experiment": {"name": "chunks", "draws": draws, "seed": 7, "batches": batches, "chunk": chunk,
                           "device": "cpu", "estimators": ROWS, "lambdas": [0.5, "optimal"]},
            "case": [{"name": name, "kind": kind, **keys} for name, (kind, keys) in cases.items()]}


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setitem(seeding.PIECE_DRAWS, "cpu", 1000)


def test_every_registered_kind_is_covered():
    builtin = {name for name, k in CASE_KINDS.items() if k.pair.__module__.startswith("kl_bench.")}
    assert builtin <= {kind for kind, _ in CASES.values()} | NEEDS_HF


@pytest.mark.parametrize("case", CASES)
def test_chunk_never_changes_the_sums(case, small_pieces):
    prep = prepare(_spec(1 << 22, {case: CASES[case]}))
    pair = prep.pairs[0]
    # 5,000 draws in 4 batches: 1,250 a batch, two pieces of 1,000 and 250 (small_pieces), so that chunk 777
    # crosses a piece's end and the token-mean groups of 7 leave 6 and 5 over
    runs = [run_case(pair, ROWS, draws=5_000, seed=3, batches=4, chunk=chunk, device=CPU, joint=True)
            for chunk in (1, 777, 5_000, 1 << 22)]
    for other in runs[1:]:
        assert torch.equal(runs[0].sums, other.sums), case
    # per row 3 sums, per aggregate the 5 joint ones, and ΣW, ΣW² where a sampler is weighted
    assert runs[0].sums.shape == (4, 3 * len(runs[0].rows) + 5 * len(pair.aggregates)
                                  + WEIGHT_FEATURES * (pair.weights != "none"))


def test_summary_csv_is_byte_identical_for_any_chunk(small_pieces):
    """The whole experiment through the public API (pilot pass, λ*, reservoir included)."""
    texts = {chunk: kl_bench.run(_spec(chunk, draws=5_000)).summary.to_csv(index=False) for chunk in (1, 999, 1 << 22)}
    assert texts[1] == texts[999] == texts[1 << 22]


@pytest.mark.parametrize("case", CASES)
def test_no_call_draws_more_than_one_piece(case, small_pieces, monkeypatch):
    """Memory is bounded by a piece: wrap each kind's one drawing function and record its sizes."""
    prep = prepare(_spec(1 << 22, {case: CASES[case]}))
    pair = prep.pairs[0]
    seen: list[int] = []
    # The owner of each kind's drawing function: its pair class, the categorical kind's sampler class, or the
    # rollout kind's sampler module.
    cls = {"rollout": rollout_sampler, "categorical": CategoricalSampler}.get(pair.kind, type(pair))
    # (The categorical kind draws token ids one by one, or alias slots of several pieces at once to count them.)
    names = {"gaussian": ["sample"], "categorical": ["sample_ids", "sample_slots"], "rollout": ["simulate"],
             "logprobs": ["sample_draws"]}[pair.kind]

    def spy(orig):
        def drawn(self, n, *args, **kwargs):
            seen.append(sum(n) if isinstance(n, list) else n)
            return orig(self, n, *args, **kwargs)
        return drawn
    for name in names:
        monkeypatch.setattr(cls, name, spy(getattr(cls, name)))
    run_case(pair, ROWS, draws=40_000, seed=3, batches=2, chunk=1 << 22, device=CPU)
    piece = pair.piece_draws(CPU)
    if pair.kind == "categorical" and pair.sampler.uses_counts(20_000):
        assert seen == []                      # counts drawn directly: no per-draw memory at all
    else:
        assert seen and max(seen) <= piece and sum(seen) == 40_000, (max(seen), piece)


def test_pieces_are_seeded_by_batch_and_piece_alone():
    assert piece_sizes(2500, 1000) == [1000, 1000, 500] and piece_sizes(2000, 1000) == [1000, 1000]
    b = BatchStream(5, "case", 3, 2500, CPU)
    pieces = list(b.pieces(1000))
    assert [m for m, _ in pieces] == [1000, 1000, 500]
    # Piece 0 is the batch's own generator: a batch that fits in one piece draws what it always drew.
    first = torch.rand(4, generator=pieces[0][1], dtype=torch.float64)
    assert torch.equal(first, torch.rand(4, generator=batch_generator(5, "case", 3, CPU), dtype=torch.float64))
    draws = [torch.rand(3, generator=g, dtype=torch.float64) for _, g in b.pieces(1000)]
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    assert [s.index for s in batch_streams(5, "case", [3, 3], CPU)] == [0, 1]


def _small_pair(sampling: str) -> CategoricalPair:
    lq = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], dtype=torch.float64), -1)
    lp = torch.log_softmax(torch.tensor([[1.0, 1.5, 0.0, 0.2, -0.5, -2.0]], dtype=torch.float64), -1)
    return CategoricalPair("six", lq, lp, sampling=sampling)


@pytest.mark.parametrize("sampling", ["counts", "tokens"])
def test_count_vectors_are_multinomial(sampling):
    """Mean n·w and variance n·w(1 − w) of every id's count over 4,000 batches of 60 draws, each
    against its standard error (binomial fourth central moment for the variance)."""
    pair = _small_pair(sampling)
    n, k = 60, 4000
    w = pair.model.log_q.exp()[0].numpy()
    counts = np.zeros((k, 6))
    for s in batch_streams(11, "six", [n] * k, CPU):
        ids, c = pair.sampler.batch_counts(s, CPU)
        if ids is None:
            counts[s.index] = c.numpy()
        else:
            counts[s.index, ids.numpy()] = c.numpy()
    assert (counts.sum(1) == n).all()
    var = n * w * (1 - w)
    z_mean = (counts.mean(0) - n * w) / np.sqrt(var / k)
    mu4 = var * (1 + 3 * (n - 2) * w * (1 - w))
    z_var = (counts.var(0, ddof=1) - var) / np.sqrt((mu4 - var**2) / k)
    assert np.abs(z_mean).max() < 5 and np.abs(z_var).max() < 5, (z_mean, z_var)


@pytest.mark.parametrize("sampling", ["counts", "tokens"])
def test_both_paths_match_the_exact_moments(sampling):
    lq = torch.log_softmax(zipf_logits(2000, 1.1, 1, 4), -1)
    g = torch.Generator().manual_seed(101)
    lp = torch.log_softmax(lq + 0.4 * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    df = mc_frame(CategoricalPair("c", lq, lp, sampling=sampling), ROWS, draws=400_000, seed=5, batches=200)
    assert (df["z"].abs() < 5).all(), df[["estimator", "z"]]
    assert (df["z_var"].abs() < 5).all(), df[["estimator", "z_var"]]
    assert math.isfinite(df["se"].sum())


def test_sampling_key_is_checked(tmp_path):
    spec = _spec(1 << 22, {"c": ("categorical", {"vocab": 10, "q": ZIPF, "p": NOISY, "sampling": "count"})})
    with pytest.raises(SpecError, match="sampling.*auto, counts, tokens"):
        prepare(spec)
