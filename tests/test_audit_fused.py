"""The audit's fused first pass (``fused=True``, kl_bench.audit.fused): the tile's elementwise work compiled
by torch.compile gives the eager pass's values within the same float32 bound of the exact float64 sums,
and equal ones to rounding in float64, also in the variant a step audit asks for; where compiling or the
compiled call fails, the eager (buffered) pass runs with one warning, and an error of the inputs is raised."""
import math

import pytest
import torch

from kl_bench.audit import Head, Outputs, Sampler, fused, position_values, stream_values
from kl_bench.audit.session import AuditSession, Record
from kl_bench.foundation.errors import SpecError
from kl_bench.integrations.trl_contract import FACTS

from .test_audit_stream import POLY, _dyadic_layer, _rounding_scale


def _close(got, want, names, tol=1e-12):
    for name in names:
        a, b = getattr(want, name), getattr(got, name)
        fin = torch.isfinite(a) & ~torch.isnan(b)
        assert fin.any(), name
        assert ((a[fin] - b[fin]).abs() / (1 + a[fin].abs())).max().item() < tol, name


@pytest.mark.slow
def test_fused_values_are_within_the_float32_bound_and_exact_in_float64():
    """Three compiled variants (~40 s, mostly compiling): float32 with b = q and every output; float64 with a
    drawing pass g at a temperature; float64 as a step audit asks (g's spread only, no Var_q, the EOS ban)."""
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
    assert not fused._FAILED

    g = torch.Generator().manual_seed(21)
    hs = hp + 0.3 * torch.randn(hp.shape, generator=g)
    zs = hs.double() @ wp.double().T
    sp = Sampler(temperature=0.8)
    dense = position_values(zq, zp, POLY, sp, sampling=zs)
    st = stream_values(hp, hr, Head(wp), Head(wr), POLY, sp, sampling_hidden=hs, tile=tile, dtype=torch.float64,
                       fused=True)
    _close(st, dense, ("kl", "mean_q", "var_q"))
    for fam in ("b", "g"):
        _close(getattr(st, fam), getattr(dense, fam), ("mean", "var", "log_mean", "log_var", "kl_q", "chi2"))

    ban = torch.rand(hp.shape[0], generator=g) < 0.5           # what a step audit of GRPO with a drawing pass asks
    step = Outputs(spread=frozenset({"g"}), var_q=False, against_q=False)
    dense = position_values(zq, zp, ("trl.grpo",), Sampler(), sampling=zs, eos_banned=ban)
    st = stream_values(hp, hr, Head(wp), Head(wr), ("trl.grpo",), sampling_hidden=hs, eos_banned=ban, tile=tile,
                       dtype=torch.float64, outputs=step, fused=True)
    _close(st, dense, ("kl", "mean_q"))
    _close(st.g, dense.g, ("mean", "var", "log_mean", "log_var"))
    assert not fused._FAILED


@pytest.fixture
def fresh(monkeypatch):
    """An empty compile cache and failure record, and a torch.compile whose compiled function raises."""
    monkeypatch.setattr(fused, "_COMPILED", {})
    monkeypatch.setattr(fused, "_FAILED", {})

    def compile_raising(error):
        def compile_(fn, **kw):
            def run(*args):
                raise error
            return run
        monkeypatch.setattr(torch, "compile", compile_)
    return compile_raising


def test_a_failed_compile_runs_the_eager_pass_with_one_warning(fresh):
    """No C++ compiler (or Triton) at run time, or any other failure of the compiled call that the eager
    pass does not share: the values are the eager pass's bit for bit, and the warning comes once per process
    with the cause (BackendCompilerFailed's inner exception, not its wrapper)."""
    class Wrapper(Exception):
        inner_exception = OSError("no working C++ compiler found")
    fresh(Wrapper("backend='inductor' raised:"))
    hp, hr, wp, wr = _dyadic_layer(4, vocab=700)
    eager = stream_values(hp, hr, Head(wp), Head(wr), POLY, tile=256)
    with pytest.warns(RuntimeWarning, match="fused=True: torch.compile could not .*OSError: no working C"):
        st = stream_values(hp, hr, Head(wp), Head(wr), POLY, tile=256, fused=True)
    for name in ("kl", "mean_q", "var_q"):
        assert torch.equal(getattr(st, name), getattr(eager, name)), name
    again = stream_values(hp, hr, Head(wp), Head(wr), POLY, tile=256, fused=True)   # no second warning
    assert torch.equal(again.kl, eager.kl)


