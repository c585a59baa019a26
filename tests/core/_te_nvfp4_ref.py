# Copyright (c) 2022-2026, NVIDIA CORPORATION & AFFILIATES. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (tests/core/LICENSE.TransformerEngine).
#
# Vendored, unmodified in the functions' bodies, from NVIDIA/TransformerEngine commit
# d0067d0da6cb01811b8072a7d304f0e00344ce2b, file
# transformer_engine/pytorch/custom_recipes/reference_nvfp4.py: the E2M1 casts and the
# NVFP4QuantizerRef methods that quantize one direction (the standard, 4over6 and row-scaled
# rules). Kept as the oracle of tests/core/test_te_nvfp4_reference.py; the class keeps only
# these static and class methods (TE's quantizer base and its GEMM are left out).
# ruff: noqa

"""TransformerEngine's pure-PyTorch NVFP4 reference quantization (test oracle)."""

from typing import Optional, Tuple

import torch


def cast_to_fp4x2(x):
    """Quantize a tensor to FP4 E2M1 and store in a byte tensor"""

    result = torch.zeros_like(x, dtype=torch.uint8)
    result[(x >= 0.0) & (x <= 0.25)] = 0
    result[(x > 0.25) & (x < 0.75)] = 1
    result[(x >= 0.75) & (x <= 1.25)] = 2
    result[(x > 1.25) & (x < 1.75)] = 3
    result[(x >= 1.75) & (x <= 2.5)] = 4
    result[(x > 2.5) & (x < 3.5)] = 5
    result[(x >= 3.5) & (x <= 5.0)] = 6
    result[x > 5.0] = 7

    result[(x >= -0.25) & (x < -0.0)] = 8
    result[(x < -0.25) & (x > -0.75)] = 9
    result[(x <= -0.75) & (x >= -1.25)] = 10
    result[(x < -1.25) & (x > -1.75)] = 11
    result[(x <= -1.75) & (x >= -2.5)] = 12
    result[(x < -2.5) & (x > -3.5)] = 13
    result[(x <= -3.5) & (x >= -5.0)] = 14
    result[x < -5.0] = 15

    return result[:, ::2] + result[:, 1::2] * 16


def cast_from_fp4x2(x, dq_dtype):
    """Dequantize FP4 E2M1 tensor that has been represented in a byte tensor"""
    fp4_values = torch.tensor(
        [
            0.0,
            0.5,
            1.0,
            1.5,
            2.0,
            3.0,
            4.0,
            6.0,
            -0.0,
            -0.5,
            -1.0,
            -1.5,
            -2.0,
            -3.0,
            -4.0,
            -6.0,
        ],
        device=x.device,
        dtype=dq_dtype,
    )

    # Convert to long integers for indexing
    second_bit = torch.div(x, 16, rounding_mode="floor").to(torch.long)
    first_bit = (x - second_bit * 16).to(torch.long)

    # Use the long integers to index fp4_values
    first_bit_values = fp4_values[first_bit]
    second_bit_values = fp4_values[second_bit]

    result = torch.zeros(
        (first_bit_values.shape[0], first_bit_values.shape[1] * 2),
        device=x.device,
        dtype=dq_dtype,
    )
    result[:, ::2] = first_bit_values
    result[:, 1::2] = second_bit_values

    return result




