"""Quantized tensors (behaviour.md §1.5, DESIGN contract 7): the wrapper subclasses are their
storages, flatten/unflatten round-trip, and every op of the table gives the bytes of doing it on
the quantized or dequantized data; any other op is refused by name."""

from __future__ import annotations

import copy
import io
import pickle

import formats
import pytest
import torch
from quant_core import (
    Float8BlockQuantizer,
    Float8BlockwiseQTensor,
    Float8BlockwiseQTensorStorage,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Float8Tensor,
    Float8TensorStorage,
    MXFP8Quantizer,
    MXFP8Tensor,
    MXFP8TensorStorage,
    NVFP4Quantizer,
    NVFP4Tensor,
    NVFP4TensorStorage,
    QuantizedStorage,
    QuantizedTensor,
)
from quant_core.tensor import TensorContext, tensor_class, tensor_classes
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def _delayed():
    return Float8Quantizer(torch.full((1,), 2.0), torch.zeros(1))


#: Every format's default quantizer and variants from tests/formats.py; delayed scaling (stateful)
#: stays local.
FORMAT_QUANTIZERS = formats.quantizers("block1d", "nvfp4_rht", defaults=True)
QUANTIZERS = {**FORMAT_QUANTIZERS, "delayed": _delayed}
CLASSES = {
    "current": Float8Tensor, "delayed": Float8Tensor, "mxfp8": MXFP8Tensor,
    "block1d": Float8BlockwiseQTensor, "block2d": Float8BlockwiseQTensor, "nvfp4": NVFP4Tensor,
    "nvfp4_rht": NVFP4Tensor,
}
#: The rows of dim 0 a piece must start at (behaviour.md §1.5).
ROW_BLOCK = {**{name: formats.format_of(name).row_block for name in FORMAT_QUANTIZERS},
             "delayed": 1}
NAMES = sorted(QUANTIZERS)


