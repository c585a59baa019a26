"""``quant export``: a trained Hugging Face checkpoint as a compressed-tensors FP8 checkpoint
(what vLLM serves).

It loads the checkpoint with transformers (``AutoModelForCausalLM``), converts it as training
did (:func:`~quant_recipes.convert` with the recipe; the default filter keeps output heads and
embeddings in high precision) and writes :func:`~quant_recipes.save_compressed_tensors`: the
weights are the bytes the recipe's weight quantizer makes of the trained weights, which are
the bytes training multiplied by (quantizing is a function of the weight alone). The
checkpoint's other files (tokenizer, generation config) are copied beside them.
"""

from __future__ import annotations

import pathlib
import shutil
import sys

import torch

#: Files of a checkpoint that the export writes itself or replaces: the weights and the config.
_WRITTEN = ("config.json", "model.safetensors")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")
_DTYPES = {"auto": "auto", "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float32": torch.float32}


def _fail(message: str) -> int:
    print(f"quant export: {message}", file=sys.stderr)
    return 2


def _copied(source: pathlib.Path, out: pathlib.Path) -> list[str]:
    """Copy the checkpoint's files other than weights and the config (tokenizer, generation
    config, chat template) into ``out``; their names."""
    names = []
    for path in sorted(source.iterdir()):
        if (path.is_file() and path.name not in _WRITTEN and not path.name.endswith(".index.json")
                and not path.name.endswith(_WEIGHT_SUFFIXES)):
            shutil.copy2(path, out / path.name)
            names.append(path.name)
    return names


def run_export(args) -> int:
    """``quant export SOURCE OUT --recipe NAME``: 0 on success, 2 with a message on stderr."""
    from ..convert import convert
    from ..export import save_compressed_tensors
    from ..recipe_names import recipe

    source, out = pathlib.Path(args.source), pathlib.Path(args.out)
    if not (source / "config.json").is_file():
        return _fail(f"{source} is not a Hugging Face checkpoint directory (no config.json)")
    if out.resolve() == source.resolve():
        return _fail("OUT must be another directory than SOURCE")
    if (out / "model.safetensors").exists() and not args.overwrite:
        return _fail(f"{out} already holds model.safetensors; pass --overwrite to replace it")
    try:
        chosen = recipe(args.recipe)
    except ValueError as e:
        return _fail(str(e))
    try:
        import transformers
    except ImportError:
        return _fail("reading a Hugging Face checkpoint needs transformers "
                     "(pip install transformers safetensors)")
    print(f"loading {source} ...", flush=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=_DTYPES[args.dtype])
    convert(model, recipe=chosen)
    try:
        config = save_compressed_tensors(model, out, chosen, per_channel=args.per_channel)
    except ValueError as e:
        return _fail(str(e))
    copied = _copied(source, out)
    layers = sum(len(g["targets"]) for g in config["config_groups"].values())
    print(f"wrote {out / 'model.safetensors'} and {out / 'config.json'} "
          f"({type(chosen).__name__}, {len(config['config_groups'])} scheme(s), "
          f"{layers if layers > 1 else 'every Linear'} target(s)); copied {len(copied)} other "
          f"file(s){': ' + ', '.join(copied) if copied else ''}")
    return 0
