"""The engine on a GPU: the same properties as on the CPU (bytes independent of chunk, Monte Carlo within
its standard errors of the exact values). Skipped cleanly where no CUDA device is present."""
import pytest
import torch

from kl_bench import seeding
from kl_bench.api import prepare
from kl_bench.engine import run_case
from kl_bench.results import to_frame
from kl_bench.results.rows import summarize

from .test_chunking import CASES, ROWS, _spec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("case", CASES)
def test_chunk_never_changes_the_sums_on_the_gpu(case, monkeypatch):
    monkeypatch.setitem(seeding.PIECE_DRAWS, "cuda", 1000)
    pair = prepare(_spec(1 << 22, {case: CASES[case]})).pairs[0]
    runs = [run_case(pair, ROWS, draws=20_000, seed=3, batches=4, chunk=chunk, device=CUDA, joint=True)
            for chunk in (1, 777, 1 << 22)]
    assert all(torch.equal(runs[0].sums, r.sums) for r in runs[1:]), case


@pytest.mark.parametrize("case", CASES)
def test_gpu_monte_carlo_matches_exact(case):
    pair = prepare(_spec(1 << 22, {case: CASES[case]})).pairs[0]
    df = to_frame(summarize(run_case(pair, ROWS, draws=400_000, seed=5, batches=200, chunk=1 << 22, device=CUDA)))
    checked = df[df["exact_mean"].notna() & df["z"].notna()]
    assert len(checked) and (checked["z"].abs() < 5).all(), checked[["estimator", "z"]]


# ----------------------------------------------------------------------------- the audit on the GPU (issue 32)
AUDIT_SAMPLERS = ["b = q", "top_k", "top_p", "temperature"]


@pytest.mark.parametrize("which", AUDIT_SAMPLERS)
def test_streamed_audit_on_the_gpu_equals_dense_float64(which):
    """stream_values with every input on the GPU: float64 tiles equal the dense float64 sums to 1e-12,
    and every result stays on the GPU; float32 tiles (TF32 off) within the float32 logits' rounding."""
    from kl_bench.audit import Head, Sampler, position_values, stream_kl, stream_values
    sp = {"b = q": Sampler(), "top_k": Sampler(top_k=20), "top_p": Sampler(top_p=0.9),
          "temperature": Sampler(temperature=0.7)}[which]
    g = torch.Generator().manual_seed(1)
    n, vocab, d = 64, 5003, 32
    hp, hr = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    wp = torch.randn(vocab, d, generator=g) / d ** 0.5 * 3
    wr = wp + 0.1 * torch.randn(vocab, d, generator=g)
    ids = torch.randint(vocab, (n,), generator=g)
    est = ("k1", "k3", "openrlhf.k3")
    dense = position_values(hp.double() @ wp.double().T, hr.double() @ wr.double().T, est, sp, ids=ids)
    args = [x.to(CUDA) for x in (hp, hr)] + [Head(wp.to(CUDA)), Head(wr.to(CUDA))]
    st = stream_values(*args, est, sp, ids=ids.to(CUDA), tile=512, dtype=torch.float64)
    assert st.kl.device.type == "cuda" and st.mean_b.device.type == "cuda"
    for name in ("kl", "mean_q", "var_q", "mean_b", "var_b", "neg_b", "miss", "logb_mean", "tok_logb"):
        a, b = getattr(dense, name), getattr(st, name).cpu()
        fin = torch.isfinite(a)
        assert torch.equal(fin, torch.isfinite(b)) and ((a[fin] - b[fin]).abs() / (1 + a[fin].abs())).max() < 1e-12, name
    kl32 = stream_kl(*args, tile=512)
    bound = 40 * 2.0 ** -24 * (2 + (hp.double() @ wp.double().T - hr.double() @ wr.double().T).abs().max().item())
    assert (kl32.cpu() - dense.kl).abs().max().item() < bound


def test_an_audit_session_runs_on_the_gpu():
    from kl_bench.audit import Head
    from kl_bench.audit.session import AuditSession, Metric, Record
    g = torch.Generator().manual_seed(2)
    B, T, V, d = 4, 6, 300, 8
    w = torch.randn(V, d, generator=g)
    h = torch.randn(B, T, d, generator=g)
    ids = torch.randint(V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    rec = Record(*(x.to(CUDA) for x in (h, h + 0.1, ids, mask, torch.zeros(B, T))))
    s = AuditSession((Head(w.to(CUDA)), Head((w + 0.1).to(CUDA))), [Metric("loss", "k3", "token-mean")])
    s.add(rec)
    (a,) = s.finish(0)
    assert a.tokens == B * T and a.exact > 0
