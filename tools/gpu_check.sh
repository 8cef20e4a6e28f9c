#!/usr/bin/env bash
# The GPU checks in one short run, on a machine with CUDA and a torch of its own but no package
# registry (the device machines lent to some tasks): the wheels that machine's image lacks come
# from .gpu-wheels (fill it beforehand with `make gpu-wheels` on a machine with the registries and
# carry it along); then, each under a time limit of its own so one hang costs only its share:
#   0. the device, the driver, torch                              -> steps.log (with each step's progress)
#      and tools/gpu_attention_probe.py: FlashAttention's varlen kernel over an arena, in a graph,
#      and each SDPA backend's first call of a new shape            -> steps.log (step "attention")
#   1. the gpu-marked tests                                        -> tests.log
#   2. `profile --ops --device cuda`: a Qwen3-0.6B-shaped bf16 model's forwards, with CUDA graphs
#      and eager                                                    -> ops.json
#   3. tools/gpu_kernels.py: a decode step's kernels and steady-state times -> kernels.json
#   4. `bench` of the tiny pair on the GPU (elastic, the bundled default's mode, beside pooled, colocated
#      and autoregressive), single stream and 8 at once, and 8 at once with CUDA
#      graphs off -> bench-1.json, bench-8.json, bench-8-eager.json;
#      the deployments' logs                                         -> logs.tgz
#   (8 files: what the device machines lent here send back at most)
#   tools/gpu_check.sh [OUT_DIR]     (default: $OUT, else /tmp/gpu-check)
#   GPU_CHECK_STEPS="attention tests ops kernels bench" picks steps, GPU_BENCHES="1 8 8-eager" the benches.
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-check}}
py=${PYTHON:-python3}
steps=${GPU_CHECK_STEPS:-attention tests ops kernels bench}
tests=${GPU_TESTS:-tests/test_gpu.py}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
$py -m pip install -q --no-index --find-links .gpu-wheels .gpu-wheels/*.whl  # (what the Makefile's GPU_WHEELS names)
$py -m pip install -q --no-deps --no-build-isolation -e .
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
  lscpu | grep -E '^(Model name|CPU\(s\))'
} 2>&1 | tee "$out/steps.log"
nf=$(dirname "$(command -v $py)")/nebula-flow
[ -x "$nf" ] || nf="$py -m nebula_flow.cli"

if [[ $steps == *attention* ]]; then
  timeout "${GPU_ATTENTION_TIMEOUT_S:-60}" $py tools/gpu_attention_probe.py 2>&1 | grep -v Warning | tee -a "$out/steps.log"
fi
if [[ $steps == *tests* ]]; then
  per_test=$($py -c "import pytest_timeout" 2>/dev/null && echo --timeout=100)  # (one hang costs one test)
  timeout "${GPU_TESTS_TIMEOUT_S:-200}" $py -m pytest -q -p no:cacheprovider -m gpu -rs --durations=10 $per_test \
      $tests 2>&1 | tee "$out/tests.log"
fi
if [[ $steps == *ops* ]]; then
  timeout "${GPU_OPS_TIMEOUT_S:-60}" $nf profile --ops --device cuda --dtype bfloat16 \
      >"$out/ops.json" 2>>"$out/steps.log"; echo "ops rc=$?"; cat "$out/ops.json"
fi
if [[ $steps == *kernels* ]]; then
  timeout "${GPU_KERNELS_TIMEOUT_S:-90}" $py tools/gpu_kernels.py --top 10 >"$out/kernels.json" 2>>"$out/steps.log"
  echo "kernels rc=$?"; head -c 400 "$out/kernels.json"; echo
fi
if [[ $steps == *bench* ]]; then
  for run in ${GPU_BENCHES:-1 8 8-eager}; do  # (concurrency, and -eager: with CUDA graphs off)
    c=${run%-eager}; graphs=$([[ $run == *-eager ]] && echo 0 || echo 1)
    echo "[bench] concurrency $c, CUDA graphs $graphs" >>"$out/steps.log"
    NEBULA_FLOW_CUDA_GRAPHS=$graphs timeout "${GPU_BENCH_TIMEOUT_S:-90}" $nf bench --config configs/tiny-gpu.toml \
        --modes elastic,pooled,colocated,autoregressive --concurrency $c --requests $((c == 1 ? 4 : 16)) \
        --max-new-tokens 48 --repeats 3 --breakdown --json >"$out/bench-$run.json" 2>>"$out/steps.log"
    echo "bench $run rc=$?"
  done
  grep -v USDT "$out/steps.log"
  tar czf "$out/logs.tgz" /tmp/nebula-flow-logs-* 2>/dev/null
fi
