#!/usr/bin/env bash
# One device call for issue 17: `quant demo --model gpt` on the GPU (12 layers, width 2048, seq 512,
# batch 8: demo_gpt.SIZES["cuda"]), one process per recipe so a time limit loses at most the
# recipe in flight. GPT_RECIPES, GPT_STEPS and GPT_BUDGET_S (stop starting new recipes after it).
set -u
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
export PYTHONPATH=$PWD/packages/quant-core/src:$PWD/packages/quant-kernels/src:$PWD/packages/quant-dynamo/src:$PWD/packages/quant-recipes/src
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
start=$(date +%s)
for r in $(echo "${GPT_RECIPES:-baseline,fp8_current,fp8_block,mxfp8,nvfp4}" | tr , ' '); do
  if [ $(( $(date +%s) - start )) -gt "${GPT_BUDGET_S:-420}" ]; then echo "budget spent: $r not run"; break; fi
  t0=$(date +%s)
  # from source trees quant-kernels' entry point is absent: register the Triton backend by hand
  python3 -c "import sys; from quant_core import backends; from quant_kernels.backend import BACKEND
backends.register(BACKEND); from quant_recipes.cli import main; sys.exit(main(sys.argv[1:]))" \
    demo --model gpt --device cuda --steps "${GPT_STEPS:-200}" \
    --recipes "$r" --no-plot --out "$OUT/gpt_$r" > "$OUT/gpt_$r.log" 2>"$OUT/gpt_$r.err"
  echo "== $r rc=$? $(( $(date +%s) - t0 )) s"
  grep -vE "^(recipe|---|ms/step|results|quant demo)" "$OUT/gpt_$r.log"; tail -3 "$OUT/gpt_$r.err" | tr '\r' '\n' | tail -2 | cut -c1-200
done
