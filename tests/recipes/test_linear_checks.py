"""A quantized ``Linear`` refuses, in forward and before any quantize or GEMM, operands the
quantized GEMM cannot take (on different devices, as ``nn.Linear`` refuses them; not floating
point), takes mixed floating dtypes, and refuses the shapes its recipe's blocks cannot take in
any GEMM of the step, backward's included
(`behaviour.md` §8, §12)."""

from __future__ import annotations

import copy
import re

import formats
import pytest
import quant_recipes as qr
import torch
from quant_recipes.convert import unsupported_shape

#: Every format's built-in recipe (tests/formats.py), by qualified id, and delayed scaling.
RECIPES = {name: make() for name, make in formats.default_recipes(qualified=True).items()}
ALL_RECIPES = {**RECIPES, "delayed": qr.DelayedScaling()}
#: The block formats, their built-in recipes and the K multiple the table states for them.
BLOCKED = {row.qualified: (row.recipe(), row.k_multiple)
           for row in formats.FORMATS.values() if row.k_multiple > 1}


def _compile_supported() -> bool:
    quant_dynamo = pytest.importorskip("quant_dynamo", reason="compile tests need quant-dynamo")
    return quant_dynamo.compile_supported() and quant_dynamo.DERIVES_IN_GRAPH


def _forward(recipe, compiled=False):
    def fn(m, x):
        with qr.autocast(recipe=recipe):
            return m(x)

    if compiled:
        if not _compile_supported():
            pytest.skip(f"torch {torch.__version__} cannot run quantizer methods in a graph")
        torch._dynamo.reset()
        return torch.compile(fn, backend="aot_eager", fullgraph=True)
    return fn


# ------------------------------------------------------------------ devices and dtypes
@pytest.mark.parametrize(("x_device", "w_device"), [("cpu", "meta"), ("meta", "cpu")])
@pytest.mark.parametrize("name", ALL_RECIPES)
def test_operands_on_different_devices_are_refused(name, x_device, w_device):
    """Before, a meta weight with a CPU input returned uninitialised values and a CPU weight
    with a meta input returned a meta tensor."""
    m = qr.Linear(64, 32, dtype=torch.bfloat16, device=w_device)
    x = torch.randn(16, 64, dtype=torch.bfloat16, device=x_device, requires_grad=True)
    qr.reset_gemm_paths()
    with pytest.raises(RuntimeError, match=f"^Linear: input is on {x_device} but weight on "
                                           f"{w_device}"):
        _forward(ALL_RECIPES[name])(m, x)
    assert qr.gemm_paths() == {}


