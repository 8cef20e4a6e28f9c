#!/usr/bin/env bash
# The GPU checks in one short run, on a machine with CUDA and a torch of its own but no package
# registry (the device machines lent to some tasks): the wheels that machine's image lacks come
# from .gpu-wheels (fill it beforehand with `make gpu-wheels` on a machine with the registries and
# carry it along); then the gpu-marked tests, logged to OUT_DIR.
#   tools/gpu_check.sh [OUT_DIR]     (default: $OUT, else /tmp/gpu-check)
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-check}}
py=${PYTHON:-python3}
mkdir -p "$out"
$py -m pip install -q --no-index --find-links .gpu-wheels .gpu-wheels/*.whl  # (what the Makefile's GPU_WHEELS names)
$py -m pip install -q --no-deps --no-build-isolation -e .
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
} 2>&1 | tee "$out/gpu.txt"
PYTHONUNBUFFERED=1 timeout "${GPU_TESTS_TIMEOUT_S:-420}" $py -m pytest -q -p no:cacheprovider -m gpu -rs \
    --durations=10 tests/test_gpu.py 2>&1 | tee "$out/gpu-tests.log"
