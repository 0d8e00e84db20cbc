"""The Python API: everything the command line does, from a script.

>>> import kl_bench
>>> spec = {"spec_version": 1,
...         "experiment": {"name": "doc", "draws": 20_000, "batches": 20, "device": "cpu",
...                        "estimators": ["k1", "k3"]},
...         "case": [{"name": "g", "kind": "gaussian", "q": {"mean": 0.0, "std": 1.0},
...                   "p": {"mean": 0.5, "std": 1.0}}]}
>>> result = kl_bench.run(spec)
>>> result.summary[["estimator", "true_kl"]].values.tolist()
[['k1', 0.125], ['k3', 0.125]]
>>> bool((result.summary["z"].abs() < 5).all())
True
>>> kl_bench.exact(spec)["exact_mean"].round(6).tolist()
[0.125, 0.125]

The command line is a thin layer over :func:`run`, :func:`exact` and :func:`check`:
``kl_bench.run(path, draws=N, seed=S).summary`` equals the ``summary.csv`` that
``kl-bench run path --draws N --seed S`` writes, and :meth:`Result.write` writes that very folder.
"""
from __future__ import annotations

import contextlib
import math
import datetime as _dt
import platform
import subprocess
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from .errors import SpecError
from .estimation import estimate  # noqa: F401  (kl_bench.api.estimate, as before)
from .results.schema import FORMAT_VERSION
from .pairs import Pair, build_pair
from .threads import single_threaded
from .spec import Spec, load_spec, spec_from_dict, with_overrides

if TYPE_CHECKING:
    import pandas as pd

    from .advice import Advice
    from .gate import Comparison
    from .experiment import SpecOutcome
    from .training import TrainResult

def load(spec, *, draws: int | None = None, seed: int | None = None, device: str | None = None) -> Spec:
    """A :class:`Spec` from a path, a Spec, or a dict with the TOML's structure (tensors allowed as
    logits), with overrides applied exactly as the command line's flags."""
    if isinstance(spec, Spec):
        sp = spec
    elif isinstance(spec, (str, Path)):
        sp = load_spec(spec)
    else:
        sp = spec_from_dict(spec)
    return with_overrides(sp, draws=draws, seed=seed, device=device)


