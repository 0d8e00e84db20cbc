"""Every folder kl-bench stores, described once and written and read through here: a run's
(``kl-bench run``), a training's (``kl-bench train``) and an audit's (the TRL callback, ``kl-bench audit``).

Each kind is a :class:`FolderFormat`: its data files (CSV tables with their schema in
:mod:`kl_bench.results.schema`, numeric ``.npz`` arrays), the ones every folder of the kind has, and the
key of run.json that records its format version. run.json (the envelope) is the same for all: the fields
its writer gives, the version, and ``files``: the sha256 of every data file. Writing (:func:`write`)
serialises the envelope strictly (a value JSON cannot hold is an error naming its key, never a string made
of it) and swaps the folder in whole (kl_bench.foundation.storage). Reading (:func:`read`) checks, before any
number is parsed, that run.json is an object of a kind and a version this kl-bench reads, that every data
file present is recorded and every recorded one present, and that each has the recorded sha256: a folder
changed after it was written is one line naming the file (its CSV tables are then checked by
:mod:`kl_bench.results.csv_checks`). :func:`kind_of` tells a folder's kind from its
envelope (what ``kl-bench report`` dispatches on). No torch, no engine.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..foundation.errors import SpecError
from ..foundation.safe_io import describe, parse_json, read_regular
from ..foundation.output_paths import same_path
from .checkpoint import CHECKPOINT
from .csv_checks import BOM, check_numeric_columns, check_whole_columns, parse_csv
from .schema import (AUDIT_COLUMNS, AUDIT_DEFAULTS, AUDIT_ENVELOPE, ENGINE_COLUMNS, ENGINE_DEFAULTS, FORMAT_VERSION,
                     RUN_ENVELOPE, TRAIN_ENVELOPE, TRAIN_SCHEMA)

ENVELOPE = "run.json"
_SHA = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class FolderFormat:
    """One kind of stored folder."""
    kind: str                       # "run", "train", "audit"
    version_key: str                # run.json's key holding the format version (its presence names the kind)
    version: int                    # the version this kl-bench writes (and the newest it reads)
    tables: tuple[str, ...]         # CSV data files (schemas: kl_bench.results.schema)
    arrays: tuple[str, ...]         # numeric .npz data files
    required: tuple[str, ...]       # data files every folder of the kind has
    writer: str                     # what writes it, for messages
    envelope: dict[str, str]        # run.json's fields → meaning (kl_bench.results.schema)
    droppable: tuple[str, ...] = ()  # data files a copy may leave out (:func:`drop`): nothing else reads them

    @property
    def data_files(self) -> tuple[str, ...]:
        return self.tables + self.arrays


FORMATS: dict[str, FolderFormat] = {f.kind: f for f in (
    FolderFormat("run", "kl_bench_run", FORMAT_VERSION,
                 ("summary.csv", "batches.csv", "lambda_sweep.csv", "gradients.csv", "group_baselines.csv", "gates.csv"),
                 ("reservoir.npz", "gradients.npz"), ("summary.csv",), "kl-bench run", RUN_ENVELOPE,
                 # the per-draw reservoir (only the report's ECDF figures read it: skipped without it) and the
                 # exact gradient vectors (the report does not read them; the Python API, when they are there)
                 droppable=("reservoir.npz", "gradients.npz")),
    # train: version 1 is the only one so far (train.csv: kl_bench.results.schema.TRAIN_SCHEMA)
    FolderFormat("train", "kl_bench_train", 1, ("train.csv",), (), ("train.csv",), "kl-bench train", TRAIN_ENVELOPE),
    # audit: version 1 (audit.csv written before a column existed reads it with schema.AUDIT_DEFAULTS)
    FolderFormat("audit", "kl_bench_audit", 1, ("audit.csv", "engine.csv"), (), ("audit.csv",),
                 "the trainer audit (KLAudit, kl-bench audit)", AUDIT_ENVELOPE),
)}
# The columns a train or audit table must have, and the values of columns an older file lacks (kl_bench.results.
# verify checks a run's tables, column by column).
TABLE_COLUMNS: dict[str, tuple[list[str], dict[str, str]]] = {
    "train.csv": (list(TRAIN_SCHEMA), {}),
    "audit.csv": (list(AUDIT_COLUMNS), AUDIT_DEFAULTS),
    "engine.csv": (list(ENGINE_COLUMNS), ENGINE_DEFAULTS),
}
# Their text columns (every other column holds numbers: empty cells are NaN, "inf" is infinity).
TEXT: dict[str, set[str]] = {"train.csv": {"case", "combination", "estimator", "mode", "aggregate", "gradients"},
                             "audit.csv": {"source", "estimator", "aggregation"}, "engine.csv": {"convention", "engine_dtype", "cause"}}
# Every data file name any kind stores (a name's size cap in kl_bench.foundation.safe_io is by its name).
DATA_FILES = tuple(dict.fromkeys(n for f in FORMATS.values() for n in f.data_files))
# Every file a results folder of any kind writes under its own name (the checkpoint, written during a run, aside).
FOLDER_FILES = (*DATA_FILES, ENVELOPE)


# ----------------------------------------------------------------------------- writing
def _json_value(v: Any, key: str) -> Any:
    """``v`` as JSON holds it, or a TypeError naming ``key``: dicts with string keys, lists, strings, numbers,
    booleans and null; NaN and ±inf (which JSON has not: an audit's pooled z of no steps) are null; numpy
    scalars are their Python value; anything else (a Path, a tensor, an object) is the writer's bug, not
    something to stringify."""
    if v is None or isinstance(v, (bool, str, int)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return _json_object(v, key)
    if isinstance(v, (list, tuple)):
        return [_json_value(x, f"{key}[{i}]") for i, x in enumerate(v)]
    item = getattr(v, "item", None)                      # numpy scalars (np.float64 is a float already)
    if callable(item) and getattr(v, "shape", None) == () and type(v).__module__ == "numpy":
        return _json_value(item(), key)
    raise TypeError(f"{ENVELOPE}: {key} holds a {type(v).__module__}.{type(v).__qualname__}, which JSON cannot "
                    "hold: convert it where the envelope is built")


def _json_object(v: dict, key: str) -> dict:
    out = {}
    for k, x in v.items():
        if not isinstance(k, str):
            raise TypeError(f"{ENVELOPE}: key {key}.{k!r} is not a string")
        out[k] = _json_value(x, f"{key}.{k}" if key else k)
    return out


def envelope_bytes(envelope: dict[str, Any]) -> bytes:
    """run.json's bytes: the envelope as strict JSON (see :func:`_json_value`), indented, one final newline."""
    return (json.dumps(_json_value(envelope, ""), indent=2, allow_nan=False) + "\n").encode()


def stored_files(kind: str, files: dict[str, bytes], envelope: dict[str, Any]) -> dict[str, bytes]:
    """The files of a folder of ``kind``: ``files`` (its data files, each one the kind stores, the required
    ones present) and run.json (``envelope`` with the kind's version and every file's sha256)."""
    fmt = FORMATS[kind]
    unknown = sorted(set(files) - set(fmt.data_files))
    missing = sorted(set(fmt.required) - set(files))
    if unknown or missing:                               # a writer's bug: the format is the contract
        raise ValueError(f"a {kind} folder stores {', '.join(fmt.data_files)}; got {sorted(files)}")
    env = {fmt.version_key: fmt.version, **envelope}      # the version first; a writer's own value kept
    env["files"] = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    return {**files, ENVELOPE: envelope_bytes(env)}


def write(kind: str, directory: str | Path, files: dict[str, bytes], envelope: dict[str, Any], *,
          locked: bool = False) -> Path:
    """Write a folder of ``kind`` atomically under its lock (a crashed writer's leftovers cleaned first;
    ``locked``: the caller holds the lock already). Entries this write does not produce are carried over (a
    report, notes), but no data file of any kind: one an earlier write left would be unrecorded in the new
    run.json. A full disk or a read-only mount is one line, the old folder untouched. Returns the folder."""
    from ..foundation.storage import write_folder, write_locked
    stored = stored_files(kind, files, envelope)
    if locked:
        write_folder(Path(directory), stored, DATA_FILES)
        return Path(directory)
    return write_locked(Path(directory), stored, DATA_FILES)


# ----------------------------------------------------------------------------- reading
def json_type(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def read_bytes(path: Path) -> bytes:
    """A stored file's bytes (regular files only, capped by its name's kind)."""
    return read_regular(path, path.name if path.name in FOLDER_FILES else ENVELOPE, path.name)


def read_envelope(path: Path) -> dict:
    """run.json as a dict; anything else (not UTF-8, not JSON, not an object) is an error."""
    path = Path(path)
    env = parse_json(read_bytes(path), path, ENVELOPE)
    if not isinstance(env, dict):
        raise SpecError(f"run.json must hold a JSON object, not {json_type(env)} (corrupted?)", file=str(path))
    for key, (typ, what, nullable, inner) in ENVELOPE_TYPES.items():
        got = _wrong_type(env[key], typ, nullable, inner) if key in env else None
        if got:
            raise SpecError(f"run.json: '{key}' must be {what}, not {got} (corrupted?)", file=str(path))
    return env


def _is(v: Any, types: tuple) -> bool:
    return isinstance(v, types) and (bool in types or not isinstance(v, bool))     # True is an int to Python


def _wrong_type(v: Any, types: tuple, nullable: bool, inner: tuple | None) -> str | None:
    """What ``v`` is, in words, if it is not of ``types`` (or an object whose values are not of ``inner``)."""
    if v is None and nullable:
        return None
    if not _is(v, types):
        return json_type(v)
    odd = next((x for x in v.values() if not _is(x, inner)), None) if inner and isinstance(v, dict) else None
    return None if odd is None else f"an object holding {json_type(odd)}"


_NUMBER = (int, float)
# The type of each envelope field a reader uses: key → (types, words, may be null, type of an object's values).
ENVELOPE_TYPES: dict[str, tuple[tuple, str, bool, tuple | None]] = {
    "files": ((dict,), "an object", False, (str,)), "dropped": ((dict,), "an object", False, (str,)),
    "cases": ((dict,), "an object of objects", False, (dict,)), "experiment": ((str,), "a string", False, None),
    "draws_per_case": ((dict, int), "an object of whole numbers", False, (int,)),
    "seed": ((int,), "a whole number", True, None), "batches": ((int,), "a whole number", True, None),
    "restored_draws": ((int,), "a whole number", True, None), "world_size": ((int,), "a whole number", True, None),
    "wall_seconds": (_NUMBER, "a number", True, None), "sampling_seconds": (_NUMBER, "a number", True, None),
    "draws_per_second": (_NUMBER, "a number", True, None), "resumed": ((bool,), "true or false", True, None),
    "spec_path": ((str,), "a string", True, None), "spec_sha256": ((str,), "a string", True, None),
    "device": ((str,), "a string", True, None), "device_name": ((str,), "a string", True, None),
    "created": ((str,), "a string", True, None), "git_commit": ((str,), "a string", True, None),
    "versions": ((dict,), "an object", True, None), "train": ((dict,), "an object", True, None),
    "pooled": ((dict,), "an object", True, (dict,)), "sampler": ((str,), "a string", True, None),
}


def format_of(envelope: dict, where: str) -> FolderFormat:
    """The kind an envelope records (by its version key). A folder written before run.json had a version
    (a run's) records none: then the kind whose required table is there, a run's by default."""
    kinds = [f for f in FORMATS.values() if f.version_key in envelope]
    if len(kinds) > 1:
        raise SpecError(f"run.json records more than one kind of folder ({', '.join(f.kind for f in kinds)}; "
                        "corrupted?)", file=where)
    if kinds:
        return kinds[0]
    folder = Path(where).parent
    return next((f for f in FORMATS.values() if f.kind != "run" and all((folder / n).is_file() for n in f.required)),
                FORMATS["run"])


def version_of(envelope: dict, fmt: FolderFormat, where: str) -> int:
    """The format version run.json records (1 where it records none); one line if it is not one we read."""
    version = envelope.get(fmt.version_key, 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise SpecError(f"run.json: {fmt.version_key} = {version!r} is not a results format version", file=where)
    if version > fmt.version:
        raise SpecError(f"written by a newer kl-bench ({fmt.kind} folder format {version}; this one reads up to "
                        f"{fmt.version}): upgrade kl-bench to read it", file=where)
    return version


def require_folder(path: str | Path) -> Path:
    """``path`` if it is a folder; else one line saying what it is (absent, a file, a FIFO, a dangling link)."""
    folder = Path(path)
    if not folder.is_dir():
        what = describe(folder)
        raise SpecError("not a results folder (it does not exist)" if what is None
                        else f"not a results folder (it is {what})", file=str(folder))
    return folder


def kind_of(path: str | Path) -> str:
    """A stored folder's kind ("run", "train", "audit"), from its run.json (read, not trusted further)."""
    folder = require_folder(path)
    if not os.path.lexists(folder / ENVELOPE):
        raise SpecError("not a kl-bench folder: run.json is missing (written by `kl-bench run`, `kl-bench "
                        "train` or the trainer audit)", file=str(folder))
    return format_of(read_envelope(folder / ENVELOPE), str(folder / ENVELOPE)).kind


def is_kind(path: str | Path, kind: str) -> bool:
    """Whether ``path`` holds a run.json saying it is a ``kind`` folder (False without one)."""
    return (Path(path) / "run.json").is_file() and kind_of(path) == kind


def check_replaceable(folder: str | Path, kind: str, key: str = "--out", spec=None) -> None:
    """Refuse, before any work, to replace a folder of another kind's results (`kl-bench audit --out` over a
    run's folder had deleted its summary.csv and batches.csv in silence): a folder of the same kind is
    replaced, as always; one whose run.json cannot be read is not judged here. Also refused: a folder whose
    writing would replace what the command reads, ``spec`` (a loaded spec: its file and the files its text
    names) at a name the folder writes (a spec saved as DIR/run.json, run with --out DIR, had been replaced
    by the results)."""
    folder = Path(folder)
    if spec is not None:
        _check_reads_kept(folder, [(Path(spec.path), "the spec"),
                                   *((f, "a file the spec reads") for f in spec.referenced_files())], key)
    if not (folder / ENVELOPE).is_file():
        return
    try:
        held = kind_of(folder)
    except SpecError:
        return
    if held != kind:
        raise SpecError(f"holds kl-bench {held} results (its run.json): only a {kind} folder is replaced here; "
                        "choose another folder, or remove this one first", file=str(folder), key=key)


def _check_reads_kept(folder: Path, reads: list[tuple[Path, str]], key: str) -> None:
    """Refuse a read (path, what) that the folder's writing replaces: one of its results files, run.json or
    the checkpoint (the files a folder of any kind writes; everything else in it is kept)."""
    writes = (*FOLDER_FILES, CHECKPOINT)
    for path, what in reads:
        if path.name in writes and same_path(path.parent, folder):
            raise SpecError(f"would replace {what} ({path}): writing the results there replaces its {path.name}; "
                            "move the file, or choose another folder", file=str(folder), key=key)


def check_file_list(files: dict, where: str) -> None:
    """run.json's ``files``: plain file names, each with a sha256."""
    for name, digest in files.items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise SpecError(f"run.json: 'files' names an invalid file {name!r} (corrupted?)", file=where)
        if not isinstance(digest, str) or not _SHA.match(digest):
            raise SpecError(f"run.json: 'files' has no valid sha256 for {name} (got {digest!r})", file=where)


def check_recorded(folder: Path, env: dict, present: list[str]) -> None:
    """Every data file that is there (whatever it is: a FIFO, a link) is recorded in run.json and every
    recorded one is there, before any is read; a file recorded as dropped (:func:`drop`) may be absent."""
    files = env.get("files")
    if files is None:
        if any(f.version_key in env for f in FORMATS.values()):   # every versioned writer records them
            raise SpecError("run.json records no 'files' (the sha256 of each data file), which kl-bench always "
                            "writes (edited?)", file=str(folder / ENVELOPE))
        return                   # written before run.json recorded hashes: nothing to compare with
    check_file_list(files, str(folder / ENVELOPE))
    dropped = env.get("dropped") or {}
    if not isinstance(dropped, dict):
        raise SpecError(f"run.json: 'dropped' must be an object, not {json_type(dropped)} (corrupted?)",
                        file=str(folder / ENVELOPE))
    check_file_list(dropped, str(folder / ENVELOPE))
    for name in present:
        if name not in files and name not in dropped:
            raise SpecError(f"{name} is not recorded in run.json (left over from another run?)",
                            file=str(folder / name))
    for name in files:
        if not os.path.lexists(folder / name):
            raise SpecError(f"{name} is missing but run.json records it (incomplete copy?)", file=str(folder))


def check_hashes(folder: Path, env: dict, blobs: dict[str, bytes]) -> None:
    """Every recorded file has the sha256 run.json records (``blobs``: bytes already read, filled in); a dropped
    file that was put back too."""
    files = env.get("files")
    if files is None:            # written before run.json recorded hashes: nothing to compare with
        return
    back = {n: d for n, d in (env.get("dropped") or {}).items() if n in blobs}
    for name, digest in {**back, **files}.items():
        p = folder / name
        data = blobs.get(name)
        if data is None:
            data = blobs[name] = read_bytes(p)
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            bom = "; it starts with a byte-order mark, as a spreadsheet saves one" if data.startswith(BOM) else ""
            raise SpecError(f"sha256 mismatch: the file changed after it was written (corrupted, truncated or "
                            f"edited{bom}; run.json records {digest[:12]}…, the file has {actual[:12]}…)", file=str(p))


def drop(path: str | Path, names: list[str]) -> Path:
    """Leave data files out of a stored folder (the committed results/ keep summaries, figures and the tables a
    report reads, not per-draw reservoirs): the folder is verified first, each file's entry moves from run.json's
    ``files`` to ``dropped`` (name → sha256: a file put back is verified again), run.json is rewritten
    atomically, then the files are removed. Only a kind's :attr:`FolderFormat.droppable` files."""
    from ..foundation.atomic import atomic_write_bytes
    stored = read(path)
    fmt = FORMATS[stored.kind]
    bad = [n for n in names if n not in fmt.droppable]
    if bad:
        raise SpecError(f"{', '.join(bad)}: a {fmt.kind} folder may leave out "
                        + (f"only {', '.join(fmt.droppable)}" if fmt.droppable else "no file"),
                        file=str(stored.path))
    env = dict(stored.envelope)
    files, dropped = dict(env["files"]), dict(env.get("dropped") or {})
    for n in names:
        if n in files:
            dropped[n] = files.pop(n)
    env["files"], env["dropped"] = files, dropped
    atomic_write_bytes(stored.path / ENVELOPE, envelope_bytes(env))
    for n in names:
        (stored.path / n).unlink(missing_ok=True)
    return stored.path


def require_kind(folder: Path, fmt: FolderFormat, kind: str) -> None:
    """One line if the folder is not of ``kind``, saying what it is."""
    if fmt.kind != kind:
        raise SpecError(f"{with_article(fmt.kind)} folder (written by {fmt.writer}), not {with_article(kind)} folder (written by "
                        f"{FORMATS[kind].writer})", file=str(folder))


def with_article(kind: str) -> str:
    """'a run', 'a train', 'an audit'."""
    return f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"


@dataclass(frozen=True)
class Stored:
    """A verified folder: its kind, run.json decoded, the bytes of every data file present."""
    kind: str
    path: Path
    envelope: dict
    files: dict[str, bytes]
    version: int


def read(path: str | Path, kind: str | None = None) -> Stored:
    """A stored folder verified (see the module docstring): of ``kind`` if given (another kind is one line
    saying what the folder is), its required files present, every file against its recorded sha256."""
    folder = require_folder(path)
    if not os.path.lexists(folder / ENVELOPE):
        want = f"{with_article(kind)} folder, written by {FORMATS[kind].writer}" if kind else "a kl-bench folder"
        raise SpecError(f"not {want}: run.json is missing", file=str(folder))
    env = read_envelope(folder / ENVELOPE)
    where = str(folder / ENVELOPE)
    fmt = format_of(env, where)
    if kind is not None:
        require_kind(folder, fmt, kind)
    for name in fmt.required:
        if not os.path.lexists(folder / name):
            raise SpecError(f"incomplete {fmt.kind} folder: {name} is missing", file=str(folder))
    present = [n for n in fmt.data_files if os.path.lexists(folder / n)]
    check_recorded(folder, env, present)
    blobs = {n: read_bytes(folder / n) for n in present}
    check_hashes(folder, env, blobs)
    return Stored(fmt.kind, folder, env, blobs, version_of(env, fmt, where))


def read_table(stored: Stored, name: str):
    """Table ``name`` of a verified train or audit folder as a DataFrame (the one CSV reader), or None where
    the folder has none: its CSV structure checked, its columns present (an older file's missing columns
    filled with :data:`TABLE_COLUMNS`' defaults, text "expected_b" meaning: that column's values), rows there
    and every number a number."""
    if name not in stored.files:
        return None
    p = stored.path / name
    columns, defaults = TABLE_COLUMNS[name]
    df = parse_csv(stored.files[name], p, [c for c in columns if c not in defaults])
    check_numeric_columns(df, [c for c in columns if c in df.columns and c not in TEXT[name]], p)
    check_whole_columns(name, df, p)
    for c, value in defaults.items():
        if c not in df.columns:
            df[c] = df[value] if value in df.columns else value if c in TEXT[name] else float(value)
    return df[columns + [c for c in df.columns if c not in columns]]
