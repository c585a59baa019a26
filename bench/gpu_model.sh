#!/usr/bin/env bash
# One device call for the model-level work: the compiled-ops conformance check
# (check_compiled_ops.py), compiled == eager for a Linear per recipe (check_compile_cuda.py), the
# saved-for-backward set of one decoder layer with Inductor's code (saved_for_backward.py,
# OUTPUT_CODE=1), the Llama step table (llama_step.py), the single-Linear step (train_step.py,
# STEP=1, STEP_SHAPES, STEP_CONFIGS) and MXFP8's max-autotune alternative (dequant_autotune.py,
# AUTOTUNE=1). Each part has a switch and a time limit: OPSCHECK, LINEARCHECK, SAVED, MODEL
# (1 = run), MODEL_SIZE, MODEL_STEPS, MODEL_CONFIGS, MODEL_LIMIT. Logs and JSON go to $OUT.
set -u
cd "$(dirname "$0")/.."
source bench/gpu_env.sh || exit 1
if [ "${OPSCHECK:-1}" = 1 ]; then
  timeout "${OPSCHECK_LIMIT:-240}" python3 bench/check_compiled_ops.py > "$OUT/opscheck.log" 2>&1
  echo "compiled-ops check rc=$?"; grep -E "FAIL|passed" "$OUT/opscheck.log" | cut -c1-300 | tail -12
fi
if [ "${LINEARCHECK:-1}" = 1 ]; then
  timeout "${LINEARCHECK_LIMIT:-200}" python3 bench/check_compile_cuda.py > "$OUT/compile.log" 2>&1
  echo "compile check rc=$?"; grep -E "^(ok|FAIL)|passed|Error" "$OUT/compile.log" | cut -c1-300 | tail -24
fi
if [ "${SAVED:-0}" = 1 ]; then
  [ "${OUTPUT_CODE:-0}" = 1 ] && export TORCH_LOGS=output_code
  timeout "${SAVED_LIMIT:-200}" python3 bench/saved_for_backward.py --size "${SAVED_SIZE:-1b}" --configs "${SAVED_CONFIGS:-bf16,ao_fp8_tensorwise,fp8_current}" > "$OUT/saved.log" 2>&1
  echo "saved rc=$?"; grep -E "^==|total|MiB \|" "$OUT/saved.log" | tail -12
  unset TORCH_LOGS
fi
if [ "${MODEL:-1}" = 1 ]; then
  timeout "${MODEL_LIMIT:-300}" python3 bench/llama_step.py --size "${MODEL_SIZE:-1b}" --steps "${MODEL_STEPS:-30}" ${MODEL_CONFIGS:+--configs $MODEL_CONFIGS} --json "$OUT/model_${MODEL_SIZE:-1b}.json" > "$OUT/model.log" 2>&1
  echo "model rc=$?"; grep -E "^\||Error|error" "$OUT/model.log" | cut -c1-400 | tail -16
fi
if [ "${STEP:-0}" = 1 ]; then
  timeout "${STEP_LIMIT:-200}" python3 bench/train_step.py --shapes "${STEP_SHAPES:-4096x4096x4096}" --configs "${STEP_CONFIGS:-bf16,ao_fp8_tensorwise,fp8_current}" --repeat "${STEP_REPEAT:-3}" --json "$OUT/step.json" > "$OUT/step.log" 2>&1
  echo "step rc=$?"; grep -E "^\||Error" "$OUT/step.log" | cut -c1-300 | tail -10
fi
if [ "${AUTOTUNE:-0}" = 1 ]; then
  timeout "${AUTOTUNE_LIMIT:-240}" python3 bench/dequant_autotune.py --json "$OUT/autotune.json" > "$OUT/autotune.log" 2>&1
  echo "autotune rc=$?"; grep -E "^\||Error" "$OUT/autotune.log" | cut -c1-300 | tail -8
fi
