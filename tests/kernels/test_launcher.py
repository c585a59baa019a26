"""The direct launch path (``quant_kernels._launcher``): which launches reuse a compiled kernel,
and the argument order its launcher receives. A stand-in kernel records both paths, so this runs
without a GPU; the byte tests at the end run every kernel through the real path on CUDA."""

from __future__ import annotations

import pytest
import torch
import triton
from _kernels_util import DEVICE, assert_same
from quant_core import reference
from quant_core.dtypes import DType
from quant_kernels import _launcher, fp8_tensor, mxfp8

STREAM = 77


class _Compiled:
    """What ``kernel[grid](...)`` returns: a launcher (``run``), a function handle, metadata."""

    def __init__(self, log):
        self.function, self.packed_metadata, self._log = object(), ("meta",), log

    def run(self, *args):
        self._log.append(("direct", args))


class _Kernel:
    """A ``@triton.jit`` stand-in: ``fn`` gives the signature, ``[grid](...)`` is Triton's path."""

    def __init__(self):
        def fn(x_ptr, out_ptr, n, eps, SCALE, BLOCK=64, ROWS=2):
            pass

        self.fn, self.log, self.compiled = fn, [], []

    def __getitem__(self, grid):
        def runner(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            c = _Compiled(self.log)
            self.compiled.append(c)
            return c

        return runner


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(_launcher, "_current_device", lambda: 0)
    monkeypatch.setattr(_launcher, "_current_stream", lambda device: STREAM)
    _launcher.clear()
    yield _Kernel()
    _launcher.clear()


def _args(x, n=256, eps=0.0):
    return (x, torch.empty(4), n, eps, None), {"BLOCK": 128, "num_warps": 4}


def _kinds(kernel):
    return [entry[0] for entry in kernel.log]


def test_second_launch_of_a_key_goes_straight_to_the_compiled_kernel(kernel):
    x = torch.empty(64, dtype=torch.bfloat16)
    args, kwargs = _args(x)
    _launcher.launch(kernel, (3, 2), args, kwargs)
    _launcher.launch(kernel, (3, 2), args, kwargs)
    assert _kinds(kernel) == ["triton", "direct"]
    # grid padded to 3-D, the stream, the handle, metadata, no hooks, then every parameter in
    # signature order: keyword constexprs in place, the unpassed default filled, no launch option
    assert kernel.log[1][1] == (3, 2, 1, STREAM, kernel.compiled[0].function, ("meta",),
                                None, None, None, *args, 128, 2)


def test_a_float_reaches_the_kernel_in_place(kernel):
    x = torch.empty(64)
    for _ in range(2):
        _launcher.launch(kernel, (1,), *_args(x, eps=0.5))
    assert _kinds(kernel) == ["triton", "direct"]
    assert kernel.log[1][1][9 + 3] == 0.5


def test_a_float_and_an_int_of_equal_value_are_apart(kernel):
    """0.0 == 0 in Python, but Triton compiles an fp32 and an i32 parameter apart."""
    x = torch.empty(64)
    for eps in (0.0, 0):
        _launcher.launch(kernel, (1,), *_args(x, eps=eps))
    assert _kinds(kernel) == ["triton", "triton"]


@pytest.mark.parametrize("change", ["alignment", "dtype", "int", "float", "bool", "option",
                                    "constexpr", "none"])
def test_what_triton_specialises_on_makes_a_new_key(kernel, change):
    base = torch.zeros(64, dtype=torch.uint8)
    args, kwargs = _args(base)
    _launcher.launch(kernel, (1,), args, kwargs)
    if change == "alignment":  # 16-byte alignment of a pointer
        args = (base[1:],) + args[1:]
    elif change == "dtype":
        args = (base.view(torch.int8),) + args[1:]
    elif change == "int":  # == 1 and % 16 are specialised; any value change is a new key
        args = args[:2] + (1,) + args[3:]
    elif change == "float":  # by value: a constexpr may be passed by position
        args = args[:3] + (0.5,) + args[4:]
    elif change == "bool":  # an int 1 and True: equal in Python, apart in Triton
        args, _ = _args(base, n=1)
        _launcher.launch(kernel, (1,), args, kwargs)
        kernel.log.clear()
        args = args[:2] + (True,) + args[3:]
        _launcher.launch(kernel, (1,), args, kwargs)
        assert _kinds(kernel) == ["triton"]
        return
    elif change == "option":
        kwargs = {**kwargs, "num_warps": 8}
    elif change == "constexpr":
        kwargs = {**kwargs, "BLOCK": 256}
    else:  # None is a constexpr to Triton
        args = args[:4] + (torch.ones(1),)
    _launcher.launch(kernel, (1,), args, kwargs)
    assert _kinds(kernel) == ["triton", "triton"]


def _descriptor(rows=64, block=(16, 32), dtype=torch.uint8, padding="zero"):
    from triton.tools.tensor_descriptor import TensorDescriptor

    base = torch.zeros(rows, 64, dtype=dtype)
    return TensorDescriptor(base, list(base.shape), list(base.stride()), list(block), padding)


def test_a_descriptor_of_another_shape_and_base_keeps_its_key(kernel):
    """A host tensor descriptor is specialised by Triton on its dtype and block shape only, so
    the launches of the grouped GEMMs (whose descriptors are new objects over new tensors every
    call) go straight to the compiled kernel from the second on."""
    args, kwargs = _args(torch.empty(4))
    _launcher.launch(kernel, (1,), (_descriptor(),) + args[1:], kwargs)
    _launcher.launch(kernel, (1,), (_descriptor(rows=96),) + args[1:], kwargs)
    assert _kinds(kernel) == ["triton", "direct"]
    assert isinstance(kernel.log[1][1][9], type(_descriptor()))


@pytest.mark.parametrize("change", [{"block": (32, 32)}, {"dtype": torch.float32},
                                    {"padding": "nan", "dtype": torch.float32}])
def test_a_descriptor_of_another_block_dtype_or_padding_is_a_new_key(kernel, change):
    args, kwargs = _args(torch.empty(4))
    first = {"dtype": torch.float32} if "padding" in change else {}
    _launcher.launch(kernel, (1,), (_descriptor(**first),) + args[1:], kwargs)
    _launcher.launch(kernel, (1,), (_descriptor(**change),) + args[1:], kwargs)
    assert _kinds(kernel) == ["triton", "triton"]


@pytest.mark.parametrize("hook", ["callable", "chain"])
def test_launch_hooks_that_would_run_take_tritons_path(kernel, monkeypatch, hook):
    x = torch.empty(64)
    _launcher.launch(kernel, (1,), *_args(x))
    if hook == "chain":  # Triton 3.6+: a HookChain, active once something is added
        if not hasattr(triton.knobs, "HookChain"):
            pytest.skip(f"Triton {triton.__version__} keeps plain hooks")
        chain = triton.knobs.HookChain()
        chain.add(lambda *a: None)
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", chain)
    else:  # earlier releases: None or one callable
        monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", lambda *a: None)
    _launcher.launch(kernel, (1,), *_args(x))
    assert _kinds(kernel) == ["triton", "triton"]


def test_an_unhashable_argument_takes_tritons_path_every_time(kernel):
    x = torch.empty(64)
    args, kwargs = _args(x)
    args = args[:4] + ([1, 2],)
    for _ in range(2):
        _launcher.launch(kernel, (1,), args, kwargs)
    assert _kinds(kernel) == ["triton", "triton"]


class _NoStorage(torch.Tensor):
    """A wrapper subclass with no storage of its own."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(func)


def test_a_tensor_without_storage_is_refused_before_any_launch(kernel):
    """A wrapper subclass without storage (an unwaited AsyncCollectiveTensor) has data_ptr 0:
    launched, it is an illegal address on the GPU (found under FSDP2 on two H200s)."""
    wrapper = torch.Tensor._make_wrapper_subclass(_NoStorage, (1,), dtype=torch.float32)
    assert wrapper.data_ptr() == 0
    args, kwargs = _args(wrapper)
    with pytest.raises(ValueError, match="has no storage"):
        _launcher.launch(kernel, (1,), args, kwargs)
    assert kernel.log == []
    empty, kwargs = _args(torch.empty(0))  # an empty tensor may have a null pointer
    _launcher.launch(kernel, (1,), empty, kwargs)
    assert _kinds(kernel) == ["triton"]


def test_a_missing_argument_without_default_is_never_launched_directly(kernel):
    x = torch.empty(64)
    args, kwargs = _args(x)
    for _ in range(2):  # SCALE absent: Triton's own path raises or handles it, not ours
        _launcher.launch(kernel, (1,), args[:4], kwargs)
    assert _kinds(kernel) == ["triton", "triton"]


def test_the_table_of_a_kernel_is_bounded(kernel, monkeypatch):
    monkeypatch.setattr(_launcher, "MAX_KEYS_PER_KERNEL", 2)
    x = torch.empty(64)
    for n in (16, 32, 48, 16):
        _launcher.launch(kernel, (1,), *_args(x, n=n))
    assert _kinds(kernel) == ["triton"] * 4  # 48 started the table again, without 16
    assert len(_launcher._tables[kernel]) == 2


# ---------------------------------------------------------------- bytes, through the real kernels
@pytest.mark.parametrize("offset", [0, 1, 0])
def test_aligned_and_misaligned_inputs_in_turn_give_the_reference_bytes(offset):
    """The same kernel and shape at two pointer alignments, back and forth: each launch uses the
    kernel compiled for its alignment."""
    flat = torch.randn(64 * 64 + 1, dtype=torch.bfloat16, device=DEVICE)
    x = flat[offset:offset + 64 * 64].view(64, 64)
    args = dict(fp8_dtype=DType.E4M3, force_pow_2_scales=False, amax_epsilon=0.0,
                rowwise=True, columnwise=True)
    got = fp8_tensor.fp8_current_quantize(x, **args)
    want = reference.fp8_current_quantize(x.cpu(), **args)
    for g, w in zip(got, want, strict=True):
        assert_same(g.cpu(), w, DType.E4M3)


def test_repeated_launches_with_new_shapes_give_the_reference_bytes():
    args = dict(fp8_dtype=DType.E4M3, rowwise=True, columnwise=True, with_2d_quantization=False,
                swizzle=False)
    for m in (32, 64, 32, 96):
        x = torch.randn(m, 64, device=DEVICE)
        got = mxfp8.mxfp8_quantize(x, **args)
        want = reference.mxfp8_quantize(x.cpu(), **args)
        for g, w in zip(got, want, strict=True):
            assert_same(g.cpu(), w, DType.E4M3)
