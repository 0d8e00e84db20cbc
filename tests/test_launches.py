"""kl_bench.foundation.launches: which dispatched operators count as kernel launches on a GPU."""
import torch

from kl_bench.foundation.launches import count_ops, launches_nothing


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
