#!/usr/bin/env bash
# The GPU checks, as one prepared run for a machine with CUDA (e.g. the lent H200):
# the CUDA-marked tests, then the strategy and background benchmarks on the GPU.
# Results land in $OUT (when set) or ./gpu-results.
set -uo pipefail
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q -e ".[test]" 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
python3 -m pytest -m gpu -v tests 2>&1 | tee "$out/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
if [ -f benchmarks/background.py ]; then
    timeout 240 python3 benchmarks/background.py 2>&1 | tee "$out/background-bench.log"
fi
cp benchmarks/results/*.json "$out/" 2>/dev/null || true
exit "$tests_rc"
