"""Where the host's wall time goes in a compiled training step, by sampling (issue 13): cProfile
inflates every Python call it sees and cannot see Dynamo's frame or native code, so its
per-function times did not add up to the measured gap against torchao.

``run``: ``bench/train_step.py``'s step (one bias-free Linear ``--n`` square, compiled, default
mode), warmed up, then ``--steps`` steps back to back without synchronising, for
``py-spy record --native -f raw`` to sample (the autograd engine on the calling thread, as in
``cprofile_step.py``, so one thread holds every frame of the step).
``report RAW...``: per raw file, the share of the loop's samples under each function (inclusive)
and at each leaf (own), as microseconds per step from the loop's measured wall time.

``py-spy record -r 200 -f raw -o ours.raw -- python bench/spy_step.py run --recipe fp8_current
> ours.json`` then ``python bench/spy_step.py report ours.raw --meta ours.json``. Works on this
CPU; on the H200 hosts py-spy fell minutes behind at 1000-2000 Hz, with or without ``--native``
(bench/RESULTS.md, seventh session), so keep the rate low there.
"""

from __future__ import annotations

import argparse
import collections
import json

#: The timed loop's frame (``train_step.host_ms``), as ``_short`` names it.
LOOP = "host_ms (train_step.py)"


def _short(frame: str) -> str:
    """``fn (file.py:line)`` of py-spy's raw format, without the directory."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit("/", 1)[-1]
    return f"{name} ({where.split(':')[0]})" if where else name


def run(args) -> None:
    import torch
    from train_step import host_ms, warm_square_step  # registers Triton from source trees

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.autograd.set_multithreading_enabled(False):
        step = warm_square_step(args.recipe, args.n, dev, warmup=10)
        us = host_ms(step, dev, args.steps) * 1e3  # the loop every sample of interest is in
    print(json.dumps({"recipe": args.recipe, "n": args.n, "steps": args.steps,
                      "us_per_step": us}))


def report(args) -> None:
    for path in args.raw:
        incl: collections.Counter = collections.Counter()
        own: collections.Counter = collections.Counter()
        total = 0
        for line in open(path):
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = [_short(f) for f in stack.split(";")]
            hits = [i for i, f in enumerate(frames) if f.startswith(LOOP)]
            if not hits:
                continue
            inner = frames[hits[-1] + 1:] or ["<loop>"]
            n = int(count)
            total += n
            for f in set(inner):
                incl[f] += n
            own[inner[-1]] += n
        # py-spy writes its own messages to the same stdout: the JSON line is run's
        meta = json.loads([ln for ln in open(args.meta[0]) if ln.startswith("{")][-1]) \
            if args.meta else {}
        # with the run's measured us/step, a share of the samples is a share of that time
        scale = meta.get("us_per_step", 100.0) / max(total, 1)
        unit = "us/step" if meta else "% of samples"
        print(f"--- {path}: {total} samples in the loop ({meta or 'no --meta: shares'})")
        for title, counter in (("inclusive", incl), ("own (leaf)", own)):
            print(f"| {unit} | {title} |\n| --- | --- |")
            for f, n in counter.most_common(args.rows):
                print(f"| {n * scale:.1f} | {f[:150]} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--recipe", default="fp8_current")
    r.add_argument("--n", type=int, default=4096)
    r.add_argument("--steps", type=int, default=2000)
    rep = sub.add_parser("report")
    rep.add_argument("raw", nargs="+")
    rep.add_argument("--meta", nargs=1, help="the JSON line `run` printed (us_per_step)")
    rep.add_argument("--rows", type=int, default=40)
    args = p.parse_args()
    run(args) if args.cmd == "run" else report(args)


if __name__ == "__main__":
    main()
