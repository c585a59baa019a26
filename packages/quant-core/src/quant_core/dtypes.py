"""Element and scale formats (`numerics.md` §1)."""

from __future__ import annotations

import enum

import torch


class DType(enum.Enum):
    """A low-precision element format. Member values are stable ints (they appear in value keys)."""

    E4M3 = 0
    E5M2 = 1
    E2M1 = 2
    E8M0 = 3

    @property
    def max(self) -> float:
        """Largest finite magnitude of the format."""
        return _MAX[self]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype with this format's bit layout (E2M1 is stored packed in uint8)."""
        return _TORCH[self]

    @property
    def is_fp8(self) -> bool:
        return self in (DType.E4M3, DType.E5M2)


_MAX = {DType.E4M3: 448.0, DType.E5M2: 57344.0, DType.E2M1: 6.0, DType.E8M0: 2.0**127}
_TORCH = {
    DType.E4M3: torch.float8_e4m3fn,
    DType.E5M2: torch.float8_e5m2,
    DType.E2M1: torch.uint8,
    DType.E8M0: torch.uint8,
}

#: High-precision input dtypes every quantizer accepts.
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_fp8(dtype: DType, what: str = "dtype") -> DType:
    """``dtype`` if it is an FP8 element format, else ``ValueError`` naming ``what``."""
    if not isinstance(dtype, DType) or not dtype.is_fp8:
        raise ValueError(f"{what} must be DType.E4M3 or DType.E5M2, got {dtype!r}")
    return dtype
