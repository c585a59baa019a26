"""The ``quant`` command: ``demo`` with tiny settings, ``doctor``, and errors for bad options."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from quant_recipes.cli import main

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
HAVE_DYNAMO = importlib.util.find_spec("quant_dynamo") is not None


def test_demo_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "3", "--recipes", "baseline,mxfp8", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if line.startswith("recipe"))
    for column in ("final loss", "vs base", "compiles", "breaks", "gemm"):
        assert column in header
    # on a CPU every quantized GEMM is emulated: no speed column, and a line that says why
    assert "ms/step" not in header and "no speed on a CPU" in text
    assert "mxfp8: " in text and "expected of FP8 values at this size" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.split() and line.split()[0] in ("baseline", "mxfp8")}
    assert set(rows) == {"baseline", "mxfp8"}
    assert "emulated" in rows["mxfp8"]  # MXFP8 GEMMs are emulated on the CPU
    results = json.loads((out / "results.json").read_text())
    runs = {r["recipe"]: r for r in results["runs"]}
    assert len(runs["mxfp8"]["losses"]) == 3
    assert runs["mxfp8"]["note"] == ""  # compiled (or eager without quant-dynamo), no fallback
    if HAVE_DYNAMO:
        import quant_dynamo

        if quant_dynamo.status()["mode"] != "none":  # fullgraph=True: one graph, no break
            assert runs["mxfp8"]["compiles"] == 1 and runs["mxfp8"]["graph_breaks"] == 0
        else:  # torch 2.9: compiled through graph breaks, which the table reports
            assert runs["mxfp8"]["compiles"] >= 1
    assert (out / "loss_curves.png").exists() == HAVE_MATPLOTLIB


def test_demo_gpt_trains_a_converted_transformer(tmp_path, capsys):
    """``--model gpt`` converts a plain transformer and reports the validation loss (and
    tokens/s in results.json)."""
    argv = ["demo", "--model", "gpt", "--steps", "3", "--recipes", "baseline,fp8_current",
            "--out", str(tmp_path), "--no-plot", "--batch", "2"]
    assert main(argv) == 0
    header = next(line for line in capsys.readouterr().out.splitlines()
                  if line.startswith("recipe"))
    assert "val loss" in header and "tok/s" not in header  # a CPU: no speed
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["model"] == "gpt"
    runs = {r["recipe"]: r for r in results["runs"]}
    for run in runs.values():
        assert run["val_loss"] > 0 and run["tokens_per_s"] > 0 and len(run["losses"]) == 3
    assert runs["baseline"]["gemm_path"] == "-"
    assert runs["fp8_current"]["gemm_path"] != "-"  # convert() quantized the projections


def test_demo_help_gives_an_example_per_option():
    from quant_recipes.cli import build_parser

    parser = build_parser()
    demo = next(a for a in parser._actions if a.dest == "command").choices["demo"]
    options = [a for a in demo._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 10
    assert [a.option_strings[0] for a in options if "e.g." not in a.help] == []


def test_demo_without_compile(tmp_path, capsys):
    out = tmp_path / "eager"
    args = ["demo", "--steps", "2", "--recipes", "fp8_current", "--no-compile", "--no-plot",
            "--out", str(out)]
    assert main(args) == 0
    assert "compile: eager" in capsys.readouterr().out
    assert not (out / "loss_curves.png").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["demo", "--recipes", "bogus"], "unknown recipe.*bogus.*choose from"),
        (["demo", "--device", "tpu"], "--device must be"),
        # a trailing comma was accepted silently; mps and gpu got different
        # wordings; a missing cuda:N was reported as "cuda"
        (["demo", "--recipes", "mxfp8,"], "--recipes 'mxfp8,' has an empty entry"),
        (["demo", "--device", "gpu"], "--device must be cpu, cuda, cuda:N or auto, got 'gpu'"),
        (["demo", "--device", "mps"], "--device must be cpu, cuda, cuda:N or auto, got 'mps'"),
        (["demo", "--device", "cuda:7"], "--device cuda:7 was asked for"),
    ],
)
def test_demo_bad_values_are_named(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main([*argv, "--out", str(tmp_path)])


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "expected a number > 0, got 0"),
    # torch.manual_seed takes no seed of 2^64 or more: refused before any training
    (["--seed", "99999999999999999999"], "--seed: expected 0 to 9223372036854775805"),
])
def test_demo_bad_numbers_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_doctor_reports_versions_backends_and_formats(capsys):
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    for needle in ("torch", "compile API", "backends", "reference", "mxfp8", "nvfp4"):
        assert needle in text
    assert "emulated" in text
    assert "nvfp4 4over6" in text and "nvfp4 row-scaled" in text
    assert "GroupedLinear    one GEMM per group" in text  # the CPU: no torch._grouped_mm path
    assert "FP8 current scaling: one GEMM per group (no FP8 tensor cores here)" in text


def test_doctor_names_the_grouped_fp8_routes(monkeypatch):
    """Where torch's grouped kernel takes E4M3 (torch 2.11 on Hopper), doctor says which kernel
    takes which pair below the expert threshold and that the backend's grouped GEMM takes every
    pair from there on; where torch's does not run, the backend's takes every pair."""
    from quant_recipes.moe import fp8_gemm as grouped_fp8_gemm

    own = "the reference backend's grouped FP8 GEMM"
    monkeypatch.setattr(grouped_fp8_gemm, "SCALED_GROUPED_MM_DEVICES", {"cpu"})
    monkeypatch.setattr(grouped_fp8_gemm, "_runs", lambda d, dtype: dtype == torch.float8_e4m3fn)
    monkeypatch.setattr(grouped_fp8_gemm, "OWN_KERNEL_MIN_EXPERTS", 64)
    assert grouped_fp8_gemm.describe("cpu") == (
        "quantized once; under 64 experts torch._scaled_grouped_mm for E4M3 x E4M3 and "
        f"{own} for the rest, else {own}")
    monkeypatch.setattr(grouped_fp8_gemm, "CUBLAS_PER_GROUP", True)
    assert grouped_fp8_gemm.describe("cpu") == (
        "quantized once; under 64 experts torch._scaled_grouped_mm for E4M3 x E4M3 and cuBLAS "
        f"per group for the rest, else {own}")
    monkeypatch.setattr(grouped_fp8_gemm, "ROUTE", "scaled_grouped_mm")
    assert grouped_fp8_gemm.describe("cpu") == (
        "quantized once; torch._scaled_grouped_mm for E4M3 x E4M3, else cuBLAS per group under "
        f"64 experts, else {own}")
    monkeypatch.setattr(grouped_fp8_gemm, "OWN_KERNEL_MIN_EXPERTS", 0)
    assert grouped_fp8_gemm.describe("cpu") == (
        f"quantized once; torch._scaled_grouped_mm for E4M3 x E4M3, else {own}")
    monkeypatch.setattr(grouped_fp8_gemm, "ROUTE", "auto")
    assert grouped_fp8_gemm.describe("cpu") == f"quantized once; {own}"
    monkeypatch.setattr(grouped_fp8_gemm, "_runs", lambda d, dtype: False)
    monkeypatch.setattr(grouped_fp8_gemm, "OWN_KERNEL_MIN_EXPERTS", 64)
    assert grouped_fp8_gemm.describe("cpu") == (
        f"quantized once; cuBLAS per group under 64 experts, else {own}")


def test_doctor_says_whether_compiled_graphs_launch_the_kernels(capsys, monkeypatch):
    pytest.importorskip("quant_dynamo")
    from quant_dynamo import capture

    if not capture.supported():
        pytest.skip("this torch cannot record Triton launches")
    main(["doctor"])
    assert "kernels in graph yes on cuda" in capsys.readouterr().out
    monkeypatch.setenv("QUANT_LOWERING", "0")
    main(["doctor"])
    assert "kernels in graph no (QUANT_LOWERING=0)" in capsys.readouterr().out


def test_doctor_prints_the_gemm_routes_of_gemm_fast(capsys, monkeypatch):
    """Doctor's GEMM table is ``gemm_fast.routes``: every format of the dispatch table, with the
    route's path, what runs and its note, in the table's order; it restates nothing."""
    import torch
    from quant_recipes import gemm_fast
    from quant_recipes.cli import doctor

    for cap in (None, (8, 0), (9, 0)):  # the CPU, an A100's, an H100's capability
        monkeypatch.setattr(gemm_fast, "_cuda_capability",
                            lambda device, cap=cap: cap if device.type == "cuda" else None)
        device = "cpu" if cap is None else "cuda"
        lines = doctor.gemm_lines(device)
        routes = gemm_fast.routes(device)
        assert [r.format for r in routes] == list(gemm_fast._PATHS)
        rows = [line for line in lines[1:] if not line.startswith(" ")]
        assert [row.split()[:2] for row in rows] == [[r.format, r.path] for r in routes]
        for r in routes:
            assert any(r.runs in row for row in rows) and (not r.note or any(
                line.strip().endswith(r.note) for line in lines))
    monkeypatch.undo()
    assert main(["doctor"]) == 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert "\n".join(doctor.gemm_lines(device)) in capsys.readouterr().out


@pytest.mark.parametrize("where", ["a_file", "under_a_file", "proc"])
def test_demo_unusable_out_is_one_clear_line(tmp_path, where):
    """An --out that cannot be a folder (an existing file, a path under a
    file, a read-only system path) stops before training with one line and a non-zero exit."""
    (tmp_path / "f").write_text("x")
    out = {"a_file": tmp_path / "f", "under_a_file": tmp_path / "f" / "sub",
           "proc": "/proc/quant-nope"}[where]
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--steps", "1", "--recipes", "baseline", "--out", str(out)])
    assert str(exc.value).startswith("quant demo: --out ")
    assert "is not a writable folder" in str(exc.value)


def test_demo_one_step_writes_strict_json(tmp_path, capsys):
    """``--steps 1`` has no timed step (the first one compiles); results.json
    held a bare NaN (not JSON). Now it is null, and the table prints "-"."""
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "1", "--recipes", "baseline", "--out", str(out),
                 "--no-plot"]) == 0
    text = (out / "results.json").read_text()
    assert "NaN" not in text
    run = json.loads(text)["runs"][0]
    assert run["ms_per_step"] is None
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("baseline"))
    assert row.split()[5] == "-"


def test_demo_output_fits_an_80_column_terminal(tmp_path, capsys, monkeypatch):
    """At 80 columns the progress line (83) and the table (up to 105) wrapped."""
    monkeypatch.setenv("COLUMNS", "80")
    args = ["demo", "--steps", "3", "--recipes", "baseline,fp8_current,fp8_block,custom_mixed",
            "--no-plot", "--out", str(tmp_path)]
    assert main(args) == 0
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).splitlines()
    assert any(line.startswith("recipe") for line in lines)
    too_long = [line for line in lines if len(line) > 79 and not line.startswith(
        ("results:", "plot:"))]  # the paths are the user's
    assert not too_long


def test_progress_line_fits_a_narrow_terminal():
    import io

    from quant_recipes.cli.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    bar = Progress(total=4, stream=stream, columns=60)
    for step in range(4):
        bar.update("custom_mixed", step, 0.123456)
    bar.close()
    drawn = [chunk for chunk in stream.getvalue().split("\r") if chunk.strip()]
    assert drawn and all(len(chunk.rstrip("\n")) <= 59 for chunk in drawn)


def test_demo_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal
    for default in ("default: 300)", "default: all)", "default: auto", "default: 64 for mlp",
                    "default: 0)", "default: mlp)"):
        assert default in text
    assert "./quant-demo" in text


def test_no_plot_removes_a_plot_left_by_an_earlier_run(tmp_path):
    """``--no-plot`` left an old PNG beside a new results.json."""
    stale = tmp_path / "loss_curves.png"
    stale.write_bytes(b"an earlier run's plot")
    args = ["demo", "--steps", "1", "--recipes", "baseline", "--no-compile", "--no-plot",
            "--out", str(tmp_path)]
    assert main(args) == 0
    assert not stale.exists() and (tmp_path / "results.json").exists()


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="the plot needs matplotlib")
def test_plot_adds_a_panel_relative_to_the_baseline(tmp_path):
    """The absolute curves lie on top of each other; a second panel shows each
    recipe's loss over the baseline's (a 10-step trailing mean)."""
    import matplotlib.image
    from quant_recipes.cli.demo import RunResult, _plot, _smoothed

    assert _smoothed([1.0, 3.0, 5.0], window=2) == [1.0, 2.0, 4.0]
    runs = [RunResult(recipe="baseline", losses=[1.0, 0.5, 0.25]),
            RunResult(recipe="mxfp8", losses=[1.0, 0.55, 0.3])]
    two, one = tmp_path / "two.png", tmp_path / "one.png"
    assert _plot(runs, two, "t") and _plot(runs[1:], one, "t")
    height_two = matplotlib.image.imread(two).shape[0]
    height_one = matplotlib.image.imread(one).shape[0]
    assert height_two == 2 * height_one  # two panels of the same height


def test_demo_gemm_column_names_the_paths_of_lowered_gemms_too(monkeypatch):
    """A GEMM lowered into a compiled graph runs no Python per call; its path, recorded when the
    graph was traced, still reaches the table's gemm column."""
    from quant_recipes import gemm
    from quant_recipes.cli import demo

    gemm.reset_gemm_paths()
    assert demo._gemm_path() == "-"
    monkeypatch.setitem(gemm._COMPILED, "scaled_mm", 3)
    monkeypatch.setitem(gemm._PATHS, "emulated", 1)
    assert demo._gemm_path() == "scaled_mm,emulated"
    gemm.reset_gemm_paths()
    assert gemm.compiled_gemm_paths() == {} and demo._gemm_path() == "-"