@pytest.mark.parametrize("name", RECIPES)
def test_operands_on_different_devices_are_refused_compiled(name):
    m = qr.Linear(64, 32, dtype=torch.bfloat16, name="proj")
    x = torch.randn(16, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(Exception, match="Linear 'proj': input is on meta but weight on cpu"):
        _forward(RECIPES[name], compiled=True)(m, x)


def test_a_bias_on_another_device_is_refused():
    m = qr.Linear(64, 32, dtype=torch.bfloat16)
    m.bias = torch.nn.Parameter(torch.zeros(32, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(RuntimeError, match="^Linear: input is on cpu but bias on meta"):
        _forward(RECIPES["fp8_current"])(m, torch.randn(16, 64, dtype=torch.bfloat16))


def test_a_bound_recipe_refuses_operands_on_different_devices():
    model = qr.convert(torch.nn.Sequential(torch.nn.Linear(64, 32, dtype=torch.bfloat16)),
                       filter=lambda fqn, m: True, recipe=RECIPES["fp8_current"],
                       always_quantize=True)
    x = torch.randn(16, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError, match="^Linear '0': input is on meta but weight on cpu"):
        model(x)


@pytest.mark.parametrize("name", RECIPES)
def test_a_quantized_weight_refuses_an_input_on_another_device(name):
    with qr.quantized_model_init(RECIPES[name]):
        m = qr.Linear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError, match="^Linear: input is on meta but weight on cpu"):
        _forward(RECIPES[name])(m, x)


@pytest.mark.parametrize("name", ["fp8_current", "fp8_block", "mxfp8", "delayed"])
def test_mixed_floating_dtypes_are_taken(name):
    """Unlike nn.Linear, the quantized layer takes a bf16 input with fp32 parameters: each
    operand is quantized from its own dtype (what an fp32 input of the same values gives), and
    the output has the input's dtype."""
    torch.manual_seed(0)
    m = qr.Linear(64, 32)
    twin = copy.deepcopy(m)  # delayed scaling's state moves with each step: a fresh twin
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    y = _forward(ALL_RECIPES[name])(m, x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, _forward(ALL_RECIPES[name])(twin, x.float()).to(torch.bfloat16))


@pytest.mark.parametrize("what", ["input", "bias"])
def test_a_non_floating_operand_is_refused(what):
    m = qr.Linear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    if what == "input":
        x = x.to(torch.int32)
    else:
        m.bias = torch.nn.Parameter(torch.zeros(32, dtype=torch.int32), requires_grad=False)
    with pytest.raises(RuntimeError, match=re.escape(f"Linear: the {what} is torch.int32")):
        _forward(RECIPES["fp8_current"])(m, x)


def test_a_non_floating_input_is_refused_compiled():
    m = qr.Linear(64, 32)
    with pytest.raises(Exception, match="Linear: the input is torch.int32"):
        _forward(RECIPES["fp8_current"], compiled=True)(m, torch.ones(16, 64, dtype=torch.int32))


def test_inside_torch_autocast_mixed_dtypes_are_taken():
    """torch.autocast casts nn.Linear's operands, so mixed dtypes are legal there; the quantized
    layer quantizes each operand from its own dtype and returns the input's dtype."""
    m = qr.Linear(64, 32)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = _forward(RECIPES["fp8_current"])(m, x)
        reference = torch.nn.functional.linear(x, m.weight, m.bias)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and m.weight.grad.dtype == torch.float32
    assert (y - reference).float().norm() < 0.1 * reference.float().norm()


def test_a_quantized_weight_takes_an_input_of_another_dtype():
    """A quantized weight's dtype is nominal: its bytes feed the GEMM whatever the input's
    dtype (in high precision it is dequantized to the input's dtype)."""
    with qr.quantized_model_init(RECIPES["fp8_current"]):
        m = qr.Linear(64, 32, bias=False)
    y = _forward(RECIPES["fp8_current"])(m, torch.randn(16, 64, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16


# ------------------------------------------------------------------ block shapes
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", BLOCKED)
def test_out_features_off_the_block_is_refused_in_forward(name, compiled):
    """Before, forward passed and backward failed quantizing grad_output with a message naming
    neither the layer nor out_features ("got shape (32, 40) (K = 40)")."""
    recipe, block = BLOCKED[name]
    m = qr.Linear(64, 40, dtype=torch.bfloat16, name="proj")
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    qr.reset_gemm_paths()
    message = (f"Linear 'proj' (in_features=64, out_features=40): {type(recipe).__name__} "
               f"quantizes grad_output [rows, out_features] for the backward GEMMs in blocks of "
               f"{block} along out_features, and 40 is not a multiple of {block}; pad "
               f"out_features to a multiple of {block}, or keep the layer in high precision "
               f"(convert(model, recipe=...) leaves such layers out)")
    with pytest.raises(ValueError if not compiled else Exception, match=re.escape(message)):
        _forward(recipe, compiled)(m, x)
    assert qr.gemm_paths() == {}


@pytest.mark.parametrize("name", BLOCKED)
def test_in_features_off_the_block_is_refused_naming_the_layer(name):
    recipe, block = BLOCKED[name]
    m = qr.Linear(40, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=re.escape(
            f"Linear(in_features=40, out_features=64): {type(recipe).__name__} quantizes input "
            f"[rows, in_features] for the forward GEMM in blocks of {block} along in_features, "
            f"and 40 is not a multiple of {block}; pad in_features")):
        _forward(recipe)(m, torch.randn(32, 40, dtype=torch.bfloat16))


@pytest.mark.parametrize("name", BLOCKED)
def test_without_a_backward_only_the_forward_gemm_decides(name):
    recipe, _ = BLOCKED[name]
    m = qr.Linear(64, 40, dtype=torch.bfloat16)
    with torch.no_grad():
        y = _forward(recipe)(m, torch.randn(32, 64, dtype=torch.bfloat16))
    assert y.shape == (32, 40)


def test_a_high_precision_backward_takes_any_out_features():
    """With backward_override="high_precision" no backward GEMM quantizes grad_output."""
    recipe = qr.MXFP8BlockScaling(backward_override="high_precision")
    m = qr.Linear(64, 40, dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    _forward(recipe)(m, x).float().sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("save_input_copy", [True, False])
def test_rows_the_hadamard_transform_cannot_take_are_refused_in_forward(save_input_copy):
    """NVFP4's RHT mixes 16 rows of the input's and grad_output's columnwise copies; with
    save_input_copy=False the input's copy is made in backward, where it used to fail."""
    m = qr.Linear(64, 64, dtype=torch.bfloat16, name="proj", save_input_copy=save_input_copy)
    x = torch.randn(20, 64, dtype=torch.bfloat16, requires_grad=True)
    qr.reset_gemm_paths()
    with pytest.raises(ValueError, match=re.escape(
            "Linear 'proj' (in_features=64, out_features=64, 20 input rows): the input's "
            "columnwise copy for the weight-gradient GEMM: NVFP4 with RHT mixes 16 rows")):
        _forward(RECIPES["nvfp4"])(m, x)
    assert qr.gemm_paths() == {}


@pytest.mark.parametrize(("in_features", "out_features"),
                         [(64, 64), (64, 40), (40, 64), (64, 48), (48, 64), (48, 80)])
@pytest.mark.parametrize("name", ALL_RECIPES)
def test_forward_refuses_exactly_the_layers_convert_leaves_out(name, in_features, out_features):
    """One rule: a layer convert(recipe=...) would keep runs a whole step; one it leaves out is
    refused in forward."""
    recipe = ALL_RECIPES[name]
    m = qr.Linear(in_features, out_features, dtype=torch.bfloat16)
    x = torch.randn(32, in_features, dtype=torch.bfloat16, requires_grad=True)
    if unsupported_shape(recipe, "", in_features, out_features, torch.bfloat16) is None:
        _forward(recipe)(m, x).float().sum().backward()
        assert x.grad.shape == x.shape
    else:
        with pytest.raises(ValueError, match="leaves such layers out"):
            _forward(recipe)(m, x)
