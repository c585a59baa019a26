"""Validation of high-precision inputs, shared by every quantizer."""

from __future__ import annotations

import torch

from .constants import FLT_MAX, NVFP4_4OVER6_E4M3_BOUNDS, NVFP4_4OVER6_ERROR_MODES
from .dtypes import INPUT_DTYPES


def as_2d(x: torch.Tensor, fmt: str, k_multiple: int = 1) -> torch.Tensor:
    """The contiguous ``[M, K]`` view of ``x`` (``M`` = product of the leading dims), detached:
    quantization is not differentiable, so no buffer it produces (scales, amaxes, the shared
    amax of delayed scaling) may carry the input's autograd history.

    Raises ``TypeError`` for a non-tensor, a sparse (non-strided) layout or a dtype other than
    fp32/bf16/fp16, and ``ValueError`` for a 0-d tensor or a last dim that is not a multiple of
    ``k_multiple`` (naming ``fmt``).
    Non-contiguous inputs are copied to a contiguous layout (same values, same result).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fmt}: expected a torch.Tensor, got {type(x).__name__}")
    check_dense(x, fmt)
    check_input_dtype(x, fmt)
    shape = x.shape
    check_shape(shape, fmt, k_multiple)
    x = x.detach().contiguous()
    return x if len(shape) == 2 else x.reshape(shape[:-1].numel(), shape[-1])


def check_input_dtype(x: torch.Tensor, what: str) -> None:
    """``TypeError`` unless ``x`` is fp32, bf16 or fp16: the quantizers check it once, and every
    backend's functions that take a high-precision ``x`` check it again with this same rule, so a
    direct backend call is refused alike by every backend (backend_contract.py)."""
    if x.dtype not in INPUT_DTYPES:
        allowed = ", ".join(str(d) for d in INPUT_DTYPES)
        raise TypeError(f"{what}: input dtype must be one of {allowed}; got {x.dtype}")


def check_output_dtype(dtype: torch.dtype, what: str) -> None:
    """``ValueError`` unless ``dtype``, the dtype asked of decoded values, is fp32, bf16 or fp16:
    the dequantizing functions of the reference and of every backend check it with this rule."""
    if dtype not in INPUT_DTYPES:
        allowed = ", ".join(str(d) for d in INPUT_DTYPES)
        raise ValueError(f"{what}: dtype must be one of {allowed}; got {dtype}")


def check_dense(x: torch.Tensor, what: str) -> None:
    """``TypeError`` unless ``x`` has the dense ``torch.strided`` layout (sparse COO/CSR/... and
    other layouts have no contiguous buffer to quantize)."""
    if x.layout != torch.strided:
        raise TypeError(
            f"{what}: input must be a dense tensor (layout torch.strided), got layout "
            f"{x.layout}; convert it with x.to_dense() first"
        )


def check_shape(shape, fmt: str, k_multiple: int = 1) -> None:
    """The shape rules every allocation path shares with ``quantize`` (`behaviour.md` §10.1): at
    least one dimension, the last one a multiple of ``k_multiple``."""
    shape = tuple(shape)
    if len(shape) == 0:
        raise ValueError(f"{fmt}: input must have at least one dimension, got a 0-d tensor")
    if shape[-1] % k_multiple:
        raise ValueError(
            f"{fmt}: the last dimension must be a multiple of {k_multiple}, got shape "
            f"{shape} (K = {shape[-1]})"
        )


def transposed_shape(shape: torch.Size) -> tuple[int, ...]:
    """``[K, *leading]``: the shape of a columnwise buffer stored transposed."""
    return (shape[-1], *shape[:-1])


def check_k_multiple(k: int, block: int, fmt: str) -> None:
    """``ValueError`` unless ``K`` is a multiple of the format's rowwise ``block``."""
    if k % block:
        raise ValueError(f"{fmt} needs K to be a multiple of {block}, got K = {k}")


def check_amax_epsilon(amax_epsilon) -> None:
    """``amax_epsilon`` is a finite number in ``[0, FLT_MAX]`` (beyond fp32 the reference raised
    a raw error while the Triton backend returned scale 1.0)."""
    if isinstance(amax_epsilon, bool) or not isinstance(amax_epsilon, (int, float)):
        raise TypeError(f"amax_epsilon must be a float, got {amax_epsilon!r}")
    if not 0 <= amax_epsilon <= FLT_MAX:  # also False for NaN (it is compared with fp32 amaxes)
        raise ValueError(
            f"amax_epsilon must be a finite fp32 value >= 0 (at most {FLT_MAX:.7g}), "
            f"got {amax_epsilon!r}"
        )


def check_block_scaling_dim(block_scaling_dim: int) -> None:
    """``ValueError`` unless the FP8 block ``block_scaling_dim`` is 1 (1x128) or 2 (128x128)."""
    if block_scaling_dim not in (1, 2):
        raise ValueError(f"FP8 block block_scaling_dim must be 1 or 2, got {block_scaling_dim!r}")


def check_row_index(x: torch.Tensor, rows: torch.Tensor, what: str, *, arg: str = "rows",
                    meaning: str = "the source row of each output row, -1 for a zero row",
                    count: int | None = None) -> None:
    """A clear error unless ``rows`` (named ``arg``, holding ``meaning``) is a 1D int32/int64
    tensor on ``x``'s device, of ``count`` entries where given."""
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{what}: {arg} must be a 1D int32/int64 tensor ({meaning}), got "
                        f"{rows.dtype} {tuple(rows.shape)}")
    if count is not None and rows.shape[0] != count:
        raise ValueError(f"{what}: {arg} must have {count} entries ({meaning}), got "
                         f"{rows.shape[0]}")
    if rows.device != x.device:
        raise ValueError(f"{what}: {arg} is on {rows.device} but x on {x.device}")


