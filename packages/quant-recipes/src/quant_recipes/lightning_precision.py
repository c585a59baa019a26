"""``QuantPrecision``: a Lightning precision plugin that trains a ``LightningModule`` under a
quant recipe, with Lightning's own loop.

As Lightning's TransformerEngine plugin does, it converts the module's ``nn.Linear`` layers when
the trainer sets the model up (``convert_module``: the module cast to ``weights_dtype``, then
:func:`~quant_recipes.convert` with the recipe) and, around every forward, training, validation,
test and predict step (``forward_context``), makes ``weights_dtype`` the default dtype, enters
``torch.autocast`` with ``fallback_compute_dtype`` for the operations quant leaves out (the
output heads, attention, norms) and, innermost, :func:`~quant_recipes.autocast`. So one plugin
is the whole precision: Lightning takes one plugin or a ``precision=`` flag, never both.
Backward runs after the step's context has exited; each layer's backward quantizers were fixed
in its forward, so that is what TransformerEngine's contexts do too. Importing this module needs
``lightning``.

``Trainer(plugins=[QuantPrecision("mxfp8")])``: bf16 weights, bf16 fallback compute.
``QuantPrecision("mxfp8", weights_dtype=torch.float32, fallback_compute_dtype=torch.bfloat16)``
is ``precision="bf16-mixed"`` with quantized Linear layers (fp32 master weights).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection

from .autocast import autocast
from .convert import check_input_dtype, convert
from .linear import Linear
from .recipe_names import as_recipe
from .recipes import Recipe

#: The dtypes ``torch.autocast`` computes in; a fallback of another dtype enters none.
_AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


class QuantPrecision(Precision):
    """Train under ``recipe`` (a :class:`~quant_recipes.Recipe`, or a name
    :func:`~quant_recipes.recipe` knows, with ``options``). ``filter`` is :func:`convert`'s.
    ``convert_layers=False`` converts nothing (for a model built from quant's layers); a model
    that already holds any is not converted either.

    ``weights_dtype`` (default ``torch.bfloat16``, as the recipes' GEMMs take their operands):
    the module's parameters are cast to it at setup and it is the default dtype inside each step;
    a dtype the recipe cannot quantize (NVFP4's Hadamard transform takes bfloat16 only) raises
    ``ValueError`` here. ``fallback_compute_dtype`` (default ``weights_dtype``): the
    ``torch.autocast`` dtype of the operations quant does not quantize, on ``device_type``
    (default ``"cuda"`` when CUDA is available, else ``"cpu"``); float32 enters no autocast.
    The floating tensors of each batch are cast to ``weights_dtype`` (``convert_input``)."""

    precision = "quant"

    def __init__(self, recipe: Recipe | str, *, weights_dtype: torch.dtype = torch.bfloat16,
                 fallback_compute_dtype: torch.dtype | None = None,
                 device_type: str | None = None, filter=None, convert_layers: bool = True,
                 **options: Any) -> None:
        self.recipe = as_recipe(recipe, "QuantPrecision", **options)
        for name, dtype in (("weights_dtype", weights_dtype),
                            ("fallback_compute_dtype", fallback_compute_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype)
                                          and dtype.is_floating_point):
                raise TypeError(f"QuantPrecision: {name} must be a floating torch.dtype, got "
                                f"{dtype!r}")
        try:
            check_input_dtype(self.recipe, "QuantPrecision", weights_dtype)
        except ValueError as e:
            raise ValueError(f"QuantPrecision: weights_dtype={weights_dtype} cannot be used "
                             f"with {type(self.recipe).__name__}: {e}; keep the default "
                             "weights_dtype=torch.bfloat16") from None
        self.weights_dtype = weights_dtype
        self.fallback_compute_dtype = fallback_compute_dtype or weights_dtype
        self.device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        self.filter = filter
        self.convert_layers = convert_layers

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = module.to(dtype=self.weights_dtype)  # first: the recipe checks this dtype
        if self.convert_layers and not any(isinstance(m, Linear) for m in module.modules()):
            convert(module, recipe=self.recipe, filter=self.filter)
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self.weights_dtype)

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def forward_context(self) -> AbstractContextManager:
        stack = ExitStack()
        stack.enter_context(_DtypeContextManager(self.weights_dtype))
        if self.fallback_compute_dtype in _AUTOCAST_DTYPES:
            stack.enter_context(torch.autocast(self.device_type,
                                               dtype=self.fallback_compute_dtype))
        stack.enter_context(autocast(recipe=self.recipe))
        return stack

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor,
                                   dst_type=self.weights_dtype)

    def convert_output(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=torch.Tensor,
                                   dst_type=torch.get_default_dtype())
