"""``kl-bench list``: the registered estimators, pair-supplied rows, case kinds and per-sequence rewards."""
from __future__ import annotations

from .common import Command, app, out_console


@app.command("list", cls=Command)
def list_() -> None:
    """List the registered estimators, pair-supplied rows, case kinds and per-sequence rewards, one line each."""
    from importlib.metadata import entry_points

    from ..estimators import ESTIMATORS, PAIR_ROWS
    from ..pairs import CASE_KINDS
    rows = [*ESTIMATORS.items(), *PAIR_ROWS.items()]
    wn = max(len(name) for name, _ in rows)
    wf = max(len(e.formula) for _, e in rows)
    for name, e in rows:
        what = "row      " if e.analytic else "estimator"
        out_console.print(f"{what}  {name:<{wn}}  {e.formula:<{wf}}  target {e.target}"
                          f"{'  unbiased' if e.unbiased else '  biased'}{'  ≥0' if e.nonnegative else ''}",
                          markup=False)
    for ep in entry_points(group="kl_bench.estimators"):
        if ep.name not in ESTIMATORS:
            out_console.print(f"plug-in    {ep.name:<{wn}}  {ep.value}  (entry point, loaded when used)", markup=False)
    for name, k in CASE_KINDS.items():
        out_console.print(f"kind       {name:<{wn}}  {k.description}", markup=False)
    from ..training.sequences import SEQUENCE_REWARDS
    for name, r in SEQUENCE_REWARDS.items():
        doc = (r.fn.__doc__ or "").strip().splitlines()[0] if r.fn.__doc__ else ""
        out_console.print(f"reward     {name:<{wn}}  {doc}  ([train] reward = {{ sequence = \"{name}\" }})", markup=False)
