#!/usr/bin/env bash
# One device call for quant-kernels: conformance (bench/check_gpu.py), the bandwidth table
# (bench/kernels.py) and Nsight Compute counters (bench/ncu_run.sh). Sources run from
# packages/*/src; the torchao wheel for the peers travels in .whl (carry it).
set -u
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/torchao-*.whl
export PYTHONPATH=$PWD/packages/quant-core/src:$PWD/packages/quant-kernels/src:/tmp/site
export PYTHONUNBUFFERED=1
timeout "${CHECK_LIMIT:-200}" python3 bench/check_gpu.py > "$OUT/check.log" 2>&1
echo "check rc=$?"; grep -E "mismatches=[1-9]|CHECKS|sweep took|MISMATCH" "$OUT/check.log"
timeout "${BENCH_LIMIT:-300}" python3 bench/kernels.py "$OUT/bench.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -v "^  " "$OUT/bench.log" | tail -45
[ "${NCU:-1}" = 1 ] && NCU_LIMIT=150 bash bench/ncu_run.sh > "$OUT/ncu.log" 2>&1
grep -v 'at::' "$OUT/ncu.md" 2>/dev/null | cut -c1-220
