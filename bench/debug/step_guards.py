"""The guards Dynamo installs on train_step.py's compiled step, and the time of one guard check
(issue 13: ``compile_wrapper``'s own time was 96 us per step for fp8_current against 16 for
torchao on the H200's host). ``python bench/debug/step_guards.py fp8_current`` with
``TORCH_LOGS=guards`` prints the guard tree too."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402
import train_step as ts  # noqa: E402
from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: E402


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "fp8_current"
    if name.partition(":")[0] not in ts.OURS:  # the peers compile a module, not a closure
        sys.exit(f"step_guards.py: choose one of {', '.join(ts.OURS)}, got {name!r}")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    x, w, g = ts.step_inputs(n, n, n, dev)
    _, fwd, _ = ts.build(name, w, True)
    for _ in range(3):
        fwd(x).backward(g)
    fn = getattr(fwd, "_torchdynamo_orig_callable", fwd)
    entries = _debug_get_cache_entry_list(fn.__code__)
    local = {"x": x, **{v: c.cell_contents for v, c in
                        zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True)}}
    gm = entries[0].guard_manager
    assert gm.check(local), "the guards of the first entry fail on the step's own locals"
    t = time.perf_counter()
    for _ in range(2000):
        gm.check(local)
    us = (time.perf_counter() - t) / 2000 * 1e6
    print(f"{name} on {dev}: {len(entries)} cache entries, one guard check {us:.2f} us")


if __name__ == "__main__":
    main()