def resolve_device(name: str, where: str | None = None, key: str = "experiment.device") -> torch.device:
    """'auto' → CUDA when available, else CPU. Asking for CUDA without one is an input error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SpecError(f"device '{name}' requested but CUDA is not available here", file=where, key=key)
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SpecError(f"device '{name}' requested but only {torch.cuda.device_count()} GPU(s) exist",
                            file=where, key=key)
    return dev


@dataclass
class Prepared:
    """A validated spec with its pairs built (files read) and its device resolved: ready to sample."""
    spec: Spec
    pairs: list[Pair]
    device: torch.device

    @property
    def file(self) -> str:
        return str(self.spec.path)


@single_threaded
def prepare(spec, *, draws: int | None = None, seed: int | None = None, device: str | None = None) -> Prepared:
    """Load and validate everything before any sampling: spec, flags, device, pairs, exact oracles."""
    from .experiment import check_group_draws, validate_oracles
    sp = load(spec, draws=draws, seed=seed, device=device)
    dev = resolve_device(sp.experiment.device, str(sp.path), "--device" if device is not None else "experiment.device")
    pairs = [build_pair(c, str(sp.path)) for c in sp.cases]
    validate_oracles(sp, pairs, str(sp.path))
    check_group_draws(sp, pairs, str(sp.path))
    return Prepared(sp, pairs, dev)


@single_threaded
def execute(prep: Prepared, *, progress=None, resume: dict[str, torch.Tensor] | None = None,
            on_sums: Callable[[str, torch.Tensor], None] | None = None, ranks=None) -> "Result | None":
    """Sample a prepared spec. ``progress``: a :class:`kl_bench.progress.LazyProgress` (or anything with
    ``advance(n)`` and ``label(text)``); ``resume``/``on_sums``: checkpointing (kl_bench.engine.run_case).
    ``ranks``: this process's place in a multi-process job (:func:`kl_bench.distributed.start`); rank 0
    gets the Result, byte for byte the one-process Result, and the other ranks None."""
    from .distributed import SINGLE
    from .experiment import run_spec
    outcome = run_spec(prep.spec, prep.pairs, prep.device, progress=None if progress is None else progress.advance,
                       resume=resume, on_sums=on_sums, on_phase=None if progress is None else progress.label,
                       ranks=ranks or SINGLE)
    return None if outcome is None else Result(prep.spec, prep.pairs, outcome, prep.device, resumed=bool(resume))


def run(spec, *, draws: int | None = None, seed: int | None = None, device: str | None = None,
        progress: bool | None = None) -> "Result":
    """Run every case of ``spec`` (a path, a :class:`Spec`, or a dict with the TOML's structure in which
    a categorical or rollout side may be a tensor or ndarray of logits). ``draws``, ``seed`` and
    ``device`` override the spec exactly as the CLI's flags do. Nothing is written: see
    :meth:`Result.write`. ``progress``: a progress line once the run has lasted 2 s (on a terminal's
    stderr, or in the cell of a notebook; never in a pipe or a file); None, the default: on in a Jupyter
    notebook, off elsewhere."""
    from .experiment import total_draws
    from .progress import LazyProgress, wanted
    prep = prepare(spec, draws=draws, seed=seed, device=device)
    bar = LazyProgress(total_draws(prep.spec), enabled=wanted(progress))
    try:
        return execute(prep, progress=bar)
    finally:
        bar.close()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, str]:
    from .version import __version__
    out = {"python": platform.python_version(), "kl-bench": __version__}
    for pkg in ("torch", "numpy", "scipy", "pandas"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


def _device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()


class Result:
    """What a run produced, in memory: the tables and the exact files of a results folder.

    ``summary``: summary.csv's rows (its columns and dtypes: it is read back from the very bytes
    written); ``lambda_sweep``, ``gradients`` and ``group_baselines``: DataFrames, or None when the spec asks
    for none;
    ``envelope``: run.json's fields (the file hashes are added on writing)."""

    def __init__(self, spec: Spec, pairs: list[Pair], outcome: "SpecOutcome", device: torch.device,
                 resumed: bool = False):
        from .results import read_frame
        self.spec, self.pairs, self.device = spec, pairs, device
        self.outcome = outcome
        self._files = outcome.files()
        self.summary = read_frame(self._files["summary.csv"])
        self.lambda_sweep = read_frame(self._files["lambda_sweep.csv"]) if "lambda_sweep.csv" in self._files else None
        self.gradients = read_frame(self._files["gradients.csv"]) if "gradients.csv" in self._files else None
        self.path: Path | None = None
        runs = [o.run for o in outcome.cases]
        exp = spec.experiment
        self.envelope: dict[str, Any] = {
            "kl_bench_run": FORMAT_VERSION,        # the results format (kl_bench.results.schema)
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "spec_path": str(spec.path), "spec_sha256": spec.sha256, "spec_text": spec.text,
            "experiment": exp.name, "seed": exp.seed,
            "draws_per_case": {c.name: n for c, n in zip(spec.cases, spec.case_draws())}, "batches": exp.batches,
            "device": str(device), "device_name": _device_name(device), "versions": _versions(),
            "git_commit": _git_commit(), "wall_seconds": round(outcome.wall, 3), "resumed": resumed,
            # Processes that drew the batches, and per case and pass the [lo, hi) batch ranges of each rank
            # (batches restored from a checkpoint are in no range).
            "world_size": outcome.world_size, "rank_batches": outcome.drawn,
            # The rate of this process: draws restored from a checkpoint (--resume) took no sampling time.
            "sampling_seconds": round(sum(r.seconds for r in runs), 3),
            "draws_per_second": round(sum(r.draws - r.restored for r in runs) / max(sum(r.seconds for r in runs), 1e-9)),
            "restored_draws": sum(r.restored for r in runs),
            "cases": {p.name: {**p.metadata(), "seconds": round(r.seconds, 3)} for p, r in zip(pairs, runs)},
        }

    @property
    def group_baselines(self) -> "pd.DataFrame | None":
        """group_baselines.csv's rows (``[experiment] baseline_groups``), or None when the spec asks for none."""
        from .results import read_frame
        return read_frame(self._files["group_baselines.csv"]) if "group_baselines.csv" in self._files else None

    @property
    def batches(self) -> "pd.DataFrame":
        """Every row's batch means (batches.csv)."""
        from .results import read_frame
        return read_frame(self._files["batches.csv"])

    @classmethod
    def stored(cls, folder: str | Path) -> "Result":
        """A results folder read back (verified: kl_bench.results.verify) as a Result: its tables, run.json, the
        advice and the report. What only a live run has (``spec``, ``pairs``, ``outcome``) is None."""
        from .report import load_results as read
        got = read(Path(folder))
        self = cls.__new__(cls)
        self.spec = self.outcome = self.device = None
        self.pairs = []
        self.summary, self.lambda_sweep, self.gradients = got.summary, got.sweep, got.gradients
        self.envelope, self.path = got.envelope, got.path
        from .safe_io import read_regular
        from .results.verify import DATA_FILES
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

        from .display import compact_frame, heading
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
        folder is swapped in whole, and a concurrent run on the same folder is refused."""
        from .storage import FolderLock, clean_stale
        directory = Path(directory)
        with FolderLock(directory):
            clean_stale(directory)
            self.write_files(directory)
        return directory

    def write_files(self, directory: str | Path) -> Path:
        """:meth:`write` for a caller that already holds the folder's lock (the CLI, which checkpoints)."""
        from .storage import write_results
        from .results.verify import refuse_undefined_statistics
        directory = Path(directory)
        refuse_undefined_statistics(self.summary, str(self.spec.path) if self.spec is not None else str(self.path))
        write_results(directory, self._files, self.envelope)
        self.path = directory
        return directory

    def report(self, directory: str | Path | None = None) -> Path:
        """Write the report (figures, table.tex/md, report.md, report.html) into ``directory`` (default:
        ``<results folder>/report`` once written). Unwritten results are written to a temporary folder
        first, named after the experiment."""
        from .report import write_report
        if self.path is not None:
            return write_report([self.path], Path(directory) if directory else self.path / "report")
        if directory is None:
            raise SpecError("give report() a folder, or write() the results first")
        from .results.verify import refuse_undefined_statistics
        refuse_undefined_statistics(self.summary, str(self.spec.path) if self.spec is not None else str(self.path))
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / self.spec.experiment.name
            from .storage import write_results
            write_results(folder, self._files, self.envelope)
            return write_report([folder], Path(directory))

    def recommendations(self, *, batch: int = 64, tolerance: float = 0.1) -> list["Advice"]:
        """Per case, what to log (the estimator of KL(q||p) with the lowest RMSE at ``batch`` among those
        that can get within ±``tolerance``) and what to put in the loss (from the gradient rows when the
        spec computed them, else the on-policy identities): :mod:`kl_bench.advice`. ``str()`` of each is
        the line ``kl-bench run`` prints."""
        from .advice import recommendations
        return recommendations(self.summary, self.gradients, batch=batch, tolerance=tolerance)

    def warnings(self) -> list[str]:
        """The warning lines ``kl-bench run`` prints (infinite targets, heavy tails, support misses)."""
        from .advice import warnings
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


