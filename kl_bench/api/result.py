"""A run's results in memory (:class:`Result`): its tables, run.json's envelope, the advice, and the folder
it writes; :func:`load_results` reads a folder back as one."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..experiment.spec import Spec
from ..foundation.errors import SpecError
from ..kinds import Pair
from ..results.run_envelope import run_envelope
from .inputs import path_argument, results_folder
from .provenance import device_name, git_commit, now, versions

if TYPE_CHECKING:
    import pandas as pd

    from ..analysis.advice import Advice
    from ..experiment.case import SpecOutcome


class Result:
    """What a run produced, in memory: the tables and the exact files of a results folder.

    ``summary``: summary.csv's rows (its columns and dtypes: it is read back from the very bytes
    written); ``lambda_sweep``, ``gradients`` and ``group_baselines``: DataFrames, or None when the spec asks
    for none;
    ``envelope``: run.json's fields (the file hashes are added on writing)."""

    def __init__(self, spec: Spec, pairs: list[Pair], outcome: "SpecOutcome", device: torch.device,
                 resumed: bool = False):
        from ..results import read_frame
        self.spec, self.pairs, self.device = spec, pairs, device
        self.outcome = outcome
        self._files = outcome.files()
        self.summary = read_frame(self._files["summary.csv"])
        self.lambda_sweep = read_frame(self._files["lambda_sweep.csv"]) if "lambda_sweep.csv" in self._files else None
        self.gradients = read_frame(self._files["gradients.csv"]) if "gradients.csv" in self._files else None
        self.path: Path | None = None
        self.envelope: dict[str, Any] = run_envelope(
            spec, pairs, outcome, created=now(), device=str(device), device_name=device_name(device),
            versions=versions(), git_commit=git_commit(), resumed=resumed)

    @property
    def group_baselines(self) -> "pd.DataFrame | None":
        """group_baselines.csv's rows (``[experiment] baseline_groups``), or None when the spec asks for none."""
        from ..results import read_frame
        return read_frame(self._files["group_baselines.csv"]) if "group_baselines.csv" in self._files else None

    @property
    def gates(self) -> "pd.DataFrame | None":
        """gates.csv's rows (``[experiment] gates``: exact mask rates and biases), or None when the spec asks for none."""
        from ..results import read_frame
        return read_frame(self._files["gates.csv"]) if "gates.csv" in self._files else None

    @property
    def batches(self) -> "pd.DataFrame":
        """Every row's batch means (batches.csv)."""
        from ..results import read_frame
        return read_frame(self._files["batches.csv"])

    @classmethod
    def stored(cls, folder: str | Path) -> "Result":
        """A results folder read back (verified: kl_bench.results.verify) as a Result: its tables, run.json, the
        advice and the report. What only a live run has (``spec``, ``pairs``, ``outcome``) is None."""
        from ..present.report_data import load_results as read
        got = read(path_argument(folder, "folder"))
        self = cls.__new__(cls)
        self.spec = self.outcome = self.device = None
        self.pairs = []
        self.summary, self.lambda_sweep, self.gradients = got.summary, got.sweep, got.gradients
        self.envelope, self.path = got.envelope, got.path
        from ..foundation.safe_io import read_regular
        from ..results.verify import DATA_FILES
        # The folder was just verified (sha256 of every file against run.json): its bytes, for write().
        self._files = {n: read_regular(got.path / n, n) for n in DATA_FILES if (got.path / n).is_file()}
        return self

    @property
    def draws(self) -> int:
        if self.outcome is None:
            return int(sum(self.summary.drop_duplicates("case")["draws"].fillna(0)))
        return sum(o.run.draws for o in self.outcome.cases)

    def descriptions(self) -> dict[str, str]:
        """Case name → one line describing its q and p."""
        if not self.pairs:
            cases = self.envelope.get("cases") or {}
            return {c: str((cases.get(c) or {}).get("description", "")) for c in dict.fromkeys(self.summary["case"])}
        return {p.name: p.describe() for p in self.pairs}

    def _repr_html_(self) -> str:
        """A notebook's view: per case the compact table (as `kl-bench run` prints at 80 columns), then the
        advice."""
        import html

        from ..present.case_tables import compact_frame, heading
        parts = [f"<h4>{html.escape(repr(self))}</h4>"]
        for case, text in self.descriptions().items():
            head = heading(self.summary, case, text).replace("\n", "<br>")
            parts.append(f"<p><b>{html.escape(head).replace('&lt;br&gt;', '<br>')}</b></p>")
            parts.append(compact_frame(self.summary, case).to_html(index=False, border=0))
        parts.append("<ul>" + "".join(f"<li>{html.escape(a.text)}</li>" for a in self.recommendations()) + "</ul>")
        return "\n".join(parts)

    def files(self) -> dict[str, bytes]:
        """The data files of the results folder (run.json is added by :meth:`write`)."""
        return dict(self._files)

    def write(self, directory: str | Path) -> Path:
        """Write the results folder ``kl-bench run`` writes (summary.csv, batches.csv, reservoir.npz,
        lambda_sweep.csv and gradients.csv when present, run.json with their sha256), atomically: the
        folder is swapped in whole, and a concurrent run on the same folder is refused. ``directory`` is
        refused as ``kl-bench run --out`` refuses it: '', '.' or '..' (the folder swapped would be the working
        folder or its parent), a file, a link, another kind's results folder."""
        from ..foundation.locks import FolderLock
        from ..foundation.storage import clean_stale
        from ..results.folders import check_replaceable
        directory = results_folder(directory, "directory")
        check_replaceable(directory, "run", key="directory")
        with FolderLock(directory):
            clean_stale(directory)
            self.write_files(directory)
        return directory

    def write_files(self, directory: str | Path) -> Path:
        """:meth:`write` for a caller that already holds the folder's lock (the CLI, which checkpoints)."""
        from ..results import folders
        from ..results.verify import refuse_undefined_statistics
        directory = path_argument(directory, "directory")
        refuse_undefined_statistics(self.summary, str(self.spec.path) if self.spec is not None else str(self.path))
        folders.write("run", directory, self._files, self.envelope, locked=True)
        self.path = directory
        return directory

    def report(self, directory: str | Path | None = None) -> Path:
        """Write the report (figures, table.tex/md, report.md, report.html) into ``directory`` (default:
        ``<results folder>/report`` once written). Unwritten results are written to a temporary folder
        first, named after the experiment. ``directory`` is refused as ``kl-bench report --out`` refuses it
        ('', '.', '..', a file, a link), and so is the results folder itself (its report goes inside it)."""
        from ..present.report import write_report
        if directory is None and self.path is None:
            raise SpecError("give report() a folder, or write() the results first")
        out = results_folder(directory if directory is not None else self.path / "report", "directory")
        if self.path is not None:
            return write_report([self.path], out, key="directory")    # refuses the results folder itself
        from ..results.verify import refuse_undefined_statistics
        refuse_undefined_statistics(self.summary, str(self.spec.path) if self.spec is not None else str(self.path))
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / self.spec.experiment.name
            from ..results import folders
            folders.write("run", folder, self._files, self.envelope, locked=True)     # a fresh temporary folder
            return write_report([folder], out)

    def recommendations(self, *, batch: int = 64, tolerance: float = 0.1, per_case: bool = False) -> list["Advice"]:
        """Per case, what to log (the estimator of KL(q||p) with the lowest RMSE at ``batch`` among those
        that can get within ±``tolerance``) and what to put in the loss (from the gradient rows when the
        spec computed them, else the on-policy identities): :mod:`kl_bench.analysis.advice`. As ``kl-bench run``
        prints them: ``str()`` of each is one of its lines, a sentence that holds for several cases alike once
        (its ``cases`` naming them); ``per_case``: one Advice per case and kind instead."""
        from ..analysis.advice import AdviceOptionError, merged, recommendations
        try:
            advice = recommendations(self.summary, self.gradients, batch=batch, tolerance=tolerance, gates=self.gates)
        except AdviceOptionError as e:     # a ValueError there (the CLI maps it too): a bad argument here is a SpecError
            raise SpecError(str(e), key=e.key) from None
        return advice if per_case else merged(advice)

    def advice(self, *, batch: int = 64, tolerance: float = 0.1) -> list[str]:
        """The advice as ``kl-bench run`` prints it: :meth:`recommendations` as lines, a sentence that holds for
        several cases alike once, naming them (kl_bench.analysis.advice.advice_lines)."""
        from ..analysis.advice import advice_lines
        return advice_lines(self.recommendations(batch=batch, tolerance=tolerance))

    def warnings(self) -> list[str]:
        """The warning lines ``kl-bench run`` prints (infinite targets, heavy tails, support misses)."""
        from ..analysis.advice import warnings
        return warnings(self.summary)

    def __repr__(self) -> str:
        name = self.envelope.get("experiment", "")
        where = f", path={str(self.path)!r}" if self.outcome is None else ""
        return (f"Result(experiment={name!r}, cases={self.summary['case'].nunique()}, rows={len(self.summary)}, "
                f"draws={self.draws:,}{where})")


def load_results(folder: str | Path) -> Result:
    """A results folder written by ``kl-bench run`` (or :meth:`Result.write`) as a :class:`Result`,
    verified on reading; a missing, incomplete or corrupted folder is a one-line :class:`SpecError`."""
    return Result.stored(folder)
