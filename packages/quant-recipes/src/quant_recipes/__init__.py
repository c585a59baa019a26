"""quant-recipes: recipes, nested ``autocast``, ``CustomRecipe`` and quantized modules.

Depends on quant-core only; quant-dynamo (compile support) and quant-kernels (Triton backend)
are used when installed (quant-dynamo is imported with the package: :mod:`.compiling`).
"""

from . import compiling  # noqa: F401  (imports quant-dynamo when installed: see its docstring)
from .autocast import Frame, autocast, current_frame, default_recipe
from .convert import convert, unconvert
from .gemm import compiled_gemm_paths, gemm_paths, last_gemm_path, reset_gemm_paths
from .identity import HighPrecisionStorage, IdentityQuantizer
from .linear import Linear
from .module import QuantizedModule, intern
from .recipes import (
    CustomRecipe,
    DelayedScaling,
    DelayedScalingRequest,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QParams,
    Recipe,
    quantizer_factory,
)
from .role import QuantizerRole
from .states import (
    CustomRecipeState,
    DelayedScalingRecipeState,
    Float8BlockScalingRecipeState,
    Float8CurrentScalingRecipeState,
    MXFP8BlockScalingRecipeState,
    NVFP4BlockScalingRecipeState,
    RecipeState,
)

__version__ = "0.1.0"

__all__ = [
    "Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
    "Float8BlockScaling", "NVFP4BlockScaling", "CustomRecipe", "DelayedScalingRequest",
    "Format", "QParams", "MMParams", "quantizer_factory", "QuantizerRole", "RecipeState",
    "DelayedScalingRecipeState", "Float8CurrentScalingRecipeState",
    "MXFP8BlockScalingRecipeState", "Float8BlockScalingRecipeState",
    "NVFP4BlockScalingRecipeState", "CustomRecipeState", "IdentityQuantizer",
    "HighPrecisionStorage", "autocast", "Frame", "current_frame", "default_recipe",
    "QuantizedModule", "Linear", "intern", "gemm_paths", "compiled_gemm_paths", "last_gemm_path",
    "reset_gemm_paths",
    "convert", "unconvert",
]
