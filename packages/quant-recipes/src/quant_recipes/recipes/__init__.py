"""The recipes, one module each with the recipe and its state (``Recipe.state_class``)."""

from ..recipe import Format, MMParams, QParams, Recipe
from .custom import CustomRecipe, CustomRecipeState, quantizer_factory
from .delayed import DelayedScaling, DelayedScalingRecipeState, DelayedScalingRequest
from .fp8_block import Float8BlockScaling, Float8BlockScalingRecipeState
from .fp8_current import Float8CurrentScaling, Float8CurrentScalingRecipeState
from .mxfp8 import MXFP8BlockScaling, MXFP8BlockScalingRecipeState
from .nvfp4 import NVFP4BlockScaling, NVFP4BlockScalingRecipeState

__all__ = [
    "Recipe", "Format", "QParams", "MMParams", "DelayedScaling", "DelayedScalingRecipeState",
    "DelayedScalingRequest", "Float8CurrentScaling", "Float8CurrentScalingRecipeState",
    "MXFP8BlockScaling", "MXFP8BlockScalingRecipeState", "Float8BlockScaling",
    "Float8BlockScalingRecipeState", "NVFP4BlockScaling", "NVFP4BlockScalingRecipeState",
    "CustomRecipe", "CustomRecipeState", "quantizer_factory",
]
