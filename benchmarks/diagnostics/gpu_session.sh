#!/usr/bin/env bash
# One call on the lent GPU machine: install the carried wheels, then run what is asked.
#   bash benchmarks/diagnostics/gpu_session.sh "pytest tests/test_kernels.py" "python3 benchmarks/kernels.py"
# Each argument is a command; the output of all of them goes to $OUT/session.log and to stdout.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
n=0
for cmd in "$@"; do
  n=$((n + 1))
  echo "=== [$n] $cmd"
  start=$(date +%s)
  bash -c "$cmd" 2>&1 | tee -a "${OUT:-/tmp}/session.log"
  echo "=== [$n] rc=${PIPESTATUS[0]} in $(( $(date +%s) - start )) s"
done
