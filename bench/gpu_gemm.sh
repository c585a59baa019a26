#!/usr/bin/env bash
# One device call for the GEMM work (issue 11): bench/gemm.py (checks, probes, GEMM speed) and
# bench/train_step.py (the compiled training step with bf16 and torchao 0.18 peers). Sources run
# from packages/*/src; torchao travels unpacked in .whl/torchao-0.18.0 (carry .whl).
# Env: SHAPES (gemm.py shapes), STEP_SHAPES, STEP_CONFIGS, GEMM_LIMIT, STEP_LIMIT.
set -u
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
export PYTHONPATH=$PWD/packages/quant-core/src:$PWD/packages/quant-kernels/src:$PWD/packages/quant-dynamo/src:$PWD/packages/quant-recipes/src:$PWD/.whl/torchao-0.18.0
export PYTHONUNBUFFERED=1
if [ "${GEMM_LIMIT:-300}" != 0 ]; then
  timeout "${GEMM_LIMIT:-300}" python3 bench/gemm.py ${SHAPES:-16384x8192x8192} --json "$OUT/gemm.json" > "$OUT/gemm.log" 2>&1
  echo "gemm rc=$?"; grep -E '"mismatches": [1-9-]|"error": "|CHECKS|probe|^speed|TFLOP' "$OUT/gemm.log" | cut -c1-260 | tail -60
fi
if [ "${STEP_LIMIT:-240}" != 0 ]; then
  timeout "${STEP_LIMIT:-240}" python3 bench/train_step.py --shapes "${STEP_SHAPES:-16384x8192x8192}" ${STEP_CONFIGS:+--configs $STEP_CONFIGS} --json "$OUT/step.json" > "$OUT/step.log" 2>&1
  echo "step rc=$?"; tail -25 "$OUT/step.log"
fi
