"""Amax reduction across a process group, passed per call and never stored (behaviour §2.6)."""

from __future__ import annotations

import torch


def reduce_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """All-reduce ``amax`` with MAX over ``group`` and return the result (a new tensor).

    ``group=None`` or a single-rank group returns ``amax`` unchanged. Uses functional collectives,
    so the reduction traces under ``torch.compile``; in eager mode the result is a plain tensor
    (the collective waited for), which any backend's kernels may read.
    """
    if group is None:
        return amax
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "amax_reduction_group was given but torch.distributed is not initialized"
        )
    if dist.get_world_size(group) == 1:
        return amax
    from torch.distributed import _functional_collectives as funcol

    out = funcol.all_reduce(amax, "max", group)
    # eager: an AsyncCollectiveTensor, a wrapper without storage (data_ptr 0) until waited;
    # kernels that read the amax need the reduced tensor itself, after the collective
    wait = getattr(out, "wait", None)
    return wait() if wait is not None else out
