"""Peak resident memory of a benchmark step, measured in a fresh Python process.

The child resets its high-water mark after setup (writing 5 to /proc/self/clear_refs) and reads VmHWM
from /proc/self/status: ru_maxrss would include the parent's size, which a forked child inherits.
"""
from __future__ import annotations

import json
import subprocess
import sys


def hwm_mib() -> float:
    """This process's peak resident set size (VmHWM) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_in_child(setup: str, step: str) -> dict:
    """Run ``setup`` then ``step`` (Python source, run in the benchmarks folder's context) in a fresh
    process; returns {'rss_before_mib', 'rss_peak_mib', 'cuda_peak_mib'} for the step."""
    code = (f"import json, sys, torch; sys.path.insert(0, 'benchmarks'); import memory; {setup}; "
            "open('/proc/self/clear_refs', 'w').write('5'); before = memory.hwm_mib(); "
            f"{step}; print(json.dumps({{'rss_before_mib': before, 'rss_peak_mib': memory.hwm_mib(), "
            "'cuda_peak_mib': torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)
