"""The streamed audit (kl_bench.audit.stream) in float32 and on other devices: float32 tile work within its
rounding bound of the exact float64 sums, the one-pass polynomial moments against the second pass, and
every buffer on the inputs' device (meta tensors: a CPU buffer would raise)."""
import math

import pytest
import torch

from kl_bench.audit import Head, Sampler, position_values, stream_kl, stream_values
from kl_bench.audit import tiling
from kl_bench.audit.polymoments import Basis, psi
from .bench_tools import launches
from kl_bench.foundation.errors import SpecError
from kl_bench.core.estimators import resolve_estimator

count_ops = launches.count_ops   # benchmarks/launches.py

POLY = ("k1", "k2", "k3", "fwd_k1", "fwd_k3")


def _dyadic_layer(seed, n=12, vocab=2000, d=16):
    """Hidden states and heads whose float32 logits are exact (multiples of 1/16, |z| ≤ 16): products and
    partial sums of d = 16 terms are exact in float32, so only the tile work rounds."""
    g = torch.Generator().manual_seed(seed)
    hp, hr = (torch.randint(-8, 9, (n, d), generator=g) / 4 for _ in range(2))
    hr = hp + torch.randint(-1, 2, (n, d), generator=g) / 4 * (torch.rand(n, d, generator=g) < 0.2)
    wp = torch.randint(-2, 3, (vocab, d), generator=g) / 4
    wr = wp + torch.randint(-1, 2, (vocab, d), generator=g) / 4 * (torch.rand(vocab, d, generator=g) < 0.1)
    return hp, hr, wp, wr


def _rounding_scale(zq, zp, name):
    """Σ_k |c_k| E_q[|u^i ψ^j|] for f = Σ c_k u^i ψ^j (E_q[f] from the moments) and the same for
    (f − E f)² (Var), in float64 from the exact logits: the sums of absolute terms that float32 tile sums
    round relative to."""
    q = torch.softmax(zq, -1)
    d = zp - zq
    centre = (q * d).sum(-1, keepdim=True)
    u = d - centre
    delta = (centre + torch.logsumexp(zq, -1, keepdim=True) - torch.logsumexp(zp, -1, keepdim=True)).squeeze(-1)
    basis = Basis(4)
    absmom = torch.stack([(q * (u.abs() ** i) * psi(u).abs() ** j).sum(-1) for i, j in basis.monomials], -1)
    f = basis.estimator(resolve_estimator(name).poly, delta)
    mean = (f * torch.stack([(q * u ** i * psi(u) ** j).sum(-1) for i, j in basis.monomials], -1)).sum(-1)
    g = f.clone()
    g[..., 0] -= mean
    return (f.abs() * absmom).sum(-1), (basis.mul(g, g).abs() * absmom).sum(-1)


@pytest.mark.parametrize("tile", [512, 8192])
@pytest.mark.parametrize("sp", [Sampler(), Sampler(temperature=0.8)], ids=lambda s: s.describe())
def test_float32_tile_work_is_within_its_rounding_bound(sp, tile):
    # Each tile sum is Σ w u^i ψ^j over t ids: w = e^{z − m} (≤ 2 ulp), ψ from expm1 (≤ 2 ulp), up to D = 4
    # products (1 ulp each), and a pairwise row sum (≤ log2 t + 1 ulp): relative ≤ (log2 t + 9)·2⁻²⁴ of the
    # sum of absolute terms; the tile centres and normalisers add ≤ (log2 t + 4)·2⁻²⁴·max|d| to log r.
    hp, hr, wp, wr = _dyadic_layer(3, vocab=10_000)     # a GPU's default tile (8,192) and a last short one
    zq, zp = hp.double() @ wp.double().T, hr.double() @ wr.double().T
    dense = position_values(zq, zp, POLY, sp)
    st = stream_values(hp, hr, Head(wp), Head(wr), POLY, sp, tile=tile, dtype=torch.float32)
    eps = (math.log2(tile) + 9) * 2.0 ** -24
    shift = (math.log2(tile) + 4) * 2.0 ** -24 * (2 + (zq - zp).abs().max().item())
    assert ((st.kl - dense.kl).abs() <= shift + eps * dense.kl.abs()).all()
    worst = 0.0
    for j, name in enumerate(POLY):
        scale_mean, scale_var = _rounding_scale(zq, zp, name)
        # log r's shift error moves f by |f′|·shift ≤ E|f′|·shift; bounded by the same absolute scale
        err_mean = (st.mean_q[:, j] - dense.mean_q[:, j]).abs()
        err_var = (st.var_q[:, j] - dense.var_q[:, j]).abs()
        assert (err_mean <= (eps + shift) * 4 * scale_mean).all(), name
        assert (err_var <= (eps + shift) * 16 * scale_var).all(), name
        worst = max(worst, (err_mean / scale_mean).max().item())
    assert worst > 0            # float32 did run (the float64 path agrees to ~1e-15)