def check_column_groups(m: int, groups: int, block: int, what: str) -> None:
    """A clear error unless ``groups`` (the columnwise data's groups of rows, 0 for none) splits
    ``m`` rows into equal groups of whole ``block``-row blocks."""
    if groups < 0 or (groups and (m % groups or (m // groups) % block)):
        raise ValueError(f"{what}: groups must be 0 or split the {m} rows into equal groups of "
                         f"a multiple of {block} rows (each group's rows transposed on their "
                         f"own), got {groups}")


def check_rht_input(x: torch.Tensor) -> None:
    """``ValueError`` unless ``x [M, K]`` can take the NVFP4 16x16 RHT: bf16 and ``M % 16 == 0``."""
    if x.dtype != torch.bfloat16:
        raise ValueError(
            f"NVFP4 with RHT needs a bfloat16 input, got {x.dtype}: cast the model and its "
            "inputs to torch.bfloat16, or turn the Hadamard transform off "
            "(NVFP4BlockScaling(disable_rht=True))")
    if x.shape[0] % 16:
        raise ValueError(
            "NVFP4 with RHT mixes 16 rows: M must be a multiple of 16, got "
            f"M = {x.shape[0]} (M is the number of tokens, all dimensions but the last): pad "
            "the batch or the sequence to a multiple of 16, or turn the Hadamard transform off "
            "(NVFP4BlockScaling(disable_rht=True))")


def check_nvfp4_variant(*, columnwise: bool, with_rht: bool, with_2d_quantization: bool = False,
                        stochastic_rounding: bool = False, rng_seed: torch.Tensor | None = None,
                        four_over_six: bool = False, e4m3_max: int = 448, err_mode: str = "MAE",
                        row_scaled: bool = False) -> None:
    """``ValueError`` for a combination of NVFP4's mode and variant flags that no backend takes,
    the one rule set of ``nvfp4_quantize`` (and of ``nvfp4_amax``, which passes its flags):

    - row-scaled (§7.9) is rowwise only, with 1x16 blocks rounded to nearest: no columnwise
      direction, RHT, 2D blocks or stochastic rounding;
    - 4over6 (§7.9) takes no RHT and no stochastic rounding, a global bound ``e4m3_max`` of
      :data:`~quant_core.constants.NVFP4_4OVER6_E4M3_BOUNDS` and an ``err_mode`` of
      :data:`~quant_core.constants.NVFP4_4OVER6_ERROR_MODES`; without 4over6 the bound is 448
      (``err_mode`` is not read);
    - RHT and 2D blocks are exclusive, and stochastic rounding needs a seed.
    """
    if row_scaled:
        refused = [name for name, on in (("columnwise", columnwise), ("with_rht", with_rht),
                                         ("with_2d_quantization", with_2d_quantization),
                                         ("stochastic_rounding", stochastic_rounding)) if on]
        if refused:
            raise ValueError(f"row-scaled NVFP4 is rowwise only, with 1x16 blocks rounded to "
                             f"nearest; it takes no {', '.join(refused)}")
    if four_over_six:
        if with_rht or stochastic_rounding:
            raise ValueError("NVFP4 4over6 takes neither with_rht nor stochastic_rounding")
        if e4m3_max not in NVFP4_4OVER6_E4M3_BOUNDS:
            raise ValueError(f"nvfp4_e4m3_max must be one of {NVFP4_4OVER6_E4M3_BOUNDS}, "
                             f"got {e4m3_max!r}")
        if err_mode not in NVFP4_4OVER6_ERROR_MODES:
            raise ValueError(f"nvfp4_4over6_err_mode must be one of {NVFP4_4OVER6_ERROR_MODES}, "
                             f"got {err_mode!r}")
    elif e4m3_max != 448:
        raise ValueError(f"nvfp4_quantize: e4m3_max must be 448 without 4over6, got {e4m3_max}")
    if with_rht and with_2d_quantization:
        raise ValueError("NVFP4 with_rht and with_2d_quantization are exclusive (weights: no RHT)")
    if stochastic_rounding and rng_seed is None:
        raise ValueError("NVFP4 stochastic rounding needs rng_seed (int64 tensor of shape (1,))")


def given_group_amax(amax: torch.Tensor, groups: int, device: torch.device,
                     what: str) -> torch.Tensor:
    """A caller's per-group amax for a grouped current-scaling cast, checked: fp32 ``[groups]``
    on ``device`` (any stride; returned contiguous)."""
    return _given_amaxes(amax, groups, device, what, "amax", "group")


def given_row_amax(row_amax: torch.Tensor, rows: int, device: torch.device,
                   what: str) -> torch.Tensor:
    """A caller's per-row amax for a grouped current-scaling cast, checked: fp32 ``[rows]`` on
    ``device`` (any stride; returned contiguous)."""
    return _given_amaxes(row_amax, rows, device, what, "row_amax", "row")


def _given_amaxes(amax, n: int, device: torch.device, what: str, arg: str,
                  per: str) -> torch.Tensor:
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32 or tuple(
            amax.shape) != (n,) or amax.device != device:
        got = (f"{amax.dtype} {tuple(amax.shape)} on {amax.device}"
               if isinstance(amax, torch.Tensor) else type(amax).__name__)
        raise ValueError(f"{what}: {arg} must be an fp32 tensor of shape ({n},) (one amax "
                         f"per {per}) on {device}, got {got}")
    return amax.contiguous()

