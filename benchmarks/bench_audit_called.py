"""The trainer audit's cost as KLAudit calls it (issue 43 item 2), against the plain baseline in the same run.

Per audited micro-batch KLAudit makes one ``AuditSession.add(record, heads)`` (kl_bench.audit.session:
``stream_values`` over the masked positions, with the drawing pass's hidden states, then the additive
sums of every metric and of the engine audit) and, per optimizer step, one ``AuditSession.finish`` (the
host sync of those sums). This benchmark makes exactly those calls with the callback's own settings:
the trainer's metrics (kl_bench.integrations.trl_contract.FACTS), the callback's default ``negative``
(read from KLAudit's signature), float32 tiles, the device's default pieces, the drawing pass captured.

Inputs: N positions (B rows × T tokens, every token counted) of a Qwen2.5-0.5B-sized output layer
(V = 151,936, d = 896, random float32 weights; the logits' standard deviation ``--std``: 4 by default,
2 for a flat policy of entropy ~10 nats), a reference 5% away, a drawing pass 10⁻³ away from the scored
policy (a real engine differs by rounding), tokens drawn from the sampler on the drawing pass's logits.

Unit: one plain float32 head forward of the same hidden states (``h @ W.T``, [N, V]). Each row times
its audit and the unit alternately, ``--repeat`` times, and reports the median of the per-repeat ratios
(the machine is shared: ratios within one process are the figures to compare, not seconds).

    python benchmarks/bench_audit_called.py [--positions 512] [--threads 1] [--repeat 3] [--rows grpo,rloo,...]
                                            [--device cpu] [--clock wall|cpu] [--smoke]
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

from kl_bench.audit import Head, Sampler, sampler_logprobs
from kl_bench.audit.session import AuditSession, Record
from kl_bench.core.estimators import ESTIMATORS
from kl_bench.integrations.trl_contract import FACTS


def callback_negative_default() -> bool:
    """KLAudit's default ``negative`` (its signature; the trl extra is needed to import it)."""
    try:
        from kl_bench.integrations.trl import KLAudit
    except ImportError:                                    # pragma: no cover - the extra is installed in CI
        from kl_bench.audit.session import AuditSession as KLAudit
    return inspect.signature(KLAudit.__init__).parameters["negative"].default


# name → (trainer, sampler, logit std or None for --std, negative or None for the callback's default, fused)
ROWS = {
    "grpo": ("GRPOTrainer", Sampler(), None, None, False),
    "grpo fused=True": ("GRPOTrainer", Sampler(), None, None, True),
    "rloo": ("RLOOTrainer", Sampler(), None, None, False),
    "rloo fused=True": ("RLOOTrainer", Sampler(), None, None, True),
    "rloo negative=True": ("RLOOTrainer", Sampler(), None, True, False),
    "grpo top_p=0.9 std 4": ("GRPOTrainer", Sampler(top_p=0.9), 4.0, None, False),
    "grpo top_p=0.9 std 4 fused=True": ("GRPOTrainer", Sampler(top_p=0.9), 4.0, None, True),
    "grpo top_p=0.9 std 2": ("GRPOTrainer", Sampler(top_p=0.9), 2.0, None, False),
}


def make_step(n: int, vocab: int, d: int, std: float, sampler: Sampler, rows: int, device: str, seed: int = 0):
    """Hidden states of the policy, the reference and the drawing pass [B, T, d], the two heads and the
    drawn ids [B, T]; made on the CPU from a seeded generator, moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    hq = torch.randn(n, d, generator=g)
    hp = hq + 0.1 * torch.randn(n, d, generator=g)
    hg = hq + 1e-3 * torch.randn(n, d, generator=g)
    wq = torch.randn(vocab, d, generator=g) / d ** 0.5 * std            # logits z = h·w: standard deviation std
    wp = wq + 0.05 * torch.randn(vocab, d, generator=g) / d ** 0.5 * std
    ids = torch.empty(n, dtype=torch.long)
    for i in range(0, n, 64):                                           # drawn from b on the drawing pass
        lb = sampler_logprobs(hg[i:i + 64] @ wq.T, sampler)
        ids[i:i + 64] = torch.multinomial(lb.exp(), 1, generator=g).squeeze(-1)
    shape = (rows, n // rows)
    hidden = [x.reshape(*shape, d).to(device) for x in (hq, hp, hg)]
    return hidden, (Head(wq.to(device)), Head(wp.to(device))), ids.reshape(shape).to(device)


def trainer_logps(hidden, heads, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's float32 log-probs of the drawn ids (policy, reference) [B, T]."""
    out = []
    for h, head in zip(hidden[:2], heads):
        lp = torch.log_softmax(h @ head.weight.T, -1)
        out.append(lp.gather(-1, ids.unsqueeze(-1)).squeeze(-1))
        del lp
    return out[0], out[1]


