#!/usr/bin/env bash
# One device call for issue 13 (host overhead) and issue 12 item 20 (RHT kernel): GPU
# conformance of NVFP4 (check_gpu.py nvfp4), the kernel tests on CUDA, the NVFP4 bandwidth rows
# (kernels.py, BENCH_ONLY=NVFP4), the host-overhead micro-benchmark with profiles, and the
# training-step table (train_step.py; STEP_SHAPES, STEP_CONFIGS, STEP_MODES, STEP_LAYERS).
# COMPILECHECK=1: compiled == eager with the ops lowered into Inductor's code
# (check_compile_cuda.py); STEP_AB=1: the step again with QUANT_LOWERING=0 (AB_CONFIGS);
# STEP_STATIC=1: again with Inductor's static launcher for the recorded kernels.
# STEP_BASE=DIR: the step table alternately from this tree and from the tree at DIR (an A/B of a
# change in separate processes, each against its own bf16 and torchao; STEP_BASE_ROUNDS pairs).
# SPY=1: py-spy --native samples of the step loop per SPY_RECIPES (bench/spy_step.py; py-spy from
# .bin/ or PATH). STATIC_PROBE=1: compile fp8_current with the static launcher in strict mode
# (raises where Inductor bypasses it). OUTPUT_CODE=1: Inductor's code of the fp8_current step.
# TAR=1: pack every file under $OUT into all.tgz at the end (a call brings back few files).
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
  (cd tests/kernels && timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE --tb=short ${KTESTS:-test_nvfp4.py} > "$OUT/ktests.log" 2>&1)
  echo "kernel tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E  " "$OUT/ktests.log" | cut -c1-300 | head -60
  timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short tests/recipes/test_cuda_graphs.py tests/recipes/test_lowered_linear.py > "$OUT/graphs.log" 2>&1
  echo "cuda graph tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E  .*(Error|assert|mismatch)" "$OUT/graphs.log" | cut -c1-300 | head -30
fi
if [ "${COMPILECHECK:-0}" = 1 ]; then
  timeout 400 python3 bench/check_compile_cuda.py > "$OUT/compile.log" 2>&1
  echo "compile check rc=$?"; grep -E "^(ok|FAIL)|passed|Error|error" "$OUT/compile.log" | cut -c1-400 | tail -30
fi
if [ "${KERNELS:-1}" = 1 ]; then
  BENCH_ONLY=${BENCH_ONLY:-NVFP4} timeout 200 python3 bench/kernels.py "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
  echo "kernels rc=$?"; grep -v "^  " "$OUT/kernels.log" | tail -16
fi
if [ "${HOST:-1}" = 1 ]; then
  timeout 300 python3 bench/host_overhead.py ${HOST_ARGS:---profile --step} --json "$OUT/host.json" > "$OUT/host.log" 2>&1
  echo "host rc=$?"; sed -n '/cProfile/q;p' "$OUT/host.log" | grep -v "^$"
fi
if [ "${STEP:-0}" = 1 ]; then
  timeout "${STEP_LIMIT:-240}" python3 bench/train_step.py --shapes "${STEP_SHAPES:-4096x4096x4096}" ${STEP_CONFIGS:+--configs $STEP_CONFIGS} ${STEP_MODES:+--modes $STEP_MODES} ${STEP_LAYERS:+--layers $STEP_LAYERS} ${STEP_REPEAT:+--repeat $STEP_REPEAT} --json "$OUT/step.json" > "$OUT/step.log" 2>&1
  echo "step rc=$?"; grep -v "^  \|Warning\|Configuration class" "$OUT/step.log" | tail -${STEP_TAIL:-25}
fi
if [ "${STEP_AB:-0}" = 1 ]; then
  QUANT_LOWERING=0 timeout "${STEP_LIMIT:-240}" python3 bench/train_step.py --shapes "${STEP_SHAPES:-4096x4096x4096}" --configs "bf16,${AB_CONFIGS:-fp8_current}" ${STEP_MODES:+--modes $STEP_MODES} --json "$OUT/step_ab.json" > "$OUT/step_ab.log" 2>&1
  echo "step (QUANT_LOWERING=0) rc=$?"; tail -12 "$OUT/step_ab.log"
fi
if [ "${STEP_STATIC:-0}" = 1 ]; then
  timeout "${STEP_LIMIT:-240}" python3 bench/train_step.py --static-launch --shapes "${STEP_SHAPES:-4096x4096x4096}" --configs "bf16,${AB_CONFIGS:-fp8_current}" ${STEP_MODES:+--modes $STEP_MODES} --json "$OUT/step_static.json" > "$OUT/step_static.log" 2>&1
  echo "step (static launch) rc=$?"; tail -12 "$OUT/step_static.log"
