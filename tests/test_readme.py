"""The README's usage example runs as written (so it cannot rot)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_readme_usage_example_runs():
    text = README.read_text()
    usage = text[text.index("## Usage"):]
    blocks = re.findall(r"```python\n(.*?)```", usage, flags=re.S)
    assert blocks, "the README's Usage section has no python example"
    namespace: dict = {}
    for block in blocks:  # in order, one namespace: later blocks use earlier names
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102
    assert namespace["q_rowwise"].columnwise_usage is False
    assert namespace["model"][0].weight.grad is not None
    net = namespace["net"]
    import quant_recipes

    assert type(net[0]) is quant_recipes.Linear and type(net[2]) is namespace["torch"].nn.Linear
    assert net[0].weight.grad is not None
    # Multi-GPU: the two layers' 2 x 256 x 1024 FP8 bytes, gathered for forward and for backward
    assert namespace["gathered"] == 2 * 2 * 256 * 1024
    from quant_core import QuantizedTensor

    assert isinstance(namespace["qnet"][0].weight, QuantizedTensor)
    assert namespace["qnet"][0].weight.grad is None  # moved onto its master by the step


def _load_noxfile(monkeypatch):
    """noxfile.py with a stand-in ``nox`` module (nox is not installed in the test sessions)."""
    import importlib.util
    import sys
    import types

    fake = types.ModuleType("nox")
    fake.options = types.SimpleNamespace()
    fake.Session = object
    fake.session = lambda *a, **k: (lambda f: f)
    fake.parametrize = lambda *a, **k: (lambda f: f)
    fake.virtualenv = types.ModuleType("nox.virtualenv")
    monkeypatch.setitem(sys.modules, "nox", fake)
    monkeypatch.setitem(sys.modules, "nox.virtualenv", fake.virtualenv)
    spec = importlib.util.spec_from_file_location("_noxfile", README.parent / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("uv_on_path", [False, True])
def test_nox_is_told_there_is_no_uv_instead_of_probing(monkeypatch, uv_on_path):
    """Issue 16 item 7: every nox run logged "uv binary not found." (nox probes for uv even for
    virtualenv sessions); without uv the noxfile now answers nox's lazy probe up front."""
    import shutil

    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/uv" if uv_on_path and name == "uv"
                        else None if name == "uv" else which(name))
    noxfile = _load_noxfile(monkeypatch)
    probed = noxfile.nox.virtualenv.__dict__
    if uv_on_path:
        assert "HAS_UV" not in probed
    else:
        assert probed["HAS_UV"] is False and str(probed["UV_VERSION"]) == "0"


def test_sessions_that_compile_stop_with_one_line_without_a_cxx_compiler(monkeypatch, tmp_path):
    """Issue 16 item 3: without g++ the compile tests failed one by one (InvalidCxxCompiler)."""
    noxfile = _load_noxfile(monkeypatch)

    class Session:
        def error(self, message):
            raise RuntimeError(message)

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no compiler on PATH
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler: install g\\+\\+ or clang"):
        noxfile._require_cxx(Session())
    fake_cxx = tmp_path / "g++"
    fake_cxx.write_text("#!/bin/sh\n")
    fake_cxx.chmod(0o755)
    noxfile._require_cxx(Session())  # a compiler on PATH: no error


@pytest.mark.parametrize("package", ["quant-core", "quant-kernels", "quant-dynamo",
                                     "quant-recipes"])
def test_package_readme_names_every_module(package):
    """Each package README's module table names every module (a directory by ``name/``)."""
    root = ROOT / "packages" / package
    (src,) = [d for d in (root / "src").iterdir() if d.is_dir() and not d.name.endswith("info")]
    readme = (root / "README.md").read_text()
    missing = [f.name + ("/" if f.is_dir() else "") for f in sorted(src.iterdir())
               if f.name != "__init__.py" and (f.suffix == ".py" or (
                   f.is_dir() and any(g.suffix == ".py" for g in f.iterdir())))
               and f"`{f.name}{'/' if f.is_dir() else ''}`" not in readme]
    assert not missing, f"{package}/README.md does not name {missing}"
