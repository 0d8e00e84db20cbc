#!/usr/bin/env bash
# Re-run every committed experiment into results/<name>/ (with its report) and refresh the CI gate's
# baseline. kl-bench computes with one intra-op thread per process, so two experiments run side by side.
# Usage: tools/regenerate_results.sh [name ...]   (default: every experiment that has a results folder)
set -euo pipefail
cd "$(dirname "$0")/.."
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for d in results/*/; do d=${d%/}; d=${d#results/}; [ "$d" != baselines ] && names+=("$d"); done
fi
one() { kl-bench run "experiments/$1.toml" --out "results/$1" --quiet && kl-bench report "results/$1" > /dev/null && echo "regenerated results/$1"; }
running=0
for n in "${names[@]}"; do
  one "$n" & running=$((running + 1))
  if [ "$running" -ge 2 ]; then wait -n; running=$((running - 1)); fi
done
wait
kl-bench baseline experiments/ci.toml --out results/baselines/ci.json --quiet > /dev/null && echo "refreshed results/baselines/ci.json"
