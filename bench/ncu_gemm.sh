#!/usr/bin/env bash
# One device call: Nsight Compute counters of the GEMM implementations (bench/profile_gemm.py,
# clocks left alone: --clock-control none) into $OUT/ncu_gemm.md, then the training step
# (bench/train_step.py) on STEP_SHAPES. Sources run from packages/*/src; torchao from .whl.
set -u
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
export PYTHONPATH=$PWD/packages/quant-core/src:$PWD/packages/quant-kernels/src:$PWD/packages/quant-dynamo/src:$PWD/packages/quant-recipes/src:$PWD/.whl/torchao-0.18.0
export PYTHONUNBUFFERED=1
cd bench
metrics=$(python3 -c 'import profile_gemm as p; print(",".join(p.METRICS))')
timeout "${NCU_LIMIT:-180}" ncu --clock-control none --metrics "$metrics" --csv --page raw \
  --kernel-name-base function -k 'regex:^(?!.*(distribution|fill|randn|normal|copy|elementwise|amax|_mxfp8_kernel|_nvfp4_row|_nvfp4_col|current_scale)).*' \
  python3 profile_gemm.py > "$OUT/ncu_gemm.csv" 2> "$OUT/ncu_gemm.err"
echo "ncu rc=$?"; tail -3 "$OUT/ncu_gemm.err"
grep -v '^==' "$OUT/ncu_gemm.csv" > "$OUT/ncu_gemm_clean.csv"
python3 profile_gemm.py "$OUT/ncu_gemm_clean.csv" | tee "$OUT/ncu_gemm.md" | cut -c1-230
cd ..
if [ "${STEP_LIMIT:-200}" != 0 ]; then
  timeout "${STEP_LIMIT:-200}" python3 bench/train_step.py --shapes "${STEP_SHAPES:-16384x8192x8192}" --json "$OUT/step.json" > "$OUT/step.log" 2>&1
  echo "step rc=$?"; tail -14 "$OUT/step.log"
fi
