"""cProfile of the compiled training step (issue 13): which Python functions the host spends a
step in, for ours against a peer, where torch.profiler only shows the ops.

``bench/train_step.py``'s step (one bias-free Linear ``--n`` square, compiled, default mode),
warmed up, then ``--steps`` steps under cProfile with the autograd engine on the calling thread
(``torch.autograd.set_multithreading_enabled(False)``: cProfile sees one thread, and the engine
would run a CUDA backward on its own). Prints the top functions by own time and by cumulative
time, per step.

``PYTHONPATH=packages/quant-core/src:packages/quant-kernels/src:packages/quant-dynamo/src:\\
packages/quant-recipes/src python bench/cprofile_step.py --recipe fp8_current``
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch
from train_step import OURS, warm_square_step  # registers Triton from source trees


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="fp8_current",
                   choices=[*OURS, "bf16", "ao_fp8_tensorwise"])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rows", type=int, default=30)
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.autograd.set_multithreading_enabled(False):
        step = warm_square_step(args.recipe, args.n, dev, warmup=5)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, calls, own s, cumulative s, _)
    for col, label in ((2, "own"), (3, "cumulative")):
        print(f"--- {args.recipe} n={args.n}, {args.steps} steps: top by {label} time, us/step")
        print("| own us | cumulative us | calls/step | function |\n| --- | --- | --- | --- |")
        top = sorted(stats.items(), key=lambda kv: kv[1][col], reverse=True)[: args.rows]
        for (file, line, name), (_, calls, own, cum, _) in top:
            where = f"{file.split('site-packages/')[-1].split('/src/')[-1]}:{line}({name})"
            print(f"| {own / args.steps * 1e6:.1f} | {cum / args.steps * 1e6:.1f} "
                  f"| {calls / args.steps:g} | {where} |")


if __name__ == "__main__":
    main()
