"""Every table of a run (or of ``kl-bench exact``), in order: :func:`print_tables`.

The tables themselves live by job: one case's (kl_bench.present.case_tables: heading, detail, compact and
exact tables, the lines under them), those across cases (side_tables: side by side, rollouts by length,
sampling mismatch, control variates) and those of a run's other outputs (run_tables: gradients, group
baselines, the gate's comparisons); kl_bench.present.terminal fits each to the terminal (or prints it whole
to a file or a pipe). Numbers and words follow kl_bench.foundation.formatting's vocabulary.
"""
from __future__ import annotations

import pandas as pd
from rich.console import Console

from .case_tables import caption_lines, compact_table, detail_table, exact_case, exact_table, heading
from .side_tables import side_tables
from .terminal import fits, prose, show


def print_tables(console: Console, df: pd.DataFrame, descriptions: dict[str, str], exact_only: bool = False,
                 lengths: dict[str, int] | None = None, wide: bool = False) -> None:
    """Every table of a run (or of ``kl-bench exact``). Per case: the compact table, or the full one with
    ``wide`` or where it fits a terminal (a case with a finite, non-zero exact truth: the full table's
    relative columns exist). Side-by-side tables fit the terminal or are stacked (:func:`show`)."""
    for case in dict.fromkeys(df["case"]):
        rows = df[df["case"] == case]
        if exact_only:
            show(console, exact_table(df, case, descriptions[case]))
        else:
            full = detail_table(df, case, descriptions[case]) if exact_case(rows) else None
            if full is not None and (wide or (console.is_terminal and fits(console, full))):
                show(console, full, wide)
            else:
                prose(console, heading(df, case, descriptions[case]))
                show(console, compact_table(df, case), fold=True)
            for line in caption_lines(rows):
                prose(console, "  " + line, indent="  ")
        console.print()
    if exact_only:
        return
    for table, layout in side_tables(df, lengths):
        show(console, table, wide, **layout)
        console.print()
