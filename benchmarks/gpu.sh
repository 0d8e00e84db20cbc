#!/usr/bin/env bash
# The GPU table (issue 33) in one command, from the repository root on a machine with CUDA: every sampling
# path (tokens at 10^8 and 10^10 draws, counts at 10^10, rollouts at 10^6 × T 256 × V 50,257 × C 256,
# rollout gradients at 10^6, the audit's stream_kl/stream_values at V 151,936) against its raw limit and
# its plain baseline, with the device's name, each pipeline's peak GPU memory and the run's time
# (benchmarks/bench_gpu.py). Paste the table into benchmarks/README.md's "GPU table" with the device it names.
#
#   benchmarks/gpu.sh                 # the table on cuda (extra arguments go to bench_gpu.py)
#   benchmarks/gpu.sh --trainer       # then the audit's share of a GRPO step at Qwen2-0.5B's shape (needs trl)
#   benchmarks/gpu.sh --tests         # first the CUDA tests (test_cuda.py, test_multinomial.py, test_rollout_blocks.py),
#                                     # with whatever pytest plugins the machine has (pytest-benchmark too)
#   benchmarks/gpu.sh --profile [PATH ...]   # after the table, these paths (default all) under torch's profiler
#   benchmarks/gpu.sh --ops [PATH ...]       # and each path's ATen operations per call (its kernel launches)
#   benchmarks/gpu.sh --smoke         # tiny sizes on the CPU: what CI runs, so that the table cannot rot
set -euo pipefail
PY=${PYTHON:-python3}          # the interpreter that holds torch (a GPU image may have no plain `python`)
cd "$(dirname "$0")/.."
# The checkout's own kl_bench, also where it is not installed (a GPU image's interpreter): a script sees only
# its own folder (benchmarks/) on its path.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ "${1:-}" == "--smoke" ]]; then
    shift
    exec "$PY" benchmarks/bench_gpu.py --smoke "$@"
fi
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu.sh: no CUDA device (gpu.sh --smoke runs the table on the CPU)')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
tests=0 trainer=0 rest=()
for arg in "$@"; do                         # --tests and --trainer anywhere; the rest goes to bench_gpu.py
    case "$arg" in
        --tests) tests=1 ;;
        --trainer) trainer=1 ;;
        *) rest+=("$arg") ;;
    esac
done
set -- "${rest[@]+"${rest[@]}"}"
failed=0
if (( tests )); then
    # No '-p no:benchmark': the test configuration must stand the plugins a GPU machine has (issue 33).
    # A failing test is reported, and the table still runs (a lease of a GPU is short): gpu.sh then exits 1.
    # pyproject's addopts name xdist's --dist: without xdist they are replaced by the rest of them.
    workers=(-o "addopts=--strict-markers -ra -m 'not slow'")
    "$PY" -c "import xdist" 2>/dev/null && workers=(-n 4)
    "$PY" -m pytest -q "${workers[@]+"${workers[@]}"}" tests/test_cuda.py tests/test_multinomial.py tests/test_rollout_blocks.py -rs --durations=8 \
        || failed=1
fi
"$PY" benchmarks/bench_gpu.py --device cuda "$@" || failed=1
# The audit as KLAudit calls it (table C), eager and fused (a Triton compile at the first call).
"$PY" benchmarks/bench_audit_called.py --device cuda --rows "grpo,grpo fused=True" --repeat 3 || failed=1
if (( trainer )); then
    # The audit's share of a TRL GRPO step at Qwen2-0.5B's shape on this GPU (needs trl; issue 32).
    "$PY" benchmarks/bench_audit.py --no-layer --device cuda --layers 24 --steps 3 --repeat 2 || failed=1
fi
exit "$failed"
