#!/usr/bin/env bash
# One device call: Nsight Compute counters (clocks left alone: --clock-control none) of the
# kernels that bench/$PROFILE.py launches, summarized into $OUT/$NAME.md. Defaults: every
# benchmarked quantize kernel at bf16 16384^2 (profile_kernels, ncu). bench/ncu_gemm.sh reuses it.
set -u
PROFILE=${PROFILE:-profile_kernels}
NAME=${NAME:-ncu}
FILTER=${KERNEL_FILTER:-'regex:^(?!.*(distribution|fill|randn|normal)).*'}
which ncu; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
export PYTHONPATH=${PYTHONPATH:-$PWD/packages/quant-core/src:$PWD/packages/quant-kernels/src} PYTHONUNBUFFERED=1
cd bench
metrics=$(python3 -c "import $PROFILE as p; print(','.join(p.METRICS))")
timeout "${NCU_LIMIT:-240}" ncu --clock-control none --metrics "$metrics" --csv --page raw \
  --kernel-name-base function -k "$FILTER" \
  python3 "$PROFILE.py" > "$OUT/$NAME.csv" 2> "$OUT/$NAME.err"
echo "ncu rc=$?"; tail -5 "$OUT/$NAME.err"
grep -v '^==' "$OUT/$NAME.csv" > "$OUT/${NAME}_clean.csv"
python3 "$PROFILE.py" "$OUT/${NAME}_clean.csv" | tee "$OUT/$NAME.md"