def test_the_fallback_uses_the_eager_paths_buffers(fresh, monkeypatch):
    """After a failure the eager pass runs with its work buffers (fresh tile-sized tensors cost more in page
    faults than the arithmetic), not with the fused call's unbuffered arguments."""
    fresh(RuntimeError("inductor failed"))
    seen = []
    from kl_bench.audit import first_pass
    real = first_pass._elementwise
    monkeypatch.setattr(first_pass, "_elementwise", lambda plan, z, s, own, b, *rest: seen.append(b) or
                        real(plan, z, s, own, b, *rest))
    hp, hr, wp, wr = _dyadic_layer(4, vocab=300)
    with pytest.warns(RuntimeWarning, match="inductor failed"):
        stream_values(hp, hr, Head(wp), Head(wr), ("k3",), tile=100, fused=True)
    assert len(seen) == 3 and all(b["u"] is not None for b in seen)


def test_an_error_the_eager_pass_shares_is_raised(fresh, monkeypatch):
    """A failure that is the inputs' fault fails the eager rerun too: that error is raised, no warning, and
    the compiled path is not marked failed."""
    fresh(ValueError("a real bug"))
    from kl_bench.audit import first_pass

    def broken(*args):
        raise ValueError("a real bug")
    monkeypatch.setattr(first_pass, "_elementwise", broken)
    hp, hr, wp, wr = _dyadic_layer(4, vocab=300)
    with pytest.raises(ValueError, match="a real bug"):
        stream_values(hp, hr, Head(wp), Head(wr), ("k3",), fused=True)
    assert not fused._FAILED


def test_fused_reaches_the_compiled_call_from_a_session(monkeypatch):
    """AuditSession(fused=True).add goes through fused.call once a tile (eager there: the spy), except for
    a piece with one row or one id, which runs eagerly rather than compile a graph for it; a flag that is
    not a bool is refused when the session is made."""
    calls = []
    monkeypatch.setattr(fused, "call", lambda fn, fused_args, eager_args: calls.append(fn) or fn(*eager_args))
    hp, hr, wp, wr = _dyadic_layer(5, n=12, vocab=300)
    heads = Head(wp), Head(wr)
    with pytest.raises(SpecError, match="fused must be True or False"):
        stream_values(hp, hr, *heads, ("k3",), fused="yes")
    with pytest.raises(SpecError, match="fused must be True or False"):
        AuditSession(heads, FACTS["GRPOTrainer"].metrics, fused=1)
    ids = torch.randint(300, (3, 4), generator=torch.Generator().manual_seed(0))
    record = Record(hp.view(3, 4, -1), hr.view(3, 4, -1), ids, torch.ones(3, 4, dtype=torch.bool),
                    {"kl": torch.zeros(3, 4), "loss": torch.zeros(3, 4)})
    AuditSession(heads, FACTS["GRPOTrainer"].metrics, tile=100, fused=True).add(record)
    assert len(calls) == 3                                  # 300 ids, one call a tile
    AuditSession(heads, FACTS["GRPOTrainer"].metrics, tile=100).add(record)
    assert len(calls) == 3                                  # off by default
    stream_values(hp, hr, *heads, ("k3",), tile=299, fused=True)
    assert len(calls) == 4                                  # the last tile holds one id: eager
    stream_values(hp, hr, *heads, ("k3",), tile=100, chunk=11, fused=True)
    assert len(calls) == 7                                  # the second chunk holds one row: eager
