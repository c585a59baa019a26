"""quant-kernels: Triton kernels for every quant format, registered as quant-core's ``triton``
backend through the entry point ``quant_core.backends`` (installing the package is enough).

:mod:`.backend` holds ``TritonBackend`` (the functions of
``quant_core.backend_contract.Backend``, byte-exact against ``quant_core.reference``); one
module per format holds its kernels; :mod:`._rounding` one helper per rounding rule; every
launch goes through :func:`._common.launch`, which ``torch.compile`` can record. Kernels run on
CUDA GPUs, and on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``) for tests.
"""

#: The backend is reached through quant-core's registry, never by name: nothing is exported.
__all__: list[str] = []
