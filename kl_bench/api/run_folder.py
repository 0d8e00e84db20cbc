"""A run written to its results folder, as ``kl-bench run`` does it, for a script too: the folder's lock,
checkpoints and ``resume``, progress, the torchrun handshake, interrupts that leave a true account of
what was written, and the atomic write (:func:`run_to_folder`)."""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch

from ..foundation import signals
from .execution import execute
from .inputs import number_argument, path_argument
from .preparation import prepare, resolve_device
from .result import Result
from .trajectories import train
from ..engine.distributed import SINGLE, RankFailure, Ranks, env_world
from ..foundation.errors import SpecError, argument
from ..experiment.case import total_draws
from ..foundation.progress import LazyProgress
from ..results.checkpoint import CHECKPOINT, OLD_CHECKPOINT, checkpoint_identity, load_checkpoint, remove_checkpoint, save_checkpoint
from ..results.folders import check_replaceable
from ..results.verify import DATA_FILES
from ..foundation.safe_io import check_folder_entries, check_write_target
from ..experiment.spec import load_spec
from ..foundation.atomic import fs_error
from ..foundation.locks import FolderLock
from ..foundation.output_paths import check_output_dir, output_dir
from ..foundation.storage import clean_stale, committed

DEFAULT_RUNS = Path("runs")        # where a run goes without an output folder (git-ignored)


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by SIGINT, SIGTERM or SIGHUP; ``message`` says in one line what was (not) written."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class RankFailed(RankFailure):
    """Another process of a torchrun job failed; ``rank`` is this process's rank."""

    def __init__(self, rank: int, why: str):
        super().__init__(f"rank {rank}: {why}; no results were written")
        self.rank = rank


class Handshake:
    """Under torchrun, rank 0 checks the output folder and reads the checkpoint alone, then tells the other
    ranks to start (with the resumed sums) or to stop (it has reported an error): :meth:`send` once, or
    :meth:`cancel`."""

    def __init__(self):
        self.ranks: Ranks = SINGLE
        self.sent = False

    def join(self, prep) -> Ranks:
        from ..engine.distributed import start
        self.ranks, prep.device = start(prep.device)
        return self.ranks

    def send(self, done) -> None:
        self.sent = True
        self.ranks.broadcast(done)

    def cancel(self) -> None:
        if self.ranks.root and self.ranks.world_size > 1 and not self.sent:
            self.sent = True
            with contextlib.suppress(RankFailure):
                self.ranks.broadcast(None)

    def close(self) -> None:
        if self.ranks.world_size > 1:
            from ..engine.distributed import stop
            stop()


def run_to_folder(spec, out: str | Path | None = None, *, draws: int | None = None, seed: int | None = None,
                  device: str | None = None, resume: bool = False, checkpoint_every: float = 30.0,
                  progress: bool = False, console=None) -> Result | None:
    """Run ``spec`` and write its results folder (default ``runs/<name>/``) atomically, as ``kl-bench
    run`` does: a concurrent run on the folder is refused, a checkpoint is written at most every
    ``checkpoint_every`` seconds (``inf``: never) and ``resume=True`` continues from it, giving the bytes
    of an uninterrupted run. ``progress``: a bar (or log lines) on ``console`` (default stderr).

    Under torchrun every process calls it; rank 0 writes and returns the :class:`Result`, the others
    return None. Raises :class:`SpecError` for bad input, :class:`RunInterrupted` (with its one line) on
    SIGINT/SIGTERM/SIGHUP, :class:`RankFailed` when another process of the job failed."""
    if not number_argument(checkpoint_every, argument("checkpoint_every")) > 0:          # also refuses NaN
        raise SpecError(f"must be > 0 (inf: never), got {checkpoint_every}", key=argument("checkpoint_every"))
    hs = Handshake()
    try:
        return _run(hs, spec, out, dict(draws=draws, seed=seed, device=device), resume, checkpoint_every,
                    progress, console)
    except RankFailure as e:
        signals.ignore()          # torchrun's SIGTERM to the survivors must not add a second line
        hs.cancel()
        raise RankFailed(hs.ranks.rank, str(e)) from None
    except BaseException:
        if hs.ranks.world_size > 1:
            signals.ignore()
        hs.cancel()
        raise
    finally:
        hs.close()


def _run(hs: Handshake, spec, out, overrides: dict, resume: bool, every: float, progress: bool,
         console) -> Result | None:
    prep = prepare(spec, **overrides)
    if not hs.join(prep).root:
        return _follow(prep, hs.ranks)
    signals.phase("pairs")
    sp = prep.spec
    out_dir = output_dir(path_argument(out, argument("out")) if out is not None else DEFAULT_RUNS / sp.experiment.name)
    if resume:
        _require_checkpoint(out_dir)                        # before anything is created
    out_dir = check_output_dir(out_dir)
    check_replaceable(out_dir, "run", spec=sp)       # nor a folder whose writing replaces the spec (DIR/run.json)
    # Something that is not a regular file at a results file's name (a folder, a FIFO, a link): refused
    # now rather than after the sampling (write_folder refuses it again at the write).
    check_folder_entries(out_dir, (*DATA_FILES, "run.json"), key=argument("out"))
    if resume or math.isfinite(every):
        # A symlink, FIFO or folder at the checkpoint's path: refused now, not at the first checkpoint's
        # write after minutes of sampling (and a resume never reads through a link).
        check_write_target(out_dir / CHECKPOINT, key=argument("resume") if resume else argument("out"))
    case_draws = sp.case_draws()
    identity = checkpoint_identity(sp, prep.device, case_draws)
    with FolderLock(out_dir):
        clean_stale(out_dir)
        done = _restored(out_dir, identity, sp, case_draws) if resume else {}
        hs.send(done)
        saver = _Checkpoints(out_dir, identity, done, every)
        bar = LazyProgress(total_draws(sp), enabled=progress, console=console)
        try:
            result = execute(prep, progress=bar, resume=done, on_sums=saver.on_sums, ranks=hs.ranks)
        except KeyboardInterrupt:
            bar.close()
            why = " (a process of the torchrun job failed, or the job was stopped)" if hs.ranks.world_size > 1 else ""
            earlier = f"; earlier results in {out_dir} are untouched" if (out_dir / "run.json").exists() else ""
            raise RunInterrupted(f"interrupted{why}: no results were written{earlier}"
                                 + ("; continue with --resume (resume=True in Python)" if saver.save_now() else "")) from None
        finally:
            bar.close()
        _write(result, out_dir)
    return result


