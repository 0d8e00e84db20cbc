#!/usr/bin/env bash
# The GPU table (issue 33) in one command, from the repository root on a machine with CUDA: every sampling
# path (tokens at 10^8 and 10^10 draws, counts at 10^10, rollouts at 10^6 × T 256 × V 50,257 × C 256,
# rollout gradients at 10^6, the audit's stream_kl/stream_values at V 151,936) against its raw limit and
# its plain baseline, with the device's name, each pipeline's peak GPU memory and the run's time
# (benchmarks/bench_gpu.py). Paste the table into benchmarks/README.md's "GPU table" with the device it names.
#
#   benchmarks/gpu.sh                 # the table on cuda (extra arguments go to bench_gpu.py)
#   benchmarks/gpu.sh --tests         # first the CUDA tests (tests/test_cuda.py, tests/test_multinomial.py)
#   benchmarks/gpu.sh --smoke         # tiny sizes on the CPU: what CI runs, so that the table cannot rot
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--smoke" ]]; then
    shift
    exec python benchmarks/bench_gpu.py --smoke "$@"
fi
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu.sh: no CUDA device (gpu.sh --smoke runs the table on the CPU)')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if [[ "${1:-}" == "--tests" ]]; then
    shift
    python -m pytest -q -p no:benchmark tests/test_cuda.py tests/test_multinomial.py -rs
fi
python benchmarks/bench_gpu.py --device cuda "$@"
