"""Which shapes a quantizer class is asked to quantize: the probe of the tests that pin how many
quantizations a step makes."""

from __future__ import annotations


def count_quantizations(monkeypatch, quantizer_cls) -> list[tuple[int, ...]]:
    """The list that collects, in order, the shape of every tensor ``quantizer_cls.quantize``
    receives from now on (undone with ``monkeypatch``)."""
    calls: list[tuple[int, ...]] = []
    real = quantizer_cls.quantize

    def counting(self, x, **kw):
        calls.append(tuple(x.shape))
        return real(self, x, **kw)

    monkeypatch.setattr(quantizer_cls, "quantize", counting)
    return calls