def test_one_pass_moments_equal_the_second_pass():
    # The same estimator through the one pass (a polynomial) and through the second pass (wrapped as a
    # plug-in function without a polynomial form): equal to float64 rounding.
    g = torch.Generator().manual_seed(5)
    hp, hr = torch.randn(9, 6, generator=g), torch.randn(9, 6, generator=g)
    wp, wr = torch.randn(700, 6, generator=g), torch.randn(700, 6, generator=g)
    k3 = resolve_estimator("k3")
    plain = type(k3)("k3_plain", k3.fn, k3.target, k3.unbiased, k3.nonnegative, k3.formula)     # poly = None
    for sp in (Sampler(), Sampler(temperature=0.6), Sampler(top_k=7)):
        a = stream_values(hp, hr, Head(wp), Head(wr), (k3, plain), sp, tile=128, dtype=torch.float64)
        for name in ("mean_q", "var_q", "mean_b", "var_b", "neg_b"):
            x = getattr(a, name)
            assert torch.allclose(x[:, 0], x[:, 1], rtol=1e-12, atol=1e-15), (sp.describe(), name)


SAMPLERS = [Sampler(), Sampler(temperature=0.7), Sampler(top_k=5), Sampler(top_p=0.9), Sampler(min_p=0.05),
            Sampler(repetition_penalty=1.3, min_new_tokens=2, eos_token_id=(3,))]


@pytest.mark.parametrize("sp", SAMPLERS, ids=lambda s: s.describe())
def test_every_buffer_is_made_on_the_inputs_device(sp):
    # On meta tensors any buffer made on the CPU fails ("tensor on device cpu is not on the expected device
    # meta"): the whole streamed audit, both passes included, runs with nothing on the CPU.
    n, vocab, d = 6, 300, 8
    meta = dict(device="meta")
    hp, hr = torch.empty(n, d, **meta), torch.empty(n, d, **meta)
    heads = Head(torch.empty(vocab, d, **meta), torch.empty(vocab, **meta)), Head(torch.empty(vocab, d, **meta))
    ids = torch.empty(n, dtype=torch.long, **meta)
    kw = dict(ids=ids, eos_banned=torch.empty(n, dtype=torch.bool, **meta),
              context_ids=torch.empty(n, 4, dtype=torch.long, **meta), tile=128)
    for dtype in (torch.float32, torch.float64):
        v = stream_values(hp, hr, *heads, ("k1", "k3", "openrlhf.k3"), sp, dtype=dtype, **kw)
        assert v.kl.device.type == "meta" and v.mean_b.shape == (n, 3)
    assert stream_kl(hp, hr, *heads, tile=128).device.type == "meta"
    lv = position_values(torch.empty(n, vocab, **meta), torch.empty(n, vocab, **meta), ("k1",), sp,
                         ids=ids, eos_banned=kw["eos_banned"], context_ids=kw["context_ids"])
    assert lv.kl.device.type == "meta"


def test_a_device_mix_is_one_line():
    w = torch.zeros(10, 4)
    with pytest.raises(SpecError, match="must be on one device, got cpu, meta"):
        stream_values(torch.zeros(2, 4), torch.zeros(2, 4), Head(w), Head(torch.empty(10, 4, device="meta")))


def test_a_16_bit_head_is_up_cast_tile_by_tile():
    g = torch.Generator().manual_seed(8)
    hp, hr = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    wp, wr = (torch.randn(300, 8, generator=g).to(torch.bfloat16) for _ in range(2))
    st = stream_values(hp.bfloat16(), hr.bfloat16(), Head(wp), Head(wr), ("k3",), dtype=torch.float64, tile=64)
    dense = position_values(hp.bfloat16().double() @ wp.double().T, hr.bfloat16().double() @ wr.double().T, ("k3",))
    assert torch.allclose(st.kl, dense.kl, rtol=1e-12, atol=1e-14)
    assert torch.allclose(st.mean_q, dense.mean_q, rtol=1e-12, atol=1e-14)


