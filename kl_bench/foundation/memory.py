"""How much memory this process may take (physical memory, a container's cgroup limit, ulimit -v/-d), the
check a case makes before it allocates, and the one line an allocation that fails anyway becomes."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

from .errors import OutOfMemory, is_out_of_memory, memory_words
from .formatting import fmt_bytes

# Bytes per (context, token) cell of a categorical or rollout case: measured peak ~130-170 B (float64
# tables of q, p, log r, b, weights, the alias table built from Python lists), rounded up.
BYTES_PER_CELL = 256


def physical_memory() -> int:
    """Bytes of physical memory of this machine."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):      # not POSIX: assume a generous 1 TiB
        return 1 << 40


def cgroup_memory(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of memory this process's control group may use (a container's limit: cgroup v2 memory.max, v1
    memory.limit_in_bytes), its own group's or the root's, whichever is set and smaller; None where no limit
    is set or none can be read (no /proc, not Linux)."""
    try:
        with open(proc, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    files = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":                          # cgroup v2
            files += [os.path.join(root, parts[2].lstrip("/"), "memory.max"), os.path.join(root, "memory.max")]
        elif "memory" in parts[1].split(","):                           # cgroup v1
            base = os.path.join(root, "memory")
            files += [os.path.join(base, parts[2].lstrip("/"), "memory.limit_in_bytes"),
                      os.path.join(base, "memory.limit_in_bytes")]
    limits = []
    for f in files:
        try:
            with open(f, encoding="ascii", errors="replace") as fh:
                text = fh.read(64).strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:                     # "max", or v1's 2^63 − page: none
            limits.append(int(text))
    return min(limits) if limits else None


def machine_memory() -> tuple[int, str]:
    """(bytes, whose) of the memory this machine gives the process: physical memory ("machine"), or a
    container's limit (:func:`cgroup_memory`, "container") where that is smaller."""
    have, group = physical_memory(), cgroup_memory()
    if group is not None and group < have:
        return group, "container"
    return have, "machine"


# The process limits an allocation meets before physical memory: (resource name, field of
# /proc/self/statm that counts what it limits, the ulimit flag that sets it). RLIMIT_AS counts every
# mapping (torch's libraries too), RLIMIT_DATA the private writable ones (since Linux 4.7).
_PROCESS_LIMITS = (("RLIMIT_AS", 0, "-v"), ("RLIMIT_DATA", 5, "-d"))


def _process_limit() -> tuple[int, int, str] | None:
    """(bytes left, the limit, its ulimit flag) of the tightest address-space limit of this process, or None
    where none is set (or none can be read). Left: the limit less what the process maps now."""
    try:
        import resource
    except ImportError:            # not POSIX: no such limits
        return None
    try:
        with open("/proc/self/statm", "rb") as fh:
            used = [int(x) * os.sysconf("SC_PAGE_SIZE") for x in fh.read().split()]
    except (OSError, ValueError, AttributeError):      # no /proc: the whole limit is taken as left
        used = []
    best = None
    for name, field, flag in _PROCESS_LIMITS:
        try:
            soft = resource.getrlimit(getattr(resource, name))[0]
        except (AttributeError, ValueError, OSError):
            continue
        if soft == resource.RLIM_INFINITY or soft < 0:
            continue
        left = max(0, soft - (used[field] if field < len(used) else 0))
        if best is None or left < best[0]:
            best = (left, soft, flag)
    return best


def memory_limit() -> tuple[int, str]:
    """(bytes, words): the memory this process may still take, the ceiling every in-memory table must fit
    under: physical memory ("this machine's 16 GiB") or a container's limit ("this container's 2 GiB
    (cgroup memory limit)"), or less where a process limit (``ulimit -v``, resource.RLIMIT_AS; ``ulimit -d``)
    leaves less ("the 2.1 GiB left under this process's limit (ulimit -v 2.9 GiB)")."""
    have, whose = machine_memory()
    limit = _process_limit()
    if limit is not None and limit[0] < have:
        left, soft, flag = limit
        return left, f"the {fmt_bytes(left)} left under this process's limit (ulimit {flag} {fmt_bytes(soft)})"
    return have, f"this {whose}'s {fmt_bytes(have)}" + (" (cgroup memory limit)" if whose == "container" else "")


def check_memory(need: float, what: str) -> str | None:
    """An error message when ``need`` bytes exceed the memory this process may take (:func:`memory_limit`),
    else None."""
    have, words = memory_limit()
    if need > have:
        return f"{what} would need about {fmt_bytes(need)} of memory, more than {words}"
    return None


def memory_advice(smaller: str) -> str:
    """What to change after a failed allocation: more memory (saying how much this process may have: this
    machine's, or its ``ulimit``), or ``smaller`` ("a smaller case", "fewer draws at once ...")."""
    (have, whose), limit = machine_memory(), _process_limit()
    if limit is not None and limit[1] < have:
        where = f"ulimit {limit[2]} allows {fmt_bytes(limit[1])}"
    else:
        where = f"this {whose} {'has' if whose == 'machine' else 'allows'} {fmt_bytes(have)}"
    return f"give kl-bench more memory ({where}), or {smaller}"


@contextlib.contextmanager
def out_of_memory_said(doing: str, smaller: str, *, file: str | None = None,
                       case: str | None = None) -> Iterator[None]:
    """Within, a failed allocation (kl_bench.foundation.errors.is_out_of_memory) becomes an
    :class:`~kl_bench.foundation.errors.OutOfMemory`: "FILE: case 'C': out of memory DOING (its words): give
    kl-bench more memory (...), or SMALLER". The failed allocation's frames are let go first (its traceback
    would hold the tables it was building)."""
    try:
        yield
    except OutOfMemory:
        raise
    except (MemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        e.__traceback__ = None
        words = memory_words(e)
        raise OutOfMemory(f"out of memory {doing} ({words}): {memory_advice(smaller)}", file=file,
                          case=case) from None