class NVFP4QuantizerRef:
    """The one-direction quantization methods of TE's NVFP4QuantizerRef."""

    @staticmethod
    def _ref_nvfp4_4over6_fp16_candidate(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Decode E2M1 x E4M3 with the kernel's FP16 product semantics."""
        q_float = q.to(torch.float32)
        q_sign = (q_float < 0).to(torch.int32)
        q_sig = (torch.abs(q_float) * 2).to(torch.int32)

        scale_code = scale.contiguous().view(torch.uint8).to(torch.int32)
        scale_sign = scale_code >> 7
        scale_exp_field = (scale_code >> 3) & 0xF
        scale_mantissa = scale_code & 0x7
        scale_sig = torch.where(scale_exp_field == 0, scale_mantissa, scale_mantissa + 8)
        scale_exp2 = torch.where(scale_exp_field == 0, scale_exp_field - 9, scale_exp_field - 10)

        product_sign = q_sign ^ scale_sign
        product_sig = q_sig * scale_sig
        product_exp2 = scale_exp2 - 1

        log2_sig = torch.zeros_like(product_sig)
        for threshold in (2, 4, 8, 16, 32, 64, 128, 256):
            log2_sig = log2_sig + (product_sig >= threshold).to(torch.int32)

        floor_exp = log2_sig + product_exp2
        normal_bits = ((floor_exp + 15) << 10) | (
            torch.bitwise_left_shift(product_sig, 10 - log2_sig) - 1024
        )
        subnormal_bits = torch.bitwise_left_shift(product_sig, product_exp2 + 24)
        magnitude_bits = torch.where(floor_exp < -14, subnormal_bits, normal_bits)
        prod_bits = (product_sign << 15) | magnitude_bits
        prod_bits = torch.where(product_sig == 0, product_sign << 15, prod_bits)
        prod_bits = torch.where(
            (scale_code & 0x7F) == 0x7F,
            torch.full_like(prod_bits, 0x7E00),
            prod_bits,
        )

        sign_f32 = torch.where(
            (prod_bits & 0x8000) != 0,
            torch.tensor(-1.0, device=prod_bits.device, dtype=torch.float32),
            torch.tensor(1.0, device=prod_bits.device, dtype=torch.float32),
        )
        fp16_exp = (prod_bits >> 10) & 0x1F
        fp16_frac = prod_bits & 0x3FF
        normal_f32 = torch.ldexp((fp16_frac + 1024).to(torch.float32), fp16_exp - 25)
        subnormal_f32 = torch.ldexp(fp16_frac.to(torch.float32), fp16_exp - 24)
        return sign_f32 * torch.where(fp16_exp == 0, subnormal_f32, normal_f32)

    @staticmethod
    def _sum_4over6_2d_error(err: torch.Tensor, tile_len_y: int) -> torch.Tensor:
        """Reduce 16 row errors in the same tree order as the CUDA warp reduction."""
        assert tile_len_y == 16, "NVFP4 4over6 2D error reduction expects 16 rows."
        rows = err.view(err.shape[0] // tile_len_y, tile_len_y, err.shape[1], 1)
        rows = rows.squeeze(-1)
        rows = rows[:, 0:8, :] + rows[:, 8:16, :]
        rows = rows[:, 0:4, :] + rows[:, 4:8, :]
        rows = rows[:, 0:2, :] + rows[:, 2:4, :]
        return (rows[:, 0, :] + rows[:, 1, :]).unsqueeze(-1)

    @staticmethod
    def _quantize_blockwise_4over6_reference(
        x: torch.Tensor,
        vec_max: torch.Tensor,
        global_amax: torch.Tensor,
        global_encode_scale: torch.Tensor,
        global_decode_scale: torch.Tensor,
        row_scaled_nvfp4: bool,
        tile_len_y: int,
        nvfp4_4over6_err_mode: str,
        nvfp4_4over6_err_use_fast_math: bool,
        nvfp4_e4m3_max: int,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Quantize NVFP4 with 4over6 candidate selection.

        This mirrors the CUDA path: map-to-4 uses a 1.5x expanded E4M3 block scale,
        MAE/MSE compute error in the original input domain by default, the
        fast-math error path computes error in the E4M3-scaled FP16 product
        domain, and ties choose map-to-6.
        """
        m, num_blocks, tile_len_x = x.shape
        n = num_blocks * tile_len_x
        FLOAT4_E2M1_MAX = torch.tensor(6.0, device=x.device, dtype=torch.float32)
        FLOAT8_E4M3_MAX = torch.tensor(448.0, device=x.device, dtype=torch.float32)
        GLOBAL_SCALE_E4M3_MAX = torch.tensor(
            float(nvfp4_e4m3_max), device=x.device, dtype=torch.float32
        )

        decode_scale_base = torch.div(vec_max, FLOAT4_E2M1_MAX) * global_encode_scale
        decode_scale_map4 = decode_scale_base * 1.5
        decode_scale_map6 = decode_scale_base
        decode_scale_map4 = torch.clamp(
            decode_scale_map4, min=-FLOAT8_E4M3_MAX, max=FLOAT8_E4M3_MAX
        ).to(torch.float8_e4m3fn)
        decode_scale_map6 = torch.clamp(
            decode_scale_map6, min=-FLOAT8_E4M3_MAX, max=FLOAT8_E4M3_MAX
        ).to(torch.float8_e4m3fn)

        fp32_max = torch.tensor(
            torch.finfo(torch.float32).max,
            device=decode_scale_map4.device,
            dtype=torch.float32,
        )
        encode_scale_map4 = torch.min(
            torch.div(1.0, decode_scale_map4.to(torch.float32) * global_decode_scale),
            fp32_max,
        )
        encode_scale_map6 = torch.min(
            torch.div(1.0, decode_scale_map6.to(torch.float32) * global_decode_scale),
            fp32_max,
        )

        clipped_x_map4 = torch.clamp(
            x.to(torch.float32) * encode_scale_map4,
            -FLOAT4_E2M1_MAX,
            FLOAT4_E2M1_MAX,
        ).reshape(m, n)
        clipped_x_map6 = torch.clamp(
            x.to(torch.float32) * encode_scale_map6,
            -FLOAT4_E2M1_MAX,
            FLOAT4_E2M1_MAX,
        ).reshape(m, n)
        qx_map4 = cast_to_fp4x2(clipped_x_map4)
        qx_map6 = cast_to_fp4x2(clipped_x_map6)

        err_map4 = torch.zeros_like(vec_max)
        err_map6 = torch.zeros_like(vec_max)
        fp4_map4 = cast_from_fp4x2(qx_map4, torch.float32).view(m, num_blocks, tile_len_x)
        fp4_map6 = cast_from_fp4x2(qx_map6, torch.float32).view(m, num_blocks, tile_len_x)
        x_float = x.to(torch.float32)
        if nvfp4_4over6_err_use_fast_math:
            original_scaled = x_float * global_encode_scale
            candidate_map4 = NVFP4QuantizerRef._ref_nvfp4_4over6_fp16_candidate(
                fp4_map4, decode_scale_map4
            )
            candidate_map6 = NVFP4QuantizerRef._ref_nvfp4_4over6_fp16_candidate(
                fp4_map6, decode_scale_map6
            )
            for idx in range(tile_len_x):
                diff_map4 = candidate_map4[:, :, idx] - original_scaled[:, :, idx]
                diff_map6 = candidate_map6[:, :, idx] - original_scaled[:, :, idx]
                if nvfp4_4over6_err_mode == "MSE":
                    err_map4 = err_map4 + (diff_map4 * diff_map4).unsqueeze(-1)
                    err_map6 = err_map6 + (diff_map6 * diff_map6).unsqueeze(-1)
                else:
                    err_map4 = err_map4 + torch.abs(diff_map4).unsqueeze(-1)
                    err_map6 = err_map6 + torch.abs(diff_map6).unsqueeze(-1)
        else:
            denom = FLOAT4_E2M1_MAX * GLOBAL_SCALE_E4M3_MAX
            sf_map4 = decode_scale_map4.to(torch.float32).squeeze(-1)
            sf_map6 = decode_scale_map6.to(torch.float32).squeeze(-1)
            if row_scaled_nvfp4:
                error_global_amax = global_amax.squeeze(-1)
            else:
                error_global_amax = global_amax
            for idx in range(tile_len_x):
                val_map4 = fp4_map4[:, :, idx] * sf_map4
                val_map4 = val_map4 * error_global_amax
                val_map4 = val_map4 / denom
                diff_map4 = val_map4 - x_float[:, :, idx]
                if nvfp4_4over6_err_mode == "MSE":
                    err_map4 = err_map4 + (diff_map4 * diff_map4).unsqueeze(-1)
                else:
                    err_map4 = err_map4 + torch.abs(diff_map4).unsqueeze(-1)

                val_map6 = fp4_map6[:, :, idx] * sf_map6
                val_map6 = val_map6 * error_global_amax
                val_map6 = val_map6 / denom
                diff_map6 = val_map6 - x_float[:, :, idx]
                if nvfp4_4over6_err_mode == "MSE":
                    err_map6 = err_map6 + (diff_map6 * diff_map6).unsqueeze(-1)
                else:
                    err_map6 = err_map6 + torch.abs(diff_map6).unsqueeze(-1)
        if tile_len_y == 1:
            pick_map4 = err_map4 < err_map6
        else:
            err_map4_blocks = NVFP4QuantizerRef._sum_4over6_2d_error(err_map4, tile_len_y)
            err_map6_blocks = NVFP4QuantizerRef._sum_4over6_2d_error(err_map6, tile_len_y)
            pick_map4 = (err_map4_blocks < err_map6_blocks).repeat_interleave(tile_len_y, dim=0)
        qx = torch.where(
            pick_map4.expand(-1, -1, tile_len_x // 2),
            qx_map4.view(m, num_blocks, tile_len_x // 2),
            qx_map6.view(m, num_blocks, tile_len_x // 2),
        ).reshape(m, n // 2)
        decode_scale = torch.where(pick_map4, decode_scale_map4, decode_scale_map6).squeeze(-1)
        return qx, decode_scale

    @classmethod
    def _quantize_blockwise_reference(
        cls,
        x: torch.Tensor,
        global_amax: torch.Tensor,
        tile_len_x: int,
        tile_len_y: int,
        *,
        pow_2_scales: bool,
        row_scaled_nvfp4: bool = False,
        nvfp4_use_4over6: bool = False,
        nvfp4_e4m3_max: int = 448,
        nvfp4_4over6_err_mode: str = "MAE",
        nvfp4_4over6_err_use_fast_math: bool = False,
        eps: float,  # pylint: disable=unused-argument
    ) -> Tuple[torch.Tensor, torch.Tensor]:

        if x.ndim != 2:
            raise ValueError(
                f"_quantize_blockwise_reference expects a 2D tensor, got {x.ndim}D with shape"
                f" {x.shape}"
            )
        using_2d_quantization = tile_len_x == 16 and tile_len_y == 16
        m, n = x.shape
        # Compute vec_max based on the original x (before reshape)
        # For 1D quantization: amax over each row chunk of 16
        # For 2D quantization: amax over each 16x16 block, but output shape is still (128, 8, 1), filled with block amax
        if using_2d_quantization:
            # x shape: (128, 128)
            x_blocks = (
                x.unfold(0, tile_len_y, tile_len_y)
                .unfold(1, tile_len_x, tile_len_x)
                .to(torch.float32)
            )  # (8, 8, 16, 16)
            block_amax = torch.amax(torch.abs(x_blocks), dim=(-1, -2))  # (8, 8)
            # Now, expand to (128, 8, 1) by repeating each block_amax for 16 rows
            vec_max = block_amax.repeat_interleave(tile_len_y, dim=0).unsqueeze(-1)  # (128, 8, 1)
        else:
            # x shape: (128, 128)
            x_reshaped = x.view(m, n // tile_len_x, tile_len_x)  # (128, 8, 16)
            vec_max = torch.amax(torch.abs(x_reshaped), dim=-1, keepdim=True).to(
                torch.float32
            )  # (128, 8, 1)
        x = x.view(m, n // tile_len_x, tile_len_x)
        FLOAT4_E2M1_MAX = torch.tensor(6.0, device=x.device, dtype=torch.float32)
        FLOAT8_E4M3_MAX = torch.tensor(448.0, device=x.device, dtype=torch.float32)
        global_scale_e4m3_max = float(nvfp4_e4m3_max if nvfp4_use_4over6 else 448)
        GLOBAL_SCALE_E4M3_MAX = torch.tensor(
            global_scale_e4m3_max, device=x.device, dtype=torch.float32
        )
        decode_scale = torch.div(vec_max, FLOAT4_E2M1_MAX)

        if pow_2_scales:
            decode_scale = cast_to_e8(decode_scale)
            encode_scale = torch.div(
                torch.tensor(1.0, device=x.device, dtype=torch.float32),
                decode_scale.to(torch.float32),
            )
        else:
            if row_scaled_nvfp4:
                global_amax = global_amax.to(torch.float32).view(m, 1, 1)

            global_encode_scale = torch.div(GLOBAL_SCALE_E4M3_MAX * FLOAT4_E2M1_MAX, global_amax)
            global_encode_scale = torch.min(
                global_encode_scale,
                torch.tensor(
                    torch.finfo(torch.float32).max,
                    device=global_encode_scale.device,
                    dtype=torch.float32,
                ),
            )
            if global_encode_scale.numel() == 1:
                if global_encode_scale == torch.tensor(0.0, device=x.device, dtype=torch.float32):
                    global_encode_scale = torch.tensor(1.0, device=x.device, dtype=torch.float32)
            else:
                global_encode_scale = torch.where(
                    global_encode_scale == 0.0,
                    torch.ones_like(global_encode_scale),
                    global_encode_scale,
                )
            global_decode_scale = torch.div(1.0, global_encode_scale)
            if nvfp4_use_4over6:
                # FourOverSix compares map-to-4 and map-to-6 candidates using
                # the configured error mode, while keeping TE-style FP4
                # quantization for each candidate.
                return cls._quantize_blockwise_4over6_reference(
                    x,
                    vec_max,
                    global_amax,
                    global_encode_scale,
                    global_decode_scale,
                    row_scaled_nvfp4,
                    tile_len_y,
                    nvfp4_4over6_err_mode,
                    nvfp4_4over6_err_use_fast_math,
                    nvfp4_e4m3_max,
                )

            global_encode_scale_multiplier = global_encode_scale * torch.reciprocal(FLOAT4_E2M1_MAX)

            # Match the kernel's default path: fold the FP4 reciprocal into the
            # global scale multiplier, but keep the final reciprocal exact.
            decode_scale = vec_max * global_encode_scale_multiplier
            decode_scale = torch.min(
                decode_scale,
                torch.tensor(
                    torch.finfo(torch.float32).max,
                    device=decode_scale.device,
                    dtype=torch.float32,
                ),
            )
            decode_scale = torch.clamp(decode_scale, min=-FLOAT8_E4M3_MAX, max=FLOAT8_E4M3_MAX)
            decode_scale = decode_scale.to(torch.float8_e4m3fn)

            encode_scale = torch.min(
                torch.div(1.0, decode_scale.to(torch.float32) * global_decode_scale),
                torch.tensor(
                    torch.finfo(torch.float32).max,
                    device=decode_scale.device,
                    dtype=torch.float32,
                ),
            )

        scaled_x = x.to(torch.float32) * encode_scale

        clipped_x = torch.clamp(scaled_x, -FLOAT4_E2M1_MAX, FLOAT4_E2M1_MAX).reshape(m, n)

        return cast_to_fp4x2(clipped_x), decode_scale.squeeze(-1)

    @staticmethod
    def _pad_tensor(
        tensor: torch.Tensor, row_divisor: Optional[int], col_divisor: Optional[int]
    ) -> torch.Tensor:

        if tensor.dim() != 2:
            raise ValueError(
                f"_pad_tensor only supports 2D tensors, got {tensor.dim()}D tensor with shape"
                f" {tensor.shape}"
            )
        M, N = tensor.shape
        padding_needed_rows = 0
        padding_needed_cols = 0

        if row_divisor is not None and M % row_divisor != 0:
            padding_needed_rows = row_divisor - (M % row_divisor)
        # Check and calculate column padding if col_divisor is provided
        if col_divisor is not None and N % col_divisor != 0:
            padding_needed_cols = col_divisor - (N % col_divisor)

        # Return original tensor if no padding is needed
        if padding_needed_rows == 0 and padding_needed_cols == 0:
            return tensor

        # pad the tensor
        out = torch.nn.functional.pad(
            tensor,
            (0, padding_needed_cols, 0, padding_needed_rows),
            mode="constant",
            value=0.0,
        ).contiguous()

        return out

    @staticmethod
    def _rm_pad_tensor(tensor: torch.Tensor, original_size: tuple[int, ...]) -> torch.Tensor:

        if tensor.dim() != 2:
            raise ValueError(
                f"_rm_pad_tensor only supports 2D tensors, got {tensor.dim()}D tensor with shape"
                f" {tensor.shape}"
            )
        M, N = original_size
        out = tensor[:M, :N].contiguous()
        return out
