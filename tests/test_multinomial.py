"""The device multinomial (kl_bench/sampling/multinomial.py), tested on the CPU: the float64 helpers against exact
arithmetic, every binomial regime's law against the binomial mass function (chi-square on quantile bins,
|z| < 5), the count vectors' law against the multinomial (every outcome of a small case enumerated; means
and covariances at n = 10^12 and 2^62 against their standard errors), zero-probability outcomes never
drawn, exact int64 sums up to n = 2^62, and a batch's counts independent of the batches drawn with it.
The categorical kind's count path runs through the tree on the CPU too (where it normally takes numpy).
CUDA tests at the end skip without a GPU."""
import math
from fractions import Fraction
from itertools import product

import numpy as np
import pytest
import torch
from scipy import stats

from .bench_tools import launches
from kl_bench.sampling import multinomial as mn
from kl_bench.engine.monte_carlo import run_case
from kl_bench.sampling.logits import zipf_logits
from kl_bench.kinds import CategoricalPair
from kl_bench.kinds.categorical import sampler as categorical   # where the count vectors are drawn
from kl_bench.results import to_frame
from kl_bench.experiment.rows import summarize
from kl_bench.sampling.seeding import BatchStream, batch_streams

from .conftest import mc_frame

count_ops = launches.count_ops   # benchmarks/launches.py

CPU = torch.device("cpu")
Z = 5.0                                       # every statistical check: |z| < 5 at a fixed seed


def chi2_z(observed: np.ndarray, expected: np.ndarray) -> float:
    """The chi-square statistic of ``observed`` against ``expected`` counts as a one-sided normal z."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    return float(stats.norm.isf(stats.chi2.sf(stat, len(observed) - 1)))


def rows(count: int, width: int = mn.SLOTS, seed: int = 0) -> tuple[torch.Tensor, object, list]:
    """``count`` rows of uniforms and a ``more`` that draws fresh rows from the same generator (recording
    how many rows it gave)."""
    g = torch.Generator().manual_seed(seed)
    given: list[int] = []

    def more(positions: torch.Tensor) -> torch.Tensor:
        given.append(positions.shape[0])
        return torch.rand(positions.shape[0], width, generator=g, dtype=torch.float64)
    return torch.rand(count, width, generator=g, dtype=torch.float64), more, given


def binomials(n: int, p: float, count: int, width: int = mn.SLOTS, seed: int = 0) -> tuple[np.ndarray, list]:
    slots, more, given = rows(count, width, seed)
    x = mn.binomial(torch.full((count,), n, dtype=torch.int64), torch.full((count,), p, dtype=torch.float64),
                    slots, more)
    return x.numpy(), given


def quantile_bins_z(x: np.ndarray, cdf, edges: np.ndarray) -> float:
    """Chi-square z of the draws ``x`` in the bins (edges[i], edges[i + 1]] against the law's ``cdf``."""
    observed = np.histogram(x, bins=np.concatenate([[-np.inf], edges + 0.5, [np.inf]]))[0]
    probs = np.diff(np.concatenate([[0.0], cdf(edges), [1.0]]))
    return chi2_z(observed, len(x) * probs)


# ----------------------------------------------------------------------------- float64 helpers
def test_exact_product_splits_n_times_p_exactly():
    g = torch.Generator().manual_seed(3)
    n = torch.randint(0, 1 << 62, (400,), generator=g)
    n[:6] = torch.tensor([0, 1, 1 << 62, (1 << 53) + 1, (1 << 62) - 1, 12345])
    p = torch.rand(400, generator=g, dtype=torch.float64)
    p[:9] = torch.tensor([0.0, 1.0, 0.5, 1e-300, 2.0**-42, 2.0**-21, 1 - 2.0**-53, 5e-324, 0.1], dtype=torch.float64)
    whole, frac = mn.exact_product(n, p)
    assert bool(((frac >= 0) & (frac < 1)).all())
    for a, b, c, d in zip(n.tolist(), p.tolist(), whole.tolist(), frac.tolist()):
        exact = Fraction(a) * Fraction(b)
        assert c == math.floor(exact), (a, b)                 # the integer part exact
        assert abs(float(exact - c) - d) < 2.0**-30, (a, b)   # the fraction within the stated 2^-33 (and then some)


