"""Where and with what a result was made (run.json's provenance fields): versions, the git commit, the
device's name, the time."""
from __future__ import annotations

import contextlib
import datetime as _dt
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str]:
    from ..foundation.version import __version__
    out = {"python": platform.python_version(), "kl-bench": __version__}
    for pkg in ("torch", "numpy", "scipy", "pandas"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[pkg] = metadata.version(pkg)
    return out


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()


def now() -> str:
    """The creation time of an envelope: UTC, to the second (ISO 8601)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
