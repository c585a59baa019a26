"""A module as an older version pickled it: saved whole without the attributes named, loaded."""

from __future__ import annotations

import io

import torch


def pickled_without(module: torch.nn.Module, *names: str) -> torch.nn.Module:
    """``module`` through ``torch.save`` / ``torch.load`` with the instance attributes ``names``
    deleted first (the state a version before them wrote)."""
    for name in names:
        delattr(module, name)
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert not set(names) & set(vars(loaded))
    return loaded
