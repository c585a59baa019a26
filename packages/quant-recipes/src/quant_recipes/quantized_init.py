"""Quantized parameters: ``quantized_model_init`` (TransformerEngine's name) and master weights.

Inside ``with quantized_model_init(recipe):`` every ``quant_recipes.Linear`` built stores its
weight quantized: a ``quant_core.tensor.QuantizedTensor`` parameter made by the layer's weight
quantizer under ``recipe`` with both usages (rowwise for fprop, columnwise for dgrad), so the
high-precision weight never stays in memory and a forward under ``autocast(recipe=...)`` does
not quantize it again. With ``preserve_high_precision_init_val=True`` the high-precision initial
value is kept on the parameter (on the CPU, as TE does): ``get_high_precision_init_val(p)``,
``clear_high_precision_init_val(p)``.

Training contract (TE's): a quantized parameter is not updated by an optimizer directly; its
gradient is the high-precision ``dW``. :class:`MasterWeights` keeps an fp32 master copy per
quantized parameter (from the preserved initial value, else the dequantized weight), gives the
optimizer those masters, moves each gradient onto its master, and after ``optimizer.step()``
requantizes the parameter from its master in place (:func:`requantize_`). ``state_dict`` holds
the quantized parameters; loading copies quantized buffers (``QuantizedTensor.copy_``), which
drops a preserved initial value (it no longer describes the parameter). The masters have a
``state_dict`` of their own.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from quant_core.storage import QuantizedStorage
from quant_core.tensor import HIGH_PRECISION_VALUE, forget_high_precision_value

from .recipes import Recipe


class _InitState(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[Recipe, bool]] = []


_STATE = _InitState()


@contextlib.contextmanager
def quantized_model_init(recipe: Recipe | None = None, *, enabled: bool = True,
                         preserve_high_precision_init_val: bool = False):
    """Build ``quant_recipes.Linear`` weights inside as quantized parameters of ``recipe``
    (default: the default recipe, ``Float8CurrentScaling``). ``enabled=False`` builds plain
    weights (an inner region can switch it off). DelayedScaling is refused: its weight scale
    lives in a recipe state that changes every step."""
    if recipe is None:
        from .autocast import default_recipe

        recipe = default_recipe()
    if not isinstance(recipe, Recipe):
        raise TypeError(f"quantized_model_init: recipe must be a quant_recipes.Recipe, "
                        f"got {recipe!r}")
    if enabled and recipe.delayed():
        raise ValueError("quantized_model_init: DelayedScaling keeps live scale state and "
                         "cannot quantize parameters; use a stateless recipe such as "
                         "Float8CurrentScaling")
    stack = _STATE.stack
    depth = len(stack)
    stack.append((recipe if enabled else None, preserve_high_precision_init_val))
    try:
        yield
    finally:
        del stack[depth:]


def quantize_at_init(module) -> None:
    """Called by ``Linear.__init__``: replace its weight by a quantized parameter when the
    innermost :func:`quantized_model_init` is enabled."""
    if not _STATE.stack or _STATE.stack[-1][0] is None:
        return
    recipe, preserve = _STATE.stack[-1]
    from quant_core.tensor import QuantizedTensor

    w = module.weight.detach()
    storage = module.weight_quantizer(recipe).quantize(w)
    param = torch.nn.Parameter(QuantizedTensor.from_storage(storage),
                               requires_grad=module.weight.requires_grad)
    if preserve:
        keep_high_precision_init_val(param, w)
    module.weight = param


def keep_high_precision_init_val(p: torch.Tensor, value: torch.Tensor) -> None:
    """Keep ``value`` (on the CPU) as the high-precision initial value of quantized ``p``."""
    setattr(p, HIGH_PRECISION_VALUE, value.cpu())


def get_high_precision_init_val(p: torch.Tensor) -> torch.Tensor | None:
    """The preserved high-precision initial value of a quantized parameter (CPU), or None."""
    return getattr(p, HIGH_PRECISION_VALUE, None)


def clear_high_precision_init_val(p: torch.Tensor) -> None:
    forget_high_precision_value(p)


@torch.no_grad()
def requantize_(p: QuantizedStorage, value: torch.Tensor) -> None:
    """Quantize ``value`` with ``p``'s quantizer into ``p``'s buffers, in place (the parameter
    object, its buffers and anything referencing them stay)."""
    if not isinstance(p, QuantizedStorage):
        raise TypeError(f"requantize_: expected a quantized tensor, got {type(p).__name__}")
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(f"requantize_: value has shape {tuple(value.shape)}, the quantized "
                         f"tensor {tuple(p.shape)}")
    new = p.quantizer.quantize(value.to(device=p.device))
    for name, t in new.buffers().items():
        mine = getattr(p, name)
        if (mine is None) != (t is None):
            raise RuntimeError(f"requantize_: buffer {name} is present in only one of the "
                               "tensor and its requantization")
        if mine is not None:
            mine.copy_(t)
    forget_high_precision_value(p)


class MasterWeights:
    """fp32 master copies of a model's quantized parameters, for a high-precision optimizer.

    ``parameters()`` is what the optimizer steps: the masters in place of the quantized
    parameters, the other parameters themselves. ``step(optimizer)`` moves each quantized
    parameter's gradient onto its master (accumulating), runs ``optimizer.step()`` and
    requantizes every quantized parameter from its master.

    A master starts from the parameter's preserved high-precision initial value while that
    still describes the parameter, else from its dequantized value: a parameter loaded with
    ``load_state_dict`` (or requantized) has dropped its initial value. ``state_dict()`` holds
    the masters by parameter name; a checkpoint of the model, these masters and the optimizer
    resumes a run bit for bit (``load_state_dict`` after building all three).
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.float32) -> None:
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self.names: list[str] = []
        self.others: list[torch.nn.Parameter] = []
        for name, p in model.named_parameters():
            if isinstance(p, QuantizedStorage):
                init = get_high_precision_init_val(p)
                value = init if init is not None else p.dequantize(dtype=dtype)
                master = torch.nn.Parameter(value.to(device=p.device, dtype=dtype).clone(),
                                            requires_grad=p.requires_grad)
                self.pairs.append((p, master))
                self.names.append(name)
            else:
                self.others.append(p)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [m for _, m in self.pairs] + self.others

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The masters by the name of their parameter in the model."""
        return {name: m.detach() for name, (_, m) in zip(self.names, self.pairs, strict=True)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor], *, requantize: bool = True
                        ) -> None:
        """Copy masters saved by :meth:`state_dict` into these (every name must match), and
        requantize each parameter from its master (``requantize=False`` keeps the parameters,
        e.g. when the model's own ``state_dict`` was loaded from the same checkpoint; the bytes
        are the same)."""
        missing = sorted(set(self.names) - set(state))
        unexpected = sorted(set(state) - set(self.names))
        if missing or unexpected:
            raise KeyError(f"MasterWeights.load_state_dict: missing {missing}, "
                           f"unexpected {unexpected}")
        for name, (p, m) in zip(self.names, self.pairs, strict=True):
            value = state[name]
            if tuple(value.shape) != tuple(m.shape):
                raise ValueError(f"MasterWeights.load_state_dict: {name} has shape "
                                 f"{tuple(value.shape)}, its master {tuple(m.shape)}")
            m.copy_(value)
            if requantize:
                requantize_(p, m)

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        for p, m in self.pairs:
            if p.grad is None:
                continue
            g = p.grad.to(m.dtype)
            m.grad = g if m.grad is None else m.grad + g
            p.grad = None
        optimizer.step()
        for p, m in self.pairs:
            requantize_(p, m)