def test_float_helpers_against_high_precision():
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 50
    k = torch.tensor([0, 1, 5, 9, 10, 19, 20, 21, 63, 64, 1000, 10**9, 1 << 62])
    exact = [mp.loggamma(j + 1) - ((j + mp.mpf(0.5)) * mp.log(j + 1) - (j + 1) + mp.log(2 * mp.pi) / 2)
             for j in k.tolist()]
    assert float((mn.stirling_tail(k) - torch.tensor([float(e) for e in exact], dtype=torch.float64)).abs().max()) < 1e-14
    x = torch.tensor([1e-12, -1e-9, 1e-3, 0.0099, -0.0099, 0.0101, -0.3, 0.5, -0.99, 40.0], dtype=torch.float64)
    exact = torch.tensor([float((1 + mp.mpf(v)) * mp.log1p(mp.mpf(v)) - mp.mpf(v)) for v in x.tolist()], dtype=torch.float64)
    assert float(((mn.log1p_excess(x) - exact) / exact).abs().max()) < 1e-13


@pytest.mark.parametrize("n,p", [(20, 0.5), (10**6, 0.3), ((1 << 40) + 17, 0.2), ((1 << 53) + 1, 0.5),
                                 (1 << 62, 0.123456789), ((1 << 62) - 1, 1e-10)])
def test_log_ratio_is_the_binomial_mass_function_without_cancellation(n, p):
    """log f(k)/f(m) against 50-digit arithmetic from −6 to +8 standard deviations: within 1e-11 up to
    n = 2^62 (the textbook form, (n + 1)·log((n − m + 1)/(n − k + 1)) and friends, is off by ~n·2^-53)."""
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 60
    state = mn._Btrs.of(torch.tensor([n]), torch.tensor([p], dtype=torch.float64))
    m = int(state.mode)
    assert m == math.floor((n + 1) * Fraction(p))                         # the mode, exactly

    def logf(j):
        return -mp.loggamma(j + 1) - mp.loggamma(n - j + 1) + j * mp.log(mp.mpf(p)) + (n - j) * mp.log(1 - mp.mpf(p))
    sd = math.sqrt(n * p * (1 - p))
    for dk in (-6, -3, -1, -0.1, 0.3, 1, 2, 4, 8):
        k = min(max(m + int(dk * sd), 0), n)
        got = float(state.log_ratio(torch.tensor([[k]]))[0, 0])
        assert abs(got - float(logf(k) - logf(m))) < 1e-11, (k, got)


# ----------------------------------------------------------------------------- binomial law
REGIMES = [(5, 0.3), (1000, 0.004), (100, 0.0999), (101, 0.1), (20, 0.5), (37, 0.27), (10**6, 0.3),
           ((1 << 40) + 3, 0.2), (1 << 62, 1e-17)]


@pytest.mark.parametrize("n,p", REGIMES, ids=[f"n{n}-p{p}" for n, p in REGIMES])
def test_binomial_law(n, p):
    """40 quantile bins of the exact binomial CDF (scipy), 100,000 draws: chi-square |z| < 5, mean |z| < 5.
    Inversion (n·p < 10), BTRS (n·p ≥ 10) and the switch between them (9.99 and 10.1)."""
    x, _ = binomials(n, p, 100_000, seed=n % 1000)
    law = stats.binom(n, p)
    edges = np.unique(law.ppf(np.linspace(0, 1, 41)[1:-1]))
    assert quantile_bins_z(x, law.cdf, edges) < Z
    assert abs((x.mean() - n * p) / math.sqrt(n * p * (1 - p) / len(x))) < Z
    assert x.min() >= 0 and x.max() <= n


def test_rejected_nodes_draw_fresh_rows_and_keep_the_law():
    """Rows of one attempt each: most BTRS nodes need fresh rows from ``more`` (their batch's generator),
    some several times; the law is unchanged."""
    n, p = 60, 0.4
    x, given = binomials(n, p, 50_000, width=2, seed=9)
    assert len(given) >= 3 and given[0] > 5_000, given
    law = stats.binom(n, p)
    edges = np.unique(law.ppf(np.linspace(0, 1, 31)[1:-1]))
    assert quantile_bins_z(x, law.cdf, edges) < Z