@single_threaded
def exact(spec, *, progress: bool | None = None, console=None) -> "pd.DataFrame":
    """The exact table of every case, no sampling: true value, exact mean and std of every row, and the
    planning columns (n_for_10pct, rmse_b*) from the exact moments, as :func:`run` fills them.
    ``progress``: as :func:`run`'s (cases built, then cases computed), on ``console`` (default stderr)."""
    from .experiment import validate_oracles
    from .progress import LazyProgress, wanted
    from .results import EXACT_COLUMNS, to_frame
    sp = load(spec)
    bar = LazyProgress(2 * len(sp.cases), enabled=wanted(progress), console=console, unit="steps")
    try:
        pairs = []
        for c in sp.cases:
            bar.label(f"{c.name}: building")
            pairs.append(build_pair(c, str(sp.path)))
            bar.advance(1)
        validate_oracles(sp, pairs, str(sp.path))
        rows = _exact_rows(sp, pairs, bar)
    finally:
        bar.close()
    df = to_frame(rows)[EXACT_COLUMNS]
    df.attrs["descriptions"] = {p.name: p.describe() for p in pairs}     # case → one line on its q and p
    return df


def _exact_rows(sp: Spec, pairs: list[Pair], bar) -> list[dict]:
    """:func:`exact`'s rows, case by case (``bar``: a LazyProgress, advanced once a case)."""
    from .estimators import make_cv
    from .planning import add_planning
    from .results.rows import exact_rows
    sources = [*sp.experiment.sources] + [make_cv(lam) for lam in sp.experiment.lambdas]
    rows = []
    for p in pairs:
        bar.label(f"{p.name}: exact moments")
        for row in exact_rows(p, [p.adapt(s) for s in sources]):
            add_planning(row, p.row_group(row["aggregate"]))
            if not math.isnan(row["lambda"]) and not p.has_sampler:    # cv rows: the exact λ*, as run gives it
                row["lambda_star"] = p.exact_joint(row["aggregate"]).lambda_star
            rows.append(row)
        bar.advance(1)
    return rows


