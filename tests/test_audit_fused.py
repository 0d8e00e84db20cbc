"""The audit's fused first pass (``fused=True``, kl_bench.audit.fused): the tile's elementwise work compiled
by torch.compile gives the eager pass's values within the same float32 bound of the exact float64 sums,
and equal ones to rounding in float64; where compiling fails, the eager operations run, with one warning."""
import math

import pytest
import torch

from kl_bench.audit import Head, Sampler, fused, position_values, stream_values
from kl_bench.audit.session import AuditSession
from kl_bench.foundation.errors import SpecError
from kl_bench.integrations.trl_contract import FACTS

from .test_audit_stream import POLY, _dyadic_layer, _rounding_scale


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch.compile's import
def test_fused_values_are_within_the_float32_bound_and_exact_in_float64():
    """One compile (dynamic shapes) serves every call below: float32 and float64 tiles, a short last tile,
    b = q and a drawing pass g with a temperature; ~30 s, mostly the compile."""
    hp, hr, wp, wr = _dyadic_layer(3, vocab=3000)
    zq, zp = hp.double() @ wp.double().T, hr.double() @ wr.double().T
    tile = 512
    dense = position_values(zq, zp, POLY)
    st = stream_values(hp, hr, Head(wp), Head(wr), POLY, tile=tile, dtype=torch.float32, fused=True)
    # the bound of tests/test_audit_stream.py::test_float32_tile_work_is_within_its_rounding_bound
    eps = (math.log2(tile) + 9) * 2.0 ** -24
    shift = (math.log2(tile) + 4) * 2.0 ** -24 * (2 + (zq - zp).abs().max().item())
    assert ((st.kl - dense.kl).abs() <= shift + eps * dense.kl.abs()).all()
    for j, name in enumerate(POLY):
        scale_mean, scale_var = _rounding_scale(zq, zp, name)
        assert ((st.mean_q[:, j] - dense.mean_q[:, j]).abs() <= (eps + shift) * 4 * scale_mean).all(), name
        assert ((st.var_q[:, j] - dense.var_q[:, j]).abs() <= (eps + shift) * 16 * scale_var).all(), name
    eager = stream_values(hp, hr, Head(wp), Head(wr), POLY, tile=tile, dtype=torch.float32)
    assert not torch.equal(st.kl, eager.kl) or not torch.equal(st.var_q, eager.var_q)   # it did run compiled

    g = torch.Generator().manual_seed(21)
    hs = hp + 0.3 * torch.randn(hp.shape, generator=g)
    sp = Sampler(temperature=0.8)
    dense = position_values(zq, zp, POLY, sp, sampling=hs.double() @ wp.double().T)
    st = stream_values(hp, hr, Head(wp), Head(wr), POLY, sp, sampling_hidden=hs, tile=tile, dtype=torch.float64,
                       fused=True)
    for got, want in ((st, dense), (st.b, dense.b), (st.g, dense.g)):
        for name in ("kl", "mean_q", "var_q", "mean", "var", "log_mean", "log_var", "kl_q", "chi2"):
            if hasattr(want, name):
                a, b = getattr(want, name), getattr(got, name)
                fin = torch.isfinite(a) & ~torch.isnan(b)
                assert fin.any(), name
                assert ((a[fin] - b[fin]).abs() / (1 + a[fin].abs())).max().item() < 1e-12, name


def test_a_failed_compile_runs_the_eager_pass_with_one_warning(monkeypatch):
    """No C++ compiler (or Triton) at run time: torch.compile's error is caught, the values are the eager
    pass's bit for bit, and the warning comes once per process."""
    class NoCompiler(Exception):
        pass
    NoCompiler.__module__ = "torch._inductor.exc"

    def broken(fn, **kw):
        def run(*args):
            raise NoCompiler("no working C++ compiler found")
        return run
    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(fused, "_COMPILED", {})
    monkeypatch.setattr(fused, "_FAILED", {})
    hp, hr, wp, wr = _dyadic_layer(4, vocab=700)
    eager = stream_values(hp, hr, Head(wp), Head(wr), POLY, tile=256)
    with pytest.warns(RuntimeWarning, match="fused=True: torch.compile could not build.*no working C"):
        st = stream_values(hp, hr, Head(wp), Head(wr), POLY, tile=256, fused=True)
    for name in ("kl", "mean_q", "var_q"):
        assert torch.equal(getattr(st, name), getattr(eager, name)), name
    again = stream_values(hp, hr, Head(wp), Head(wr), POLY, tile=256, fused=True)   # no second warning
    assert torch.equal(again.kl, eager.kl)


def test_an_error_that_is_not_the_compilers_is_raised(monkeypatch):
    def broken(fn, **kw):
        def run(*args):
            raise ValueError("a real bug")
        return run
    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(fused, "_COMPILED", {})
    monkeypatch.setattr(fused, "_FAILED", {})
    hp, hr, wp, wr = _dyadic_layer(4, vocab=300)
    with pytest.raises(ValueError, match="a real bug"):
        stream_values(hp, hr, Head(wp), Head(wr), ("k3",), fused=True)


def test_fused_is_a_flag_through_the_session(monkeypatch):
    calls = []
    monkeypatch.setattr(fused, "call", lambda fn, *args: calls.append(fn) or fn(*args))
    hp, hr, wp, wr = _dyadic_layer(5, vocab=300)
    with pytest.raises(SpecError, match="fused must be True or False"):
        stream_values(hp, hr, Head(wp), Head(wr), ("k3",), fused="yes")
    session = AuditSession((Head(wp), Head(wr)), FACTS["GRPOTrainer"].metrics, fused=True)
    assert session.fused
    stream_values(hp, hr, Head(wp), Head(wr), ("k3",), tile=100, fused=True)
    assert len(calls) == 3                                  # one call a tile
