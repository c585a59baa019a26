#!/usr/bin/env bash
# One call on the GPU machine (device tool): install the four wheels built here with
#   pip wheel --no-deps packages/quant-{core,kernels,dynamo,recipes} -w .whl
# then: reference bytes CPU vs CUDA, compiled qdq / Linear on CUDA, the recipe tests,
# quant doctor and quant demo on the GPU. Logs and the demo's plot land in $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/quant_*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
run() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -40; }
run reference_cuda 90 python3 bench/check_reference_cuda.py
run compile_cuda 150 python3 bench/check_compile_cuda.py
run doctor 30 python3 -m quant_recipes.cli doctor
run recipe_tests 90 python3 -m pytest -q -p no:cacheprovider tests/recipes -x
run demo 200 python3 -m quant_recipes.cli demo --device cuda --steps 150 --out "$OUT/demo"
