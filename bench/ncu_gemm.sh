#!/usr/bin/env bash
# One device call: Nsight Compute counters of the GEMM implementations (bench/profile_gemm.py,
# through bench/ncu_run.sh) into $OUT/ncu_gemm.md, then the training step (bench/train_step.py)
# on STEP_SHAPES. Sources run from packages/*/src; torchao from .whl (carry it).
set -u
export PYTHONPATH=$PWD/packages/quant-core/src:$PWD/packages/quant-kernels/src:$PWD/packages/quant-dynamo/src:$PWD/packages/quant-recipes/src:$PWD/.whl/torchao-0.18.0
PROFILE=profile_gemm NAME=ncu_gemm NCU_LIMIT=${NCU_LIMIT:-180} \
  KERNEL_FILTER='regex:^(?!.*(distribution|fill|randn|normal|copy|elementwise|amax|_mxfp8_kernel|_nvfp4_row|_nvfp4_col|current_scale)).*' \
  bash bench/ncu_run.sh | cut -c1-230
if [ "${STEP_LIMIT:-200}" != 0 ]; then
  timeout "${STEP_LIMIT:-200}" python3 bench/train_step.py --shapes "${STEP_SHAPES:-16384x8192x8192}" --json "$OUT/step.json" > "$OUT/step.log" 2>&1
  echo "step rc=$?"; tail -14 "$OUT/step.log"
fi