def test_demo_warns_when_a_gpu_run_quantizes_on_the_reference():
    import torch
    from quant_recipes.cli import demo

    assert "quant-kernels" in demo._backend_note(torch.device("cuda"), "reference")
    assert demo._backend_note(torch.device("cuda"), "triton") is None
    assert demo._backend_note(torch.device("cpu"), "reference") is None


@pytest.mark.parametrize("value", ["bogus", "triton"])
def test_a_bad_quant_backend_is_one_line_in_doctor_and_demo(value, monkeypatch, capsys,
                                                            tmp_path):
    """``QUANT_BACKEND`` naming no backend, or one that cannot run on the CPU (Triton without
    ``TRITON_INTERPRET=1``), is named with the allowed values instead of a traceback."""
    monkeypatch.setenv("QUANT_BACKEND", value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from quant_core import backends

    backends._choice_cache.clear()
    assert main(["doctor"]) == 1
    line = next(t for t in capsys.readouterr().out.splitlines() if t.startswith("backend on CPU"))
    assert f"QUANT_BACKEND={value!r}" in line and "allowed on cpu: " in line
    assert "reference" in line.split("allowed on cpu: ")[1]
    with pytest.raises(SystemExit, match=f"quant demo: QUANT_BACKEND={value!r}"):
        main(["demo", "--steps", "1", "--recipes", "baseline", "--device", "cpu",
              "--out", str(tmp_path)])


def test_demo_refuses_an_unknown_compile_backend(tmp_path):
    pytest.importorskip("quant_dynamo")
    with pytest.raises(SystemExit, match="--compile-backend 'inductr' is not a torch.compile "
                                         "backend; allowed: .*inductor"):
        main(["demo", "--steps", "1", "--recipes", "baseline", "--compile-backend", "inductr",
              "--out", str(tmp_path)])
    assert not (tmp_path / "results.json").exists()


def test_demo_refuses_nvfp4_with_a_batch_it_cannot_take_before_training(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"recipe nvfp4 cannot quantize this run's 3 tokens per "
                                         r"step \(--batch 3\): input: .*multiple of 16"):
        main(["demo", "--steps", "1", "--recipes", "baseline,nvfp4", "--batch", "3",
              "--out", str(tmp_path), "--no-compile", "--no-plot"])
    assert not (tmp_path / "results.json").exists()  # refused up front: nothing trained


def test_demo_writes_what_finished_when_a_later_recipe_fails(tmp_path, monkeypatch):
    from quant_recipes.cli import demo

    real = demo.train_one

    def failing(name, *args, **kwargs):
        if name == "mxfp8":
            raise RuntimeError("a failure in the second recipe")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(demo, "train_one", failing)
    with pytest.raises(RuntimeError, match="second recipe"):
        main(["demo", "--steps", "2", "--recipes", "baseline,mxfp8", "--out", str(tmp_path),
              "--no-compile", "--no-plot"])
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["recipe"] for r in runs] == ["baseline"]


