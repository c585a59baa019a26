#!/usr/bin/env bash
# One device call for issue 18 item 2 on a host with 2 GPUs (NCCL): the FSDP2 tests with
# QUANT_DIST_BACKEND=nccl (tests/recipes/test_distributed.py: amax reduction eager and compiled,
# delayed scaling's reduction; tests/recipes/test_fsdp2.py: the weight all-gather in each recipe's
# quantized format gives, bit for bit, the unsharded step's loss and gradient shards, and moves
# the quantized bytes) and the FSDP2 step benchmark (bench/fsdp2_step.py: bf16, torchao float8
# with FP8 all-gather, each recipe with the bf16 all-gather, ':requant' and ':fp8ag', with step
# time, peak memory and all-gather bytes). Logs and the JSON go to $OUT.
# TESTS=0 / BENCH=0 skip a part; FSDP2_ARGS adds benchmark arguments (e.g. "--configs bf16,
# fp8_current:fp8ag --layers 4"); BENCH_LIMIT bounds the benchmark (seconds). Both parts
# together may pass one 10-minute device call: run TESTS=1 BENCH=0, then TESTS=0 BENCH=1.
set -u
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
export PYTHONPATH=$PWD/packages/quant-core/src:$PWD/packages/quant-kernels/src:$PWD/packages/quant-dynamo/src:$PWD/packages/quant-recipes/src:$PWD/.whl/torchao-0.18.0
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if [ "${TESTS:-1}" = 1 ]; then
  # the test workers register the Triton backend themselves (source trees lack the entry point)
  QUANT_DIST_BACKEND=nccl timeout "${TESTS_LIMIT:-540}" python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short \
    tests/recipes/test_fsdp2.py tests/recipes/test_distributed.py > "$OUT/fsdp2_tests.log" 2>&1
  echo "FSDP2 tests (nccl) rc=$?"
  grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|^E  .*(Error|assert)" "$OUT/fsdp2_tests.log" | cut -c1-300 | head -30
fi
if [ "${BENCH:-1}" = 1 ]; then
  # bench/fsdp2_step.py registers the Triton backend at import, in every rank
  timeout "${BENCH_LIMIT:-500}" python3 bench/fsdp2_step.py --nproc 2 ${FSDP2_ARGS:-} \
    --json "$OUT/fsdp2_step.json" > "$OUT/fsdp2_step.log" 2>&1
  echo "FSDP2 benchmark rc=$?"
  grep -E "^(###|\|)" "$OUT/fsdp2_step.log"
  grep -E "Error|error" "$OUT/fsdp2_step.log" | grep -v "^|" | sort | uniq -c | head -10
fi
