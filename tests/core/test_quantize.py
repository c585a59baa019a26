"""Quantizer-level behaviour: storages, shapes, usages, input errors, backends (the reference)."""

from __future__ import annotations

import formats
import pytest
import torch
from quant_core import (
    DType,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    backends,
)

#: Every format's default quantizer and the variants with their own layouts (tests/formats.py).
QUANTIZERS = {name: make() for name, make in formats.quantizers(
    "mxfp8_2d", "block1d", "nvfp4_rht", "nvfp4_2d", defaults=True).items()}

# Expected buffer shapes for x of shape (2, 48, 64): M = 96, K = 64 (numerics.md §4-§7, §9).
EXPECTED_SHAPES = {
    "current": {"_data": (2, 48, 64), "_transpose": (64, 2, 48), "_scale_inv": (1,)},
    "mxfp8": {"_rowwise_data": (2, 48, 64), "_rowwise_scale_inv": (128, 4),
              "_columnwise_data": (2, 48, 64), "_columnwise_scale_inv": (4, 128)},
    "block1d": {"_rowwise_data": (2, 48, 64), "_rowwise_scale_inv": (1, 96),
                "_columnwise_data": (64, 2, 48), "_columnwise_scale_inv": (1, 64)},
    "block2d": {"_rowwise_data": (2, 48, 64), "_rowwise_scale_inv": (1, 4),
                "_columnwise_data": (64, 2, 48), "_columnwise_scale_inv": (1, 4)},
    "nvfp4": {"_rowwise_data": (2, 48, 32), "_rowwise_scale_inv": (128, 4),
              "_columnwise_data": (64, 48), "_columnwise_scale_inv": (128, 8),
              "_amax_rowwise": (1,), "_amax_columnwise": (1,)},
}


