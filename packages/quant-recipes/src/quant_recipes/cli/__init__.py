"""The ``quant`` command: ``quant demo`` (the main job), ``quant doctor`` and ``quant export``.

The package holds the command and what only it runs: :mod:`.demo` (with :mod:`.demo_gpt`, the
``--model gpt`` task), :mod:`.doctor` and :mod:`.export`. ``python -m quant_recipes.cli`` runs
it too."""

from __future__ import annotations

import argparse

#: ``torch.manual_seed`` takes a seed below 2^64; the demo derives seeds up to ``seed + 2``.
_MAX_SEED = 2**63 - 3


def _whole_number(low: int, high: int | None = None):
    """An argparse type: a whole number of at least ``low`` (and at most ``high``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if high is None and value < low:
            raise argparse.ArgumentTypeError(f"expected a number > {low - 1}, got {value}")
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected {low} to {high}, got {value}")
        return value

    return parse


_positive_int = _whole_number(1)
_seed = _whole_number(0, _MAX_SEED)


def build_parser() -> argparse.ArgumentParser:
    from .demo import DEFAULT_RECIPES, RECIPES

    parser = argparse.ArgumentParser(
        prog="quant", description="Low-precision training under torch.compile."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,doctor,export}")

    demo = sub.add_parser(
        "demo", help="train a small model under every recipe and compare the loss curves",
    )
    demo.add_argument("--model", choices=("mlp", "gpt"), default="mlp",
                      help="mlp: a 3-layer MLP learns a random teacher (fast); gpt: a small "
                      "transformer learns a generated character corpus, quantized with "
                      "convert() (e.g. --model gpt; default: %(default)s)")
    demo.add_argument("--steps", type=_positive_int, default=300,
                      help="training steps per recipe (e.g. --steps 100; default: %(default)s)")
    demo.add_argument(
        "--recipes", default=",".join(DEFAULT_RECIPES),
        help=f"comma-separated recipes to run, from: {', '.join(RECIPES)} "
        "(e.g. --recipes baseline,mxfp8; default: all)",
    )
    demo.add_argument(
        "--device", default="auto",
        help="cpu, cuda, cuda:N, or auto (e.g. --device cuda:1; default: auto, which is cuda "
        "when available)",
    )
    demo.add_argument("--out", default="quant-demo",
                      help="folder for the plot and results.json (e.g. --out /tmp/run1; "
                      "default: ./%(default)s)")
    demo.add_argument(
        "--no-compile", action="store_true",
        help="run eagerly, without torch.compile (e.g. to compare eager and compiled speed)",
    )
    demo.add_argument(
        "--compile-backend", default=None,
        help="torch.compile backend (e.g. --compile-backend inductor; default: inductor on "
        "CUDA, aot_eager on CPU)",
    )
    demo.add_argument("--batch", type=_positive_int, default=None,
                      help="batch size: rows for mlp, sequences for gpt (e.g. --batch 32; "
                      "default: 64 for mlp, 8 for gpt)")
    demo.add_argument("--seed", type=_seed, default=0,
                      help="seed for the data and the weights (e.g. --seed 1; default: "
                      "%(default)s)")
    demo.add_argument("--no-plot", action="store_true",
                      help="do not write the PNG plot (e.g. on a machine without matplotlib)")

    sub.add_parser("doctor", help="what this machine supports: versions, backends, formats")

    export = sub.add_parser(
        "export", help="a trained Hugging Face checkpoint as a compressed-tensors FP8 checkpoint "
        "(what vLLM serves)")
    export.add_argument("source", help="the trained checkpoint's directory (save_pretrained)")
    export.add_argument("out", help="the directory to write (e.g. ./model-fp8)")
    export.add_argument("--recipe", required=True,
                        help="the recipe the model trained under, by name: fp8_current "
                        "(per-tensor E4M3) or fp8_block (128x128 weight blocks), e.g. "
                        "--recipe fp8_block")
    export.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"),
                        default="auto", help="the dtype to load the checkpoint in, which the "
                        "unquantized tensors keep (default: %(default)s, the checkpoint's)")
    export.add_argument("--per-channel", action="store_true",
                        help="with fp8_current: write each per-tensor scale repeated per output "
                        "channel (compressed-tensors' channel strategy; the same bytes)")
    export.add_argument("--overwrite", action="store_true",
                        help="replace OUT's model.safetensors and config.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from .doctor import run_doctor

        return run_doctor()
    if args.command == "export":
        from .export import run_export

        return run_export(args)
    from .demo import run_demo

    return run_demo(args)


__all__ = ["build_parser", "main"]
