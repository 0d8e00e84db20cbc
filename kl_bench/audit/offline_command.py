"""``kl-bench audit DIR``: audit a folder of saved steps (:mod:`kl_bench.audit.offline`) and print a line per
step, its warnings and the pooled verdict; or, for the callback's results folder without saved steps,
read its audit.csv back and print the verdicts it records."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..foundation.errors import SpecError
from ..foundation.formatting import plural
from ..foundation.output_paths import check_output_dir
from ..foundation.safe_io import describe
from ..results.folders import check_replaceable
from .offline import audit_folder
from .rollout_engine import engine_line
from .step import AuditLog, StepAudit, read_audit_folder
from .verdict import Voice, engine_warnings, pooled_line, step_warnings


@dataclass(frozen=True)
class Outcome:
    """What ``kl-bench audit`` did: the folder it wrote (None for a folder read back) and whether a check
    failed (a step's or the pooled |z|, the consistency check, the engine, the trainer's formula: exit 1)."""
    written: Path | None
    failed: bool


def steps_folder(directory: Path) -> Path | None:
    """Where the saved steps of ``directory`` are: itself, or the ``steps/`` of a callback's results
    folder; None when there are none."""
    directory = Path(directory)
    for d in (directory, directory / "steps"):
        if d.is_dir() and any(d.glob("step-*.safetensors")):
            return d
    return None


def _check_pieces(tile: int | None, chunk: int | None) -> None:
    for key, value in (("--tile", tile), ("--chunk", chunk)):
        if value is not None and value < 1:
            raise SpecError(f"must be ≥ 1, got {value}", key=key)


def _check_replay_options(directory: Path, out: Path | None, tile: int | None, chunk: int | None) -> None:
    """A folder read back (nothing audited or written) refuses the options that would be ignored."""
    for key, value in (("--out", out), ("--tile", tile), ("--chunk", chunk)):
        if value is not None:          # nothing is audited or written: the option would be ignored
            raise SpecError(f"has no effect here: {directory} holds no saved steps, only the verdicts its "
                            f"audit.csv records (read back, nothing written): drop {key}", key=key)


def audit_command(directory: Path, out: Path | None, *, tile: int | None, chunk: int | None,
                  echo=print, progress=None) -> Outcome:
    """``kl-bench audit DIR``: audit every saved step (DIR's own or its ``steps/``), print what the live
    audit said (its notes, each step's line and warnings, each once: :class:`~.verdict.Voice`) and the
    pooled verdict, write ``--out`` (default DIR/audit) with audit.csv and run.json. A callback's results
    folder without saved steps is read back and its verdicts printed (nothing written). ``progress``: a
    :class:`kl_bench.foundation.progress.LazyProgress` (or anything with ``set_total``, ``label`` and
    ``advance``), told of the files read and of each step audited."""
    _check_pieces(tile, chunk)
    directory = Path(directory)
    what = describe(directory)
    if what != "a folder":              # said of DIR itself, before an --out is derived from it
        raise SpecError(f"{'does not exist' if what is None else 'is ' + what}: not a folder of saved steps",
                        file=str(directory))
    found = steps_folder(directory)
    if found is None and any((directory / n).is_file() for n in ("audit.csv", "run.json")):
        _check_replay_options(directory, out, tile, chunk)
        return replay_folder(directory, echo)       # a folder the callback wrote (another kind: said so)
    out = check_output_dir(Path(out) if out is not None else directory / "audit")
    check_replaceable(out, "audit")
    voice = Voice()

    def say(lines):
        for line in lines:
            echo(line)
    if progress is not None:
        steps = sorted((found or directory).glob("step-*.safetensors"))
        progress.set_total(len(steps))
        progress.label(f"reading {plural(len(steps), 'saved step')}")

    def on_step(a, warnings):
        say(voice.step(a, warnings))
        if progress is not None:
            progress.label(f"step {a.step} {a.source}")
            progress.advance(1)
    log = audit_folder(found or directory, on_step=on_step, on_notes=lambda notes: say(voice.notes(notes)),
                       tile=tile, chunk=chunk)
    for a in log.engine:                                  # saved steps with a rollout engine's log-probs
        echo(engine_line(a))
        say(voice.warnings(engine_warnings(a)))
    for source, p in log.pooled().items():
        echo(pooled_line(source, p))
    return Outcome(log.write(out, source_folder=str(directory)), voice.failed)


def replay_folder(directory: Path, echo=print) -> Outcome:
    """A results folder written by the callback (audit.csv, run.json) read back: the notes and each step's
    line and warnings the callback printed, from the stored rows."""
    envelope, rows = read_audit_folder(directory)
    sampler = str(envelope.get("sampler", "b"))
    voice = Voice()
    notes = envelope.get("notes") or []
    if not isinstance(notes, list) or not all(isinstance(n, list) and len(n) == 2 and all(isinstance(x, str) for x in n)
                                              for n in notes):
        raise SpecError("must be a list of [key, message] strings", file=str(Path(directory) / "run.json"),
                        key="notes")
    for line in voice.notes(tuple(n) for n in notes):
        echo(line)
    history: dict[str, list[StepAudit]] = {}
    for a in rows:
        history.setdefault(a.source, []).append(a)
        for line in voice.step(a, step_warnings(a, history[a.source], sampler)):
            echo(line)
    log = AuditLog()
    for a in rows:
        log.add(a)
    for source, p in log.pooled().items():
        echo(pooled_line(source, p))
    return Outcome(None, voice.failed)
