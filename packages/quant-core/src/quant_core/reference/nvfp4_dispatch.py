"""``nvfp4_quantize``, the backend-contract entry of NVFP4 quantization (`numerics.md` §7): it
checks the mode and variant flags once (:func:`quant_core.inputs.check_nvfp4_variant`) and hands
the call to the variant's function, the TE-default :mod:`.nvfp4` or 4over6's
:mod:`.nvfp4_4over6`. It sits above both, which import nothing from each other; a backend with
its own two variant functions builds its entry the same way (:func:`nvfp4_dispatcher`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..inputs import check_nvfp4_variant
from .nvfp4 import nvfp4_base_quantize
from .nvfp4_4over6 import nvfp4_4over6_quantize
from .nvfp4_common import Buffers


def nvfp4_dispatcher(base_quantize: Callable[..., Buffers],
                     four_over_six_quantize: Callable[..., Buffers]) -> Callable[..., Buffers]:
    """The contract's ``nvfp4_quantize`` over one backend's variant functions: ``base_quantize``
    takes the arguments of :func:`.nvfp4.nvfp4_base_quantize`, ``four_over_six_quantize`` those
    of :func:`.nvfp4_4over6.nvfp4_4over6_quantize`."""

    def nvfp4_quantize(
        x: torch.Tensor,
        amax_rowwise: torch.Tensor | None,
        amax_columnwise: torch.Tensor | None,
        *,
        rowwise: bool,
        columnwise: bool,
        with_rht: bool,
        rht_sign_mask: int,
        with_2d_quantization: bool,
        stochastic_rounding: bool,
        rng_seed: torch.Tensor | None,
        swizzle: bool,
        four_over_six: bool = False,
        e4m3_max: int = 448,
        err_mode: str = "MAE",
        row_scaled: bool = False,
    ) -> Buffers:
        """Quantize ``x`` ``[M, K]`` to NVFP4 with the given per-direction amaxes (§7.2–§7.9).

        Returns ``(row_data [M, K/2], row_scale, col_data [K, ceil(M/2)], col_scale)`` (uint8;
        scales E4M3 bytes in ``quant_core.shapes``' padded shapes, padding 0; a direction not
        asked for is ``None``); the modes (RHT, 2D blocks, stochastic rounding, ``swizzle``) are
        those of ``nvfp4_base_quantize``. ``four_over_six``: 4over6 block scaling with the
        global bound ``e4m3_max`` and the error metric ``err_mode`` (§7.9; no RHT, no
        stochastic rounding). ``row_scaled``: ``amax_rowwise`` holds one value per row
        (``(M,)``) and each row has its own ``S_enc`` (§7.9); rowwise only, 1x16 blocks, round
        to nearest.
        """
        check_nvfp4_variant(columnwise=columnwise, with_rht=with_rht,
                            with_2d_quantization=with_2d_quantization,
                            stochastic_rounding=stochastic_rounding, rng_seed=rng_seed,
                            four_over_six=four_over_six, e4m3_max=e4m3_max, err_mode=err_mode,
                            row_scaled=row_scaled)
        if four_over_six:
            return four_over_six_quantize(
                x, amax_rowwise, amax_columnwise, rowwise=rowwise, columnwise=columnwise,
                with_2d_quantization=with_2d_quantization, e4m3_max=e4m3_max,
                err_mode=err_mode, swizzle=swizzle, row_scaled=row_scaled,
            )
        return base_quantize(
            x, amax_rowwise, amax_columnwise, rowwise=rowwise, columnwise=columnwise,
            with_rht=with_rht, rht_sign_mask=rht_sign_mask,
            with_2d_quantization=with_2d_quantization,
            stochastic_rounding=stochastic_rounding, rng_seed=rng_seed, swizzle=swizzle,
            row_scaled=row_scaled,
        )

    return nvfp4_quantize


#: The reference's ``nvfp4_quantize``.
nvfp4_quantize = nvfp4_dispatcher(nvfp4_base_quantize, nvfp4_4over6_quantize)
