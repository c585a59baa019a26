"""Sessions for the quant monorepo.

`nox -s demo` trains a small model under every recipe. `nox` runs the default list, what CI
runs: lint, one isolation session per package (only that package and what it declares), the
rest of the suite on torch 2.13 with every package, the Hugging Face and framework sessions, and
the torch-version matrix (`compat`), which downloads five CUDA builds of torch (39 GB of
virtualenvs). Tests run on one pytest-xdist worker per CPU. Without the matrix:
`nox -s lint core kernels kernels_newest_triton dynamo recipes tests hf integrations torchtitan`.

torch comes from PyPI, which serves its CUDA build on Linux (about 5 GB with its CUDA
libraries). pip reads its options from the environment and nox passes them on, so on a machine
without a GPU `PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu nox ...` installs the
CPU build instead (its version, `2.13.0+cpu`, satisfies `torch==2.13.0` and sorts above it).

Virtualenvs live outside the clone (`$QUANT_NOX_ENVDIR`, default `~/.cache/quant-nox`) and are
reused: third-party requirements are installed only when they change (a stamp file per venv), so a
warm run does not reinstall six torch builds. The project's own packages are installed editable
(the stamp records the clone's path), so a source change needs no reinstall and a new clone
reinstalls only them.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import sys

import nox

ROOT = pathlib.Path(__file__).resolve().parent
PACKAGES = ROOT / "packages"

nox.options.envdir = os.environ.get(
    "QUANT_NOX_ENVDIR", str(pathlib.Path.home() / ".cache" / "quant-nox")
)
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "core", "kernels", "kernels_newest_triton", "dynamo", "recipes",
                        "tests", "hf", "integrations", "torchtitan", "compat"]


def _skip_uv_probe() -> None:
    """These sessions use virtualenv. Without uv on PATH, nox still probes for it at the first
    session and logs "uv binary not found." on every run; say there is none before it looks
    (nox reads these module attributes, computed lazily, before probing)."""
    if shutil.which(os.environ.get("UV") or "uv") is not None:
        return
    import nox.virtualenv
    from packaging.version import Version

    nox.virtualenv.HAS_UV, nox.virtualenv.UV, nox.virtualenv.UV_VERSION = False, "uv", Version("0")


_skip_uv_probe()

#: torch for the main suite: the CPU build that lies on this machine's disk.
TEST_TORCH = "2.13.0"
#: Triton as on the H200 GPU machine, so interpreter and hardware see the same compiler.
TRITON = "3.6.0"
#: The newest Triton, which pip picks for quant-kernels (``triton>=3.4``) where no CUDA torch pins
#: one (a CPU-only machine): the kernels are tested through its interpreter too.
NEWEST_TRITON = "3.9.0"
#: Releases whose opaque-object API differs (docs/torch-versions.md).
#: TEST_TORCH is not among them: every other session runs it.
COMPAT_TORCH = ["2.9.1", "2.10.0", "2.11.0", "2.14.1", "2.15.0"]
#: What the compat sessions run on each release: the tests that touch the opaque-object API,
#: compile a module, or shard with DTensor (tensor parallelism, one recipe there:
#: ``QUANT_TEST_SCOPE=compat``); the rest of tests/recipes does not depend on the release.
COMPAT_TESTS = [
    "tests/compat", "tests/dynamo", "tests/recipes/test_compile.py",
    "tests/recipes/test_te_compile_sanity.py", "tests/recipes/test_lowered_linear.py",
    "tests/recipes/test_grouped_linear.py", "tests/recipes/test_grouped_fp8.py",
    "tests/recipes/test_moe_routes.py", "tests/recipes/test_grouped_routed_rows.py",
    "tests/recipes/test_grouped_backward_parts.py",
    "tests/recipes/test_tensor_parallel.py", "tests/recipes/test_step_weights.py",
    "tests/recipes/test_requantized_in_backward_compiled.py",
]
#: Releases that share their API generation with a newer one in COMPAT_TORCH (2.14 and 2.15:
#: ``custom_class``) run tests/compat only: the newest of the generation runs COMPAT_TESTS.
COMPAT_SAME_API = {"2.14.1"}
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2", "pytest-xdist>=3"]
#: pytest-xdist workers per session: one per CPU (``$QUANT_TEST_WORKERS`` overrides; 0 runs the
#: tests in the session's own process). The suite is Python-bound (compiles, the interpreter).
WORKERS = os.environ.get("QUANT_TEST_WORKERS", "auto")
#: Hugging Face Transformers for tests/hf only (never a runtime dependency).
TRANSFORMERS = "transformers==5.24.0"
#: The training frameworks of the integrations session, and compressed-tensors, which loads the
#: exported checkpoints there (test dependencies only).
INTEGRATIONS = ["accelerate==1.15.0", "peft==0.21.2", "lightning==2.6.6",
                "compressed-tensors==0.20.1"]
#: torchtitan for its session only: its model-config converters (0.3 and later). It imports
#: Triton (its expert-parallel kernels), which it does not declare.
TORCHTITAN = ["torchtitan==0.3.0", f"triton=={TRITON}"]
#: The Triton interpreter (TRITON_INTERPRET=1, how CI runs the kernels) imports numpy. Triton
#: 3.6's interpreter turns a loop bound into a Python int with ``int(array)``, which numpy 2.4
#: refuses for 1-element arrays: a runtime-bounded ``range`` (the GEMM K loops) needs numpy < 2.4.
INTERPRETER = ["numpy>=1.26,<2.4"]

#: PyTorch's index of CPU-only builds, and the pip settings that choose where packages come from.
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
PIP_SOURCES = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS")

# The machine's pip config caps torch at 2.14.1 through a constraints file; pointing
# PIP_CONSTRAINT at an empty file lifts the cap for one command (an empty value does not).
UNCAPPED = {"PIP_CONSTRAINT": os.devnull, "PIP_NO_CACHE_DIR": "1"}


def _require_cxx(session: nox.Session) -> None:
    """Stop with one clear line when no C++ compiler is on PATH: Inductor (torch.compile's code
    generator) builds C++ for the CPU, and without one the compile tests fail one by one."""
    candidates = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if not any(c and shutil.which(c) for c in candidates):
        session.error(
            "this session runs torch.compile on the CPU, which needs a C++ compiler: install "
            "g++ or clang++ (Debian/Ubuntu: apt install g++), or point CXX at one"
        )


def _cuda_torch_note(args: list[str]) -> str | None:
    """What to set when ``pip install *args`` is about to take torch's CUDA build from PyPI on a
    Linux machine without a GPU (no pip index or find-links set in the environment), or None."""
    torch = next((a for a in args if a.startswith("torch==")), None)
    if (torch is None or not sys.platform.startswith("linux") or shutil.which("nvidia-smi")
            or any(os.environ.get(v) for v in PIP_SOURCES)):
        return None
    return (f"{torch}: PyPI serves the CUDA build on Linux (about 5 GB with its CUDA libraries). "
            f"No GPU here: for the CPU build, run nox with PIP_EXTRA_INDEX_URL={CPU_TORCH_INDEX} "
            "(unless your pip configuration already names an index)")


def _stamp_install(session: nox.Session, name: str, args: list[str], env=None) -> None:
    """Run ``pip install *args`` unless this venv's stamp ``name`` records exactly these args."""
    key = json.dumps(args)
    for arg in args:  # local packages: their metadata and location are part of the key
        path = pathlib.Path(arg)
        if (path / "pyproject.toml").is_file():
            key += str(path.resolve()) + hashlib.sha256(
                (path / "pyproject.toml").read_bytes()
            ).hexdigest()
    stamp = pathlib.Path(session.virtualenv.location) / f".quant-stamp-{name}"
    if stamp.is_file() and stamp.read_text() == key:
        session.log(f"{name}: requirements unchanged, not reinstalling")
        return
    note = _cuda_torch_note(args)
    if note is not None:
        session.log(note)
    if NO_ISOLATION in args:  # the build backend the editable installs then take from the venv
        session.install(*BUILD, env=env)
    session.install(*args, env=env)
    stamp.write_text(key)