def test_negative_false_skips_the_second_pass_and_says_so():
    g = torch.Generator().manual_seed(9)
    hp, hr = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    wp, wr = torch.randn(200, 6, generator=g), torch.randn(200, 6, generator=g)
    v = stream_values(hp, hr, Head(wp), Head(wr), ("k1", "k3"), negative=False, dtype=torch.float64)
    assert torch.isnan(v.neg_b[:, 0]).all() and (v.neg_b[:, 1] == 0).all()      # k1: not computed; k3 ≥ 0
    full = stream_values(hp, hr, Head(wp), Head(wr), ("k1", "k3"), dtype=torch.float64)
    dense = position_values(hp.double() @ wp.double().T, hr.double() @ wr.double().T, ("k1", "k3"))
    assert torch.allclose(full.neg_b, dense.neg_b, atol=1e-12)


def test_rows_whose_float32_moments_overflow_are_redone_exactly():
    # A reference that puts e^25 more weight than q on a few ids: u ≈ 25 there, ψ(u)⁴ ≈ e^100 overflows
    # float32. Those rows are summed again by the second pass (f itself, float64), the others stay one-pass.
    g = torch.Generator().manual_seed(11)
    hp = torch.randn(6, 8, generator=g)
    wp = torch.randn(400, 8, generator=g)
    bias_r = torch.zeros(400)
    bias_r[:3] = 25.0
    heads = Head(wp), Head(wp, bias_r)
    st = stream_values(hp, hp, *heads, POLY, tile=128, dtype=torch.float32)
    z = hp.double() @ wp.double().T
    dense = position_values(z, z + bias_r.double(), POLY)
    # float32 logits round log r by δ ≤ 2·2⁻²⁴·max|z|; f and f² (degree ≤ 2 and 4 in r, log r) then move
    # by ≤ 4δ(1 + max|log r|) relative: the float32 run's tolerance against the float64 sums.
    zr = z + bias_r.double()
    logr = torch.log_softmax(zr, -1) - torch.log_softmax(z, -1)
    tol = 4 * 2 * 2.0 ** -24 * max(z.abs().max().item(), zr.abs().max().item()) * (1 + logr.abs().max().item())
    for name in ("kl", "mean_q", "var_q"):
        a, b = getattr(dense, name), getattr(st, name)
        assert torch.isfinite(b).all(), name
        assert ((a - b).abs() / a.abs()).max().item() < tol, name


def test_a_token_the_reference_cannot_draw_gives_an_infinite_kl():
    g = torch.Generator().manual_seed(12)
    hp = torch.randn(3, 8, generator=g)
    wp = torch.randn(100, 8, generator=g)
    bias_r = torch.zeros(100)
    bias_r[5] = -torch.inf
    st = stream_values(hp, hp, Head(wp), Head(wp, bias_r), ("k1", "k3"), tile=32)
    dense = position_values(hp.double() @ wp.double().T, hp.double() @ wp.double().T + bias_r.double(), ("k1", "k3"))
    assert torch.isinf(st.kl).all() and torch.isinf(dense.kl).all()
    assert torch.equal(torch.isinf(st.mean_q), torch.isinf(dense.mean_q))


