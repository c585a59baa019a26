"""Every python block of the README runs on its own, as written (so none can rot)."""

from __future__ import annotations

import linecache
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _python_blocks() -> list[tuple[int, str]]:
    """Each python block of the README with the line its code starts on (1-based)."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
            for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S)]


BLOCKS = _python_blocks()


def _check_q_rowwise(ns):
    assert ns["q_rowwise"].columnwise_usage is False


def _check_model(ns):
    assert ns["model"][0].weight.grad is not None


def _check_net(ns):
    import quant_recipes
    import torch

    net = ns["net"]
    assert type(net[0]) is quant_recipes.Linear and type(net[2]) is torch.nn.Linear
    assert net[0].weight.grad is not None


def _check_gathered(ns):
    # the two layers' 2 x 256 x 1024 FP8 bytes, gathered for forward and for backward
    assert ns["gathered"] == 2 * 2 * 256 * 1024


def _check_qnet(ns):
    from quant_core import QuantizedTensor

    assert isinstance(ns["qnet"][0].weight, QuantizedTensor)
    assert ns["qnet"][0].weight.grad is None  # moved onto its master by the step


def _check_loaded(ns):
    import quant_recipes

    layers = ns["loaded"].model.layers[0]
    assert type(layers.self_attn.q_proj) is quant_recipes.Linear  # converted after loading
    assert layers.self_attn.q_proj.bound_recipe is not None


#: Packages of the integrations (their own nox session installs them): a block importing one
#: is skipped where it is absent.
_INTEGRATIONS = ("lightning", "transformers", "peft", "accelerate")

#: What a block that defines each name must leave behind.
CHECKS = {"q_rowwise": _check_q_rowwise, "model": _check_model, "net": _check_net,
          "gathered": _check_gathered, "qnet": _check_qnet, "loaded": _check_loaded}


def test_readme_has_the_checked_examples():
    assert BLOCKS, "the README has no python example"
    defined = set()
    for _, code in BLOCKS:
        defined |= {name for name in CHECKS if re.search(rf"^\s*{name} = ", code, flags=re.M)}
    assert defined == set(CHECKS), f"no README block defines {sorted(set(CHECKS) - defined)}"


@pytest.mark.parametrize("index", range(len(BLOCKS)),
                         ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_usage_example_runs(index, tmp_path, monkeypatch):
    """Block ``index`` runs in a fresh namespace (its own imports and setup) and a fresh working
    directory (for what it writes), and the names it defines hold what the README says."""
    monkeypatch.chdir(tmp_path)
    import torch.distributed as dist

    line, code = BLOCKS[index]
    for package in _INTEGRATIONS:  # these blocks run in the session that installs the package
        if re.search(rf"^\s*(import|from) {package}\b", code, flags=re.M):
            pytest.importorskip(package)
    # padded with newlines so that a traceback names the block's line in the README; the source
    # is registered under its own name, since inspect (Dynamo) reads the source of what it traces
    source = "\n" * (line - 1) + code
    filename = f"{README}:block{index}"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict = {"__name__": f"readme_block_{index}"}
    try:
        exec(compile(source, filename, "exec"), namespace)  # noqa: S102
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()  # a failed block must not leave its group behind
    for name, check in CHECKS.items():
        if name in namespace:
            check(namespace)


def _load_noxfile(monkeypatch):
    """noxfile.py with a stand-in ``nox`` module (nox is not installed in the test sessions)."""
    import importlib.util
    import sys
    import types

    fake = types.ModuleType("nox")
    fake.options = types.SimpleNamespace()
    fake.Session = object
    fake.sessions = []  # the functions @nox.session decorates, in order
    fake.session = lambda *a, **k: (lambda f: fake.sessions.append(f) or f)
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
    """nox probes for uv even for virtualenv sessions and logs "uv binary not found." when it is
    absent; without uv the noxfile answers nox's lazy probe up front, so nothing is logged."""
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
    """Without a C++ compiler a session that compiles stops with one line naming the fix,
    instead of failing each compile test on its own (InvalidCxxCompiler)."""
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


def test_nox_list_shows_a_whole_sentence_per_session(monkeypatch):
    """``nox -l`` prints the first line of each session's docstring: a whole sentence, without
    Sphinx roles or reST literals."""
    noxfile = _load_noxfile(monkeypatch)
    assert len(noxfile.nox.sessions) == len(noxfile.nox.options.sessions) + 1  # and demo
    for session in noxfile.nox.sessions:
        first = session.__doc__.strip().split("\n")[0]
        assert first.endswith(".") and first.count("(") == first.count(")"), session.__name__
        assert not re.search(r":\w+:`|``", first), session.__name__


@pytest.mark.parametrize(("args", "gpu"), [([], False), ([], True), (["--device", "cpu"], True),
                                           (["--device=cuda"], False)])
def test_the_demo_installs_triton_and_the_kernels_only_for_a_gpu(monkeypatch, args, gpu):
    """On the CPU the demo runs the pure-torch reference: no Triton kernel would run."""
    import shutil

    noxfile = _load_noxfile(monkeypatch)
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: ("/usr/bin/nvidia-smi" if gpu else None)
                        if name == "nvidia-smi" else which(name))
    deps, local = noxfile._demo_requirements(args)
    on_gpu = args == ["--device=cuda"] or (gpu and not args)
    assert any(d.startswith("triton==") for d in deps) is on_gpu
    assert ("quant-kernels" in local) is on_gpu
    assert {"quant-core", "quant-dynamo", "quant-recipes"} <= set(local)
    assert any(d.startswith("torch==") for d in deps)


def test_installing_torch_on_linux_without_a_gpu_names_the_cpu_index(monkeypatch):
    import shutil

    noxfile = _load_noxfile(monkeypatch)
    monkeypatch.setattr(noxfile.sys, "platform", "linux")
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "nvidia-smi"
                        else which(name))
    for name in noxfile.PIP_SOURCES:
        monkeypatch.delenv(name, raising=False)
    note = noxfile._cuda_torch_note(["torch==2.13.0", "pytest>=8"])
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in note
    assert noxfile._cuda_torch_note(["pytest>=8"]) is None  # no torch in this install
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", noxfile.CPU_TORCH_INDEX)
    assert noxfile._cuda_torch_note(["torch==2.13.0"]) is None  # the user chose a source