def _x(shape=(256, 128), dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def _bytes_equal(a, b) -> None:
    """Every buffer present in one is present in the other with equal bytes; tags equal."""
    assert type(a).__name__.replace("Storage", "") == type(b).__name__.replace("Storage", "") or (
        isinstance(a, QuantizedStorage) and isinstance(b, QuantizedStorage))
    for name in a.buffer_names:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.shape == y.shape and x.dtype == y.dtype, name
            assert torch.equal(x.contiguous().view(torch.uint8),
                               y.contiguous().view(torch.uint8)), name
    for name in a.tag_names:
        assert getattr(a, name) == getattr(b, name), name


def _internal(q):
    if isinstance(q, Float8Quantizer):
        return Float8Quantizer(q.scale, q.amax, q.dtype, internal=True)
    return q.replace(internal=True)


# --------------------------------------------------------------------------- construction
@pytest.mark.parametrize("name", NAMES)
def test_quantize_returns_the_subclass_and_internal_the_storage(name):
    q = QUANTIZERS[name]()
    x = _x()
    t = q.quantize(x)
    assert type(t) is CLASSES[name]
    assert isinstance(t, torch.Tensor) and isinstance(t, QuantizedStorage)
    assert isinstance(t, t._storage_type)
    assert t.shape == x.shape and t.dtype == x.dtype and t.device == x.device
    assert not t.requires_grad and t.quantizer is q
    s = _internal(q).quantize(x)
    assert type(s) is t._storage_type and not isinstance(s, torch.Tensor)
    _bytes_equal(t, s)
    assert torch.equal(t.dequantize(), s.dequantize())
    assert type(q.make_empty(x.shape, dtype=x.dtype)) is CLASSES[name]
    assert type(_internal(q).make_empty(x.shape, dtype=x.dtype)) is t._storage_type


def test_tensor_classes_cover_the_four_storages():
    pairs = {Float8TensorStorage: Float8Tensor, MXFP8TensorStorage: MXFP8Tensor,
             Float8BlockwiseQTensorStorage: Float8BlockwiseQTensor,
             NVFP4TensorStorage: NVFP4Tensor}
    assert {s: s.tensor_class for s in pairs} == pairs
    assert set(tensor_classes()) == set(pairs.values())


@pytest.mark.parametrize("name", NAMES)
def test_from_storage_and_as_storage_share_buffers(name):
    s = _internal(QUANTIZERS[name]()).quantize(_x())
    t = QuantizedTensor.from_storage(s, requires_grad=True)
    assert type(t) is tensor_class(type(s)) and t.requires_grad
    for n, b in s.buffers().items():
        assert getattr(t, n) is b
    back = t.as_storage()
    assert type(back) is type(s) and back.quantizer is s.quantizer and back.shape == s.shape
    for n, b in s.buffers().items():
        assert getattr(back, n) is b
    assert torch.equal(back.dequantize(), s.dequantize())


def test_from_storage_refuses_an_unknown_format():
    class Other(QuantizedStorage):
        buffer_names = ("_data",)

    with pytest.raises(TypeError, match="Other has no quantized tensor class"):
        QuantizedTensor.from_storage(Other(shape=(1,), dtype=torch.float32, quantizer=None,
                                           _data=torch.zeros(1)))


@pytest.mark.parametrize("name", NAMES)
def test_storage_api_works_on_the_tensor(name):
    q = QUANTIZERS[name]()
    x = _x()
    t, s = q.quantize(x), _internal(q).quantize(x)
    assert [b is None for b in t.buffer_list(x)] == [b is None for b in s.buffer_list(x)]
    for transposed in (False, True):
        a, b = t.gemm_operand(transposed), s.gemm_operand(transposed)
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(t.dequantize(dtype), s.dequantize(dtype))
    saved = t.prepare_for_saving()
    assert all(b is None for b in t.buffers().values())
    t.restore_from_saved(saved)
    assert torch.equal(t.dequantize(), s.dequantize())


# --------------------------------------------------------------------------- flatten
@pytest.mark.parametrize("name", NAMES)
def test_flatten_unflatten_round_trip(name):
    q = QUANTIZERS[name]().with_usage(columnwise=False) if name != "delayed" else _delayed()
    t = q.quantize(_x((2, 128, 64)))
    assert is_traceable_wrapper_subclass(t)
    names, ctx = t.__tensor_flatten__()
    assert names == [n for n, b in t.buffers().items() if b is not None]
    assert isinstance(ctx, TensorContext) and ctx.quantizer is q
    assert ctx.shape == (2, 128, 64) and ctx.dtype == torch.bfloat16
    assert copy.deepcopy(ctx) is ctx  # Dynamo's guard deep-copies the context
    back = type(t).__tensor_unflatten__({n: getattr(t, n) for n in names}, ctx, t.shape,
                                        t.stride())
    assert type(back) is type(t) and back.shape == t.shape and back.dtype == t.dtype
    _bytes_equal(back, t)
    assert back.quantizer is q


def test_flatten_context_compares_quantizers_by_value_or_identity():
    def ctx(q, seed=0):
        return q.quantize(_x(seed=seed)).__tensor_flatten__()[1]

    a, b = ctx(Float8CurrentScalingQuantizer()), ctx(Float8CurrentScalingQuantizer(), 1)
    assert a == b and a != ctx(Float8CurrentScalingQuantizer(force_pow_2_scales=True))
    d1, d2 = _delayed(), _delayed()  # stateful: equal only to itself
    assert ctx(d1) == ctx(d1, 1) and ctx(d1) != ctx(d2)


@pytest.mark.parametrize("cls", [Float8CurrentScalingQuantizer, NVFP4Quantizer])
def test_flatten_refuses_a_stored_group(cls):
    with pytest.warns(DeprecationWarning):
        q = cls(amax_reduction_group=object())
    t = q.quantize(_x())  # eager use is fine
    assert type(t) is q._storage_class.tensor_class
    with pytest.raises(TypeError, match="holds an amax_reduction_group"):
        t.__tensor_flatten__()


# --------------------------------------------------------------------------- ops
@pytest.mark.parametrize("name", NAMES)
def test_detach_alias_clone(name):
    t = QUANTIZERS[name]().quantize(_x())
    for out in (t.detach(), torch.ops.aten.alias(t)):
        assert type(out) is type(t) and out.quantizer is t.quantizer
        for n, b in t.buffers().items():
            assert getattr(out, n) is b
    c = t.clone()
    _bytes_equal(c, t)
    assert all(getattr(c, n) is not b for n, b in t.buffers().items() if b is not None)


@pytest.mark.parametrize("name", NAMES)
def test_view_and_reshape_keeping_the_last_dim(name):
    q = QUANTIZERS[name]()
    x = _x((4, 64, 128))
    t = q.quantize(x)
    for out in (t.view(256, 128), t.reshape(-1, 128), t.view(2, 2, 64, 128)):
        expected = _internal(q).quantize(x.reshape(out.shape))
        assert type(out) is type(t) and out.shape == expected.shape
        _bytes_equal(out, expected)
        for n, b in out.buffers().items():  # views, not copies
            if b is not None:
                assert b.untyped_storage().data_ptr() == getattr(t, n).untyped_storage().data_ptr()


@pytest.mark.parametrize("name", NAMES)
def test_as_strided_is_the_identity_only(name):
    t = QUANTIZERS[name]().quantize(_x())
    out = torch.as_strided(t, t.shape, t.stride(), 0)  # what FSDP2 asks of a parameter
    assert type(out) is type(t) and all(getattr(out, n) is b for n, b in t.buffers().items())
    with pytest.raises(NotImplementedError, match="only its own size with contiguous strides"):
        torch.as_strided(t, (128, 128), (128, 1), 128)


@pytest.mark.parametrize("name", NAMES)
def test_view_changing_the_last_dim_is_refused(name):
    t = QUANTIZERS[name]().quantize(_x())
    with pytest.raises(NotImplementedError, match="must keep the last dimension"):
        t.view(128, 256)


def test_float8_rowwise_only_views_freely():
    q = Float8CurrentScalingQuantizer(columnwise_usage=False)
    x = _x()
    out = q.quantize(x).view(-1)
    assert out.shape == (256 * 128,)
    assert torch.equal(out.dequantize(), q.quantize(x).dequantize().view(-1))


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_float8_transpose_swaps_rowwise_and_columnwise(name):
    q = QUANTIZERS[name]()
    x = _x((64, 128))
    t = q.quantize(x)
    for out in (t.t(), t.transpose(0, 1), t.T):
        assert out.shape == (128, 64)
        assert out._data is t._transpose and out._transpose is t._data
        assert out._scale_inv is t._scale_inv
        assert torch.equal(out.dequantize(), t.dequantize().t())
    ref = Float8CurrentScalingQuantizer(internal=True).quantize(x.t().contiguous())
    if name == "current":  # the same amax, so the same scale: quantizing the transpose
        _bytes_equal(t.t(), ref)


@pytest.mark.parametrize("name", formats.select(FORMAT_QUANTIZERS, transposes=False))
def test_transpose_of_a_block_format_is_refused(name):
    t = QUANTIZERS[name]().quantize(_x())
    with pytest.raises(NotImplementedError, match=f"{type(t).__name__}: its columnwise"):
        t.t()


@pytest.mark.parametrize("name", NAMES)
def test_to_dtype_dequantizes_and_to_device_keeps_the_format(name):
    t = QUANTIZERS[name]().quantize(_x())
    for dtype in (torch.float32, torch.float16):
        out = t.to(dtype)
        assert type(out) is torch.Tensor and torch.equal(out, t.dequantize(dtype))
    out = t.to(torch.bfloat16, copy=True)  # the nominal dtype, with a copy: dequantized
    assert type(out) is torch.Tensor and torch.equal(out, t.dequantize())
    moved = t.to("meta")
    assert type(moved) is type(t) and moved.device.type == "meta"
    assert all(b.device.type == "meta" for b in moved.buffers().values() if b is not None)


@pytest.mark.parametrize("name", NAMES)
def test_copy_high_precision_into_quantized_requantizes_in_place(name):
    q = QUANTIZERS[name]()
    t = q.quantize(_x())
    ptrs = {n: b.data_ptr() for n, b in t.buffers().items() if b is not None}
    y = _x(seed=3)
    t.copy_(y)
    assert {n: b.data_ptr() for n, b in t.buffers().items() if b is not None} == ptrs
    _bytes_equal(t, _internal(q).quantize(y))


@pytest.mark.parametrize("name", NAMES)
def test_copy_quantized_into_quantized(name):
    q = QUANTIZERS[name]()
    dst, src = q.quantize(_x()), q.quantize(_x(seed=5))
    dst.copy_(src)
    _bytes_equal(dst, src)
    assert all(getattr(dst, n) is not b for n, b in src.buffers().items() if b is not None)


def test_copy_quantized_of_another_format_requantizes_its_dequantized_values():
    src = MXFP8Quantizer().quantize(_x())
    dst = Float8CurrentScalingQuantizer().quantize(_x(seed=1))
    dst.copy_(src)
    _bytes_equal(dst, Float8CurrentScalingQuantizer(internal=True).quantize(src.dequantize()))


def test_copy_quantized_into_high_precision_dequantizes():
    t = NVFP4Quantizer().quantize(_x())
    out = torch.empty(256, 128, dtype=torch.float32)
    out.copy_(t)
    assert torch.equal(out, t.dequantize(torch.float32))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("op", ["empty_like", "zeros_like", "new_zeros"])
def test_empty_like_is_make_empty(name, op):
    q = QUANTIZERS[name]()
    t = q.quantize(_x())
    out = t.new_zeros((128, 128)) if op == "new_zeros" else getattr(torch, op)(t)
    shape = (128, 128) if op == "new_zeros" else t.shape
    _bytes_equal(out, _internal(q).make_empty(shape, dtype=t.dtype))
    assert type(out) is type(t) and out.quantizer is q


def test_is_same_size():
    t = MXFP8Quantizer().quantize(_x())
    assert torch.ops.aten.is_same_size(t, t.detach())
    assert not torch.ops.aten.is_same_size(t, MXFP8Quantizer().quantize(_x((64, 128))))


def _shared_amax_reference(name, q, piece, whole):
    """What quantizing ``piece`` gives with the whole tensor's per-tensor scale or amax."""
    if name == "current":
        amax = whole.abs().amax().float().reshape(1)
        return _internal(q).quantize_with_amax(piece, amax)
    if name == "delayed":
        return Float8Quantizer(q.scale, torch.zeros(1), q.dtype, internal=True).quantize(piece)
    if name.startswith("nvfp4"):
        return _internal(q).quantize_with_amax(piece, q.local_amax(whole))
    return _internal(q).quantize(piece)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(384, 128), (3, 128, 64), (200, 64)], ids=str)
