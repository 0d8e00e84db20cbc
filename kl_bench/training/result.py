"""A training run in memory (train.csv's frame, run.json's envelope), its atomic write, and its summary."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from ..formatting import fmt
from ..results import frame_to_csv_bytes, read_frame
from ..storage import write_locked
from .run import TRAIN_SCHEMA


class TrainResult:
    """``frame``: train.csv's rows, read back from the very bytes written; ``envelope``: run.json's fields."""

    def __init__(self, rows: list[dict], envelope: dict[str, Any]):
        self._csv = frame_to_csv_bytes(pd.DataFrame(rows, columns=list(TRAIN_SCHEMA)))
        self.frame = read_frame(self._csv)
        self.envelope = envelope
        self.path: Path | None = None

    def files(self) -> dict[str, bytes]:
        return {"train.csv": self._csv}

    def write(self, directory: str | Path) -> Path:
        """train.csv and run.json (with its sha256), swapped in whole; a concurrent run is refused."""
        self.path = write_locked(Path(directory), self.files(), self.envelope)
        return directory

    def final(self) -> pd.DataFrame:
        """The last recorded step of every (case, combination, gradients)."""
        df = self.frame
        return df[df["step"] == df.groupby(["case", "combination", "gradients"])["step"].transform("max")]

    def summary_lines(self) -> list[str]:
        """Per case: which combination ends closest to q* and how far the others are (exact rows when the
        run has them, else the sampled means)."""
        fin = self.final()
        lines = []
        for case, df in fin.groupby("case", sort=False):
            kind = "exact" if (df["gradients"] == "exact").any() else "sampled"
            d = df[df["gradients"] == kind].sort_values("kl_opt", kind="stable")
            best = d.iloc[0]
            # the distance over the best's: rounding (two combinations on one trajectory) prints as 0
            others = ", ".join(f"{r.combination} {_fmt(r.kl_opt)} ({fmt(r.kl_opt - best.kl_opt, scale=best.kl_opt, sign=True)})"
                               for r in d.iloc[1:].itertuples())
            lines.append(f"{case}: closest to the optimum q* ∝ p·exp(reward/β) ({kind}): {best.combination}, "
                         f"KL(q‖q*) = {_fmt(best.kl_opt)}" + (f"; others: {others}" if others else ""))
        return lines


def _fmt(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.3g}"
