"""``kl-bench exact``: the exact table and the advice, without sampling."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import (Command, advice_options, advise, app, check_output, err_console, out_console,
                     user_errors, warn_rows, write_outputs)
from .common import batch_option, quiet_option, tolerance_option


@app.command(cls=Command)
def exact(spec: Path = typer.Argument(..., metavar="SPEC", help="experiment spec (TOML)", show_default=False),
          out: Optional[Path] = typer.Option(None, "--out", help="also write the exact table to this CSV file"),
          batch: int = batch_option(),
          tolerance: float = tolerance_option(),
          quiet: bool = quiet_option("no progress line (there is none in a pipe)")) -> None:
    """Print the exact KL and estimator moments of every case, and the advice, without sampling."""
    from .. import api
    from ..analysis.advice import recommendations
    from ..present.tables import print_tables
    from ..results import frame_to_csv_bytes
    advice_options(batch, tolerance)
    with user_errors():
        if out is not None:
            check_output(out, "--out", api.load(spec))
        df = api.exact(spec, progress=not quiet, console=err_console)
    print_tables(out_console, df, df.attrs["descriptions"], exact_only=True)
    warn_rows(df, err_console)
    advise(recommendations(df, batch=batch, tolerance=tolerance))
    if out is not None:
        write_outputs({out: lambda: frame_to_csv_bytes(df)})
        out_console.print(f"→ {out}")