@pytest.mark.parametrize("sp", SAMPLERS, ids=lambda s: s.describe())
def test_the_sampling_pass_family_streams_equal_dense(sp):
    # g: the sampler applied to the logits of the pass that drew the tokens (here: the policy's hidden
    # states moved a little, as dropout or other position ids would), next to b on the scored pass's.
    g = torch.Generator().manual_seed(21)
    n, vocab, d = 11, 700, 10
    hq, hr = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    hs = hq + 0.3 * torch.randn(n, d, generator=g)
    wq, wr = torch.randn(vocab, d, generator=g), torch.randn(vocab, d, generator=g)
    ids = torch.randint(vocab, (n,), generator=g)
    ban = torch.rand(n, generator=g) < 0.5
    ctx = torch.randint(-1, vocab, (n, 4), generator=g)
    kw = dict(ids=ids, eos_banned=ban, context_ids=ctx)
    est = ("k1", "k3", "openrlhf.k3")
    dense = position_values(hq.double() @ wq.double().T, hr.double() @ wr.double().T, est, sp,
                            sampling=hs.double() @ wq.double().T, **kw)
    st = stream_values(hq, hr, Head(wq), Head(wr), est, sp, sampling_hidden=hs, tile=128, dtype=torch.float64,
                       candidates=16, **kw)
    assert st.g is not None and dense.g is not None
    for fam in ("b", "g"):
        for name in ("mean", "var", "neg", "miss", "log_mean", "log_var", "tok_log", "kl_q", "chi2", "gap_abs",
                     "tok_score", "tau"):
            a, b = getattr(getattr(dense, fam), name), getattr(getattr(st, fam), name)
            assert torch.equal(torch.isinf(a), torch.isinf(b)), (fam, name)
            # gap_abs is NaN (not computed) only where one pass cannot give it: a full-support b ≠ q; a truncating
            # b has it in every row, rows past the 16 candidates (top-p's nuclei here) from the widening pass
            fin = torch.isfinite(a) & ~torch.isnan(b)
            if name == "gap_abs" and sp.truncates:
                assert not torch.isnan(b).any()
            err = (a[fin] - b[fin]).abs() / (1 + a[fin].abs())
            assert err.numel() == 0 or err.max().item() < 1e-12, (fam, name)
    assert (st.g.mean - st.b.mean).abs().max().item() > 1e-3          # the two passes do differ


def test_pieces_follow_the_device_unless_named():
    """Chunk and tile default by device type (tiling.PIECES: the CPU's small pieces, a GPU's larger ones,
    issue 32); a caller's own win."""
    assert tiling.pieces(torch.device("cpu")) == tiling.PIECES["cpu"] == (256, 4096)
    assert tiling.pieces(torch.device("cuda")) == tiling.PIECES["cuda"] == (1024, 8192)
    assert tiling.pieces(torch.device("cuda:1"), chunk=64) == (64, 8192)
    assert tiling.pieces(torch.device("meta"), tile=100) == (256, 100)      # other devices: the CPU's
    for bad in (0, -3, 2.5, True):
        with pytest.raises(SpecError, match="≥ 1"):
            tiling.pieces(torch.device("cpu"), chunk=bad)
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(4, 8, generator=g), torch.randn(50, 8, generator=g)
    with pytest.raises(SpecError, match="tile"):
        stream_values(h, h, Head(w), Head(w), ("k3",), tile=0)               # 0 is refused, not the default
    with pytest.raises(SpecError, match="chunk"):
        stream_kl(h, h, Head(w), Head(w), chunk=0)


def test_a_gpus_pieces_make_a_fraction_of_the_operations(monkeypatch):
    """Each tile costs ~60 operations (about one kernel launch each on a GPU): a GPU's pieces, forced here on
    the CPU, give the same values within float32 rounding and at most 40% of the operations (512
    positions, V = 40,000: 5 tiles instead of 20)."""
    g = torch.Generator().manual_seed(5)
    hp, wp = torch.randn(512, 16, generator=g), torch.randn(40_000, 16, generator=g) / 2
    hr, wr = hp + 0.1 * torch.randn(512, 16, generator=g), wp + 0.05 * torch.randn(40_000, 16, generator=g)

    def run():
        return stream_values(hp, hr, Head(wp), Head(wr), ("k3",))
    cpu, cpu_ops = count_ops(run)
    monkeypatch.setitem(tiling.PIECES, "cpu", tiling.PIECES["cuda"])
    gpu, gpu_ops = count_ops(run)
    assert sum(gpu_ops.values()) <= 0.4 * sum(cpu_ops.values())
    # Each is within the float32 bound of the exact KL (test_float32_tile_work_is_within_its_rounding_bound,
    # at the larger tile), so they are within twice it of each other
    t = tiling.PIECES["cuda"][1]
    d = (hp.double() @ wp.double().T - hr.double() @ wr.double().T).abs().max().item()
    shift, eps = (math.log2(t) + 4) * 2.0**-24 * (2 + d), (math.log2(t) + 9) * 2.0**-24
    assert ((gpu.kl - cpu.kl).abs() <= 2 * (shift + eps * cpu.kl.abs())).all()
    assert not torch.equal(gpu.kl, cpu.kl)                                 # the pieces did differ
