"""The nox demo session asks for a C++ compiler only when the demo compiles with Inductor."""

from __future__ import annotations

import pytest
from test_readme import _load_noxfile


@pytest.mark.parametrize(("args", "inductor"), [
    ([], False),  # the CPU default: aot_eager, no generated code
    (["--steps", "5"], False),
    (["--compile-backend", "inductor"], True),
    (["--compile-backend=inductor"], True),
    (["--compile-backend", "aot_eager", "--device", "cuda"], False),
    (["--device", "cuda"], True),  # Inductor is the default on a GPU
    (["--device", "cuda", "--no-compile"], False),
])
def test_the_demo_session_needs_a_compiler_only_with_inductor(monkeypatch, args, inductor):
    nf = _load_noxfile(monkeypatch)
    monkeypatch.setattr(nf.shutil, "which", lambda name: None)  # no GPU driver: auto is the CPU
    assert nf._demo_uses_inductor(args) is inductor


def test_auto_device_on_a_gpu_machine_compiles_with_inductor(monkeypatch):
    nf = _load_noxfile(monkeypatch)
    monkeypatch.setattr(nf.shutil, "which", lambda name: "/usr/bin/" + name)
    assert nf._demo_uses_inductor([]) is True
    assert nf._demo_uses_inductor(["--device", "cpu"]) is False


def test_the_demo_session_without_a_compiler_runs_the_demo(monkeypatch):
    nf = _load_noxfile(monkeypatch)
    monkeypatch.setattr(nf.shutil, "which", lambda name: None)  # no compiler on PATH
    ran = []

    class Session:
        posargs: list[str] = []

        def error(self, message):
            raise AssertionError(message)

        def run(self, *args, **kwargs):
            ran.append(args)

    monkeypatch.setattr(nf, "_stamp_install", lambda *a, **k: None)
    nf.demo(Session())
    assert ran == [("quant", "demo")]
    Session.posargs = ["--compile-backend", "inductor"]
    with pytest.raises(AssertionError, match="needs a C\\+\\+ compiler"):
        nf.demo(Session())