def _pkg(name: str) -> str:
    return str(PACKAGES / name)


#: The project's build backend and what its editable builds need. Editable installs build with
#: the venv's copy (``--no-build-isolation``): pip's default builds each package in a fresh
#: environment of its own, about 8 s per package in every session of a new clone.
BUILD = ["hatchling>=1.21", "editables>=0.3"]
NO_ISOLATION = "--no-build-isolation"


def _editable(*names: str) -> list[str]:
    """pip's arguments installing the named packages of ``packages/`` editable."""
    args: list[str] = [NO_ISOLATION]
    for name in names:
        args += ["-e", _pkg(name)]
    return args


#: The sessions without numpy (core, dynamo, recipes, compat) need none; torch still warns that
#: it could not load it, once per process: noise, silenced where the tests import torch.
QUIET = ["-W", "ignore:Failed to initialize NumPy"]


def _pytest(session: nox.Session, *paths: str, env=None) -> None:
    session.run(
        "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", WORKERS, *QUIET, *paths,
        *session.posargs, env=env,
    )


def _assert_absent(session: nox.Session, *modules: str) -> None:
    """Prove the isolation: the given modules must not be importable in this venv."""
    code = (
        "import importlib.util, sys; "
        f"found = [m for m in {list(modules)!r} if importlib.util.find_spec(m)]; "
        "sys.exit('unexpectedly installed: ' + ', '.join(found) if found else 0)"
    )
    session.run("python", "-c", code)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff over the whole repository (config in ruff.toml)."""
    _stamp_install(session, "tools", ["ruff==0.15.*"])
    session.run("ruff", "check", ".")


@nox.session(python="3.11")
def core(session: nox.Session) -> None:
    """quant-core alone: torch and nothing else (no triton, no other quant package)."""
    _stamp_install(session, "deps", [f"torch=={TEST_TORCH}", *TEST_TOOLS])
    _stamp_install(session, "local", _editable("quant-core"))
    _assert_absent(session, "triton", "quant_kernels", "quant_dynamo", "quant_recipes")
    _pytest(session, "tests/core")


@nox.session(python="3.11")
def kernels(session: nox.Session) -> None:
    """quant-kernels with quant-core, through the Triton interpreter on the CPU."""
    _stamp_install(
        session, "deps", [f"torch=={TEST_TORCH}", f"triton=={TRITON}", *INTERPRETER, *TEST_TOOLS]
    )
    _stamp_install(session, "local", _editable("quant-core", "quant-kernels"))
    _assert_absent(session, "quant_dynamo", "quant_recipes")
    _pytest(session, "tests/kernels", env={"TRITON_INTERPRET": "1"})


@nox.session(python="3.11")
def kernels_newest_triton(session: nox.Session) -> None:
    """The kernels session with the newest Triton, which pip picks where no CUDA torch pins one.

    NEWEST_TRITON is that release; the kernels session has the GPU machine's (TRITON)."""
    _stamp_install(
        session, "deps",
        [f"torch=={TEST_TORCH}", f"triton=={NEWEST_TRITON}", *INTERPRETER, *TEST_TOOLS],
    )
    _stamp_install(session, "local", _editable("quant-core", "quant-kernels"))
    _pytest(session, "tests/kernels", env={"TRITON_INTERPRET": "1"})


