"""Splitting a run across processes (``torchrun --nproc-per-node N -m kl_bench run SPEC``).

Batch i of a case draws from generators seeded by (seed, case, i) alone (kl_bench.sampling.seeding), and its
float64 sums do not depend on which process drew it. So each process (rank) draws a share of the batches,
rank 0 gathers the per-batch rows and puts them back in batch order, and everything computed from them
(summary.csv, batches.csv, lambda_sweep.csv, checkpoints) is byte-identical to a one-process run. Only
rank 0 reads checkpoints, writes files or prints; the other ranks ("followers", :func:`follower`) say
nothing of bad input (every rank reads the same arguments and files: rank 0 says it once), only what
went wrong in their own share of the work, after they joined the job (:func:`joined`).

The main pass goes in rounds: in each round every rank draws one contiguous slice of the next
``world_size × c`` batches and rank 0 gathers them, so after every round rank 0 holds a prefix of the
batches, exactly what a one-process checkpoint holds (``--resume`` works unchanged).

``torch.distributed`` is imported only when a process group is started: ``import kl_bench`` stays light.
"""
from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator

from ..foundation.errors import SpecError

# Seconds a collective waits for the other ranks before giving up (a rank that hangs, or a job started
# by hand without torchrun's teardown). Generous: rank 0 works alone on some phases (small-batch
# simulation, gradient passes whose totals cannot be merged exactly) while the others wait.
TIMEOUT_ENV = "KL_BENCH_DIST_TIMEOUT"
DEFAULT_TIMEOUT = 1800.0


class RankFailure(Exception):
    """Another rank failed (or a collective timed out): the job stops, and nothing is written."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job. ``Ranks()`` is a one-process run (no collectives)."""
    rank: int = 0
    world_size: int = 1

    @property
    def root(self) -> bool:
        return self.rank == 0

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj``, in rank order, on rank 0; None on the others."""
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist
        out = [None] * self.world_size if self.root else None
        _collective(lambda: dist.gather_object(obj, out, dst=0))
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled: floats and tensors arrive bit for bit)."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist
        box = [obj if self.root else None]
        _collective(lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist
            _collective(dist.barrier)


SINGLE = Ranks()


def _collective(fn) -> None:
    try:
        fn()
    except KeyboardInterrupt:
        raise
    except Exception as e:      # noqa: BLE001 - gloo and NCCL raise RuntimeError subclasses, or others
        raise RankFailure(f"another process of the job failed or stopped answering ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    """The gist of a backend error: its first line without gloo's "[file.cc:NNN]" source location."""
    import re
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    line = re.sub(r"^\[[^\]]*\]\s*", "", line).split(". ")[0]     # gloo adds advice after the first sentence
    return line[:120]


def rounds(first: int, total: int, per_chunk: int, ranks: Ranks) -> Iterator[tuple[int, int, int, int]]:
    """(start, stop, lo, hi) of each round of a pass over batches ``first``..``total``: the round covers
    batches [start, stop), this rank draws [lo, hi) of them (possibly none). The slice per rank is at
    most ``per_chunk`` batches, and small enough that every rank gets work."""
    w = ranks.world_size
    c = max(1, min(per_chunk, math.ceil((total - first) / w))) if total > first else 1
    for start in range(first, total, c * w):
        stop = min(start + c * w, total)
        lo = min(start + ranks.rank * c, stop)
        yield start, stop, lo, min(lo + c, stop)


def drawn_by_rank(first: int, total: int, per_chunk: int, world_size: int) -> list[list[list[int]]]:
    """The batches each rank draws in a pass (run.json): per rank, merged [lo, hi) ranges."""
    out: list[list[list[int]]] = []
    for r in range(world_size):
        ranges: list[list[int]] = []
        for _, _, lo, hi in rounds(first, total, per_chunk, Ranks(r, world_size)):
            if hi <= lo:
                continue
            if ranges and ranges[-1][1] == lo:
                ranges[-1][1] = hi
            else:
                ranges.append([lo, hi])
        out.append(ranges)
    return out


def block(total: int, ranks: Ranks) -> tuple[int, int]:
    """Rank r's contiguous block [lo, hi) of ``total`` batches (a pass without checkpoints)."""
    return total * ranks.rank // ranks.world_size, total * (ranks.rank + 1) // ranks.world_size


TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _alone(env: dict[str, str]) -> bool:
    """No torchrun variable, or only those of a one-process job (WORLD_SIZE 1, RANK 0, no address)."""
    return not env or (env.get("WORLD_SIZE", "1").strip() == "1" and set(env) <= {"WORLD_SIZE", "RANK", "LOCAL_RANK"}
                       and env.get("RANK", "0").strip() == "0")


def _env_numbers(env: dict[str, str]) -> tuple[int, int, int]:
    """(world size, rank, local rank) as integers; a value that is not a whole number is refused."""
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        return world, rank, int(env.get("LOCAL_RANK", str(rank)))
    except ValueError:
        bad = next(k for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in env and not env[k].strip().isdigit())
        raise SpecError(f"torchrun environment: {bad}={env[bad]!r} is not a whole number", key=bad) from None


def env_world() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun with more than one process, else None.

    A torchrun environment that is only partly there, or inconsistent (a rank outside the world, a
    value that is not a number), is refused in one line: silently running alone would write a whole
    result per process into the same folder, and joining would wait for ranks that never come."""
    env = {k: os.environ[k] for k in TORCHRUN_ENV if k in os.environ}
    if _alone(env):
        return None                 # no torchrun, or a one-process job: run alone
    world, rank, local = _env_numbers(env)
    if world == 1 and rank == 0:
        return None
    _check_world(env, world, rank, local)
    return rank, world, local


def _check_world(env: dict[str, str], world: int, rank: int, local: int) -> None:
    """Every torchrun variable there (LOCAL_RANK aside) and the rank inside the world."""
    missing = [k for k in TORCHRUN_ENV if k not in env and k != "LOCAL_RANK"]
    if missing:
        raise SpecError(f"torchrun environment is incomplete: {', '.join(k + '=' + env[k] for k in env)} set, but not "
                        f"{' or '.join(missing)}; start the job with torchrun, or unset these variables to run in "
                        "one process", key=missing[0])
    if world < 1 or not 0 <= rank < world or local < 0:
        raise SpecError(f"torchrun environment: RANK={rank} must lie in [0, WORLD_SIZE={world})", key="RANK")


def follower() -> int | None:
    """This process's rank when it is a rank other than 0 of a torchrun job of several processes, else None:
    no torchrun, rank 0, or an environment :func:`env_world` refuses (then every process says why). Rank 0
    speaks and writes for the job; a follower of a command that does not split its work exits at once."""
    try:
        env = env_world()
    except SpecError:
        return None
    return env[0] if env is not None and env[0] != 0 else None


_joined = [False]       # set by start(): this process has been part of a torchrun job's process group


def joined() -> bool:
    """Whether this process joined a torchrun job's process group (:func:`start`), even if it has left it
    since: an error it finds from then on is its own share of the work's, not the input every rank reads."""
    return _joined[0]


def one_process(command: str, file: str | None = None) -> None:
    """Refuse, in one line, to run ``command`` under torchrun with more than one process: a command that does
    not split its work across ranks would have every rank do all of it. Nothing heavy is imported first."""
    env = env_world()
    if env is not None:
        raise SpecError(f"{command} runs in one process and is not split across torchrun's {env[1]} processes: "
                        "start it without torchrun (one process writes the same bytes)", file=file)


def start(device) -> tuple[Ranks, Any]:
    """Join torchrun's process group when there is one: gloo on CPU devices, NCCL on CUDA (device
    cuda:LOCAL_RANK). Returns (ranks, device); a one-process run gets (SINGLE, device) unchanged."""
    env = env_world()
    if env is None:
        return SINGLE, device
    rank, world, local = env
    import torch
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT)))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend, timeout=timeout)
        except Exception as e:      # noqa: BLE001
            raise RankFailure(f"cannot join the torchrun job ({backend}): {_first_line(e)}") from None
    _joined[0] = True
    return Ranks(dist.get_rank(), dist.get_world_size()), device


def stop() -> None:
    """Leave the process group, if one was joined."""
    import sys
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:       # noqa: BLE001 - a peer already gone: nothing left to release
            pass