def audit_call(trainer: str, sampler: Sampler, negative: bool, step, fused: bool = False):
    """The callable that makes KLAudit's calls for one audited micro-batch and its step."""
    hidden, heads, ids = step
    lq, lp = trainer_logps(hidden, heads, ids)
    metrics = FACTS[trainer].metrics
    values = {m.source: ESTIMATORS[m.estimator].fn(lp - lq) for m in metrics}
    mask = torch.ones_like(ids, dtype=torch.bool)
    record = Record(hidden[0], hidden[1], ids, mask, values, sampling_hidden=hidden[2],
                    prompt_ids=torch.full((ids.shape[0], 1), -1, device=ids.device),
                    policy_logprobs=lq, reference_logprobs=lp)
    session = AuditSession(heads, metrics, sampler, negative=negative, fused=fused)

    def call():
        with torch.no_grad():
            session.add(record, heads=heads)
            return session.finish(step=1)
    return call


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, device: str, clock: str) -> float:
    """Seconds of ``fn``: wall, or this process's CPU seconds (``clock="cpu"``, one thread: what the call
    itself used, not the time other jobs on a shared machine held the core)."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    _sync(device)
    t = now()
    fn()
    _sync(device)
    return now() - t


def ratio(audit, unit, repeat: int, device: str, clock: str = "wall") -> tuple[float, float, float, float]:
    """(median of audit/unit over interleaved repeats, median audit s, median unit s, the first audit call's
    wall seconds: a fused row's compile); one untimed call each first."""
    first = _time(audit, device, "wall")
    unit()
    pairs = [(_time(audit, device, clock), _time(unit, device, clock)) for _ in range(repeat)]
    return (statistics.median(a / u for a, u in pairs), statistics.median(a for a, _ in pairs),
            statistics.median(u for _, u in pairs), first)


def run(names, n: int, vocab: int, d: int, std: float, rows: int, repeat: int, device: str, clock: str = "wall") -> None:
    where = "CPU" if device == "cpu" else torch.cuda.get_device_name()
    default = callback_negative_default()
    print(f"KLAudit's calls per audited step (AuditSession.add + finish, drawing pass captured), N = {n} "
          f"({rows} rows), V = {vocab:,}, d = {d}, float32 tiles, {where}, {torch.get_num_threads()} threads, "
          f"callback default negative={default}; unit = one float32 head forward [N, V] of the same hidden "
          f"states; median of {repeat} interleaved ratios ({clock} seconds)")
    print(f"{'row':<32} {'audit/unit':>10} {'audit s':>9} {'unit s':>8} {'first call s':>12}")
    for name in names:
        trainer, sampler, row_std, negative, fused = ROWS[name]
        step = make_step(n, vocab, d, row_std or std, sampler, rows, device)
        audit = audit_call(trainer, sampler, default if negative is None else negative, step, fused)
        h, w = step[0][0].reshape(n, d), step[1][0].weight
        r, a, u, first = ratio(audit, lambda: h @ w.T, repeat, device, clock)
        print(f"{name:<32} {r:10.2f} {a:9.3f} {u:8.3f} {first:12.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--batch-rows", type=int, default=8, help="rows of the micro-batch (N / rows tokens each)")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--dim", type=int, default=896)
    ap.add_argument("--std", type=float, default=4.0, help="the logits' standard deviation (rows naming none)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: CPU seconds of this process (a CPU run on a shared machine; one thread)")
    ap.add_argument("--rows", default=None, help="comma-separated row names (default: all): " + ", ".join(ROWS))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.smoke:
        a.positions, a.batch_rows, a.vocab, a.dim, a.repeat = 16, 4, 1000, 16, 1
    names = a.rows.split(",") if a.rows else list(ROWS)
    if a.clock == "cpu" and a.device != "cpu":
        ap.error("--clock cpu times CPU runs only (a GPU's work is not this process's CPU time)")
    run(names, a.positions, a.vocab, a.dim, a.std, a.batch_rows, a.repeat, a.device, a.clock)


if __name__ == "__main__":
    main()
