"""Flat rows under top-p in two passes (kl_bench.audit.nucleus): a nucleus larger than the candidates is
bracketed by a mass histogram in the first pass and summed, with τ found among the bracket's tokens, in
the second; the values equal the dense float64 sums (to rounding with float64 tiles, to float32 rounding
with float32 tiles), and rows the bracket cannot serve are widened as before."""
import pytest
import torch

import kl_bench.audit.stream as stream
from kl_bench.audit import Head, Sampler, position_values, stream_values
from kl_bench.audit.stream_plan import Outputs

FIELDS = ("mean", "var", "neg", "log_mean", "log_var", "tok_log", "tau")
SESSION = Outputs(spread=frozenset({"g"}), var_q=False, against_q=False)        # what a step audit reads


def _layer(seed, std, n=24, vocab=3000, d=16):
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(vocab, d, generator=g) * std / d ** 0.5
    wp = wq + 0.05 * torch.randn(vocab, d, generator=g) * std / d ** 0.5
    hq = torch.randn(n, d, generator=g)
    return (hq, hq + 0.1 * torch.randn(n, d, generator=g), hq + 0.01 * torch.randn(n, d, generator=g), wq, wp,
            torch.randint(0, vocab, (n,), generator=g))


def _spy(monkeypatch):
    calls = {"flat": 0, "widened": 0}
    flat, widen = stream.flat_values, stream.redo_rows

    def counted_flat(scan, plan, centre):
        calls["flat"] += scan.n
        return flat(scan, plan, centre)

    def counted_widen(scan, plan, out, fams, unknown, rows):
        calls["widened"] += rows.numel()
        return widen(scan, plan, out, fams, unknown, rows)
    monkeypatch.setattr(stream, "flat_values", counted_flat)
    monkeypatch.setattr(stream, "redo_rows", counted_widen)
    return calls


def _compare(st, dense, families, fields, tol):
    for name in ("kl", "mean_q"):
        assert torch.allclose(getattr(st, name), getattr(dense, name), rtol=tol, atol=tol), name
    for fam in families:
        for name in fields:
            a, b = getattr(getattr(st, fam), name), getattr(getattr(dense, fam), name)
            assert torch.equal(torch.isinf(a), torch.isinf(b)), (fam, name)
            fin = torch.isfinite(b)
            assert torch.allclose(a[fin], b[fin], rtol=tol, atol=tol), (fam, name, (a[fin] - b[fin]).abs().max())


@pytest.mark.parametrize("est", [("trl.grpo",), ("k1", "k2", "k3")])
@pytest.mark.parametrize("sp", [Sampler(top_p=0.9), Sampler(temperature=0.8, top_p=0.7)], ids=lambda s: s.describe())
def test_flat_rows_equal_the_dense_sums_in_two_passes(monkeypatch, sp, est):
    # logits of standard deviation 0.5 over 3,000 ids: every nucleus holds ~1,900 ids, past 16 candidates
    hq, hp, hs, wq, wp, ids = _layer(1, 0.5)
    calls = _spy(monkeypatch)
    st = stream_values(hq, hp, Head(wq), Head(wp), est, sp, ids=ids, sampling_hidden=hs, tile=256, chunk=10,
                       dtype=torch.float64, candidates=16, outputs=SESSION)
    assert calls == {"flat": 24, "widened": 0}
    zq, zp, zs = (h.double() @ w.double().T for h, w in ((hq, wq), (hp, wp), (hs, wq)))
    dense = position_values(zq, zp, est, sp, ids=ids, sampling=zs)
    _compare(st, dense, ["g"], FIELDS, 1e-12)
    _compare(st, dense, ["b"], ("mean", "miss", "tok_log", "tau"), 1e-12)
    # everything but the rollout engine's distances (KL(b‖q), χ², E|log b − log q|), every family's spread
    st = stream_values(hq, hp, Head(wq), Head(wp), est, sp, ids=ids, sampling_hidden=hs, tile=256, chunk=10,
                       dtype=torch.float64, candidates=16, outputs=Outputs(against_q=False))
    _compare(st, dense, ["b", "g"], FIELDS, 1e-12)
    assert torch.allclose(st.var_q, dense.var_q, rtol=1e-12, atol=1e-12) and calls["widened"] == 0


def test_flat_rows_in_float32_are_within_its_rounding():
    hq, hp, hs, wq, wp, ids = _layer(2, 0.5)
    st = stream_values(hq, hp, Head(wq), Head(wp), ("k1", "k3"), Sampler(top_p=0.9), ids=ids, sampling_hidden=hs,
                       tile=256, chunk=10, candidates=16, outputs=Outputs(against_q=False))
    zq, zp, zs = (h.double() @ w.double().T for h, w in ((hq, wq), (hp, wp), (hs, wq)))
    dense = position_values(zq, zp, ("k1", "k3"), Sampler(top_p=0.9), ids=ids, sampling=zs)
    _compare(st, dense, ["b", "g"], FIELDS, 2e-5)


def test_rows_the_candidates_miss_go_to_two_passes_and_rows_the_bracket_misses_are_widened(monkeypatch):
    # Peaked rows (std 3: the probe keeps them in the candidates' pass) whose nucleus is past 16 candidates
    # take the two passes; rows of logits within 10⁻⁵ of each other put every id in one bin, past what a
    # tile gives (TAKE), and are widened to the whole row (no ties: they would be kept whole, where
    # transformers keeps an arbitrary prefix). Both stay exact.
    hq, hp, hs, wq, wp, ids = _layer(3, 3.0)
    for h in (hq, hp, hs):
        h[:4] *= 1e-6
    calls = _spy(monkeypatch)
    st = stream_values(hq, hp, Head(wq), Head(wp), ("k3",), Sampler(top_p=0.9), ids=ids, sampling_hidden=hs,
                       tile=256, chunk=10, dtype=torch.float64, candidates=16, outputs=SESSION)
    assert calls["flat"] > 4 and calls["widened"] == 4, calls
    zq, zp, zs = (h.double() @ w.double().T for h, w in ((hq, wq), (hp, wp), (hs, wq)))
    dense = position_values(zq, zp, ("k3",), Sampler(top_p=0.9), ids=ids, sampling=zs)
    _compare(st, dense, ["g"], FIELDS, 1e-12)
    _compare(st, dense, ["b"], ("mean", "miss", "tau"), 1e-12)


def test_an_engine_audit_keeps_the_widening_pass(monkeypatch):
    # KL(b‖q) and E|log b − log q| need log Z_b inside the sums: not two passes
    hq, hp, hs, wq, wp, ids = _layer(4, 0.5, n=6)
    calls = _spy(monkeypatch)
    st = stream_values(hq, hp, Head(wq), Head(wp), ("k3",), Sampler(top_p=0.9), ids=ids, sampling_hidden=hs,
                       tile=256, dtype=torch.float64, candidates=16)
    assert calls == {"flat": 0, "widened": 6}
    zq, zp, zs = (h.double() @ w.double().T for h, w in ((hq, wq), (hp, wp), (hs, wq)))
    dense = position_values(zq, zp, ("k3",), Sampler(top_p=0.9), ids=ids, sampling=zs)
    _compare(st, dense, ["b", "g"], FIELDS + ("kl_q", "chi2", "gap_abs"), 1e-12)
