"""A training run in memory (train.csv's frame, run.json's envelope), its atomic write, and its summary."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..foundation.formatting import sig
from ..results import frame_to_csv_bytes, read_frame
from ..results import folders
from ..results.schema import TRAIN_SCHEMA


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
        self.path = folders.write("train", directory, self.files(), self.envelope)
        return self.path

    def final(self) -> pd.DataFrame:
        """The last recorded step of every (case, combination, gradients)."""
        return final_rows(self.frame)

    def summary_lines(self) -> list[str]:
        """Per case: which combination ends closest to q* and how far the others are (exact rows when the
        run has them, else the sampled means)."""
        return summary_lines(self.frame)

    def warnings(self) -> list[str]:
        """One line per trajectory that diverged (:func:`diverged`)."""
        return [f"warning: case '{case}': {combination} ({gradients}) diverged: non-finite values from step {step} "
                f"on (a smaller [train] lr?)" for case, combination, gradients, step in diverged(self.frame)]


def final_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The last recorded step of every (case, combination, gradients) of train.csv's frame."""
    return df[df["step"] == df.groupby(["case", "combination", "gradients"])["step"].transform("max")]


# The values of the policy alone, which a diverged update makes non-finite (θ overflows: NaN or ±inf
# probabilities); not kl_opt, which also holds log Z, a property of the problem (finite p: kl_rev and
# kl_fwd are finite for any finite θ).
POLICY_VALUES = ("kl_rev", "kl_fwd", "entropy", "reward", "objective")


def diverged(frame: pd.DataFrame) -> list[tuple[str, str, str, int]]:
    """(case, combination, gradients, first step) of every trajectory of train.csv's frame with a
    non-finite value (NaN or ±inf) in a policy value (:data:`POLICY_VALUES`) at some recorded step."""
    bad = ~np.isfinite(frame[list(POLICY_VALUES)].to_numpy(dtype=float)).all(axis=1)
    first = frame[bad].groupby(["case", "combination", "gradients"], sort=False)["step"].min()
    return [(c, k, g, int(s)) for (c, k, g), s in first.items()]


def summary_lines(frame: pd.DataFrame) -> list[str]:
    """Per case of train.csv's frame: which combination ends closest to q* (the smallest KL(q‖q*)) and how
    far the others are (exact rows when the run has them, else the sampled means); a diverged trajectory
    (:func:`diverged`) is named as such, never ranked, and a case where all did names no winner."""
    gone = {(c, k, g): s for c, k, g, s in diverged(frame)}
    return [_case_line(case, df, gone) for case, df in final_rows(frame).groupby("case", sort=False)]


def _case_line(case: str, df: pd.DataFrame, gone: dict) -> str:
    """:func:`summary_lines`' line of one case: its final rows ``df``, ``gone`` the diverged trajectories."""
    kind = "exact" if (df["gradients"] == "exact").any() else "sampled"
    d = df[df["gradients"] == kind]
    lost = [r for r in d.itertuples() if (case, r.combination, kind) in gone]
    tail = "; diverged: " + ", ".join(f"{r.combination} (from step {gone[case, r.combination, kind]})"
                                      for r in lost) if lost else ""
    d = d[[(case, k, kind) not in gone for k in d["combination"]]].sort_values("kl_opt", kind="stable")
    if d.empty:
        return f"{case}: every combination diverged ({kind}){tail[len('; diverged'):]}"
    if not np.isfinite(d["kl_opt"].to_numpy(dtype=float)).any():
        return (f"{case}: KL(q‖q*) is not computable here (the normaliser of q* is not finite in "
                f"float64); compare the combinations by their objective in train.csv{tail}")
    best = d.iloc[0]
    others = ", ".join(f"{r.combination} {sig(r.kl_opt)} ({_gap(r.kl_opt, best.kl_opt)})"
                       for r in d.iloc[1:].itertuples())
    return (f"{case}: closest to the optimum q* ∝ p·exp(reward/β) ({kind}): {best.combination}, "
            f"KL(q‖q*) = {sig(best.kl_opt)}" + (f"; others: {others}" if others else "") + tail)


def _gap(v: float, best: float) -> str:
    """How much further from q* than the best: "+0.0518", or "the same" for a difference of float64
    rounding (two trajectories that are one in exact arithmetic: ~1e-16, never a real gap)."""
    gap = v - best
    return "the same" if abs(gap) <= 1e-9 * abs(best) + 1e-12 else f"+{sig(gap)}"
