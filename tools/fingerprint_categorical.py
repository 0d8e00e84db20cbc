"""Fingerprint every experiment that has a categorical case, at reduced draws, so that a change to the
categorical sampling paths can show its numbers did not move on the CPU (issue 33: "numbers must not move").

    python tools/fingerprint_categorical.py run OUT [--draws N]   # writes OUT/<name>/ and OUT/fingerprint.json
    python tools/fingerprint_categorical.py compare BEFORE AFTER  # exit 1 on any difference, naming it

`run` runs `kl-bench run SPEC --draws N` (as `python -m kl_bench` in the checkout that holds this script, so
its own code runs: to fingerprint another commit, `git archive COMMIT | tar -x -C /tmp/base`, copy this
script to /tmp/base/tools/ and run it there) for every experiments/*.toml with a case of kind "categorical",
each into OUT/<name>/, on the CPU with one thread (kl-bench's default). Choose N so that the batches take
the path under test: a batch of n draws over M (context, token) ids takes the count vector when n ≥ M under
`sampling = "auto"`, the token path below (sparse ids when 8n < M). The fingerprint holds the sha256 of
every file; run.json is hashed after removing what legitimately changes between runs (times, speeds,
versions, the git commit, the creation date) and the files' own sha256 entries. Two fingerprints of the
same code, seed and machine are identical; `compare` prints which folder and file differ. (The rollout
branch has the same tool for rollout specs, tools/fingerprint.py.)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KL_BENCH = [sys.executable, "-m", "kl_bench"]    # run in ROOT: this checkout's kl_bench
VOLATILE = re.compile(r"(^created$|^versions$|^git_commit$|seconds|per_second|^sha256$|^device_name$|^spec_path$)")


def categorical_specs() -> list[Path]:
    return [p for p in sorted((ROOT / "experiments").glob("*.toml"))
            if re.search(r'^kind\s*=\s*"categorical"', p.read_text(), re.M) and not p.stem.startswith("training")]


def _stable(x):
    """run.json without the fields that change between identical runs."""
    if isinstance(x, dict):
        return {k: _stable(v) for k, v in x.items() if not VOLATILE.search(k)}
    if isinstance(x, list):
        return [_stable(v) for v in x]
    return x


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


def fingerprint(out: Path) -> dict[str, str]:
    fp = {}
    for f in sorted(out.rglob("*")):
        if not f.is_file() or f.name == "fingerprint.json":
            continue
        rel = str(f.relative_to(out))
        if f.name == "run.json":
            data = _stable(json.loads(f.read_text()))
            fp[rel] = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
        else:
            fp[rel] = hashlib.sha256(f.read_bytes()).hexdigest()
    return fp


def compare(before: Path, after: Path) -> int:
    a = json.loads((before / "fingerprint.json").read_text())
    b = json.loads((after / "fingerprint.json").read_text())
    bad = [f"{k}: {'missing after' if k not in b else 'missing before' if k not in a else 'differs'}"
           for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    print("\n".join(bad) if bad else f"identical: {len(a)} files")
    return 1 if bad else 0


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
