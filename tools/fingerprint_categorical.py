"""Fingerprint every experiment that has a categorical case, at reduced draws, so that a change to the
categorical sampling paths can show its numbers did not move on the CPU (issue 33: "numbers must not move").

    python tools/fingerprint_categorical.py run OUT [--draws N]   # writes OUT/<name>/ and OUT/fingerprint.json
    python tools/fingerprint_categorical.py compare BEFORE AFTER  # exit 1 on any difference, naming it

`run` runs `kl-bench run SPEC --draws N` (as `python -m kl_bench` in the checkout that holds this script, so
its own code runs: to fingerprint another commit, `git archive COMMIT | tar -x -C /tmp/base`, copy this
script and tools/fingerprint.py, whose hashing and comparison it shares, to /tmp/base/tools/ and run it
there) for every experiments/*.toml with a case of kind "categorical",
each into OUT/<name>/, on the CPU with one thread (kl-bench's default). Choose N so that the batches take
the path under test: a batch of n draws over M (context, token) ids takes the count vector when n ≥ M under
`sampling = "auto"`, the token path below (sparse ids when 8n < M). The fingerprint holds the sha256 of
every file; run.json is hashed after removing what legitimately changes between runs (times, speeds,
versions, the git commit, the creation date) and the files' own sha256 entries. Two fingerprints of the
same code, seed and machine are identical; `compare` prints which folder and file differ. (tools/fingerprint.py
does the same for rollout specs.)
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from fingerprint import KL_BENCH, ROOT, compare, fingerprint   # beside this script: one hashing, one comparison


def categorical_specs() -> list[Path]:
    return [p for p in sorted((ROOT / "experiments").glob("*.toml"))
            if re.search(r'^kind\s*=\s*"categorical"', p.read_text(), re.M) and not p.stem.startswith("training")]


def run(out: Path, draws: int, only: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for spec in categorical_specs():
        if only and spec.stem not in only:
            continue
        cmd = [*KL_BENCH, "run", str(spec), "--draws", str(draws), "--out", str(out / spec.stem), "--quiet",
               "--no-checkpoint", "--device", "cpu"]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    (out / "fingerprint.json").write_text(json.dumps(fingerprint(out), indent=1, sort_keys=True) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--draws", type=int, default=20_000)
    r.add_argument("--only", nargs="*", default=[], help="spec names (stems) to run; default: all")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.out, args.draws, args.only)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