def test_split_chunk_narrow_slice_give_the_pieces_bytes(name, shape):
    if name == "nvfp4_rht" and shape[0] % 16:
        pytest.skip("NVFP4 with RHT quantizes only M a multiple of 16")
    q = QUANTIZERS[name]()
    x = _x(shape)
    t = q.quantize(x)
    inner = 1 if len(shape) == 2 else shape[1]
    step = max(1, ROW_BLOCK[name] // inner) * (2 if len(shape) == 2 else 1)
    if len(shape) == 2 and ROW_BLOCK[name] == 128:
        step = 128
    pieces = t.split(step)
    assert sum(p.shape[0] for p in pieces) == shape[0]
    for i, p in enumerate(pieces):
        ref = _shared_amax_reference(name, q, x[i * step:(i + 1) * step], x)
        assert type(p) is type(t) and p.shape == ref.shape
        _bytes_equal(p, ref)
    assert torch.equal(torch.cat(pieces).dequantize(), t.dequantize())
    _bytes_equal(torch.cat(pieces), t)
    end = min(2 * step, shape[0])
    for out, (a, b) in ((t.narrow(0, step, end - step), (step, end)), (t[step:end], (step, end))):
        _bytes_equal(out, _shared_amax_reference(name, q, x[a:b], x))
    if shape[0] % (2 * step) == 0:
        half = shape[0] // 2
        for i, out in enumerate(torch.chunk(t, 2)):
            _bytes_equal(out, _shared_amax_reference(name, q, x[i * half:(i + 1) * half], x))


@pytest.mark.parametrize("name", ["mxfp8", "block2d", "nvfp4"])
def test_split_off_the_block_rows_is_refused(name):
    t = QUANTIZERS[name]().quantize(_x())
    with pytest.raises(NotImplementedError, match=f"{ROW_BLOCK[name]}-row blocks"):
        t.split(ROW_BLOCK[name] // 2)


def test_block1d_rowwise_only_splits_on_any_row():
    q = Float8BlockQuantizer(block_scaling_dim=1, columnwise_usage=False)
    x = _x((200, 256))
    pieces = q.quantize(x).split(7)
    for i, p in enumerate(pieces):
        _bytes_equal(p, _internal(q).quantize(x[i * 7:(i + 1) * 7]))


def test_split_of_swizzled_scales_or_other_dims_is_refused():
    t = MXFP8Quantizer(optimize_for_gemm=True).quantize(_x())
    with pytest.raises(NotImplementedError, match="GEMM-swizzled"):
        t.split(128)
    t = MXFP8Quantizer().quantize(_x())
    with pytest.raises(NotImplementedError, match="along dim 1"):
        t.split(32, dim=1)


def test_cat_refuses_pieces_of_different_quantizers():
    a = Float8CurrentScalingQuantizer().quantize(_x())
    b = Float8CurrentScalingQuantizer(force_pow_2_scales=True).quantize(_x())
    with pytest.raises(ValueError, match="must share class, quantizer"):
        torch.cat([a, b])
    c = Float8CurrentScalingQuantizer().quantize(_x(seed=9))
    with pytest.raises(ValueError, match="_scale_inv differ"):
        torch.cat([a, c])


@pytest.mark.parametrize("name", NAMES)
def test_an_unsupported_op_names_itself_and_the_class(name):
    t = QUANTIZERS[name]().quantize(_x())
    with pytest.raises(NotImplementedError, match=rf"{type(t).__name__} does not support "
                                                  r"aten\.mul\.Tensor.*\.dequantize\(\)"):
        t * 2
    with pytest.raises(NotImplementedError, match="aten.add.Tensor"):
        torch.add(t, t)


# --------------------------------------------------------------------------- autograd, modules
def test_dequantize_of_a_parameter_passes_the_gradient_straight_through():
    p = torch.nn.Parameter(Float8CurrentScalingQuantizer().quantize(_x()))
    assert isinstance(p, torch.nn.Parameter) and type(p) is Float8Tensor and p.requires_grad
    out = p.dequantize(torch.float32)
    out.sum().backward()
    assert p.grad is not None and p.grad.shape == p.shape and torch.all(p.grad == 1)


class _Holder(torch.nn.Module):
    def __init__(self, t, as_parameter):
        super().__init__()
        if as_parameter:
            self.w = torch.nn.Parameter(t, requires_grad=False)
        else:
            self.register_buffer("w", t)


@pytest.mark.parametrize("as_parameter", [True, False], ids=["parameter", "buffer"])
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip(name, as_parameter):
    q = QUANTIZERS[name]()
    src = _Holder(q.quantize(_x()), as_parameter)
    dst = _Holder(q.quantize(_x(seed=7)), as_parameter)
    sd = src.state_dict()
    assert type(sd["w"]) is type(src.w)
    dst.load_state_dict(sd)
    _bytes_equal(dst.w, src.w)
    hp = torch.nn.Linear(128, 256, bias=False)  # a high-precision module loads it dequantized
    hp.load_state_dict({"weight": sd["w"]})
    assert torch.equal(hp.weight.detach(), src.w.dequantize(torch.float32))
    dst.load_state_dict({"w": _x(seed=11)})  # a high-precision checkpoint: requantized
    _bytes_equal(dst.w, _internal(q).quantize(_x(seed=11)))


@pytest.mark.parametrize("name", NAMES)
def test_torch_load_with_weights_only(name):
    """``torch.load``'s default since torch 2.6, ``weights_only=True``, loads quantized tensors of
    the built-in value quantizers (their classes and rebuild functions are allowed); a delayed
    quantizer pickles its state object, so it needs ``weights_only=False``, as the error says."""
    if not hasattr(torch.serialization, "add_safe_globals"):
        pytest.skip("this torch has no weights_only allow list")
    t = QUANTIZERS[name]().quantize(_x())
    buf = io.BytesIO()
    torch.save({"w": t}, buf)
    buf.seek(0)
    if name == "delayed":
        with pytest.raises(pickle.UnpicklingError, match="weights_only"):
            torch.load(buf, weights_only=True)
        return
    loaded = torch.load(buf, weights_only=True)["w"]
    assert type(loaded) is type(t) and loaded.quantizer == t.quantizer
    _bytes_equal(loaded, t)


@pytest.mark.parametrize("name", NAMES)
def test_deepcopy_pickle_and_torch_save(name):
    t = QUANTIZERS[name]().quantize(_x())
    c = copy.deepcopy(t)
    assert type(c) is type(t)
    _bytes_equal(c, t)
    if name != "delayed":
        assert c.quantizer == t.quantizer
    p = pickle.loads(pickle.dumps(t))
    _bytes_equal(p, t)
    buf = io.BytesIO()
    torch.save({"w": t}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)["w"]
    assert type(loaded) is type(t)
    _bytes_equal(loaded, t)
    m = _Holder(t, as_parameter=True)
    _bytes_equal(copy.deepcopy(m).w, t)


def _bytes(t):
    return {n: b.clone() for n, b in t.buffers().items() if b is not None}


def _same_bytes(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("name", NAMES)
def test_copy_into_a_piece_is_refused_and_changes_nothing(name):
    """A piece shares the whole tensor's scales, amaxes and columnwise copy: quantizing a
    source into it alone would corrupt rows outside it or leave the columnwise copy stale."""
    t = QUANTIZERS[name]().quantize(_x())
    before, rows = _bytes(t), ROW_BLOCK[name]
    piece = t[:rows] if rows < t.shape[0] else t[: t.shape[0] // 2]
    with pytest.raises(NotImplementedError, match="copy_ into a piece"):
        piece.copy_(_x(tuple(piece.shape), seed=3))
    with pytest.raises(NotImplementedError, match="copy_ into a piece"):
        t.split(rows)[0].detach().copy_(_x((rows, 128), seed=3))  # a piece's alias too
    assert _same_bytes(_bytes(t), before)
    t[:].copy_(_x(seed=4))  # the whole tensor: requantized in place
    assert _same_bytes(_bytes(t), _bytes(t.quantizer.quantize(_x(seed=4))))


@pytest.mark.parametrize("name", ["current", "mxfp8", "block2d", "nvfp4"])
def test_data_assignment_replaces_what_the_tensor_holds(name):
    q = QUANTIZERS[name]()
    p = torch.nn.Parameter(q.quantize(_x()))
    other = q.quantize(_x(seed=5))
    p.data = other
    assert _same_bytes(_bytes(p), _bytes(other)) and isinstance(p, QuantizedTensor)
    p.data = _x(seed=6)  # a high-precision tensor is quantized
    assert _same_bytes(_bytes(p), _bytes(q.quantize(_x(seed=6))))
    with pytest.raises(ValueError, match="keeps its shape"):
        p.data = _x((128, 128))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["current", "mxfp8", "block1d", "nvfp4"])
def test_module_dtype_conversion_keeps_quantized_parameters(name, dtype):
    """``Module.to(dtype)`` / ``.half()`` assign ``p.data = p.to(dtype)``: the parameter keeps
    its bytes and reports (and dequantizes to) the new dtype, with no hidden dense storage."""
    q = QUANTIZERS[name]()
    layer = torch.nn.Linear(128, 256, bias=False)
    layer.weight = torch.nn.Parameter(q.quantize(_x(dtype=torch.float32)))
    before = _bytes(layer.weight)
    layer.to(dtype)
    w = layer.weight
    assert isinstance(w, QuantizedTensor) and w.dtype == dtype
    assert w.dequantize().dtype == dtype and layer.state_dict()["weight"].dtype == dtype
    assert _same_bytes(_bytes(w), before)
    assert w.data_ptr() == 0  # a wrapper: no dense storage of its own


def test_an_edited_dequantization_is_quantized_again():
    t = QUANTIZERS["current"]().quantize(_x())
    d = t.to(torch.float32)
    d.mul_(2)  # no longer t's dequantization
    t.data = d
    assert _same_bytes(_bytes(t), _bytes(t.quantizer.quantize(d)))
