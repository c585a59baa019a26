"""Every Triton kernel compiles from the source Inductor writes for it.

A compiled graph that records a kernel's launch (quant_dynamo.capture) does not import the kernel:
Inductor writes the kernel's source and the transitive closure of what it calls into a new module
(``user_defined_triton_kernel_transitive_closure_source_code``) and compiles that in a worker
process. Only names the kernel loads unqualified come along (``@triton.jit`` helpers, int / bool /
``tl.constexpr`` globals, triton's own symbols): a helper called as ``module.helper`` fails there
with ``NameError`` although the eager kernel runs. The check rebuilds each kernel's closure as
Inductor does and resolves every global the rebuilt functions load. Under ``TRITON_INTERPRET``
kernels are not ``JITFunction`` objects, so it runs in a subprocess without it;
``python tests/kernels/test_kernel_sources.py`` prints one line per kernel and exits 1 on a miss.
"""

from __future__ import annotations

import builtins
import dis
import importlib
import importlib.util
import pathlib
import pkgutil
import sys
import tempfile

import pytest
from _sm90 import run_as_script


def test_every_kernel_resolves_in_inductors_source():
    wrapper = pytest.importorskip("torch._inductor.codegen.wrapper")
    if not hasattr(wrapper, "user_defined_triton_kernel_transitive_closure_source_code"):
        pytest.skip("this torch writes user kernels' sources differently")
    run_as_script(__file__, min_ok=20, timeout=300)


def _kernels():
    """``(module name, kernel)`` of every ``@triton.jit`` function quant_kernels defines."""
    import quant_kernels
    from triton.runtime.jit import JITFunction

    for info in pkgutil.iter_modules(quant_kernels.__path__):
        module = importlib.import_module(f"quant_kernels.{info.name}")
        for value in vars(module).values():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                yield module.__name__, value


def _unresolved(kernel) -> list[str]:
    """Globals that functions of ``kernel``'s Inductor-written closure load and it lacks."""
    from torch._inductor.codegen.wrapper import (
        user_defined_triton_kernel_transitive_closure_source_code as closure_source,
    )
    from triton.runtime.jit import JITFunction

    source = "import triton\nimport triton.language as tl\n@triton.jit\n" + closure_source(kernel)
    with tempfile.TemporaryDirectory() as folder:  # triton reads a jit function's source file
        path = pathlib.Path(folder, f"closure_{kernel.fn.__name__}.py")
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    namespace = vars(module)
    missing = []
    for value in list(namespace.values()):
        if not isinstance(value, JITFunction):
            continue
        for inst in dis.Bytecode(value.fn):
            name = inst.argval
            if (inst.opname == "LOAD_GLOBAL" and name not in namespace
                    and not hasattr(builtins, name)):
                missing.append(f"{value.fn.__name__}: {name}")
    return missing


def main() -> int:
    failed = 0
    for module, kernel in _kernels():
        missing = _unresolved(kernel)
        failed += bool(missing)
        print(f"{'MISS' if missing else 'ok  '} {module}.{kernel.fn.__name__}"
              + (f" ({', '.join(missing)})" if missing else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