@nox.session(python="3.11")
def dynamo(session: nox.Session) -> None:
    """quant-dynamo with quant-core only."""
    _require_cxx(session)
    _stamp_install(session, "deps", [f"torch=={TEST_TORCH}", *TEST_TOOLS])
    _stamp_install(session, "local", _editable("quant-core", "quant-dynamo"))
    _assert_absent(session, "triton", "quant_kernels", "quant_recipes")
    _pytest(session, "tests/dynamo")


@nox.session(python="3.11")
def recipes(session: nox.Session) -> None:
    """quant-recipes with quant-core only (compile tests needing quant-dynamo skip here)."""
    _stamp_install(session, "deps", [f"torch=={TEST_TORCH}", *TEST_TOOLS])
    _stamp_install(session, "local", _editable("quant-core", "quant-recipes"))
    _assert_absent(session, "triton", "quant_kernels", "quant_dynamo")
    _pytest(session, "tests/recipes")


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The suite on torch 2.13 with all four packages, kernels through the Triton interpreter.

    Less tests/core and tests/kernels: they import only quant-core and quant-kernels, whose
    sessions run them with the same torch and Triton (installing the others changes nothing they
    run)."""
    _require_cxx(session)
    _stamp_install(
        session, "deps",
        [f"torch=={TEST_TORCH}", f"triton=={TRITON}", "matplotlib>=3.7", *INTERPRETER,
         *TEST_TOOLS],
    )
    _stamp_install(
        session, "local",
        _editable("quant-core", "quant-kernels", "quant-dynamo", "quant-recipes"),
    )
    _pytest(session, "tests", "--ignore=tests/core", "--ignore=tests/kernels",
            env={"TRITON_INTERPRET": "1"})


@nox.session(python="3.11")
def hf(session: nox.Session) -> None:
    """Hugging Face Llama and MoE models converted, trained eagerly and compiled (tests/hf).

    transformers is a test dependency of this session only."""
    _require_cxx(session)
    _stamp_install(session, "deps", [f"torch=={TEST_TORCH}", TRANSFORMERS, *TEST_TOOLS])
    _stamp_install(session, "local", _editable("quant-core", "quant-dynamo", "quant-recipes"))
    _pytest(session, "tests/hf")


@nox.session(python="3.11")
def integrations(session: nox.Session) -> None:
    """Training frameworks: HF Trainer (accelerate), PEFT and Lightning, with the README snippets.

    tests/integrations, and the README's snippets for them; the frameworks' packages are test
    dependencies of this session only."""
    _require_cxx(session)  # the README's first snippet compiles with Inductor
    _stamp_install(session, "deps",
                   [f"torch=={TEST_TORCH}", TRANSFORMERS, *INTEGRATIONS, *TEST_TOOLS])
    _stamp_install(session, "local", _editable("quant-core", "quant-dynamo", "quant-recipes"))
    _pytest(session, "tests/integrations", "tests/test_readme.py")


@nox.session(python="3.11")
def torchtitan(session: nox.Session) -> None:
    """torchtitan's Llama 3 debug model with quant's config converter, built and trained on the CPU.

    torchtitan is a test dependency of this session only."""
    _require_cxx(session)  # FlexAttention compiles with Inductor on the CPU
    _stamp_install(session, "deps", [f"torch=={TEST_TORCH}", *TORCHTITAN, *TEST_TOOLS])
    _stamp_install(session, "local", _editable("quant-core", "quant-dynamo", "quant-recipes"))
    _pytest(session, "tests/integrations/test_torchtitan.py",
            env={"QUANT_TORCHTITAN_SESSION": "1"})


@nox.session(python="3.11")
@nox.parametrize("torch", COMPAT_TORCH)
def compat(session: nox.Session, torch: str) -> None:
    """The tests that depend on the torch release, on one release (PyPI's build).

    COMPAT_TESTS; tests/compat alone on a release of COMPAT_SAME_API."""
    _require_cxx(session)
    _stamp_install(session, "deps", [f"torch=={torch}", *TEST_TOOLS], env=UNCAPPED)
    _stamp_install(
        session, "local", _editable("quant-core", "quant-dynamo", "quant-recipes"), env=UNCAPPED
    )
    session.run("python", *QUIET, "-c", "import torch; print('torch', torch.__version__)")
    _pytest(
        session, *(["tests/compat"] if torch in COMPAT_SAME_API else COMPAT_TESTS),
        env={"QUANT_EXPECT_TORCH": torch, "QUANT_TEST_SCOPE": "compat"},
    )


def _demo_option(args: list[str], flag: str) -> str | None:
    """The value ``quant demo args`` gives ``flag`` (``--flag value`` or ``--flag=value``)."""
    flat = " ".join(args).replace("=", " ").split()
    return flat[flat.index(flag) + 1] if flag in flat[:-1] else None


def _demo_on_gpu(args: list[str]) -> bool:
    """Whether ``quant demo args`` runs on a GPU: ``--device cuda``, or ``auto`` (the default)
    where ``nvidia-smi`` is on PATH."""
    device = _demo_option(args, "--device") or "auto"
    return device.startswith("cuda") or (device == "auto" and bool(shutil.which("nvidia-smi")))


def _demo_uses_inductor(args: list[str]) -> bool:
    """Whether ``quant demo args`` compiles with Inductor (``--compile-backend inductor``, or
    the default on a GPU), which builds code with a compiler."""
    if "--no-compile" in " ".join(args).split():
        return False
    backend = _demo_option(args, "--compile-backend")
    if backend is not None:
        return backend == "inductor"
    return _demo_on_gpu(args)


def _demo_requirements(args: list[str]) -> tuple[list[str], list[str]]:
    """``(third-party requirements, quant packages)`` of ``quant demo args``. The Triton kernels
    (quant-kernels, Triton) run on CUDA only: on the CPU every recipe runs the pure-torch
    reference, so neither is installed there."""
    gpu = _demo_on_gpu(args)
    deps = [f"torch=={TEST_TORCH}", *([f"triton=={TRITON}"] if gpu else []), "matplotlib>=3.7"]
    local = ["quant-core", *(["quant-kernels"] if gpu else []), "quant-dynamo", "quant-recipes"]
    return deps, local


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The main job: `quant demo` with its defaults (a small model trained under every recipe).

    It needs a C++ compiler only when the demo compiles with Inductor (`--compile-backend
    inductor`, or the default on a GPU); on a CPU it compiles with aot_eager, which generates
    no code. Triton and quant-kernels are installed only for a GPU, where they run."""
    if _demo_uses_inductor(session.posargs):
        _require_cxx(session)
    deps, local = _demo_requirements(session.posargs)
    _stamp_install(session, "deps", deps)
    _stamp_install(session, "local", _editable(*local))
    session.run("quant", "demo", *session.posargs)
