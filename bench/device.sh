#!/usr/bin/env bash
# The GPU machine's runner: bash bench/device.sh <profile>[,<profile>...] [args...]
#
# Run from the repository root on the GPU machine, with the wheels built here by
# bench/gpu_wheels.sh in .whl/ (carried there; peers such as torchao's wheel beside them). It
# installs every .whl/*.whl into /tmp/site, so that quant-kernels' entry point registers the
# Triton backend as in a user's install, then runs the profile's steps in order. Each step writes
# $OUT/<step>.log (JSON where the command writes one) and prints its exit status and the log's
# table and result lines. The exit status is 1 if any step failed.
#
# Profiles (args go to the profile's first command, appended: its later options win):
#   check        the GPU conformance tests, tests/gpu (kernels, reference, compiled code, bitwise);
#                args are pytest's (e.g. -k "not exhaustive", -k mxfp8)
#   tests        tests/kernels and tests/recipes on the GPU (args: pytest's)
#   model        speed.py model: the Llama table, 1B widths, 30 steps (e.g. --size 8b --steps 20
#                --configs bf16,ao_fp8_tensorwise,fp8_current)
#   step         speed.py step: the 4096^3 Linear step, bf16 / torchao / fp8_current, 3 rounds
#   gemm         speed.py gemm at 16384x8192x8192, then speed.py step at that shape
#   kernels      speed.py kernels: the quantize kernels' bandwidth (e.g. --only NVFP4)
#   host         speed.py host --profile --step: eager host time and compiled steps
#   autotune     speed.py autotune: MXFP8 dequantize + cuBLAS against max-autotune
#   memory       memory.py saved (one Llama layer's saved set, 1B) and memory.py step
#   fsdp2        tests/recipes' FSDP2 and distributed tests on NCCL, then memory.py fsdp2
#                (2 GPUs: the nvidia-h200-x2 machine); args go to memory.py fsdp2
#   fsdp2-bench  memory.py fsdp2 alone
#   profile      profiling.py torch (bf16, torchao, fp8_current; default and reduce-overhead
#                modes), then profiling.py cprofile (fp8_current, torchao); args go to each
#                torch call (e.g. --sort self_device_time_total --steps 4 --sync)
#   ncu          profiling.py ncu (Nsight Compute) of the kernel and GEMM cases; args: the sets
#   spy          py-spy samples of the step loop per recipe (py-spy from PATH or .bin/); args:
#                the recipes (default fp8_current ao_fp8_tensorwise bf16)
#   demo         quant doctor, then quant demo on the GPU (150 steps)
#   gpt          quant demo --model gpt per recipe, one process each; args: the recipes
#   multi        the multi-GPU run: tests/recipes' FSDP2, distributed and tensor-parallel tests
#                on NCCL, then speed.py multi-gpu (Llama 8b widths) under FSDP2 on 2 GPUs, and
#                under FSDP2 x TP (2 x 2) where 4 GPUs are present; args go to speed.py multi-gpu
#   moe          speed.py moe: the MoE expert layer, bf16 / torchao / quant's GroupedLinear
#                (args: speed.py moe's, e.g. --tokens 2048 --experts 64)
#   grouped      GroupedLinear's tests on the GPU (tests/recipes/test_grouped_*.py; args: pytest's)
#   moe-check    the mixture-of-experts checks: the grouped FP8 GEMM kernels against the
#                reference, tests/gpu/test_grouped_cuda.py (no host sync, CUDA-graph replay,
#                the per-group bound) and GroupedLinear's tests (args: pytest's)
#   probe        speed.py probe: which grouped FP8 GEMM forms torch and Triton take here (E5M2
#                operands, per-group slices, fp32 outputs, quant-kernels' grouped kernels), their
#                errors and speed (args: speed.py probe's, e.g. --own --ragged)
#   cmd          any command as one step (NAME, else "cmd"; limit LIMIT, else 300 s), with the
#                same setup: e.g. NAME=sweep bash bench/device.sh cmd python3 -m pytest ...
#
# A campaign's one-off device profiles go in its dated report (bench/results/), as cmd commands,
# not in this runner.
#
# Environment: OUT (where results go; set by the GPU machine), LIMIT (seconds for each step,
# instead of the step's own limit), SRC=1 (put this tree's packages/*/src before the wheels;
# SRC=DIR: that tree's, for an A/B of two trees), TAR=1 (pack $OUT into all.tgz at the end).
# Anything else the commands read passes through (TORCH_LOGS=output_code, QUANT_LOWERING, ...).
set -u
cd "$(dirname "$0")/.."

setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
  if [ -n "${SRC:-}" ]; then
    local tree=$PWD
    [ "$SRC" != 1 ] && tree=$SRC
    PYTHONPATH=$tree/packages/quant-core/src:$tree/packages/quant-kernels/src:$tree/packages/quant-dynamo/src:$tree/packages/quant-recipes/src:$PYTHONPATH
  fi
  # NVLink multicast stays off (the device rules)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())
try:
    import transformers; print('transformers', transformers.__version__)
except ImportError as e: print('transformers unavailable:', e)
from quant_core import backends; print('backends', backends.available())"
}

status=0
# step NAME LIMIT COMMAND...: COMMAND under a time limit, its output in $OUT/NAME.log
step() {
  local name=$1 limit=${LIMIT:-$2} t0=$SECONDS rc
  shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "=== $name rc=$rc ($((SECONDS - t0)) s)"
  grep -E '^(\||#)|passed|failed|CHECKS|mismatch|MiB|Error' "$OUT/$name.log" \
    | grep -v '^  ' | cut -c1-300 | tail -n 40
  [ $rc = 0 ] || status=1
}

PYTEST=(python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short)

profile_check() { step check 560 "${PYTEST[@]}" tests/gpu "$@"; }
profile_tests() { step tests 560 "${PYTEST[@]}" tests/kernels tests/recipes "$@"; }
profile_model() {
  step model 540 python3 bench/speed.py model --size 1b --steps 30 --json "$OUT/model.json" "$@"
}
profile_step() {
  step step 300 python3 bench/speed.py step --shapes 4096x4096x4096 \
    --configs bf16,ao_fp8_tensorwise,fp8_current --repeat 3 --json "$OUT/step.json" "$@"
}
profile_gemm() {
  step gemm 300 python3 bench/speed.py gemm 16384x8192x8192 --json "$OUT/gemm.json" "$@"
  step gemm_step 240 python3 bench/speed.py step --shapes 16384x8192x8192 \
    --json "$OUT/gemm_step.json"
}
profile_kernels() { step kernels 300 python3 bench/speed.py kernels --json "$OUT/kernels.json" "$@"; }
profile_host() {
  step host 300 python3 bench/speed.py host --profile --step --json "$OUT/host.json" "$@"
}
profile_autotune() {
  step autotune 240 python3 bench/speed.py autotune --json "$OUT/autotune.json" "$@"
}
profile_memory() {
  step saved 240 python3 bench/memory.py saved --size 1b \
    --configs bf16,ao_fp8_tensorwise,fp8_current "$@"
  step memory_step 240 python3 bench/memory.py step
}
profile_fsdp2() {
  QUANT_DIST_BACKEND=nccl step fsdp2_tests 300 "${PYTEST[@]}" tests/recipes/test_fsdp2.py \
    tests/recipes/test_distributed.py
  profile_fsdp2-bench "$@"
}
profile_fsdp2-bench() {
  step fsdp2 290 python3 bench/memory.py fsdp2 --nproc 2 --json "$OUT/fsdp2.json" "$@"
}
profile_profile() {
  local mode r
  for mode in default reduce-overhead; do
    for r in bf16 ao_fp8_tensorwise fp8_current; do
      step "profile_${r}_$mode" 120 python3 bench/profiling.py torch --recipe "$r" --mode "$mode" \
        --trace "$OUT/trace_${r}_$mode.json" "$@"
    done
  done
  for r in fp8_current ao_fp8_tensorwise; do
    step "cprofile_$r" 120 python3 bench/profiling.py cprofile --recipe "$r" --rows 40
  done
}
profile_ncu() {
  local set
  for set in ${*:-kernels gemm}; do
    step "ncu_$set" 300 python3 bench/profiling.py ncu "$set" --out "$OUT"
  done
}
profile_spy() {
  local spy r
  spy=$(command -v py-spy || echo "$PWD/.bin/py-spy")
  for r in ${@:-fp8_current ao_fp8_tensorwise bf16}; do
    # --native unwinding falls minutes behind at 1000 Hz on the H200 host: a low rate, no --native
    step "spy_$r" 200 "$spy" record -r 200 -f raw -o "$OUT/spy_$r.raw" -- \
      python3 bench/profiling.py spy-run --recipe "$r" --steps 3000
    grep '^{' "$OUT/spy_$r.log" > "$OUT/spy_$r.json"
    step "spy_report_$r" 60 python3 bench/profiling.py spy-report "$OUT/spy_$r.raw" \
      --meta "$OUT/spy_$r.json"
  done
}
profile_multi() {
  QUANT_DIST_BACKEND=nccl step multi_tests 400 "${PYTEST[@]}" tests/recipes/test_fsdp2.py \
    tests/recipes/test_distributed.py tests/recipes/test_tensor_parallel.py
  step multi_fsdp2 560 python3 bench/speed.py multi-gpu --nproc 2 --json "$OUT/multi_fsdp2.json" \
    "$@"
  if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
    step multi_tp 560 python3 bench/speed.py multi-gpu --nproc 4 --tp 2 \
      --json "$OUT/multi_tp.json" "$@"
  fi
}
profile_grouped() {
  step grouped 300 "${PYTEST[@]}" tests/recipes/test_grouped_fp8.py tests/recipes/test_grouped_linear.py "$@"
}
profile_moe-check() {
  step moe_check 420 "${PYTEST[@]}" tests/kernels/test_fp8_grouped_gemm.py \
    tests/gpu/test_grouped_cuda.py tests/recipes/test_grouped_fp8.py \
    tests/recipes/test_grouped_linear.py tests/recipes/test_grouped_host_reads.py "$@"
}
profile_cmd() { step "${NAME:-cmd}" 300 "$@"; }
profile_probe() { step probe 240 python3 bench/speed.py probe "$@"; }
profile_moe() { step moe 400 python3 bench/speed.py moe --json "$OUT/moe.json" "$@"; }
profile_demo() {
  step doctor 30 python3 -m quant_recipes.cli doctor
  step demo 200 python3 -m quant_recipes.cli demo --device cuda --steps 150 --out "$OUT/demo"
}
profile_gpt() {
  local r
  for r in ${@:-baseline fp8_current fp8_block mxfp8 nvfp4}; do
    step "gpt_$r" 200 python3 -m quant_recipes.cli demo --model gpt --device cuda --steps 200 \
      --recipes "$r" --no-plot --out "$OUT/gpt_$r"
  done
}

if [ $# -lt 1 ]; then
  sed -n '2,/^set -u/p' "$0" | sed '$d'
  exit 2
fi
: "${OUT:?set OUT to the directory for results}"
mkdir -p "$OUT"
profiles=$1
shift
IFS=, read -r -a names <<< "$profiles"
for p in "${names[@]}"; do
  if ! declare -F "profile_$p" > /dev/null; then echo "unknown profile: $p"; exit 2; fi
done
if [ ${#names[@]} -gt 1 ] && [ $# -gt 0 ]; then echo "args go with one profile only"; exit 2; fi
setup || exit 1
for p in "${names[@]}"; do "profile_$p" "$@"; done
if [ "${TAR:-0}" = 1 ]; then
  (cd "$OUT" && tar czf all.tgz --remove-files $(ls | grep -v '^all.tgz$'))
fi
exit $status
