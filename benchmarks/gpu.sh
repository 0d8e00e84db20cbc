#!/usr/bin/env bash
# Everything this project measures on a GPU, in one command (run from the repository root on a machine
# with CUDA): the test suite (its CUDA tests run instead of skipping), then every benchmark with
# --device cuda. Paste the printed tables into benchmarks/README.md with the device name they print.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu.sh: no CUDA device')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -m pytest -q tests/test_cuda.py -rs
python -m pytest -q -x
python benchmarks/bench_vocab50k.py --device cuda --draws 100000000 10000000000 --token-draws 10000000000
python benchmarks/bench_gaussian.py --device cuda --draws 1000000000
python benchmarks/bench_rollout.py --device cuda
python benchmarks/bench_gradients.py --device cuda
python benchmarks/bench_memory.py --device cuda