class RefusedByRankZero(Exception):
    """A rank other than 0 stops: rank 0 refused the run and has said why (nothing more to print)."""


def _require_checkpoint(out_dir: Path) -> None:
    """--resume without a checkpoint to resume (or with one of an older kl-bench): one line."""
    if not (out_dir / CHECKPOINT).exists():
        raise SpecError(f"the checkpoint was written by an older kl-bench ({OLD_CHECKPOINT}); rerun without resuming"
                        if (out_dir / OLD_CHECKPOINT).exists() else
                        "nothing to resume: no checkpoint in the results folder", file=str(out_dir), key=argument("resume"))


def _restored(out_dir: Path, identity: dict, sp, case_draws: list[int]) -> dict[str, torch.Tensor]:
    """The checkpoint's sums (checked against the run: its identity, its cases and their batches) as tensors."""
    batches = {c.name: min(sp.experiment.batches, n) for c, n in zip(sp.cases, case_draws)}
    return {case: torch.from_numpy(s) for case, s in load_checkpoint(out_dir, identity, batches).items()}


def _follow(prep, ranks: Ranks) -> None:
    """A rank other than 0: draw its share of the batches; rank 0 writes and reports everything."""
    done = ranks.broadcast(None)
    if done is None:
        raise RefusedByRankZero()
    execute(prep, resume=done, ranks=ranks)
    return None


def _write(result: Result, out_dir: Path) -> None:
    try:
        signals.phase("write")
        result.write_files(out_dir)
        signals.phase("written")
        remove_checkpoint(out_dir)
    except KeyboardInterrupt:
        raise RunInterrupted(interrupt_line(out_dir, "results", "earlier results in {out} are untouched"
                                            if (out_dir / "run.json").exists() else "nothing was written")) from None
    except OSError as e:
        raise fs_error(e, out_dir) from None


def train_to_folder(spec, out: str | Path | None = None, *, seed: int | None = None, device: str | None = None,
                    progress: bool = False, console=None):
    """Train ``spec`` (a [train] table) and write its folder (default ``runs/<name>/``: train.csv and run.json,
    swapped in whole), as ``kl-bench train`` does. Under torchrun every process calls it: the units are split
    across the processes (one process group for the job), rank 0 writes and returns the
    :class:`kl_bench.training.TrainResult`, the others None; a failed rank is one line on every rank."""
    from ..engine.distributed import start, stop      # looked up when called: tests/kl_test_hooks.py wraps start
    sp = load_spec(spec)
    from ..training.config import parse_train     # what the spec lacks is said before what --out holds
    parse_train(sp.train, str(sp.path), sp.path.parent)
    out_dir = check_output_dir(output_dir(path_argument(out, argument("out")) if out is not None
                                          else DEFAULT_RUNS / sp.experiment.name))
    check_replaceable(out_dir, "train", spec=sp)
    if env_world() is None:
        result = train(sp, seed=seed, device=device, progress=progress, console=console)
    else:
        dev = resolve_device(device or sp.experiment.device, str(sp.path),
                             argument("device") if device is not None else "experiment.device")
        try:
            ranks, dev = start(dev)
            result = train(sp, seed=seed, device=str(dev), ranks=ranks, progress=progress, console=console)
        except RankFailure as e:
            raise SpecError(str(e)) from None
        finally:
            stop()
    if result is not None:
        result.write(out_dir)
    return result


class _Checkpoints:
    """The main passes' sums so far, saved at most every ``every`` seconds (and once more on an interrupt)."""

    def __init__(self, out_dir: Path, identity: Any, done: dict, every: float):
        self.out_dir, self.identity, self.every = out_dir, identity, every
        self.state = dict(done)
        self.last = time.monotonic()

    def on_sums(self, case: str, sums) -> None:
        self.state[case] = sums
        if time.monotonic() - self.last >= self.every:
            try:
                save_checkpoint(self.out_dir, self.identity, self.host_sums())
            except OSError as e:
                raise fs_error(e, self.out_dir, "cannot write a checkpoint") from None
            self.last = time.monotonic()

    def host_sums(self) -> dict:
        """The sums so far as float64 arrays on the host (a checkpoint holds numpy arrays, no torch)."""
        return {case: s.detach().cpu().numpy() for case, s in self.state.items()}

    def save_now(self) -> bool:
        """After an interrupt: save what was drawn, if checkpoints are on; whether one was saved."""
        if not (math.isfinite(self.every) and self.state):
            return False
        with contextlib.suppress(OSError):
            save_checkpoint(self.out_dir, self.identity, self.host_sums())
            return True
        return False


def interrupt_line(out: Path, what: str, untouched: str) -> str:
    """The truth after an interrupt while ``out`` was being written: whether the new contents are in."""
    if committed(out):
        return f"interrupted after the {what} were written to {out} (they are complete)"
    return f"interrupted while writing: no {what} were written; " + untouched.format(out=out)