# ----------------------------------------------------------------------------- check
@dataclass
class CheckReport:
    """The regression gate's verdict: ``passed``, the ``failures`` (each with ``.sentence()``), every
    comparison as a ``table``, and notes (rows on one side only, a spec changed since the baseline)."""
    comparisons: list["Comparison"]
    alpha: float
    notes: list[str] = field(default_factory=list)
    baseline: str | None = None

    @property
    def passed(self) -> bool:
        """All comparisons passed, and there was at least one: a gate that compared nothing fails."""
        return bool(self.comparisons) and all(c.passed for c in self.comparisons)

    @property
    def failures(self) -> list["Comparison"]:
        return [c for c in self.comparisons if not c.passed]

    @property
    def table(self) -> "pd.DataFrame":
        import pandas as pd
        return pd.DataFrame([{"row": c.row, "statistic": c.statistic, "value": c.value, "reference": c.reference,
                              "se": c.se, "z": c.z, "p": c.p, "z_limit": c.threshold, "passed": c.passed}
                             for c in self.comparisons])

    def to_json(self) -> bytes:
        """The verdict and every comparison, for CI (``kl-bench check --json FILE``). Non-finite numbers
        are written as null (JSON has no NaN or inf)."""
        import json

        def num(x):
            return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None
        doc = {"kl_bench_check": 1, "passed": self.passed, "verdict": self.verdict, "alpha": self.alpha,
               "baseline": self.baseline, "notes": list(self.notes),
               "comparisons": [{"row": c.row, "statistic": c.statistic, "value": num(c.value),
                                "reference": num(c.reference), "se": num(c.se), "z": num(c.z), "p": num(c.p),
                                "z_limit": num(c.threshold), "passed": bool(c.passed),
                                **({} if c.passed else {"failure": c.sentence()})} for c in self.comparisons]}
        return (json.dumps(doc, indent=1, ensure_ascii=False, allow_nan=False) + "\n").encode()

    def to_junit(self) -> bytes:
        """JUnit XML (one testcase per comparison, a failure element with its sentence), the format CI
        systems display (``kl-bench check --junit FILE``)."""
        from xml.etree import ElementTree as ET
        suite = ET.Element("testsuite", name="kl-bench check", tests=str(len(self.comparisons)),
                           failures=str(len(self.failures)), errors="0", skipped="0")
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="alpha", value=f"{self.alpha:g}")
        ET.SubElement(props, "property", name="baseline", value=self.baseline or "")
        for c in self.comparisons:
            case = ET.SubElement(suite, "testcase", classname=c.row, name=c.statistic)
            if not c.passed:
                ET.SubElement(case, "failure", message=c.sentence(), type="StatisticalRegression")
        if self.notes:
            ET.SubElement(suite, "system-out").text = "\n".join(self.notes)
        ET.indent(suite)
        return ET.tostring(suite, encoding="utf-8", xml_declaration=True) + b"\n"

    @property
    def verdict(self) -> str:
        n, bad = len(self.comparisons), len(self.failures)
        if n == 0:
            return ("check: FAILED: nothing was compared (no row has an exact value or a baseline row to compare "
                    "with), so nothing was verified" + (f"; baseline {self.baseline}" if self.baseline else ""))
        from .formatting import plural
        return (f"check: {n - bad:,} passed, {bad:,} failed ({plural(n, 'comparison')} against exact values"
                + (f" and baseline {self.baseline}" if self.baseline else "") + f"; family-wise α = {self.alpha:g}, Holm)")


