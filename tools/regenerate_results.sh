#!/usr/bin/env bash
# Re-run every committed experiment into results/<name>/ (with its report) and refresh the CI gate's
# baseline. kl-bench computes with one intra-op thread per process, so two experiments run side by side.
# A spec with a [train] table is a training (`kl-bench train`); the others are runs, whose per-draw reservoir
# (reservoir.npz: only the report's ECDF figures read it, and the report is drawn first) and exact gradient
# vectors (gradients.npz: the report does not read them) are then left out of the copy kept in git
# (kl_bench.results.folders.drop: run.json records them under "dropped", with their sha256).
# Usage: tools/regenerate_results.sh [name ...]   (default: every experiment that has a results folder)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for d in results/*/; do d=${d%/}; d=${d#results/}; [ "$d" != baselines ] && names+=("$d"); done
fi
one() {
  if grep -q '^\[train\]' "experiments/$1.toml"; then
    kl-bench train "experiments/$1.toml" --out "results/$1" --quiet
    kl-bench report "results/$1" > /dev/null
  else
    kl-bench run "experiments/$1.toml" --out "results/$1" --quiet
    kl-bench report "results/$1" > /dev/null
    "$PY" -c "import sys; from kl_bench.results.folders import drop; drop(sys.argv[1], ['reservoir.npz', 'gradients.npz'])" "results/$1"
  fi
  echo "regenerated results/$1"
}
running=0
for n in "${names[@]}"; do
  one "$n" & running=$((running + 1))
  if [ "$running" -ge 2 ]; then wait -n; running=$((running - 1)); fi
done
wait
kl-bench baseline experiments/ci.toml --out results/baselines/ci.json --quiet > /dev/null && echo "refreshed results/baselines/ci.json"
