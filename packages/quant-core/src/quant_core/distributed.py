"""Amax reduction across a process group, passed per call and never stored (behaviour §2.6)."""

from __future__ import annotations

import torch


def reduce_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """All-reduce ``amax`` with MAX over ``group`` and return the result (a new tensor).

    ``group=None`` or a single-rank group returns ``amax`` unchanged. Uses functional collectives,
    so the reduction traces under ``torch.compile``.
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

    return funcol.all_reduce(amax, "max", group)
