#!/usr/bin/env bash
# Build the four packages as wheels into .whl/ (ignored by git, carried to the GPU machine with
# `carry: [".whl"]`), beside any peer wheels already there (torchao). On the GPU machine,
# `bash bench/device.sh` installs them into /tmp/site, so that quant-kernels' entry point
# registers the Triton backend as in a user's install.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
rm -f .whl/quant_*.whl
for p in quant-core quant-kernels quant-dynamo quant-recipes; do
  python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl "packages/$p" 2>/dev/null \
    || python3 -m pip wheel -q --no-deps -w .whl "packages/$p"
done
ls .whl