@pytest.mark.parametrize("block", [1, 3])
@pytest.mark.parametrize("n,p", [(5, 0.3), (100, 0.0999), (1 << 62, 2e-18)])
def test_inversion_blocks_keep_the_law(block, n, p, monkeypatch):
    """The inversion tries INVERSION_BLOCK values of k at a time and carries the rows still searching into
    the next block: with blocks of 1 and 3 values most rows cross several blocks (a mean near 10 crosses
    4 blocks of 3), and the law is the binomial's (chi-square on quantile bins, mean |z| < 5); n = 5 stops
    at k = n inside a block."""
    monkeypatch.setattr(mn, "INVERSION_BLOCK", block)
    g = torch.Generator().manual_seed(block)
    u = torch.rand(60_000, generator=g, dtype=torch.float64)
    x = mn.binomial_inversion(torch.full((60_000,), n), torch.full((60_000,), p, dtype=torch.float64), u).numpy()
    law = stats.binom(n, p)
    edges = np.unique(law.ppf(np.linspace(0, 1, 31)[1:-1]))
    assert quantile_bins_z(x, law.cdf, edges) < Z
    assert abs((x.mean() - n * p) / math.sqrt(n * p * (1 - p) / len(x))) < Z
    assert x.min() >= 0 and x.max() <= n


@pytest.mark.parametrize("n", [1 << 62, (1 << 62) - 1, (1 << 53) + 1])
def test_binomial_at_huge_n_is_exact_integers(n):
    """A float64 n·p has an ulp of 512 near 2^61: a sampler that rounds there returns multiples of it. The
    low bits of these draws are uniform (k mod 1024, chi-square), the law matches its normal limit on 30
    bins (its error at σ = 2^30 is ~1e-9, far below what 60,000 draws see), and the mean and variance
    match n·p and n·p(1 − p)."""
    p = 0.3
    x, _ = binomials(n, p, 60_000, seed=5)
    exact = [int(v) for v in x]
    mean, sd = Fraction(n) * Fraction(p), math.sqrt(n * p * (1 - p))
    dev = np.array([float(k - mean) for k in exact])            # exact integers minus the exact mean
    residues = np.bincount(np.array([k % 1024 for k in exact]), minlength=1024)
    assert chi2_z(residues, np.full(1024, len(exact) / 1024)) < Z
    z = dev / sd
    edges = stats.norm.ppf(np.linspace(0, 1, 31)[1:-1])
    observed = np.histogram(z, bins=np.concatenate([[-np.inf], edges, [np.inf]]))[0]
    assert chi2_z(observed, np.full(30, len(z) / 30)) < Z
    assert abs(z.mean() * math.sqrt(len(z))) < Z
    assert abs((z.var() - 1) / math.sqrt(2 / len(z))) < Z


# ----------------------------------------------------------------------------- count vectors
def streams(count: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(count)]


def test_small_multinomial_enumerated():
    """Every one of the 84 count vectors of n = 6 over 4 outcomes (one of probability 0) against its exact
    multinomial probability, 20,000 vectors: chi-square |z| < 5; the zero outcome never drawn."""
    w = torch.tensor([0.1, 0.0, 0.5, 0.4], dtype=torch.float64)
    n, k = 6, 20_000
    counts = mn.draw_counts(mn.MultinomialTree.of(w), [n] * k, streams(k, 1)).numpy()
    assert (counts.sum(1) == n).all() and (counts[:, 1] == 0).all()
    support = [c for c in product(range(n + 1), repeat=3) if sum(c) == n]       # outcomes 0, 2, 3
    index = {c: i for i, c in enumerate(support)}
    observed = np.bincount([index[(a, c, d)] for a, _, c, d in counts], minlength=len(support))
    probs = np.array([math.factorial(n) / (math.factorial(a) * math.factorial(c) * math.factorial(d))
                      * 0.1**a * 0.5**c * 0.4**d for a, c, d in support])
    assert len(support) == 28 and abs(probs.sum() - 1) < 1e-12
    assert chi2_z(observed, k * probs) < Z