def test_doctor_names_the_lowered_form(capsys, monkeypatch):
    pytest.importorskip("quant_dynamo")
    from quant_dynamo import capture

    if not capture.supported():
        pytest.skip("this torch cannot record Triton launches")
    monkeypatch.delenv("QUANT_LOWERING", raising=False)
    main(["doctor"])
    assert ("rowwise casts as torch ops, columnwise copies as kernels (QUANT_LOWERING=mixed, "
            "the default)") in capsys.readouterr().out
    monkeypatch.setenv("QUANT_LOWERING", "ops")
    main(["doctor"])
    assert "FP8 current scaling as torch ops first (QUANT_LOWERING=ops)" in capsys.readouterr().out
    monkeypatch.setenv("QUANT_LOWERING", "kernels")
    main(["doctor"])
    assert "kernels only (QUANT_LOWERING=kernels)" in capsys.readouterr().out


def _run(recipe, losses):
    from quant_recipes.cli.demo import RunResult

    return RunResult(recipe=recipe, losses=losses, ms_per_step=2.0, tokens_per_s=10.0)


def test_the_demo_table_says_whether_each_gap_is_expected_and_shows_speed_off_the_cpu():
    from quant_recipes.cli.demo import format_table

    runs = [_run("baseline", [1.0] * 5), _run("fp8_current", [1.02] * 5), _run("mxfp8", [1.2] * 5),
            _run("nvfp4", [1.3] * 5)]
    text = format_table(runs, columns=200, speed=True)
    assert "ms/step" in text.splitlines()[0]
    assert "fp8_current: +2.0%, within the 5% expected of FP8 values at this size" in text
    assert "mxfp8: +20.0%, beyond the 5% expected" in text and "worth a look" in text
    assert "nvfp4: +30.0%, within the 50% expected of 4-bit values" in text
    assert "ms/step" not in format_table(runs, columns=200, speed=False).splitlines()[0]
