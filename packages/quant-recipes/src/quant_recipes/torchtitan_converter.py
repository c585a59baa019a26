"""quant's Linear in torchtitan's model-config tree (torchtitan 0.3 and later).

torchtitan builds a model from a tree of dataclass configs. Converters rewrite that tree before
anything is built (``ModelConfigConverter.convert(model_config)``), and a model's registry
function applies the converters a training config lists::

    from quant_recipes.torchtitan_converter import QuantLinearConverter
    from torchtitan.models.llama3 import model_registry

    config.model_spec = model_registry(
        "8B", converters=[QuantLinearConverter.Config(recipe="mxfp8")])

:class:`QuantLinearConverter` replaces each Linear config its rule accepts
(``torchtitan.models.common.linear.Linear.Config`` itself) with a :class:`QuantLinear.Config`.
The model torchtitan then builds holds :class:`QuantLinear` layers. Each is quant's
:class:`~quant_recipes.Linear` (an ``nn.Linear``), bound to the recipe so that it quantizes
without :func:`~quant_recipes.autocast`, as ``convert(..., always_quantize=True)`` binds, since
torchtitan's loop enters no context of quant's. Each is also a torchtitan ``Module``, so the
``param_init`` and ``sharding_config`` of the config it replaces carry over.

The rule is :func:`~quant_recipes.convert`'s default: every Linear but the output heads (named as
in ``HEAD_NAMES``, e.g. ``lm_head``) and LoRA adapters. On top of that it skips
the layers whose name contains one of ``filter_fqns`` (the option of torchtitan's float8
converter) and the widths the recipe cannot quantize (logged with the reason). Subclasses of the
Linear config (``ScaledBiasRowwiseLinear``) keep their own forward and are left as they are.

Importing this module needs torchtitan 0.3 or later. torchtitan 0.2 and earlier name converters
in a registry instead: :mod:`quant_recipes.model_converter` registers quant's there.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear as TitanLinear
from torchtitan.protocols.module import Module

from .convert import kept_by_name, unsupported_shape
from .linear import Linear
from .module import check_bindable
from .recipe_names import as_recipe

log = logging.getLogger(__name__)


class QuantLinear(Linear, Module):
    """quant's :class:`~quant_recipes.Linear` as a torchtitan ``Module``, built from its
    config and bound to the config's recipe (a name :func:`~quant_recipes.recipe` knows)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanLinear.Config):
        recipe: str = "fp8_current"
        """The recipe the layer quantizes with, by name (``fp8_current``, ``fp8_block``,
        ``mxfp8``, ``nvfp4``)."""

        name: str = ""
        """The layer's name in quant's quantizer roles (the converter gives its FQN)."""

    def __init__(self, config: Config) -> None:
        Linear.__init__(self, config.in_features, config.out_features, bias=config.bias,
                        name=config.name)
        self.bound_recipe = config.recipe


class QuantLinearConverter(QuantizationConverter):
    """Replaces the Linear configs of a torchtitan model config with :class:`QuantLinear`
    configs bound to ``recipe`` (the module docstring has the rule)."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = "fp8_current"
        """The recipe, by name: ``fp8_current``, ``fp8_block``, ``mxfp8`` or ``nvfp4`` with
        their defaults (delayed scaling cannot be bound to a layer)."""

        filter_fqns: list[str] = field(default_factory=list)
        """Layers whose fully qualified name contains one of these stay torchtitan's Linear."""

    def __init__(self, config: Config) -> None:
        self.config = config
        who = "QuantLinearConverter.Config.recipe"
        self.recipe = as_recipe(config.recipe, who)
        check_bindable(self.recipe, who)

    def _kept(self, fqn: str, linear: TitanLinear.Config) -> str | None:
        """Why the rule keeps the layer ``fqn`` as it is (None: it is converted, if its widths
        allow)."""
        if isinstance(linear, QuantLinear.Config):
            return "already a QuantLinear"
        if type(linear) is not TitanLinear.Config:
            return f"a {type(linear).__qualname__} keeps its own forward"
        if kept_by_name(fqn):
            return "an output head or LoRA adapter (quant's default filter)"
        if any(part in fqn for part in self.config.filter_fqns):
            return "named in filter_fqns"
        return None

    def convert(self, model_config):
        """``model_config`` with the accepted Linear configs replaced (in place; the root is
        returned, replaced too where it is itself a Linear config)."""
        converted = 0
        for fqn, linear, parent, attr in list(model_config.traverse(TitanLinear.Config)):
            why = self._kept(fqn, linear)
            if why is not None:
                log.info("QuantLinearConverter: %s left as it is: %s", fqn or "<root>", why)
                continue
            why = unsupported_shape(self.recipe, fqn, linear.in_features, linear.out_features,
                                    torch.bfloat16)
            if why is not None:
                log.warning("QuantLinearConverter: %s left as it is: %s", fqn or "<root>", why)
                continue
            kept = {f.name: getattr(linear, f.name) for f in dataclasses.fields(linear) if f.init}
            new = QuantLinear.Config(**kept, recipe=self.config.recipe, name=fqn)
            converted += 1
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        log.info("QuantLinearConverter: %d Linear layers bound to %s", converted,
                 self.config.recipe)
        return model_config