@pytest.mark.parametrize("n", [10**12, 1 << 62])
def test_moments_at_large_n(n):
    """3,000 vectors over 9 outcomes (Zipf-like, one of mass 1e-13, one of mass 0): each mean against n·w,
    each covariance against n(diag w − w wᵀ), both by their standard errors; sums exactly n, the zero
    outcome never drawn. Deviations are taken from the exact mean in integers before going to float64."""
    w = [0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05 - 1e-13, 1e-13, 0.0]
    tree = mn.MultinomialTree.of(torch.tensor(w, dtype=torch.float64))
    k = 3000
    counts = mn.draw_counts(tree, [n] * k, streams(k, 2))
    assert bool((counts.sum(1) == n).all()) and bool((counts[:, 8] == 0).all()) and bool((counts >= 0).all())
    # the tree's own split probabilities give the law it draws (w up to rounding in the last bits)
    mean = [Fraction(n) * Fraction(x) / Fraction(sum(Fraction(y) for y in w)) for x in w]
    whole = torch.tensor([math.floor(m) for m in mean], dtype=torch.int64)
    dev = (counts - whole).to(torch.float64).numpy() - np.array([float(m - math.floor(m)) for m in mean])
    wf = np.array(w) / sum(w)
    cov = n * (np.diag(wf) - np.outer(wf, wf))
    live = [i for i in range(8) if wf[i] * n > 50]              # outcomes with a spread worth a z
    for i in range(8):
        assert abs(dev[:, i].mean() / math.sqrt(cov[i, i] / k)) < Z, i
    for i in live:
        for j in live:
            prod_ij = dev[:, i] * dev[:, j]
            assert abs((prod_ij.mean() - cov[i, j]) / (prod_ij.std(ddof=1) / math.sqrt(k))) < Z, (i, j)


def test_a_batch_draws_the_same_alone_or_with_others():
    """All batches in one call, or each alone, or in another grouping: the same counts (each from its own
    generator; the tree's operations are elementwise, and its integer outputs flip only if a float64
    comparison lands within an ulp)."""
    w = torch.softmax(zipf_logits(3000, 1.1, 1, 7)[0], -1)
    tree = mn.MultinomialTree.of(w)
    sizes = [0, 1, 50, 2999, 3000, 10**6, 10**9, 1 << 62]
    together = mn.draw_counts(tree, sizes, streams(len(sizes), 4))
    alone = torch.cat([mn.draw_counts(tree, [s], [g]) for s, g in zip(sizes, streams(len(sizes), 4))])
    pairs = torch.cat([mn.draw_counts(tree, sizes[i:i + 3], streams(len(sizes), 4)[i:i + 3]) for i in range(0, 8, 3)])
    assert torch.equal(together, alone) and torch.equal(together, pairs)
    assert together.sum(1).tolist() == sizes
    assert not torch.equal(together[5], mn.draw_counts(tree, [10**6], streams(6, 5)[5:])[0])   # seeds matter


def test_launches_per_call_do_not_grow_with_the_batches(monkeypatch):
    """On a GPU each operation is about one kernel launch, and the tree was launch-bound on an H100 (issue 33: one
    uniform call per batch and level, ~10 operations per inversion step). A call's operations (counted at
    the dispatcher, benchmarks/launches.py) grow by the batches' own uniform calls only, and a
    level costs a bounded number of them whatever n: measured here, the same on any device. (Rows of 20
    attempts, so that no node of these sizes needs the rare fresh rows, whose rounds cost a level's
    attempt again: about one node in 10^6 with the default 12.)"""
    monkeypatch.setattr(mn, "ATTEMPTS", 20)
    monkeypatch.setattr(mn, "SLOTS", 40)
    w = torch.softmax(zipf_logits(3000, 1.1, 1, 7)[0], -1)
    tree = mn.MultinomialTree.of(w)
    levels = len(tree.levels)

    def ops(batches: int, n: int):
        return count_ops(lambda: mn.draw_counts(tree, [n] * batches, streams(batches, 2)))[1]
    few_ops, many_ops = ops(40, 10**7), ops(80, 10**7)   # both with rejected BTRS nodes at every level
    few, many = sum(few_ops.values()), sum(many_ops.values())
    # 2 operations per batch and group of levels (a view and its uniform call; 3 groups of at most the
    # widest level's 1,500 nodes: 752, 750 and 1,500), not per batch and level (the code before: 960 here);
    # 150 of slack for a data-dependent pass (a level where only the larger call has a rejected node)
    assert many - few <= 2 * 3 * 40 + 150, (few, many)
    assert few <= 500 * levels, few            # the BTRS regime at every level: ~440 operations a level
    # ... of which ~360 make a kernel (BTRS's constants in two matrices: two gathers to keep a node, not 13)
    assert few_ops.launching <= 400 * levels, few_ops.launching
    assert sum(ops(40, 10**3).values()) <= 500 * levels   # the inversion regime too: a few blocks a level


