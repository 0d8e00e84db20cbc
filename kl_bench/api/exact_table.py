"""The exact table of a spec, no sampling (:func:`exact`)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..experiment.spec import Spec
from ..foundation.threads import single_threaded
from ..kinds import Pair
from .preparation import build_pairs, load

if TYPE_CHECKING:
    import pandas as pd


@single_threaded
def exact(spec, *, progress: bool | None = None, console=None) -> "pd.DataFrame":
    """The exact table of every case, no sampling: true value, exact mean and std of every row, and the
    planning columns (n_for_10pct, rmse_b*) from the exact moments, as :func:`run` fills them.
    ``progress``: as :func:`run`'s (cases built, then cases computed), on ``console`` (default stderr)."""
    from ..foundation.progress import LazyProgress, wanted
    from ..results import EXACT_COLUMNS, to_frame
    sp = load(spec)
    bar = LazyProgress(2 * len(sp.cases), enabled=wanted(progress), console=console, unit="steps")
    try:
        pairs = build_pairs(sp, bar)
        rows = _exact_rows(sp, pairs, bar)
    finally:
        bar.close()
    df = to_frame(rows)[EXACT_COLUMNS]
    df.attrs["descriptions"] = {p.name: p.describe() for p in pairs}     # case → one line on its q and p
    return df


def _exact_rows(sp: Spec, pairs: list[Pair], bar) -> list[dict]:
    """:func:`exact`'s rows, case by case (``bar``: a LazyProgress, advanced once a case)."""
    from ..core.estimators import make_cv
    from ..core.planning import add_planning
    from ..experiment.rows import exact_rows
    from ..foundation.memory import out_of_memory_said
    sources = [*sp.experiment.sources] + [make_cv(lam) for lam in sp.experiment.lambdas]
    rows = []
    for p in pairs:
        bar.label(f"{p.name}: exact moments")
        # the description's head: the kind and its size ("categorical V=50257", "rollout V=64, C=4, T=8")
        with out_of_memory_said(f"computing the exact moments ({p.describe().split(': ')[0]})", "a smaller case",
                                file=str(sp.path), case=p.name):
            for row in exact_rows(p, [p.adapt(s) for s in sources]):
                add_planning(row, p.row_group(row["aggregate"]))
                if not math.isnan(row["lambda"]) and not p.has_sampler:    # cv rows: the exact λ*, as run gives it
                    row["lambda_star"] = p.exact_joint(row["aggregate"]).lambda_star
                rows.append(row)
        bar.advance(1)
    return rows
