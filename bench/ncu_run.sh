#!/usr/bin/env bash
# One device call: Nsight Compute counters of every benchmarked kernel at bf16 16384^2
# (clocks left alone: --clock-control none), summarized into $OUT/ncu.md.
set -u
which ncu; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
export PYTHONPATH=$PWD/packages/quant-core/src:$PWD/packages/quant-kernels/src PYTHONUNBUFFERED=1
cd bench
metrics=$(python3 -c 'import profile_kernels as p; print(",".join(p.METRICS))')
timeout "${NCU_LIMIT:-240}" ncu --clock-control none --metrics "$metrics" --csv --page raw \
  --kernel-name-base function -k 'regex:^(?!.*(distribution|fill|randn|normal)).*' \
  python3 profile_kernels.py > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu rc=$?"; tail -5 "$OUT/ncu.err"
grep -v '^==' "$OUT/ncu.csv" > "$OUT/ncu_clean.csv"
python3 profile_kernels.py "$OUT/ncu_clean.csv" | tee "$OUT/ncu.md"
