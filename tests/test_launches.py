"""benchmarks/launches.py: which dispatched operators count as kernel launches on a GPU."""
import torch

from .bench_tools import launches

SELF_COPY, count_ops, launches_nothing = launches.SELF_COPY, launches.count_ops, launches.launches_nothing

def test_views_allocations_and_wrapped_scalars_make_no_kernel():
    x = torch.randn(6, 4)

    def run():
        a = x[:, 1:3].t().unsqueeze(0).expand(2, 2, 6)   # views: slice, t, unsqueeze, expand
        b = x.view(24).unbind(0)                          # views: view, unbind
        e = torch.empty(5)                                # allocation without a fill
        w = torch.where(x > 0, x, 0.0)                    # gt and where make kernels; 0.0 is a wrapped scalar
        x.add_(1)                                         # in place: aliases its input but writes it
        return a.sum() + b[0] + e.numel() + w.mul(2).sum()  # sum, add, mul, sum, add: kernels
    _, ops = count_ops(run)
    assert {"slice", "t", "unsqueeze", "expand", "view", "unbind", "empty", "scalar_tensor"} <= ops.free
    assert not ops.free & {"gt", "where", "add_", "sum", "mul", "add"}
    assert ops.launching == sum(v for k, v in ops.items() if k not in ops.free)
    assert ops.launching == sum(ops[k] for k in ("gt", "where", "add_", "sum", "mul", "add"))
    assert launches_nothing(torch.ops.aten.select.int) and not launches_nothing(torch.ops.aten.add_.Tensor)


def test_the_traffic_proxy_counts_operands_results_and_gathers():
    """Ops.streamed / Ops.sectors (benchmarks/launches.py): an elementwise kernel streams its operands
    and result once each (a broadcast operand once, a column of a row-major block a sector an element, an
    in-place operand read and written); a gather streams its index and result and reads a sector per index
    (an embedding_bag row of 64 bytes: two); x[a:b] += y's closing self-copy makes no kernel and no traffic."""
    n, f64 = 1000, torch.float64
    x, y = torch.rand(n, dtype=f64), torch.rand(n, dtype=f64)
    col, big = torch.rand(n, 1, dtype=f64), torch.rand(n, 64, dtype=f64)
    table, idx = torch.rand(10_000, dtype=f64), torch.randint(0, 10_000, (n,))
    rows, keys = torch.rand(500, 8, dtype=f64), torch.randint(0, 500, (n, 4))
    cases = [
        (lambda: x + y, 24 * n, 0),
        (lambda: x.add_(y), 24 * n, 0),
        (lambda: col.expand(n, 64) * big, 8 * n + 2 * 8 * 64 * n, 0),
        (lambda: big[:, 3] * 2.0, 32 * n + 8 * n, 0),
        (lambda: torch.index_select(table, 0, idx), 16 * n, n),
        (lambda: table[idx], 16 * n, n),
    ]
    for run, streamed, sectors in cases:
        _, ops = count_ops(run)
        assert (sum(ops.streamed.values()), sum(ops.sectors.values())) == (streamed, sectors), (ops, ops.streamed)
        assert ops.traffic == streamed + 32 * sectors
    _, ops = count_ops(lambda: torch.nn.functional.embedding_bag(keys, rows, mode="sum"))
    assert sum(ops.sectors.values()) == 2 * keys.numel()
    # the keys, the bags' offsets (written by an arange, then read), the [n, 8] sums
    assert sum(ops.streamed.values()) == 8 * keys.numel() + 2 * 8 * n + 8 * 8 * n

    def pairwise():
        z = torch.rand(4, n, dtype=f64)
        z[:2] += z[2:]
    _, ops = count_ops(pairwise)
    assert "copy_" not in ops and ops[SELF_COPY] == 1 and SELF_COPY in ops.free
    assert sum(ops.streamed.values()) == 8 * 4 * n + 3 * 8 * 2 * n       # the rand, then the add_