def _randn(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("name", sorted(EXPECTED_SHAPES))
def test_storage_buffer_shapes_for_leading_dims(name):
    storage = QUANTIZERS[name].quantize(_randn(2, 48, 64))
    shapes = {k: tuple(v.shape) for k, v in storage.buffers().items() if v is not None}
    assert shapes == EXPECTED_SHAPES[name]
    assert storage.shape == torch.Size((2, 48, 64)) and storage.dtype == torch.bfloat16
    assert storage.quantizer == QUANTIZERS[name]


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_every_buffer_is_contiguous(name):
    """Custom ops' fake kernels, checkpoints and GEMMs assume the row-major layout."""
    for q in (QUANTIZERS[name], QUANTIZERS[name].replace(optimize_for_gemm=True)):
        storage = q.quantize(_randn(16, 256))
        for buf_name, buf in storage.buffers().items():
            assert buf is None or buf.is_contiguous(), buf_name


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_dequantize_has_input_shape_and_dtype(name):
    x = _randn(2, 48, 64)
    q = QUANTIZERS[name]
    out = q.quantize(x).dequantize()
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert q.dequantize(q.quantize(x), dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_empty_input_gives_empty_buffers(name):
    q = QUANTIZERS[name]
    storage = q.quantize(torch.empty(0, 64, dtype=torch.bfloat16))
    assert storage.dequantize().shape == (0, 64)
    for buf_name, buf in storage.buffers().items():
        if buf is not None and "amax" in buf_name:
            assert buf.tolist() == [0.0]


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_non_contiguous_input_gives_the_same_bytes(name):
    x = _randn(64, 128)
    xt = x.t().contiguous().t()  # same values, column-major strides
    assert not xt.is_contiguous()
    a, b = QUANTIZERS[name].quantize(x), QUANTIZERS[name].quantize(xt)
    for (na, ta), (_, tb) in zip(a.buffers().items(), b.buffers().items(), strict=True):
        assert (ta is None) == (tb is None), na
        if ta is not None:
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), na


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_usage_flags_select_the_buffers(name):
    q = QUANTIZERS[name]
    x = _randn(32, 64)
    row = q.with_usage(columnwise=False).quantize(x)
    col = q.with_usage(rowwise=False).quantize(x)
    full = q.quantize(x)
    row_names = {"_data", "_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise"}
    for buf_name, buf in row.buffers().items():
        if buf_name == "_scale_inv":
            continue
        assert (buf is not None) == (buf_name in row_names), buf_name
        if buf is not None:  # one direction alone gives that direction's bytes
            assert torch.equal(buf.view(torch.uint8), getattr(full, buf_name).view(torch.uint8))
    for buf_name, buf in col.buffers().items():
        if buf_name == "_scale_inv":
            continue
        assert (buf is not None) == (buf_name not in row_names), buf_name


def test_per_tensor_columnwise_dequantizes_like_rowwise():
    x = _randn(3, 32, 48)
    q = Float8CurrentScalingQuantizer()
    assert torch.equal(
        q.with_usage(rowwise=False).quantize(x).dequantize(), q.quantize(x).dequantize()
    )


def test_block_2d_columnwise_dequantizes_like_rowwise():
    x = _randn(130, 200, dtype=torch.float32)
    q = Float8BlockQuantizer(block_scaling_dim=2)
    assert torch.equal(
        q.with_usage(rowwise=False).quantize(x).dequantize(), q.quantize(x).dequantize()
    )


def test_nvfp4_columnwise_only_refuses_dequantize():
    s = NVFP4Quantizer().with_usage(rowwise=False).quantize(_randn(32, 32))
    with pytest.raises(NotImplementedError, match="rowwise"):
        s.dequantize()


def test_swizzled_scales_still_dequantize_exactly():
    x = _randn(100, 96)
    for q in (MXFP8Quantizer(), NVFP4Quantizer()):
        plain = q.quantize(x)
        swz = q.replace(optimize_for_gemm=True).quantize(x)
        assert swz._with_gemm_swizzled_scales
        assert not torch.equal(plain._rowwise_scale_inv, swz._rowwise_scale_inv)
        assert torch.equal(plain.dequantize(), swz.dequantize())


@pytest.mark.parametrize(
    "q, k, multiple",
    [(MXFP8Quantizer(), 48, 32), (NVFP4Quantizer(), 24, 16)],
    ids=["mxfp8", "nvfp4"],
)
def test_unaligned_last_dim_names_the_multiple(q, k, multiple):
    with pytest.raises(ValueError, match=f"multiple of {multiple}.*K = {k}"):
        q.quantize(torch.zeros(4, k))


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_bad_inputs_get_clear_errors(name):
    q = QUANTIZERS[name]
    with pytest.raises(TypeError, match="input dtype must be one of"):
        q.quantize(torch.zeros(4, 64, dtype=torch.int32))
    with pytest.raises(TypeError, match="input dtype must be one of"):
        q.quantize(torch.zeros(4, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="0-d"):
        q.quantize(torch.tensor(1.0))
    with pytest.raises(TypeError, match="torch.Tensor"):
        q.quantize([1.0, 2.0])


def test_rht_needs_bf16_and_rows_in_sixteens():
    q = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
    with pytest.raises(ValueError, match="bfloat16"):
        q.quantize(torch.zeros(16, 16))
    with pytest.raises(ValueError, match="multiple of 16, got M = 8"):
        q.quantize(torch.zeros(8, 16, dtype=torch.bfloat16))
    q.with_usage(columnwise=False).quantize(torch.zeros(8, 16))  # no RHT on the rowwise path


def test_delayed_scaling_records_amax_and_snapshots_scale_inv():
    scale = torch.tensor([4.0])
    amax = torch.tensor([1.5])
    q = Float8Quantizer(scale, amax, DType.E4M3)
    x = torch.tensor([[0.5, -3.0, 2.0, 1.0]])
    s = q.quantize(x)
    assert amax.item() == 3.0  # max(1.5, |-3|), recorded in the same pass
    assert s._scale_inv.item() == 0.25
    # 0.5*4 = 2 (0x40), -3*4 = -12 (0xD4), 2*4 = 8 (0x50), 1*4 = 4 (0x48) in E4M3
    assert s._data.flatten().tolist() == [0x40, 0xD4, 0x50, 0x48]
    q.calibrate(torch.tensor([[-7.0]]))
    assert amax.item() == 7.0


@pytest.fixture
def one_rank_group(tmp_path):
    """The WORLD group of a one-rank gloo process group (made here unless one exists)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(
            "gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1
        )
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def test_current_scaling_reduction_over_one_rank_group_changes_nothing(one_rank_group):
    x = _randn(8, 32)
    q = Float8CurrentScalingQuantizer(with_amax_reduction=True)
    a = q.quantize(x, amax_reduction_group=one_rank_group)
    b = q.quantize(x)
    assert torch.equal(a._data, b._data) and torch.equal(a._scale_inv, b._scale_inv)


def test_stochastic_rounding_is_reproducible_from_the_generator():
    q = NVFP4Quantizer(stochastic_rounding=True).with_usage(columnwise=False)
    x = _randn(64, 64, dtype=torch.float32)
    draw = lambda seed: q.quantize(x, generator=torch.Generator().manual_seed(seed))._rowwise_data
    assert torch.equal(draw(1), draw(1))
    assert not torch.equal(draw(1), draw(2))
    assert not q.is_requantization_safe() and NVFP4Quantizer().is_requantization_safe()


def test_backend_choice(monkeypatch):
    assert "reference" in backends.available()
    assert backends.get("reference").name == "reference"
    assert backends.get(None, "cpu").name == "reference"  # the interpreter is never auto-picked
    with pytest.raises(ValueError, match="unknown quant backend 'nope'.*available"):
        backends.get("nope")
    monkeypatch.setenv("QUANT_BACKEND", "nope")
    with pytest.raises(ValueError, match="unknown quant backend"):
        MXFP8Quantizer().quantize(torch.zeros(1, 32))


def test_prepare_for_saving_round_trip():
    s = MXFP8Quantizer().quantize(_randn(32, 64))
    expected = s.dequantize()
    saved = s.prepare_for_saving()
    assert all(b is None for b in s.buffers().values())
    assert s.restore_from_saved(saved + ["rest"]) == ["rest"]
    assert torch.equal(s.dequantize(), expected)


def test_per_tensor_update_usage_builds_the_byte_transpose():
    x = _randn(4, 16, 32)
    full = Float8CurrentScalingQuantizer().quantize(x)
    s = Float8CurrentScalingQuantizer().with_usage(columnwise=False).quantize(x)
    s.update_usage(columnwise=True)
    assert torch.equal(s._transpose, full._transpose)
    s.update_usage(rowwise=False)
    assert s._data is None and torch.equal(s.dequantize(), full.dequantize())


@pytest.mark.parametrize("usage", [dict(columnwise_usage=False), dict(rowwise_usage=False)])
def test_nvfp4_amax_reduction_with_one_usage(one_rank_group, usage):
    """With one usage there is one amax; the reduction concatenated a None
    (``TypeError: expected Tensor as element 1``). Over a one-rank group nothing changes."""
    x = _randn(32, 64)
    a = NVFP4Quantizer(with_amax_reduction=True, **usage).quantize(
        x, amax_reduction_group=one_rank_group)
    b = NVFP4Quantizer(**usage).quantize(x)
    for name, t in b.buffers().items():
        got = getattr(a, name)
        assert (got is None) == (t is None) and (t is None or torch.equal(got, t)), name


@pytest.mark.parametrize("cls", [Float8CurrentScalingQuantizer, Float8BlockQuantizer])
@pytest.mark.parametrize("eps, error", [
    (1e39, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
    (-1.0, ValueError), ("0.1", TypeError), (True, TypeError),
])
def test_amax_epsilon_checked_at_construction(cls, eps, error):
    """An epsilon beyond fp32 (or NaN, or not a number) is refused when the
    quantizer is built; before, the reference raised a raw error at quantize time while the
    Triton backend silently returned scale 1.0."""
    with pytest.raises(error, match="amax_epsilon must"):
        cls(amax_epsilon=eps)
    assert cls(amax_epsilon=3.4028234663852886e38).amax_epsilon > 0  # FLT_MAX itself is fine


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_empty_last_dimension_round_trips(name):
    """MXFP8 quantized a (4, 0) tensor but could not dequantize it."""
    x = torch.randn(16, 0, dtype=torch.bfloat16)  # bf16, M % 16 == 0: what the RHT needs
    assert QUANTIZERS[name].quantize(x).dequantize().shape == (16, 0)


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_buffers_carry_no_autograd_history(name):
    """``_scale_inv`` of current scaling and NVFP4's ``_amax_*`` carried the
    input's ``grad_fn`` (and kept its graph alive); no buffer may require grad."""
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    st = QUANTIZERS[name].quantize(x * 2)
    for buf, t in st.buffers().items():
        assert t is None or (t.grad_fn is None and not t.requires_grad), buf


def test_delayed_amax_buffer_stays_out_of_autograd():
    """Quantizing an input that requires grad made the shared amax buffer
    require grad (CopySlices), keeping every past step's activations alive."""
    amax = torch.zeros(1)
    q = Float8Quantizer(torch.ones(1), amax, DType.E4M3)
    x = torch.randn(8, 32, requires_grad=True)
    q.quantize(x * 3)
    q.calibrate(x * 3)
    assert not amax.requires_grad and amax.grad_fn is None and amax.item() > 0


@pytest.mark.parametrize("q, shape, message", [
    (MXFP8Quantizer(), (32, 48), "MXFP8: the last dimension must be a multiple of 32"),
    (NVFP4Quantizer(), (32, 7), "NVFP4: the last dimension must be a multiple of 16"),
    (MXFP8Quantizer(), (), "at least one dimension"),
    (Float8CurrentScalingQuantizer(), (), "at least one dimension"),
    (Float8BlockQuantizer(), (), "at least one dimension"),
])
def test_make_empty_applies_the_quantize_shape_rules(q, shape, message):
    """Make_empty accepted shapes quantize rejects (MXFP8 K = 48; NVFP4 K = 7
    gave data of shape (32, 3)) and raised a raw IndexError for ``()``; both refuse alike now."""
    with pytest.raises(ValueError, match=message):
        q.make_empty(shape)
    if shape:
        with pytest.raises(ValueError, match=message):
            q.quantize(torch.zeros(shape))


@pytest.mark.parametrize("dtype", [torch.int32, "float32", torch.float64])
def test_dequantize_refuses_a_dtype_it_cannot_produce(dtype):
    """``dequantize(dtype=torch.int32)`` silently gave zeros and
    ``dequantize("float32")`` an unrelated "Invalid device string"."""
    st = MXFP8Quantizer().quantize(torch.randn(4, 32))
    with pytest.raises(TypeError, match=r"dequantize\(dtype=...\) must be one of"):
        st.dequantize(dtype)


def test_backend_registration_checks_the_contract():
    """``backends.register()`` accepted any object."""
    with pytest.raises(TypeError, match="lacks priority .* name .* supports"):
        backends.register(object())


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_input_is_refused_with_its_layout(name, layout):
    """"unsupported memory format option" before."""
    x = torch.zeros(32, 64, dtype=torch.bfloat16)
    x = x.to_sparse() if layout == "coo" else x.to_sparse_csr()
    with pytest.raises(TypeError, match=f"dense tensor.*layout torch.sparse_{layout}.*to_dense"):
        QUANTIZERS[name].quantize(x)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_delayed_quantizer_refuses_a_scale_that_cannot_dequantize(bad):
    """``scale=0`` quantized to zeros with ``scale_inv = inf``, so every value
    dequantized to NaN, silently."""
    with pytest.raises(ValueError, match="Float8Quantizer.scale must be finite and > 0"):
        Float8Quantizer(torch.tensor([bad]), torch.zeros(1), DType.E4M3)
    tiny = torch.tensor([torch.finfo(torch.float32).tiny])  # positive and finite: accepted
    Float8Quantizer(tiny, torch.zeros(1), DType.E4M3)


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_buffer_list_keeps_positions_with_absent_buffers(name):
    """One convention for buffer lists: declaration order, an absent buffer as
    an empty uint8 tensor on the input's device."""
    q = QUANTIZERS[name].with_usage(rowwise=True, columnwise=False)
    x = _randn(32, 64)
    storage = q.quantize(x)
    listed = storage.buffer_list(x)
    assert len(listed) == len(storage.buffer_names)
    for name_, t in zip(storage.buffer_names, listed, strict=True):
        original = getattr(storage, name_)
        if original is None:
            assert t.numel() == 0 and t.dtype == torch.uint8 and t.device == x.device
        else:
            assert t is original


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_rows_quantize_apart_says_whether_a_row_depends_on_the_others(name):
    """``rows_quantize_apart()`` against what quantizing does: the rows of ``x[1:]`` quantized
    alone decode to the values they have as rows of ``x`` exactly when the quantizer says so
    (``x``'s largest row is its first, and dropping it shifts every block of several rows)."""
    q = QUANTIZERS[name].with_usage(True, False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(257, 128, generator=g) * torch.exp2(torch.arange(257) % 7 - 3.0)[:, None]
    x[0] *= 1000
    x = x.to(torch.bfloat16)
    whole = q.quantize(x).dequantize(dtype=torch.float32)[1:]
    alone = q.quantize(x[1:]).dequantize(dtype=torch.float32)
    assert torch.equal(whole, alone) == q.rows_quantize_apart(), name
