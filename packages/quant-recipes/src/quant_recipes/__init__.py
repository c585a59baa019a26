"""quant-recipes: recipes, nested ``autocast``, ``CustomRecipe`` and quantized modules.

Depends on quant-core only; quant-dynamo (compile support) and quant-kernels (Triton backend)
are used when installed (quant-dynamo is imported with the package: :mod:`.compiling`).
"""

from . import compiling  # noqa: F401  (imports quant-dynamo when installed: see its docstring)
from .accelerate_prepare import accelerate_prepare
from .autocast import Frame, autocast, current_frame, default_recipe
from .checkpointing import checkpoint_contexts, in_forward_frame
from .convert import convert, unconvert
from .export import compressed_tensors_state_dict, save_compressed_tensors
from .fsdp import all_gather_bytes, enable_fsdp_quantized_all_gather, reset_all_gather_bytes
from .gemm import compiled_gemm_paths, gemm_paths, last_gemm_path, reset_gemm_paths
from .identity import HighPrecisionStorage, IdentityQuantizer
from .linear import Linear
from .module import QuantizedModule, intern
from .moe import GroupedLinear, grouped_gemm_paths, reset_grouped_gemm_paths
from .quantized_init import (
    MasterWeights,
    clear_high_precision_init_val,
    get_high_precision_init_val,
    quantized_model_init,
    requantize_,
)
from .recipe_names import RECIPE_NAMES, recipe
from .recipes import (
    CustomRecipe,
    CustomRecipeState,
    DelayedScaling,
    DelayedScalingRecipeState,
    DelayedScalingRequest,
    Float8BlockScaling,
    Float8BlockScalingRecipeState,
    Float8CurrentScaling,
    Float8CurrentScalingRecipeState,
    Format,
    MMParams,
    MXFP8BlockScaling,
    MXFP8BlockScalingRecipeState,
    NVFP4BlockScaling,
    NVFP4BlockScalingRecipeState,
    QParams,
    Recipe,
    quantizer_factory,
)
from .reuse import shared_activations
from .role import QuantizerRole
from .states import RecipeState
from .step_weights import StepWeights, quantize_weights_per_step
from .tensor_parallel import (
    PrepareQuantModuleInput,
    QuantColwiseParallel,
    QuantRowwiseParallel,
    reset_tensor_parallel_gather_bytes,
    tensor_parallel_gather_bytes,
)
from .weight_cache import cached_weights, invalidate_cached_weights

__version__ = "0.1.0"

__all__ = [
    "Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
    "Float8BlockScaling", "NVFP4BlockScaling", "CustomRecipe", "DelayedScalingRequest",
    "Format", "QParams", "MMParams", "quantizer_factory", "QuantizerRole", "RecipeState",
    "DelayedScalingRecipeState", "Float8CurrentScalingRecipeState",
    "MXFP8BlockScalingRecipeState", "Float8BlockScalingRecipeState",
    "NVFP4BlockScalingRecipeState", "CustomRecipeState", "IdentityQuantizer",
    "HighPrecisionStorage", "autocast", "checkpoint_contexts", "in_forward_frame", "Frame",
    "current_frame", "default_recipe",
    "QuantizedModule", "Linear", "intern", "gemm_paths", "compiled_gemm_paths", "last_gemm_path",
    "reset_gemm_paths", "GroupedLinear", "grouped_gemm_paths", "reset_grouped_gemm_paths",
    "convert", "unconvert", "accelerate_prepare", "enable_fsdp_quantized_all_gather",
    "all_gather_bytes",
    "reset_all_gather_bytes", "quantized_model_init", "MasterWeights", "requantize_",
    "get_high_precision_init_val", "clear_high_precision_init_val", "cached_weights",
    "invalidate_cached_weights", "quantize_weights_per_step", "StepWeights", "shared_activations",
    "recipe", "RECIPE_NAMES", "QuantColwiseParallel", "QuantRowwiseParallel",
    "PrepareQuantModuleInput", "tensor_parallel_gather_bytes",
    "reset_tensor_parallel_gather_bytes", "compressed_tensors_state_dict",
    "save_compressed_tensors",
]