@pytest.mark.parametrize("slots", [2, 4])
def test_fresh_rows_come_from_the_batchs_own_generator(slots, monkeypatch):
    """With rows of one or two attempts most BTRS nodes need fresh rows: a batch still draws the same alone or
    with others (its fresh rows come from its own generator), and the law holds (the enumerated case)."""
    monkeypatch.setattr(mn, "SLOTS", slots)
    w = torch.softmax(zipf_logits(500, 1.1, 1, 9)[0], -1)
    tree = mn.MultinomialTree.of(w)
    sizes = [10**4, 10**6, 10**9, 1 << 62]
    together = mn.draw_counts(tree, sizes, streams(4, 6))
    alone = torch.cat([mn.draw_counts(tree, [s], [g]) for s, g in zip(sizes, streams(4, 6))])
    assert torch.equal(together, alone) and together.sum(1).tolist() == sizes
    test_small_multinomial_enumerated()


def test_bad_input_is_refused():
    tree = mn.MultinomialTree.of(torch.tensor([0.5, 0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="2\\^62"):
        mn.draw_counts(tree, [(1 << 62) + 1], streams(1))
    with pytest.raises(ValueError, match="one generator"):
        mn.draw_counts(tree, [1, 2], streams(1))
    for bad in ([0.5, -0.1], [0.0, 0.0], [math.nan, 1.0], []):
        with pytest.raises(ValueError, match="non-negative"):
            mn.MultinomialTree.of(torch.tensor(bad, dtype=torch.float64))
    one = mn.MultinomialTree.of(torch.tensor([2.0], dtype=torch.float64))
    assert one.levels == () and one.device == CPU          # no levels: the device is the weights' own
    assert mn.draw_counts(one, [7, 0], streams(2)).tolist() == [[7], [0]]
    assert mn.batches_per_call(50257) == 222 and mn.batches_per_call(10**9) == 1 and mn.batches_per_call(2) == mn.CALL_BATCHES
    assert mn.batches_per_call(50257, 1 << 32) == 111                     # a smaller budget: fewer batches a call
    assert mn.call_bytes(CPU) == mn.CALL_BYTES


# ----------------------------------------------------------------------------- the categorical kind
@pytest.fixture
def tree_on_cpu(monkeypatch):
    """Count vectors from the torch tree on the CPU (which normally takes numpy's)."""
    monkeypatch.setattr(categorical, "COUNTS_ON_HOST", set())


def _pair(vocab: int = 2000) -> CategoricalPair:
    lq = torch.log_softmax(zipf_logits(vocab, 1.1, 1, 4), -1)
    g = torch.Generator().manual_seed(101)
    lp = torch.log_softmax(lq + 0.4 * torch.randn(lq.shape, generator=g, dtype=torch.float64), -1)
    return CategoricalPair("c", lq, lp, sampling="counts")


def test_the_cpu_keeps_numpys_count_vectors():
    """On the CPU the count vectors are numpy's, exactly as before the tree existed (results/ stay put)."""
    pair = _pair()
    b = BatchStream(3, "c", 7, 123_456, CPU)
    ids, counts = pair.sampler.batch_counts(b, CPU)
    want = b.numpy_generator().multinomial(123_456, pair.model.pvals)
    assert ids is None and np.array_equal(counts.numpy(), want.astype(np.float64))


def test_categorical_counts_through_the_tree_match_exact(tree_on_cpu):
    df = mc_frame(_pair(), ["k1", "k2", "k3", "abs", "fwd_k3", "full"], draws=400_000, seed=5, batches=200)
    assert (df["z"].abs() < Z).all(), df[["estimator", "z"]]
    assert (df["z_var"].abs() < Z).all(), df[["estimator", "z_var"]]


def test_categorical_counts_through_the_tree_ignore_the_chunk(tree_on_cpu):
    pair = _pair()
    runs = [run_case(pair, ["k1", "k3"], draws=200_000, seed=3, batches=20, chunk=chunk, device=CPU, joint=True)
            for chunk in (1, 25_000, 1 << 22)]
    assert all(torch.equal(runs[0].sums, r.sums) for r in runs[1:])
    assert pair.batches_per_chunk(10_000, 1) == mn.batches_per_call(pair.model.support.shape[0])   # count vectors: by memory
    pair.sampler.sampling = "tokens"
    assert pair.batches_per_chunk(100, 1000) == 10                              # tokens: by draws


def test_a_smaller_devices_budget_splits_calls_not_counts(tree_on_cpu, monkeypatch):
    """A GPU with little memory draws a chunk's count vectors in more, smaller calls (multinomial.call_bytes):
    the same bytes."""
    pair = _pair()
    whole = run_case(pair, ["k1", "k3"], draws=200_000, seed=3, batches=20, chunk=1 << 22, device=CPU, joint=True)
    calls: list[int] = []
    orig = categorical.draw_counts
    monkeypatch.setattr(categorical, "draw_counts", lambda t, sizes, g: calls.append(len(sizes)) or orig(t, sizes, g))
    widest = (pair.model.support.shape[0] + 1) // 2                                   # nodes of the widest level
    monkeypatch.setattr(categorical, "call_bytes", lambda device: 3 * mn.NODE_BYTES * widest)   # 3 batches a call
    split = run_case(pair, ["k1", "k3"], draws=200_000, seed=3, batches=20, chunk=1 << 22, device=CPU, joint=True)
    assert max(calls) == 3 and sum(calls) == 20 and torch.equal(whole.sums, split.sums)


def test_count_vectors_of_a_chunk_are_multinomial(tree_on_cpu):
    """Means and variances of every id's count over 3,000 batches of 60 draws (the tree's inversion
    regime), against n·w and n·w(1 − w) by their standard errors."""
    lq = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], dtype=torch.float64), -1)
    pair = CategoricalPair("six", lq, lq, sampling="counts")
    n, k = 60, 3000
    counts = torch.stack([c for _, c in pair.sampler.count_vectors(batch_streams(11, "six", [n] * k, CPU), CPU)]).numpy()
    w = lq.exp()[0].numpy()
    assert (counts.sum(1) == n).all()
    var = n * w * (1 - w)
    mu4 = var * (1 + 3 * (n - 2) * w * (1 - w))
    assert np.abs((counts.mean(0) - n * w) / np.sqrt(var / k)).max() < Z
    assert np.abs((counts.var(0, ddof=1) - var) / np.sqrt((mu4 - var**2) / k)).max() < Z