def check(results, baseline=None, alpha: float = 0.001, *, spec=None, spec_sha256: str | None = None) -> CheckReport:
    """Compare every statistic with its exact value and, given a ``baseline`` (a path to a baseline
    JSON, or its decoded dict), with the stored run; Holm's step-down at family-wise ``alpha``.
    ``results``: a :class:`Result`, a results folder, or a summary DataFrame (then ``spec_sha256``, if
    given, says which spec made it, for the note when the spec changed since the baseline). With ``spec``
    (a path, Spec or dict), a results folder must hold that experiment's cases."""
    import pandas as pd

    from .gate import baseline_comparisons, exact_comparisons, holm, skipped_notes
    from .results.baseline import load_baseline, normalize_baseline
    if not 0 < alpha < 1:
        raise SpecError(f"must lie in (0, 1), got {alpha}", key="alpha")
    sha = spec_sha256
    if isinstance(results, Result):
        df, sha = results.summary, results.spec.sha256
    elif isinstance(results, pd.DataFrame):
        df = results
    else:
        from .report import load_results
        loaded = load_results(Path(results))
        if spec is not None:
            from .results.verify import check_results_match_spec
            check_results_match_spec(loaded, load(spec))
        df, sha = loaded.summary, loaded.envelope.get("spec_sha256")
    comparisons = exact_comparisons(df)
    notes: list[str] = skipped_notes(df)        # rows neither passed nor failed: said, not silent
    where = None
    if baseline is not None:
        if isinstance(baseline, dict):
            base, where = normalize_baseline(baseline), "(given)"
        else:
            base, where = load_baseline(Path(baseline)), str(baseline)
        if sha is not None and base.get("spec_sha256") != sha:
            notes.insert(0, f"the spec changed since the baseline {where} was made (sha256 "
                         f"{str(base.get('spec_sha256'))[:12]}… then, {sha[:12]}… now); rows are matched by case, "
                         "estimator, aggregate and λ")
        more, row_notes = baseline_comparisons(df, base)
        comparisons += more
        notes += row_notes
    holm(comparisons, alpha)
    return CheckReport(comparisons, alpha, notes, where)


__all__ = ["load", "prepare", "execute", "run", "Result", "exact", "check", "CheckReport", "estimate",
           "resolve_device"]


# ----------------------------------------------------------------------------- training trajectories (issue 22)
@single_threaded
def train(spec, *, seed: int | None = None, device: str | None = None, ranks=None, progress: bool | None = None,
          console=None) -> "TrainResult | None":
    """Optimisation trajectories of a spec with a ``[train]`` table (kl_bench.training, docs/training.md):
    train.csv's rows and run.json's envelope, in memory; :meth:`TrainResult.write` writes the folder.
    ``ranks``: a torchrun job's :class:`kl_bench.distributed.Ranks` (``kl-bench train`` under torchrun passes
    it): the units are split across the processes and rank 0 gets the result (the others None). Without it,
    a call under torchrun is refused in one line (each process would train everything). ``progress``: as
    :func:`run`'s, in steps of this process's trajectories, on ``console`` (default stderr)."""
    from .distributed import SINGLE, one_process
    from .progress import LazyProgress, wanted
    from .training import TrainResult, train_rows
    if ranks is None:
        one_process("kl_bench.train", str(spec) if isinstance(spec, (str, Path)) else None)
    sp = load(spec, seed=seed, device=device)
    dev = resolve_device(sp.experiment.device, str(sp.path), "--device" if device is not None else "experiment.device")
    bar = LazyProgress(0, enabled=wanted(progress), console=console, unit="steps")
    try:
        rows, cfg, wall = train_rows(sp, dev, ranks or SINGLE, bar)
    finally:
        bar.close()
    if rows is None:
        return None
    exp = sp.experiment
    envelope = {
        "kl_bench_train": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "spec_path": str(sp.path), "spec_sha256": sp.sha256, "spec_text": sp.text,
        "experiment": exp.name, "seed": exp.seed, "device": str(dev), "device_name": _device_name(dev),
        "versions": _versions(), "git_commit": _git_commit(), "wall_seconds": round(wall, 3),
        "world_size": 1 if ranks is None else ranks.world_size,
        "train": {"optimizer": cfg.optimizer.name, "lr": cfg.optimizer.lr, "steps": cfg.steps, "beta": cfg.beta,
                  "gradients": list(cfg.gradients), "draws_per_step": cfg.draws or exp.draws, "seeds": cfg.seeds,
                  "reward": cfg.reward.kind, "combinations": list(cfg.combinations)},
    }
    if cfg.reward.function is not None:           # a per-sequence reward: its registry name or plug-in reference
        envelope["train"]["reward_function"] = cfg.reward.function.name
    return TrainResult(rows, envelope)
