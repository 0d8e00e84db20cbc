"""``kl-bench list``: the registered estimators, pair-supplied rows, gates, case kinds and per-sequence rewards."""
from __future__ import annotations

from .common import Command, app, out_console


@app.command("list", cls=Command)
def list_() -> None:
    """List the registered estimators, pair-supplied rows, gates, case kinds and per-sequence rewards, one line each."""
    from rich.markup import escape

    from ..present.terminal import show
    rows = _estimator_rows() + _gate_rows() + _kind_rows() + _reward_rows()
    show(out_console, _table([[escape(c) for c in row] for row in rows]), fold=True)


def _estimator_rows() -> list[list[str]]:
    """The registered estimators and pair-supplied rows, and the plug-ins installed as entry points."""
    from importlib.metadata import entry_points

    from ..core.estimators import ESTIMATORS, PAIR_ROWS
    rows = []
    for name, e in [*ESTIMATORS.items(), *PAIR_ROWS.items()]:
        sign = ", ≥0" if e.nonnegative else ", ≥0 up to rounding" if getattr(e, "rounding_negative", False) else ""
        props = ("unbiased" if e.unbiased else "biased") + sign
        rows.append(["row" if e.analytic else "estimator", name, f"{e.target}, {props}: {e.formula}"])
    for ep in entry_points(group="kl_bench.estimators"):
        if ep.name not in ESTIMATORS:
            rows.append(["plug-in", ep.name, f"{ep.value} (entry point, loaded when used)"])
    return rows


def _gate_rows() -> list[list[str]]:
    """One line per gate (kl_bench.core.gates): its mask, its source and its spec key (top-K ones with K = 20)."""
    from ..core.gates import GATES, gate
    rows = []
    for name in [*GATES.names(), "topk_kl@K", "topk_tv@K"]:
        g = gate(name.replace("@K", "@20"))
        formula = g.formula.replace("top-20", "top-K")
        key = f'"{g.name}"' if "@" in g.name else g.name        # a TOML key with @ is quoted
        rows.append(["gate", name, f"masks when {formula}; {g.source} ([experiment] gates = {{ {key} = [δ] }})"])
    return rows


def _kind_rows() -> list[list[str]]:
    """One line per case kind; a kind whose module fails to load or registers another name is listed with that
    one-line error (the other kinds still listed, no traceback)."""
    from ..foundation.errors import SpecError
    from ..kinds import CASE_KINDS
    rows = []
    for name in CASE_KINDS.names():
        CASE_KINDS.get(name)        # imported first: a module's name registered under another name is listed too
    for name in CASE_KINDS.names():
        try:
            rows.append(["kind", name, CASE_KINDS[name].description])
        except SpecError as e:
            rows.append(["kind", name, f"not loaded: {e}"])
    return rows


def _reward_rows() -> list[list[str]]:
    from ..training.sequences import SEQUENCE_REWARDS
    rows = []
    for name, r in SEQUENCE_REWARDS.items():
        doc = (r.fn.__doc__ or "").strip().splitlines()[0] if r.fn.__doc__ else ""
        rows.append(["reward", name, f"{doc} ([train] reward = {{ sequence = \"{name}\" }})"])
    return rows


def _table(rows: list[list[str]]):
    """Three columns, the last one wrapped at a terminal's width (its lines under its own column)."""
    from rich.table import Table
    t = Table(box=None, show_header=False, show_edge=False, pad_edge=False, padding=(0, 2, 0, 0))
    t.add_column("what", no_wrap=True)
    t.add_column("name", no_wrap=True)
    t.add_column("description", overflow="fold")
    for row in rows:
        t.add_row(*row)
    return t