def test_token_pieces_of_several_general_pieces(monkeypatch):
    """A CUDA run draws token ids in pieces of 16 general pieces (seeding.TOKEN_PIECES): the same mechanism
    on the CPU, with pieces of 1,000 and token pieces of 4,000, draws at most 4,000 ids a call and the same
    bytes whatever the chunk; the CPU's own factor stays 1 (its bytes unchanged)."""
    from kl_bench.sampling import seeding
    assert seeding.TOKEN_PIECES["cpu"] == 1 and seeding.token_piece_draws(CPU) == seeding.piece_draws(CPU)
    monkeypatch.setitem(seeding.PIECE_DRAWS, "cpu", 1000)
    monkeypatch.setitem(seeding.TOKEN_PIECES, "cpu", 4)
    pair = _pair()
    pair.sampler.sampling = "tokens"
    seen: list[int] = []
    orig = categorical.CategoricalSampler.sample_slots
    monkeypatch.setattr(categorical.CategoricalSampler, "sample_slots", lambda self, n, g, *a: seen.append(sum(n)) or orig(self, n, g, *a))
    runs = [run_case(pair, ["k1", "k3"], draws=90_000, seed=3, batches=6, chunk=chunk, device=CPU, joint=True)
            for chunk in (1, 20_000, 1 << 22)]
    assert all(torch.equal(runs[0].sums, r.sums) for r in runs[1:])
    assert max(seen) == 4000 and sum(seen) == 3 * 90_000 and pair.piece_draws(CPU) == 4000