fi
if [ -n "${STEP_BASE:-}" ]; then
  for i in $(seq "${STEP_BASE_ROUNDS:-2}"); do
    for tree in new base; do
      dir=$PWD; [ $tree = base ] && dir=$STEP_BASE
      (cd "$dir" && PYTHONPATH=$dir/packages/quant-core/src:$dir/packages/quant-kernels/src:$dir/packages/quant-dynamo/src:$dir/packages/quant-recipes/src:$PYTHONPATH \
        timeout "${STEP_LIMIT:-240}" python3 bench/train_step.py --shapes "${STEP_SHAPES:-4096x4096x4096}" ${STEP_CONFIGS:+--configs $STEP_CONFIGS} ${STEP_MODES:+--modes $STEP_MODES} ${STEP_REPEAT:+--repeat $STEP_REPEAT} --json "$OUT/step_${tree}_$i.json" > "$OUT/step_${tree}_$i.log" 2>&1)
      echo "step $tree round $i rc=$?"; grep -v "^  \|Warning\|Configuration class" "$OUT/step_${tree}_$i.log" | tail -${STEP_TAIL:-12}
    done
  done
fi
if [ "${STATIC_PROBE:-0}" = 1 ]; then
  TORCHINDUCTOR_STRICT_STATIC_CUDA_LAUNCHER=1 timeout 200 python3 bench/train_step.py --static-launch --shapes 4096x4096x4096 --configs bf16,fp8_current --json "$OUT/static_probe.json" > "$OUT/static_probe.log" 2>&1
  echo "static probe rc=$?"; grep -E "CannotStatically|Bypassing|Error|ms" "$OUT/static_probe.log" | cut -c1-300 | tail -8
fi
if [ "${OUTPUT_CODE:-0}" = 1 ]; then
  TORCH_LOGS=output_code timeout 200 python3 bench/debug/step_guards.py fp8_current 4096 > "$OUT/output_code.log" 2>&1
  echo "output code rc=$? ($(wc -l < "$OUT/output_code.log") lines)"
fi
if [ "${SPY:-0}" = 1 ]; then
  spy=$(command -v py-spy || echo "$PWD/.bin/py-spy")
  for r in ${SPY_RECIPES:-fp8_current ao_fp8_tensorwise bf16}; do
    # --native unwinding falls minutes behind at 1000 Hz on the H200 host: off unless SPY_NATIVE=1
    (cd bench && timeout 200 "$spy" record ${SPY_NATIVE:+--native} -r "${SPY_RATE:-200}" -f raw -o "$OUT/spy_$r.raw" -- \
      python3 spy_step.py run --recipe "$r" --steps "${SPY_STEPS:-3000}" > "$OUT/spy_$r.json" 2> "$OUT/spy_$r.err")
    echo "spy $r rc=$? $(tail -1 "$OUT/spy_$r.json")"; grep -v "^py-spy>" "$OUT/spy_$r.err" | grep -iE "error|denied" | head -3
  done
fi
if [ "${PROFILE:-0}" = 1 ]; then
  # per-kernel GPU time and per-op host time of the compiled step (bench/profile_step.py)
  for mode in ${PROFILE_MODES:-default reduce-overhead}; do
    for r in ${PROFILE_RECIPES:-bf16 ao_fp8_tensorwise fp8_current}; do
      timeout 120 python3 bench/profile_step.py --recipe "$r" --mode "$mode" --n "${PROFILE_N:-4096}" \
        --sort "${PROFILE_SORT:-self_device_time_total}" --rows "${PROFILE_ROWS:-25}" \
        ${PROFILE_TRACE:+--steps 4 --sync --trace $OUT/trace_${r}_${mode}.json} \
        > "$OUT/profile_${r}_${mode}.log" 2>&1
      echo "profile $r $mode rc=$?"; grep -E "ms/step" "$OUT/profile_${r}_${mode}.log"
    done
  done
fi
if [ "${CPROFILE:-0}" = 1 ]; then
  # Python functions of the compiled step, ours against torchao (bench/cprofile_step.py)
  for r in ${CPROFILE_RECIPES:-fp8_current ao_fp8_tensorwise}; do
    timeout 120 python3 bench/cprofile_step.py --recipe "$r" --n "${PROFILE_N:-4096}" --rows 40 \
      > "$OUT/cprofile_$r.log" 2>&1
    echo "cprofile $r rc=$?"
  done
fi
if [ "${TAR:-0}" = 1 ]; then
  (cd "$OUT" && tar czf all.tgz --remove-files $(ls | grep -v '^all.tgz$'))
fi
