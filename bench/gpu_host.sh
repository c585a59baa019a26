#!/usr/bin/env bash
# One device call for issue 13 (host overhead) and issue 12 item 20 (RHT kernel): GPU
# conformance of NVFP4 (check_gpu.py nvfp4), the kernel tests on CUDA, the NVFP4 bandwidth rows
# (kernels.py, BENCH_ONLY=NVFP4), the host-overhead micro-benchmark with profiles, and the
# training-step table (train_step.py; STEP_SHAPES, STEP_CONFIGS, STEP_MODES, STEP_LAYERS).
set -u
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
export PYTHONPATH=$PWD/packages/quant-core/src:$PWD/packages/quant-kernels/src:$PWD/packages/quant-dynamo/src:$PWD/packages/quant-recipes/src:$PWD/.whl/torchao-0.18.0
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${CHECK:-1}" = 1 ]; then
  if [ "${CHECKGPU:-1}" = 1 ]; then
    timeout 200 python3 bench/check_gpu.py ${CHECK_FORMATS:-nvfp4} > "$OUT/check.log" 2>&1
    echo "check rc=$?"; grep -E "mismatches=[1-9]|CHECKS|MISMATCH|took" "$OUT/check.log"
  fi
  (cd tests/kernels && timeout 200 python3 -m pytest -q -p no:cacheprovider ${KTESTS:-test_nvfp4.py} 2>&1 | tail -4)
  timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short tests/recipes/test_cuda_graphs.py > "$OUT/graphs.log" 2>&1
  echo "cuda graph tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E  .*(Error|assert|mismatch)" "$OUT/graphs.log" | cut -c1-300 | head -30
fi
if [ "${KERNELS:-1}" = 1 ]; then
  BENCH_ONLY=${BENCH_ONLY:-NVFP4} timeout 200 python3 bench/kernels.py "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  echo "kernels rc=$?"; grep -v "^  " "$OUT/kernels.log" | tail -16
fi
if [ "${HOST:-1}" = 1 ]; then
  timeout 300 python3 bench/host_overhead.py --profile --step --json "$OUT/host.json" > "$OUT/host.log" 2>&1
  echo "host rc=$?"; sed -n '/cProfile/q;p' "$OUT/host.log" | grep -v "^$"
fi
if [ "${STEP:-0}" = 1 ]; then
  timeout "${STEP_LIMIT:-240}" python3 bench/train_step.py --shapes "${STEP_SHAPES:-4096x4096x4096}" ${STEP_CONFIGS:+--configs $STEP_CONFIGS} ${STEP_MODES:+--modes $STEP_MODES} ${STEP_LAYERS:+--layers $STEP_LAYERS} --json "$OUT/step.json" > "$OUT/step.log" 2>&1
  echo "step rc=$?"; tail -25 "$OUT/step.log"
fi
