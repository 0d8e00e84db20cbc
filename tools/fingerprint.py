"""Fingerprint every experiment that has a rollout case, at reduced draws, so that a refactoring can show
its numbers did not move (issue 34, item 5).

    python tools/fingerprint.py run OUT [--draws N] [--steps S] [--every]   # OUT/<name>/, OUT/fingerprint.json
    python tools/fingerprint.py compare BEFORE AFTER              # exit 1 on any difference, naming it

`run` runs `kl-bench run SPEC --draws N` (as `python -m kl_bench` in the
checkout that holds this script, so its own code runs: to fingerprint another commit, `git archive COMMIT |
tar -x -C /tmp/base`, copy this script to /tmp/base/tools/ and run it there) for every experiments/*.toml with a case of kind
"rollout" (with ``--every``: every experiments/*.toml, Gaussian, categorical and model kinds included), and
`kl-bench train` for experiments/training*.toml with [train] steps (and record_every) reduced to S, each
into OUT/<name>/ (one CPU thread: kl-bench's default). The fingerprint holds the sha256 of every file of
every folder; run.json is hashed after removing what legitimately changes between runs (times, speeds,
versions, the git commit, the creation date) and the files' own sha256 entries (their bytes are hashed
directly). Two fingerprints of the same code, seed and machine are identical; `compare` prints which
folder and file differ.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KL_BENCH = [sys.executable, "-m", "kl_bench"]    # run in ROOT: this checkout's kl_bench
VOLATILE = re.compile(r"(^created$|^versions$|^git_commit$|seconds|per_second|^sha256$|^device_name$)")


def rollout_specs(every: bool = False) -> list[Path]:
    """Every experiment spec with a rollout case (``every``: every spec), and the training specs."""
    specs = [p for p in sorted((ROOT / "experiments").glob("*.toml"))
             if every or re.search(r'^kind\s*=\s*"rollout"', p.read_text(), re.M)]
    return sorted(set(specs) | set((ROOT / "experiments").glob("training*.toml")))


def _stable(x):
    """run.json without the fields that change between identical runs."""
    if isinstance(x, dict):
        return {k: _stable(v) for k, v in x.items() if not VOLATILE.search(k)}
    if isinstance(x, list):
        return [_stable(v) for v in x]
    return x


def _reduced_training_spec(spec: Path, steps: int, tmp: Path) -> Path:
    """The training spec with [train] steps (and record_every) at most ``steps``; relative paths kept by
    writing it beside the original's name in a temporary folder that holds links to the spec's folder."""
    text = spec.read_text()
    text = re.sub(r"^steps\s*=\s*\d+", f"steps = {steps}", text, flags=re.M)
    text = re.sub(r"^record_every\s*=\s*\d+", "record_every = 1", text, flags=re.M)
    out = tmp / spec.name
    out.write_text(text)
    return out


def run(out: Path, draws: int, steps: int, every: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if every and not (ROOT / "experiments" / "tiny-models").exists():     # experiments/model.toml's models
        subprocess.run([sys.executable, str(ROOT / "tools" / "build_tiny_models.py")], check=True, cwd=ROOT)
    with tempfile.TemporaryDirectory(dir=ROOT / "experiments") as tmp:
        for spec in rollout_specs(every):
            name, folder = spec.stem, out / spec.stem
            if name.startswith("training"):
                cmd = [*KL_BENCH, "train", str(_reduced_training_spec(spec, steps, Path(tmp))), "--out", str(folder),
                       "--quiet"]
            else:
                cmd = [*KL_BENCH, "run", str(spec), "--draws", str(draws), "--out", str(folder), "--quiet",
                       "--no-checkpoint"]
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
            data.pop("spec_path", None)           # the reduced training specs live in a temporary folder
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
    r.add_argument("--steps", type=int, default=6)
    r.add_argument("--every", action="store_true", help="every experiments/*.toml, not only the rollout ones")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = ap.parse_args()
    if args.cmd == "run":
        run(args.out, args.draws, args.steps, args.every)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
