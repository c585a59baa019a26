"""Per-tensor FP8 (`numerics.md` §3-§4): the storage, its tensor, and the two quantizers,
delayed scaling (stateful) and current scaling (a value)."""

from __future__ import annotations

import torch

from .. import backends
from ..distributed import reduce_amax
from ..dtypes import DType, check_fp8
from ..inputs import as_2d, check_amax_epsilon, transposed_shape
from ..operand import GemmOperand
from ..quantizer import Quantizer, value_quantizer, warn_deprecated_group
from ..reference.fp8_tensor import accumulate_amax
from ..shapes import m_k
from ..sharding import ShardPlan
from ..storage import QuantizedStorage, present_buffers
from ..tensor import QuantizedTensor


class Float8TensorStorage(QuantizedStorage):
    """Per-tensor FP8 (current or delayed scaling): ``_data`` ``[shape]``, ``_transpose``
    ``[K, *leading]`` (byte transpose), ``_scale_inv`` fp32 ``(1,)``."""

    format = "fp8"
    buffer_names = ("_data", "_transpose", "_scale_inv")
    tag_types = {"_fp8_dtype": DType}
    rowwise_data_name, columnwise_data_name = "_data", "_transpose"
    rowwise_only_names = ("_data",)
    directions_interchangeable = True

    def _decode(self, columnwise, dtype):
        m, k = m_k(self.shape)
        if columnwise and self._transpose is not None or self._data is None:
            out = self._backend().fp8_dequantize(self._transpose.reshape(k, m), self._scale_inv,
                                                 fp8_dtype=self._fp8_dtype, dtype=dtype)
            return out.t()
        return self._backend().fp8_dequantize(self._data.reshape(m, k), self._scale_inv,
                                              fp8_dtype=self._fp8_dtype, dtype=dtype)

    def update_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Drop a direction, or build the transpose from ``_data`` (exact: the scale is shared)."""
        if columnwise and self._transpose is None:
            if self._data is None:
                raise RuntimeError("cannot build the transpose: no rowwise data")
            self._transpose = self._data.movedim(-1, 0).contiguous()
        if rowwise and self._data is None:
            if self._transpose is None:
                raise RuntimeError("cannot build rowwise data: no transpose")
            self._data = self._transpose.movedim(0, -1).contiguous()
        if rowwise is False:
            self._data = None
        if columnwise is False:
            self._transpose = None

    def gemm_operand(self, transposed: bool) -> GemmOperand | None:
        """One scale for the whole tensor: either buffer serves either role, the rowwise data
        viewed transposed or the byte transpose as it is."""
        m, k = m_k(self.shape)
        if self._data is None and self._transpose is None:
            return None
        x = self._data.reshape(m, k) if self._data is not None else None
        xt = self._transpose.reshape(k, m) if self._transpose is not None else None
        if transposed:
            data, rows, kk = (xt if xt is not None else x.t()), k, m
        else:
            data, rows, kk = (x if x is not None else xt.t()), m, k
        return GemmOperand("fp8", data, self._scale_inv, self._fp8_dtype, rows, kk)

    @classmethod
    def shard_plan(cls, q, shape, world, columnwise):
        """Any row split: the data bytes are gathered (rows past the weight's, FSDP2's padding,
        dropped); the one ``scale_inv`` comes from the amax all-reduced over the group, equal on
        every rank, so it travels as metadata. The transpose is built from the data."""
        row = q.replace(rowwise_usage=True, columnwise_usage=False, with_amax_reduction=False)
        return ShardPlan(row, ("_data",), ("_scale_inv",), True, trimmed=("_data",),
                         rows_independent=True)

    @classmethod
    def columnwise_from_rowwise(cls, s, q) -> dict[str, torch.Tensor]:
        """The byte transpose of the data (exact: one scale)."""
        m, k = m_k(s.shape)
        return {**present_buffers(cls, s), "_transpose": s._data.reshape(m, k).t().contiguous()}


class Float8Tensor(QuantizedTensor, Float8TensorStorage):
    """Per-tensor FP8 (current or delayed scaling) as a tensor."""

    _storage_type = Float8TensorStorage

    def _layout(self):
        return {"_data": ("rows", 0, 1, 1), "_transpose": ("cols_t", 1, 1, 1),
                "_scale_inv": None}

    def _split_refusal(self):
        return None  # a 1D tensor too: one scale, both buffers are [K]

    def _reshaped_buffers(self, shape):
        if self._transpose is not None:
            return None
        return {**self.buffers(), "_data": None if self._data is None else self._data.view(shape)}

    def _transposed_buffers(self):
        return {**self.buffers(), "_data": self._transpose, "_transpose": self._data}


def _quantize_per_tensor(q: Quantizer, x, x2d, be, scale, amax_out=None):
    """Cast ``x`` (2D view ``x2d``) with the fp32 ``(1,)`` ``scale`` into a storage."""
    data, transpose, scale_inv = be.fp8_quantize(
        x2d, scale, fp8_dtype=q.dtype, rowwise=q.rowwise_usage, columnwise=q.columnwise_usage,
        amax_out=amax_out,
    )
    return q._make_storage(
        x.shape, x.dtype, {"_data": data, "_transpose": transpose, "_scale_inv": scale_inv}
    )


class _PerTensorFP8:
    """Buffers and tags shared by the two per-tensor FP8 quantizers (`numerics.md` §4 layout)."""

    _storage_class = Float8TensorStorage

    def inner_tensor_specs(self, shape):
        specs = {}
        if self.rowwise_usage:
            specs["_data"] = (tuple(shape), torch.uint8)
        if self.columnwise_usage:
            specs["_transpose"] = (transposed_shape(shape), torch.uint8)
        specs["_scale_inv"] = ((1,), torch.float32)
        return specs

    def _storage_tags(self):
        return {"_fp8_dtype": self.dtype}


class Float8Quantizer(_PerTensorFP8, Quantizer):
    """Delayed scaling: casts with the ``scale`` it holds and records ``max|x|`` into ``amax``.

    ``scale`` and ``amax`` are fp32 views into a recipe state's buffers (``scale[i]`` and
    ``amax_history[0][i]``), so this quantizer holds live state: identity semantics, eager only.
    """

    scale: torch.Tensor
    amax: torch.Tensor
    dtype: DType = DType.E4M3

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, dtype: DType = DType.E4M3,
                 **fields) -> None:
        check_fp8(dtype)
        for name, t in (("scale", scale), ("amax", amax)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
                raise TypeError(f"Float8Quantizer.{name} must be an fp32 tensor of one element")
        super().__init__(scale=scale, amax=amax, dtype=dtype, **fields)
        if torch.compiler.is_compiling():
            return  # eager only: quant-recipes and quant-dynamo refuse it in a compiled region
        # One read of the scale at construction (a device sync on GPU, once per quantizer build):
        # a zero, negative or non-finite scale makes every dequantized value NaN or wrong, and
        # the delayed-scaling update never produces one (numerics.md §4 step 5).
        value = float(scale.detach().reshape(()).item())
        if not 0.0 < value < float("inf"):
            raise ValueError(
                f"Float8Quantizer.scale must be finite and > 0, got {value} (the data is divided "
                "by it on dequantize: scale_inv = 1 / scale)"
            )

    def quantize(self, x, *, amax_reduction_group=None, backend=None):
        x2d = as_2d(x, *self.shape_rule())
        be = backends.get(backend, x.device)
        return _quantize_per_tensor(
            self, x, x2d, be, self.scale.reshape(1), amax_out=self.amax.view(1)
        )

    def derive(self, **fields) -> Float8Quantizer:
        """A delayed-scaling quantizer over the same ``scale`` and ``amax`` tensors (the recipe
        state's live slots) with the other ``fields`` changed."""
        fields = {k: v for k, v in fields.items() if k not in ("scale", "amax", "dtype")}
        return Float8Quantizer(self.scale, self.amax, self.dtype, **{
            "rowwise_usage": self.rowwise_usage, "columnwise_usage": self.columnwise_usage,
            "internal": self.internal, **fields})

    def calibrate(self, x: torch.Tensor) -> None:
        """Record ``max|x|`` into ``amax`` without quantizing."""
        be = backends.get(None, x.device)
        accumulate_amax(self.amax.view(1), be.amax(as_2d(x, "Float8Quantizer")))

    def supports_only_rowwise_all_gather(self) -> bool:
        return True


@value_quantizer
class Float8CurrentScalingQuantizer(_PerTensorFP8, Quantizer):
    """Per-tensor current scaling: the scale comes from this tensor's own amax.

    The deprecated ``amax_reduction_group=`` is accepted for TransformerEngine users (with a
    ``DeprecationWarning``); such an object refuses ``==``, ``hash`` and compilation. Pass the
    group per call: ``q.quantize(x, amax_reduction_group=g)``.
    """

    dtype: DType = DType.E4M3
    with_amax_reduction: bool = False
    force_pow_2_scales: bool = False
    amax_epsilon: float = 0.0

    reduces_amax = True

    def __init__(self, dtype: DType = DType.E4M3, *, amax_reduction_group=None, **fields) -> None:
        check_fp8(dtype)
        super().__init__(dtype=dtype, **fields)
        check_amax_epsilon(self.amax_epsilon)
        if amax_reduction_group is not None:
            warn_deprecated_group(type(self).__name__)
            object.__setattr__(self, "amax_reduction_group", amax_reduction_group)

    def quantize(self, x, *, amax_reduction_group=None, backend=None):
        x2d = as_2d(x, *self.shape_rule())
        be = backends.get(backend, x.device)
        if not self.with_amax_reduction:  # amax, scale and cast in one backend call
            return self._current(x, x2d, be, None)
        group = amax_reduction_group or getattr(self, "amax_reduction_group", None)
        amax = reduce_amax(self.local_amax(x, backend=backend), group)
        return self.quantize_with_amax(x, amax, backend=backend)

    def amax_numel(self, rows: int | None = None) -> int:
        return 1

    def local_amax(self, x: torch.Tensor, *, backend=None) -> torch.Tensor:
        """fp32 ``(1,)``: this rank's ``max|x|``, the value an amax reduction combines."""
        return backends.get(backend, x.device).amax(as_2d(x, *self.shape_rule()))

    def quantize_with_amax(self, x: torch.Tensor, amax: torch.Tensor, *, backend=None):
        """Quantize ``x`` with the scale of ``amax`` (fp32 ``(1,)``, e.g. :meth:`local_amax`
        reduced over the ranks): the steps of :meth:`quantize` after its reduction."""
        return self._current(x, as_2d(x, *self.shape_rule()), backends.get(backend, x.device),
                             amax)

    def _current(self, x, x2d, be, amax):
        """The storage of ``x`` (2D view ``x2d``) cast with the scale of ``amax``, or of its own
        amax (``None``), in one backend call."""
        data, transpose, scale_inv = be.fp8_current_quantize(
            x2d, fp8_dtype=self.dtype, force_pow_2_scales=self.force_pow_2_scales,
            amax_epsilon=self.amax_epsilon, rowwise=self.rowwise_usage,
            columnwise=self.columnwise_usage, amax_in=amax)
        return self._make_storage(x.shape, x.dtype, {
            "_data": data, "_transpose": transpose, "_scale_inv": scale_inv})

    def decodes_exactly_to_bf16(self) -> bool:
        """With a power-of-2 scale, ``fp8 * scale_inv`` is a bf16 value."""
        return self.force_pow_2_scales

    def is_requantization_safe(self) -> bool:
        return True

    def supports_only_rowwise_all_gather(self) -> bool:
        return True

    def lowerings(self) -> tuple[str, ...]:
        """The backend's kernels, and the traced reference ops: the amax reduction, the scale
        (an fp64 division rounded once) and the cast compile to the reference's bytes."""
        return ("ops", "kernels")