# ----------------------------------------------------------------------------- on a GPU
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
def test_gpu_count_vectors_moments_and_grouping():
    dev = torch.device("cuda")
    w = torch.softmax(zipf_logits(50257, 1.1, 1)[0], -1).to(dev)
    tree = mn.MultinomialTree.of(w)
    k, n = 400, 10**9
    gens = [torch.Generator(device=dev).manual_seed(i) for i in range(k)]
    counts = mn.draw_counts(tree, [n] * k, gens)
    assert counts.device.type == "cuda" and bool((counts.sum(1) == n).all())
    one = mn.MultinomialTree.of(torch.ones(1, dtype=torch.float64, device=dev))
    assert mn.draw_counts(one, [5], gens[:1]).device.type == "cuda"
    alone = mn.draw_counts(tree, [n], [torch.Generator(device=dev).manual_seed(7)])
    assert torch.equal(alone[0], counts[7])
    wc = w.double().cpu().numpy()
    top = np.argsort(-wc)[:50]
    dev_ = counts[:, top].double().cpu().numpy() - n * wc[top]
    assert np.abs(dev_.mean(0) / np.sqrt(n * wc[top] * (1 - wc[top]) / k)).max() < Z


@cuda
def test_gpu_categorical_counts_ignore_the_chunk_and_match_exact():
    dev = torch.device("cuda")
    pair = _pair()
    runs = [run_case(pair, ["k1", "k3"], draws=200_000, seed=3, batches=20, chunk=chunk, device=dev, joint=True)
            for chunk in (1, 1 << 22)]
    assert torch.equal(runs[0].sums, runs[1].sums)
    df = to_frame(summarize(run_case(pair, ["k1", "k2", "k3"], draws=400_000, seed=5, batches=200, chunk=1 << 22,
                                     device=dev)))
    assert (df["z"].abs() < Z).all(), df[["estimator", "z"]]


def test_token_counts_by_alias_slot_equal_the_tokens_counted_one_by_one(monkeypatch):
    """The token path counts alias slots of several batches' pieces at once (issue 33): each batch's counts
    are the bincount of the very tokens sample_ids draws from its pieces' generators, integer for integer,
    for batches that share a round, span rounds or fill one alone."""
    from kl_bench.sampling import seeding
    from kl_bench.sampling.seeding import batch_streams
    monkeypatch.setitem(seeding.PIECE_DRAWS, "cpu", 1000)
    pair = _pair()
    m = pair.model.support.shape[0]
    for sizes in ([300, 450, 250, 999], [2500, 10, 1000, 1], [1000] * 3):
        streams = batch_streams(5, "slots", sizes, CPU)
        got = pair.sampler.token_counts(streams, CPU)
        for b, counts in zip(streams, got):
            ids = torch.cat([pair.sampler.sample_ids(k, g, CPU) for k, g in b.pieces(1000)])
            assert torch.equal(counts, torch.bincount(ids, minlength=m).double()), (sizes, b.index)
    # Slots come as int32 wherever the round's bins fit in one (all of the above), else int64: the same slots.
    gens = lambda: [torch.Generator().manual_seed(s) for s in (1, 2)]                       # noqa: E731
    wide, narrow = (pair.sampler.sample_slots([700, 300], gens(), CPU, dt) for dt in (torch.int64, torch.int32))
    assert wide.dtype == torch.int64 and narrow.dtype == torch.int32 and torch.equal(wide, narrow.long())
