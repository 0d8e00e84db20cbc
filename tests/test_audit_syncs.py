"""Host synchronisations on the audit's path (issue 43 item 2): what reads a tensor's values back to the host
(item, bool, int, float, tolist, nonzero, a boolean mask's indexing, masked_select, unique) is counted, and
the count per audited micro-batch does not grow with its rows. On a GPU each of these waits for the device;
on the CPU, where the tests run, the same calls are counted (the code paths are the same)."""
import collections

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from kl_bench.audit import Head, Sampler, stream_values
from kl_bench.audit.session import AuditSession, Metric, Record
from kl_bench.integrations.trl_capture import Generation

# aten operations whose result's size or value the host must read
READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique",
         "aten.repeat_interleave.Tensor")


class Syncs(TorchDispatchMode):
    """Counts host reads of tensor values inside its ``with`` block, by operation (``counts``)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(READS):
            self.counts[name] += 1
        elif name.startswith(("aten.index.Tensor", "aten.index_put")):
            indices = args[1] if len(args) > 1 else ()
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                self.counts[name + " (boolean mask)"] += 1
        return func(*args, **(kwargs or {}))


class _Tolist(TorchFunctionMode):
    """Tensor.tolist reads every value without an aten operation: counted here."""

    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "tolist":
            self.counts["Tensor.tolist"] += 1
        return func(*args, **(kwargs or {}))


def count_syncs(fn) -> collections.Counter:
    syncs = Syncs()
    with _Tolist(syncs.counts), syncs:
        fn()
    return syncs.counts


def test_the_counter_sees_every_kind_of_read():
    x = torch.arange(6.0)
    m = x > 2
    got = count_syncs(lambda: (x.tolist(), x[0].item(), bool(m.any()), int(x.sum()), x[m], m.nonzero(),
                               x.masked_select(m), torch.unique(x)))
    assert sum(got.values()) == 8, got
    assert sum(count_syncs(lambda: (x + 1, x[torch.tensor([1, 2])], x.index_select(0, torch.tensor([0])))).values()) == 0


def _record(rows, seed=0, T=6, V=50, d=8, sp=Sampler()):
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(V, d, generator=g)
    wr = wq + 0.2 * torch.randn(V, d, generator=g)
    hq = torch.randn(rows, T, d, generator=g)
    hr = hq + 0.2 * torch.randn(rows, T, d, generator=g)
    hs = hq + 0.01 * torch.randn(rows, T, d, generator=g)
    ids = torch.randint(0, V, (rows, T), generator=g)
    mask = torch.arange(T) < torch.randint(1, T + 1, (rows, 1), generator=g)
    values = {"kl": torch.rand(rows, T, generator=g), "reward": torch.rand(rows, T, generator=g)}
    return Record(hq, hr, ids, mask, values, sampling_hidden=hs,
                  engine_logprobs=-torch.rand(rows, T, generator=g)), (Head(wq), Head(wr))


@pytest.mark.parametrize("sp", [Sampler(), Sampler(temperature=0.7, top_k=5), Sampler(top_p=0.9, min_new_tokens=2,
                                                                                      eos_token_id=(3,))],
                         ids=lambda s: s.describe())
def test_an_audited_micro_batch_reads_the_host_as_often_with_1_row_as_with_8(sp):
    # chunk = 4 positions: 8 rows × 6 tokens are several chunks, 1 row one; KLAudit's calls per micro-batch
    metrics = [Metric("kl", "k1", "token-mean"), Metric("reward", "k1", "seq-mean-token-sum")]

    def audit(rows):
        rec, heads = _record(rows, sp=sp)
        session = AuditSession(heads, metrics, sp, chunk=4, tile=16, negative=True)
        return count_syncs(lambda: (session.add(rec), session.finish(step=1)))
    one, eight = audit(1), audit(8)
    assert one == eight, (one, eight)
    assert sum(eight.values()) <= 16, eight


def test_rows_redone_by_a_second_pass_read_the_host_once_for_all_chunks():
    # A flat policy under top-p with 4 candidates: every row's nucleus is larger, so every row is widened
    # and summed again; a reference that cannot draw one id makes every row's one-pass moments infinite
    # (redone exactly). The rows come back from the host once, however many rows and chunks.
    g = torch.Generator().manual_seed(3)
    V, d = 40, 4
    w = 0.01 * torch.randn(V, d, generator=g)
    bias = torch.zeros(V)
    bias[7] = -torch.inf

    def run(n):
        h = torch.randn(n, d, generator=g)
        return count_syncs(lambda: stream_values(h, h + 0.1, Head(w), Head(w, bias), ("k3",), Sampler(top_p=0.9),
                                                 ids=torch.zeros(n, dtype=torch.long), sampling_hidden=h + 0.01,
                                                 chunk=3, tile=16, candidates=4))
    small, large = run(2), run(20)
    assert small == large and sum(large.values()) == 1, (small, large)


def _generation(rows, prompt=3, k=4, d=5, seed=0):
    """A captured generate(): left-padded prompts, then k decoding steps (hidden [rows, d] each)."""
    g = torch.Generator().manual_seed(seed)
    gen = Generation()
    ids = torch.randint(0, 50, (rows, prompt), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 0] = 0                                              # one left pad
    gen.step({"input_ids": ids, "attention_mask": mask}, torch.randn(rows, prompt, d, generator=g), limit=rows)
    drawn = []
    for _ in range(k - 1):
        tok = torch.randint(0, 50, (rows, 1), generator=g)
        drawn.append(tok)
        gen.step({"input_ids": tok}, torch.randn(rows, 1, d, generator=g), limit=rows)
    full = torch.cat([ids] + drawn + [torch.randint(0, 50, (rows, 1), generator=g)], dim=1)
    return gen, full, torch.cat([mask, torch.ones(rows, k, dtype=torch.long)], dim=1)


def test_matching_generated_rows_reads_the_host_once_whatever_the_rows():
    counts = []
    for rows in (1, 8):
        gen, full, att = _generation(rows)
        order = torch.arange(rows).flip(0)                      # the scored rows in another order
        got = []
        counts.append(count_syncs(lambda: got.append(gen.match(full[order], att[order], 4))))
        assert got[0] is not None and torch.equal(got[0], torch.stack(gen.hidden[:4], dim=1)[order])
    assert counts[0] == counts[1] and sum(counts[1].values()) == 1, counts
    gen, full, att = _generation(4)
    full[2, 1] += 1                                             # a row generate() never drew
    assert gen.match(full, att, 4) is None


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning", "ignore::DeprecationWarning")
def test_klaudit_reads_the_host_as_often_for_2_rows_as_for_8(tiny_models, tmp_path):
    # A live GRPO run (TRL's own passes, generate() captured): every scoring pass the callback's hooks
    # handle is counted, the audit of its rows (row matching, the drawing pass's rows, AuditSession.add)
    # included; the counts are the same whatever max_rows audits of the 8 rows a step.
    pytest.importorskip("trl")
    from kl_bench.integrations.demo import build_trainer
    from kl_bench.integrations.trl import KLAudit
    counts = {}
    for rows in (2, 8):
        tr = build_trainer(tiny_models, tmp_path / f"run{rows}", steps=2, learning_rate=0.0)
        cb = KLAudit(tr, every=1, max_rows=rows, print_fn=lambda line: None)
        seen, scored = [], cb._scored

        def counted(call, output, scored=scored, seen=seen, cb=cb):
            before = len(cb.step_inputs)
            got = count_syncs(lambda: scored(call, output))
            if len(cb.step_inputs) > before:                    # this pass audited a micro-batch
                seen.append((call.role, cb.step_inputs[-1]["mask"].shape[0], got))
        cb._scored = counted
        tr.add_callback(cb)
        tr.train()
        assert {r for _, r, _ in seen} == {rows} and len(seen) == 2, seen
        counts[rows] = [c for _, _, c in seen]
    assert counts[2] == counts[8], counts
