"""``QuantizerRole``: what a quantizer slot is for (`behaviour.md` §6)."""

from __future__ import annotations

from dataclasses import dataclass

#: Tensor types the built-in recipe states dispatch on.
KNOWN_TENSOR_TYPES = ("input", "weight", "output", "grad_output", "grad_input")
#: Positional fallback for slots without a known tensor type.
FORWARD_SLOT_TYPES = ("input", "weight", "output")
BACKWARD_SLOT_TYPES = ("grad_output", "grad_input")


@dataclass(frozen=True)
class QuantizerRole:
    """Frozen label of a quantizer slot: module kind, tensor kind and module name.

    ``str()`` joins the non-empty fields with ``|`` (``"linear|weight|fc1"``).
    """

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        for field_name in ("module_type", "tensor_type", "name"):
            value = getattr(self, field_name)
            if not isinstance(value, str):
                raise TypeError(f"QuantizerRole.{field_name} must be a str, got {value!r}")

    def __str__(self) -> str:
        return "|".join(p for p in (self.module_type, self.tensor_type, self.name) if p)
