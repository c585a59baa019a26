"""Model, layer and step construction shared by the benchmarks (speed.py, memory.py,
profiling.py): the configs (bf16, torchao 0.18's float8 peers, quant's recipes and their
variants), a compiled training step of one or more bias-free Linear layers, and a Hugging Face
Llama with its data."""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import sysconfig
import types
from unittest import mock

import torch


def register_triton() -> None:
    """Register quant-kernels' Triton backend: from source trees (``PYTHONPATH``) the entry point
    that registers it in an installed package is absent."""
    from quant_core import backends

    try:
        from quant_kernels.backend import BACKEND
    except ImportError:
        return
    backends.register(BACKEND)


def run_cli(doc: str, add_commands) -> None:
    """An entry point's command line: its docstring's first paragraph as the description, the
    rest as the epilog; ``add_commands(subparsers)`` adds the subcommands and returns
    ``{name: fn(args, parser)}``; the chosen one runs after quant_dynamo (compile support, before
    any quant module is traced) and the Triton backend are set up."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = add_commands(p.add_subparsers(dest="cmd", required=True, metavar="command"))
    args = p.parse_args()
    import quant_dynamo  # noqa: F401

    register_triton()
    commands[args.cmd](args, p)


def recipes() -> dict:
    """quant's recipe classes by config name."""
    import quant_recipes as qr

    return {"fp8_current": qr.Float8CurrentScaling, "fp8_block": qr.Float8BlockScaling,
            "mxfp8": qr.MXFP8BlockScaling, "nvfp4": qr.NVFP4BlockScaling}


OURS = ("fp8_current", "fp8_block", "mxfp8", "nvfp4")


class Unavailable(Exception):
    """A peer whose API is missing here."""


@contextlib.contextmanager
def quant_lowering(value: str):
    """``QUANT_LOWERING=value`` while the block compiles and runs (read when graphs are traced)."""
    old = os.environ.get("QUANT_LOWERING")
    os.environ["QUANT_LOWERING"] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ["QUANT_LOWERING"]
        else:
            os.environ["QUANT_LOWERING"] = old


# --- one Linear layer (or a stack of them): the step the step / host / profiling commands run

#: Linear-step configs: bf16, the torchao peers, ours; ``ao_fp8_blockwise_triton`` only on request.
LINEAR_PEERS = ("ao_fp8_tensorwise", "ao_fp8_rowwise", "ao_fp8_blockwise")
LINEAR_DEFAULT = ("bf16", *LINEAR_PEERS, *OURS)
LINEAR_ALL = (*LINEAR_DEFAULT, "ao_fp8_blockwise_triton")
#: ``<ours>:<variant>`` runs one of OURS differently, for an A/B inside one process: "opaque"
#: keeps the quant ops opaque (QUANT_LOWERING=0), "static" has Inductor launch the recorded
#: Triton kernels with its C launcher (static_launch_user_defined_triton_kernels), "requant"
#: quantizes the weight again in backward instead of saving its quantized copy.
LINEAR_VARIANTS = ("opaque", "static", "requant")


def plain_linear(w: torch.Tensor) -> torch.nn.Linear:
    n, k = w.shape
    lin = torch.nn.Linear(k, n, bias=False, dtype=w.dtype, device=w.device)
    with torch.no_grad():
        lin.weight.copy_(w)
    return lin


def torchao_linear(name: str, w: torch.Tensor) -> torch.nn.Module:
    """The torchao 0.18 module of peer ``name`` with weight ``w``: ``Float8Linear`` through
    ``convert_to_float8_training`` (tensorwise, rowwise) or the prototype
    ``Float8BlockwiseLinear`` (``F.scaled_mm``; its Triton GEMMs for ``..._triton``)."""
    try:
        if name in ("ao_fp8_tensorwise", "ao_fp8_rowwise"):
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            config = Float8LinearConfig.from_recipe_name(name.removeprefix("ao_fp8_"))
            return convert_to_float8_training(plain_linear(w), config=config)
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
    except (ImportError, AttributeError, AssertionError, ValueError) as e:
        raise Unavailable(f"{type(e).__name__}: {e}") from e
    mod = Float8BlockwiseLinear.from_float(plain_linear(w))
    mod.use_triton = name == "ao_fp8_blockwise_triton"
    return mod


def check_linear_config(name: str) -> bool:
    """Whether ``name`` is a known Linear-step config (``<ours>:<variant>`` included)."""
    base, _, kind = name.partition(":")
    return name in LINEAR_ALL or (base in OURS and kind in LINEAR_VARIANTS)


def _stack(make, layers: int) -> torch.nn.Module:
    return make() if layers == 1 else torch.nn.Sequential(*(make() for _ in range(layers)))


def build_linear(name: str, w: torch.Tensor, compile_: bool, mode: str = "default",
                 layers: int = 1):
    """``(module, compiled forward, eager forward)`` of config ``name`` (``mode``: torch.compile's
    mode, ``"default"`` or ``"reduce-overhead"``); ``layers > 1`` stacks that many layers, each
    with weight ``w`` (square). ``<ours>:requant`` quantizes the weight again in backward
    (``Linear(save_weight_copy=False)``) instead of saving its copy. Ours compile with
    ``fullgraph=True``, inside ``quant_recipes.autocast``."""
    import quant_recipes as qr

    name, _, kind = name.partition(":")
    if name in OURS:
        n, k = w.shape

        def make():
            layer = qr.Linear(k, n, bias=False, dtype=w.dtype, device=w.device,
                              save_weight_copy=kind != "requant")
            with torch.no_grad():
                layer.weight.copy_(w)
            return layer

        lin = _stack(make, layers)
        recipe = recipes()[name]()

        def fwd(x):
            with qr.autocast(recipe=recipe):
                return lin(x)

        fullgraph = True
    elif name == "bf16":
        lin = _stack(lambda: plain_linear(w), layers)
        fwd, fullgraph = lin, True
    else:
        lin = _stack(lambda: torchao_linear(name, w), layers)
        fwd, fullgraph = lin, False
    kw = {} if mode == "default" else {"mode": mode}
    return lin, (torch.compile(fwd, fullgraph=fullgraph, **kw) if compile_ else fwd), fwd


def step_inputs(m: int, k: int, n: int, device) -> tuple[torch.Tensor, ...]:
    """bf16 ``x [m, k]`` (requires grad), ``W [n, k]`` and ``g [m, n]``, seeded."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16).requires_grad_()
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device, torch.bfloat16)
    g = torch.randn(m, n, generator=gen).to(device, torch.bfloat16)
    return x, w, g


def make_step(name, x, w, g, compile_: bool = True, mode: str = "default", layers: int = 1):
    """``(step, clear, eager, params)`` of config ``name``: ``step()`` runs one training step
    ``y = x @ W.T; y.backward(g)`` (gradients cleared first; no optimizer), ``clear()`` drops the
    gradients, ``eager`` is the uncompiled forward."""
    lin, fwd, eager = build_linear(name, w, compile_, mode, layers)
    params = list(lin.parameters())
    graphs = mode == "reduce-overhead"

    def clear():
        x.grad = None
        for p in params:
            p.grad = None

    def step():
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        clear()
        fwd(x).backward(g)

    return step, clear, eager, params


def warm_square_step(name: str, n: int, device: torch.device, warmup: int,
                     mode: str = "default"):
    """:func:`make_step`'s step of config ``name`` for one ``n`` square layer, run ``warmup``
    times (compiling it) and synchronised: what the profilers then time or sample."""
    step = make_step(name, *step_inputs(n, n, n, device), mode=mode)[0]
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return step


@contextlib.contextmanager
def linear_variant(name: str):
    """The environment of Linear config ``name``'s variant while it compiles and runs."""
    kind = name.partition(":")[2]
    if kind == "opaque":
        with quant_lowering("0"):
            yield
    elif kind == "static":
        import torch._inductor.config as inductor_config

        with inductor_config.patch(static_launch_user_defined_triton_kernels=True):
            yield
    else:
        yield


# --- a Hugging Face Llama: what the model / saved commands run

#: name -> (hidden, MLP, heads, KV heads, vocab, layers, sequence, batch)
SIZES = {
    "8b": (4096, 14336, 32, 8, 128256, 8, 8192, 1),
    "1b": (2048, 8192, 32, 8, 128256, 16, 4096, 2),
    "tiny": (256, 512, 4, 2, 512, 2, 256, 2),
}
LLAMA_PEERS = ("ao_fp8_tensorwise", "ao_fp8_rowwise")
LLAMA_DEFAULT = ("bf16", *LLAMA_PEERS, *OURS)
#: ``@form`` suffix -> QUANT_LOWERING while the config compiles.
FORMS = {"ops": "ops", "kernels": "kernels", "opaque": "0", "mixed": "mixed"}
#: ``:variant`` suffix -> the ``Linear`` attributes set to False: which quantized copies backward
#: quantizes again instead of keeping them from forward (the other variants, the other tables
#: below and :data:`PATCH_VARIANTS`, set none: :func:`variants`).
LLAMA_VARIANTS = {"requant": ("save_weight_copy",), "requant_input": ("save_input_copy",),
                  "requant_all": ("save_weight_copy", "save_input_copy"), "split": (),
                  "weight_copy": (), "step_weights": (), "copies": ()}
#: ``:variant`` suffix -> the grouped layers' flags it sets to True (their defaults are False).
GROUPED_KEEPS = {"weight_copy": ("save_weight_copy",)}
#: ``:variant`` suffix -> the dense layers' flags it sets to True: ``copies`` keeps both
#: quantized copies from forward in compiled graphs too (FP8 current scaling's default there
#: quantizes both again in backward).
LINEAR_KEEPS = {"copies": ("save_weight_copy", "save_input_copy")}
#: ``:variant`` suffix -> the recipe fields it changes: ``split`` gives the forward GEMM the
#: split accumulator too (``fp8_gemm_fprop=MMParams(True)``; the default accumulates it fast).
RECIPE_VARIANTS = {"split": {"fp8_gemm_fprop": {"use_split_accumulator": True}}}


@contextlib.contextmanager
def routed_copy():
    """The experts' grouped layers without their in-place reads, for an A/B in one process:
    the routed rows gathered into a copy first (which backward keeps), and the FP8 grouped
    quantize's own amax pass (no row amaxes computed in the graph). Patched while a config
    compiles and runs (``:copy``)."""
    from quant_recipes.moe import linear
    from quant_recipes.moe.routes import gather_tokens

    project, row_amaxes = linear.GroupedProjection.project, linear._row_amaxes

    def gathering(self, x, offs, w, b, layouts=None, routes=None, param=None):
        x = x if routes is None else gather_tokens(x, routes)
        return project(self, x, offs, w, b, layouts, param=param)

    linear.GroupedProjection.project = gathering
    linear._row_amaxes = lambda t, traced, rows=None: None
    try:
        yield
    finally:
        linear.GroupedProjection.project, linear._row_amaxes = project, row_amaxes


@contextlib.contextmanager
def index_routes():
    """The experts' routes as autograd's index forms, for an A/B in one process (``:index``):
    the combine a gather and a sum over the routes (``y[copies].sum(1)``, its gradient a
    scatter), each token's input gradient autograd's scatter of its routed rows' (bf16 atomic
    adds on a GPU) instead of :func:`~quant_recipes.moe.routes.token_gradients`' fp32 sum."""
    from quant_recipes.moe import hf_experts, linear

    def combine(y, weights, routes):
        y = y * weights.reshape(-1)[routes.perm].unsqueeze(-1)
        return y[routes.copies].sum(dim=1)

    def scatter(d, copies):
        rows = torch.empty(copies.numel(), dtype=copies.dtype, device=copies.device)
        rows[copies.reshape(-1)] = torch.arange(copies.shape[0], device=copies.device
                                                ).repeat_interleave(copies.shape[1])
        return d.new_zeros(copies.shape[0], d.shape[1]).index_put((rows,), d, accumulate=True)

    saved = hf_experts.combine_routes, linear.token_gradients
    hf_experts.combine_routes, linear.token_gradients = combine, scatter
    try:
        yield
    finally:
        hf_experts.combine_routes, linear.token_gradients = saved


@contextlib.contextmanager
def whole_chunk_groups():
    """The FP8 current grouped layers' padded layout at 128 rows a group (``:chunks``): the
    weight-gradient kernel loads whole chunks from descriptors made on the host instead of
    one pair per program, for more zero padding in the transposed copies."""
    from quant_recipes.moe import fp8_gemm

    saved = fp8_gemm.TOKENS_GROUP_MULTIPLE
    fp8_gemm.TOKENS_GROUP_MULTIPLE = 128
    try:
        yield
    finally:
        fp8_gemm.TOKENS_GROUP_MULTIPLE = saved


@contextlib.contextmanager
def columns_first():
    """The grouped rows kernels' programs in their configs' order (column tile first) whatever
    the expert's bytes, in the one tile config (``:cols_first``;
    ``fp8_grouped_gemm.L2_EXPERT_BYTES`` lifted), as before the rules by expert size."""
    from quant_kernels import fp8_grouped_gemm

    with mock.patch.object(fp8_grouped_gemm, "L2_EXPERT_BYTES", 2**62):
        yield


@contextlib.contextmanager
def one_rows_tile():
    """The grouped FP8 rows kernels in one tile config, row tile first for every expert past
    ``L2_EXPERT_BYTES`` whatever its shape (``:one_rows_tile``), as before the long-contraction
    tiles."""
    from quant_kernels import fp8_grouped_gemm as kern

    def rows_first(n, k, element_size):
        return n * k * element_size > kern.L2_EXPERT_BYTES

    with mock.patch.object(kern, "rows_first", rows_first), \
            mock.patch.object(kern, "long_contraction", lambda n, k: False):
        yield


@contextlib.contextmanager
def whole_tiles():
    """The HYBRID grouped FP8 GEMMs' TMA tiles multiplied whole (``SPLIT`` 1, ``:whole_tiles``)
    where their configs split them in two halves of their columns, as before the halves."""
    with gpu_configs_with(("fp8_grouped_rows_gemm", "fp8_grouped_tokens_gemm"), SPLIT=1):
        yield


@contextlib.contextmanager
def gpu_configs_with(names, **changes):
    """The GPU tile configs of kernels ``names`` with ``changes`` over their settings."""
    from quant_kernels import configs

    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(configs.overridden(name, {**configs.TABLE[name]["gpu"],
                                                          **changes}))
        yield


@contextlib.contextmanager
def product_kernels():
    """Backward's columnwise copy of a pointwise product (a SwiGLU's) recorded as kernels, from
    an exact copy of the product, as every columnwise copy is (``:product_kernels``), instead of
    traced as ops that fuse into the product's backward kernel."""
    from quant_dynamo import capture

    with mock.patch.object(capture, "pointwise_of_products", lambda t: False):
        yield


@contextlib.contextmanager
def wgrad_columns_first():
    """The grouped contraction (weight-gradient) kernels' programs in their configs' order
    (sweeping ``b``) whatever the operands' bytes (``:wgrad_cols``;
    ``fp8_grouped_gemm.SWEPT_GROUP_BYTES`` lifted), as before that threshold."""
    from quant_kernels import fp8_grouped_gemm

    with mock.patch.object(fp8_grouped_gemm, "SWEPT_GROUP_BYTES", 2**62):
        yield


@contextlib.contextmanager
def descriptors_by_identity():
    """Host tensor descriptors keyed by the object, as before the direct launch path took them
    (``:desc_slow``): every grouped GEMM launch with descriptors takes Triton's own path, for an
    A/B in one process."""
    from quant_kernels import _launcher

    saved = _launcher._arg_key

    def key(a):
        return [a] if type(a) is _launcher.TensorDescriptor else saved(a)  # unhashable

    _launcher._arg_key = key
    try:
        yield
    finally:
        _launcher._arg_key = saved


@contextlib.contextmanager
def two_pass_experts():
    """FP8 current scaling's expert weights quantized by the amax pass and the cast apart, as
    before the one-pass kernel (``:two_pass``), for an A/B in one process."""
    from quant_kernels import fp8_grouped_experts

    saved = fp8_grouped_experts.ONE_PASS_EXPERT_BYTES
    fp8_grouped_experts.ONE_PASS_EXPERT_BYTES = 0
    try:
        yield
    finally:
        fp8_grouped_experts.ONE_PASS_EXPERT_BYTES = saved


#: ``:variant`` suffix -> a context the config compiles and runs in.
PATCH_VARIANTS = {"copy": routed_copy, "index": index_routes, "chunks": whole_chunk_groups,
                  "desc_slow": descriptors_by_identity, "cols_first": columns_first,
                  "wgrad_cols": wgrad_columns_first, "one_rows_tile": one_rows_tile,
                  "product_kernels": product_kernels, "two_pass": two_pass_experts,
                  "whole_tiles": whole_tiles}


def variants() -> list[str]:
    """Every ``:variant`` suffix a config may take."""
    return [*LLAMA_VARIANTS, *PATCH_VARIANTS]


def whole_step_patch(config: str):
    """The context of config ``config``'s ``:variant`` (:data:`PATCH_VARIANTS`; none: a null
    context), for a caller to hold over whole training steps: the model's forward holds it
    itself, and a variant whose code runs in backward too (an eager launch path, say) needs it
    held there as well."""
    return PATCH_VARIANTS.get(parse_llama_config(config)[1], contextlib.nullcontext)()


LLAMA_CONFIG_HELP = (
    "bf16; torchao ao_fp8_tensorwise, ao_fp8_rowwise; quant fp8_current, fp8_block, mxfp8, "
    "nvfp4, each with an optional :variant (requant: save_weight_copy=False, requant_input: "
    "save_input_copy=False, requant_all: both, split: fp8_gemm_fprop=MMParams(True), copy: the "
    "experts' routed rows gathered into a copy first, with the quantize's own amax pass; index: "
    "the experts' routes as autograd's index forms: the combine a sum over a gather, the "
    "tokens' gradient a scatter; weight_copy: the experts' grouped layers keep their weights' "
    "transposed FP8 copies for backward instead of casting them again; chunks: the FP8 "
    "current grouped layers' groups padded to 128 rows, whole chunks of the weight "
    "gradient's contraction loaded from descriptors made on the host; desc_slow: the grouped "
    "GEMMs' launches with host tensor descriptors through Triton's own launch path; "
    "cols_first: the grouped rows kernels' programs column tile first for experts of any size; "
    "wgrad_cols: the grouped weight-gradient kernels' programs sweeping b whatever its bytes; "
    "one_rows_tile: the grouped FP8 rows kernels in one tile config, row tile first for every "
    "expert past 32 MiB; product_kernels: backward's columnwise copy of a SwiGLU product "
    "recorded as kernels from an exact copy, as before such copies took the ops; "
    "copies: the dense layers keep both quantized copies from forward, compiled too; "
    "two_pass: FP8 current's expert weights quantized by an amax pass and a cast apart; "
    "whole_tiles: the HYBRID grouped FP8 GEMMs' tiles multiplied whole, not as two halves; "
    "step_weights: the "
    "Linear weights (and FP8 current's expert weights) quantized after each optimizer step "
    "and read by every forward, quantize_weights_per_step) and "
    "@form "
    "(ops: the reference's torch ops for Inductor to fuse, kernels: the recorded Triton "
    "kernels, opaque: opaque custom ops, mixed: the default, ops for rowwise casts and kernels "
    "for columnwise copies)")


#: Mixture-of-experts widths, name -> (hidden, expert width, experts, top-k, heads, KV heads,
#: head dim, vocab, layers, sequence, batch): Qwen3-30B-A3B's and Mixtral-8x7B's, 4 layers.
MOE_SIZES = {
    "qwen3-moe": (2048, 768, 128, 8, 32, 4, 128, 151936, 4, 4096, 2),
    "mixtral": (4096, 14336, 8, 2, 32, 8, 128, 32000, 4, 8192, 1),
    "tiny-moe": (128, 64, 8, 2, 4, 2, 32, 512, 2, 64, 2),
    # GPT-OSS-20B's widths: expert biases, weights stored [experts, in, out]
    "gpt-oss": (2880, 2880, 32, 4, 64, 8, 64, 201088, 4, 4096, 2),
    "tiny-gpt-oss": (128, 64, 8, 2, 4, 2, 32, 512, 2, 64, 2),
    "tiny-mixtral": (128, 256, 8, 2, 4, 2, 32, 512, 2, 64, 2),
}


def seq_batch(size: str) -> tuple[int, int]:
    """``(sequence, batch)`` of a Llama or mixture-of-experts size."""
    return (SIZES.get(size) or MOE_SIZES[size])[-2:]


def moe_model(size: str, device: torch.device, layers: int | None = None,
              kv_cache: bool = False):
    """The bf16 Hugging Face MoE model of ``size`` (:data:`MOE_SIZES`: ``Qwen3MoeForCausalLM``,
    ``MixtralForCausalLM`` or ``GptOssForCausalLM``) from a config, seeded, its experts on
    transformers' own ``grouped_mm`` implementation (``torch._grouped_mm``: the bf16
    baseline). GPT-OSS's expert biases, which transformers initialises to zero, are drawn at
    random, so that their gradients are not zero. ``kv_cache``: the config's ``use_cache``
    (see :func:`llama`)."""
    import transformers

    hidden, inter, experts, top_k, heads, kv, head_dim, vocab, n, _, _ = MOE_SIZES[size]
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers or n,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                  num_experts_per_tok=top_k, max_position_embeddings=8192,
                  tie_word_embeddings=False, experts_implementation="grouped_mm",
                  use_cache=kv_cache)
    if size.endswith("mixtral"):
        cfg = transformers.MixtralConfig(intermediate_size=inter, num_local_experts=experts,
                                         **common)
        cls = transformers.MixtralForCausalLM
    elif size.endswith("gpt-oss"):
        cfg = transformers.GptOssConfig(
            intermediate_size=inter, num_local_experts=experts, sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * ((layers or n) // 2)
            + ["sliding_attention"] * ((layers or n) % 2), **common)
        cls = transformers.GptOssForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(intermediate_size=4 * inter,
                                          moe_intermediate_size=inter, num_experts=experts,
                                          decoder_sparse_step=1, norm_topk_prob=True, **common)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg)
        for name, p in model.named_parameters():
            if name.endswith("_proj_bias") and p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
    return model.to(torch.bfloat16)


def llama(size: str, device: torch.device, layers: int | None = None, kv_cache: bool = False):
    """The bf16 ``LlamaForCausalLM`` of ``size`` from a config (random init, no download),
    seeded: every config starts from the same weights; ``layers`` decoder layers (default: the
    size's). ``kv_cache``: the config's ``use_cache``. A training forward with it builds a KV
    cache, whose per-layer state Dynamo guards on: each decoder layer compiled on its own is
    then traced again instead of reusing the first layer's compiled code."""
    import transformers

    hidden, mlp, heads, kv, vocab, n, _, _ = SIZES[size]
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
        num_hidden_layers=layers or n,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192,
        tie_word_embeddings=False, use_cache=kv_cache,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16)


def corpus(tokens: int) -> torch.Tensor:
    """``tokens`` byte values of this Python's standard-library sources (real text, present on
    every machine), as int64."""
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= tokens:
            break
    if len(data) < tokens:
        data = data * (tokens // max(len(data), 1) + 1)
    return torch.tensor(list(data[:tokens]), dtype=torch.int64)


def nested_regions(model) -> None:
    """Each decoder layer of ``model`` a nested compile region
    (``torch.compiler.nested_compile_region``): a whole-model compile traces and compiles the
    layer once and calls that code for every layer (hierarchical compilation)."""
    layers = model.model.layers
    region = torch.compiler.nested_compile_region(type(layers[0]).forward)
    for layer in layers:
        layer.forward = types.MethodType(region, layer)


def compiled_training(config: str, size: str, device: torch.device, layers: int | None = None,
                      kv_cache: bool = False, whole: bool = False, mode: str = "default",
                      regions: bool = False):
    """``(model, forward, optimizer)`` of the model benchmark: ``size``'s model (Llama or
    mixture of experts) with ``layers`` decoder layers, converted for ``config``
    (:func:`convert_llama`), every decoder layer compiled (per block, as torchtitan compiles),
    AdamW (fused on CUDA); ``kv_cache``: see :func:`llama`; ``whole``: the whole model compiled
    at once (``model.compile()``) instead, with ``regions`` each decoder layer a nested compile
    region (:func:`nested_regions`); ``mode``: torch.compile's (``"reduce-overhead"``:
    each compiled graph replayed as a CUDA graph). Call it inside :func:`llama_lowering` of
    ``config``."""
    model = (moe_model if size in MOE_SIZES else llama)(size, device, layers, kv_cache)
    forward = convert_llama(config, model)
    kw = {} if mode == "default" else {"mode": mode}
    if whole:
        if regions:
            nested_regions(model)
        model.compile(**kw)
    else:
        for layer in model.model.layers:
            layer.compile(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    return model, forward, opt


def batches(size: str, steps: int, device: torch.device) -> list[torch.Tensor]:
    """One ``[batch, seq]`` batch per step, consecutive windows of the corpus."""
    seq, batch = seq_batch(size)
    ids = corpus(steps * batch * seq).reshape(steps, batch, seq)
    return [ids[i].to(device) for i in range(steps)]


def parse_llama_config(config: str) -> tuple[str, str, str]:
    """``(name, variant, form)`` of ``name[:variant][@form]`` (either suffix first)."""
    match = re.fullmatch(r"([^:@]+)((?:[:@][^:@]+)*)", config)
    if match is None:
        raise ValueError(f"config {config!r}: expected name[:variant][@form]")
    name, variant, form = match.group(1), "", ""
    for marker, value in re.findall(r"([:@])([^:@]+)", match.group(2)):
        if marker == ":":
            variant = value
        else:
            form = value
    if form and form not in FORMS:
        raise ValueError(f"{config!r}: unknown form {form!r}; known: {', '.join(FORMS)}")
    if variant and variant not in variants():
        raise ValueError(f"{config!r}: unknown variant {variant!r}; known: "
                         f"{', '.join(variants())}")
    return name, variant, form


@contextlib.contextmanager
def llama_lowering(config: str):
    """``QUANT_LOWERING`` of config ``name@form`` while it compiles and runs."""
    form = parse_llama_config(config)[2]
    if not form:
        yield
        return
    with quant_lowering(FORMS[form]):
        yield


def convert_llama(config: str, model):
    """Convert ``model`` in place for ``config`` (the output head stays bf16: quant's
    ``convert`` default, torchao through its module filter); returns ``forward(ids) -> loss``
    (ours inside ``autocast``)."""
    name, variant, _ = parse_llama_config(config)
    if name in LLAMA_PEERS:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        ao = Float8LinearConfig.from_recipe_name(name.removeprefix("ao_fp8_"))
        convert_to_float8_training(model, config=ao,
                                   module_filter_fn=lambda m, fqn: "lm_head" not in fqn)
    elif name in OURS:
        import quant_recipes as qr

        recipe = qr.recipe(name, **RECIPE_VARIANTS.get(variant, {}))
        qr.convert(model, recipe=recipe)
        from quant_recipes.moe.linear import GroupedProjection

        for m in model.modules():
            if isinstance(m, (qr.Linear, GroupedProjection)):
                for attr in LLAMA_VARIANTS.get(variant, ()):
                    setattr(m, attr, False)
            if isinstance(m, GroupedProjection):
                for attr in GROUPED_KEEPS.get(variant, ()):
                    setattr(m, attr, True)
            elif isinstance(m, qr.Linear):
                for attr in LINEAR_KEEPS.get(variant, ()):
                    setattr(m, attr, True)

        if variant == "step_weights":  # held by quant until the model is gone
            qr.quantize_weights_per_step(model, recipe)
        patch = PATCH_VARIANTS.get(variant, contextlib.nullcontext)

        def forward(ids):
            with patch(), qr.autocast(recipe=recipe):
                return model(input_ids=ids, labels=ids).loss

        @contextlib.contextmanager
        def autocast():
            with patch(), qr.autocast(recipe=recipe):
                yield

        forward.autocast = autocast
        return forward
    elif name != "bf16":
        raise ValueError(f"unknown config {config!r}; known: {', '.join(LLAMA_DEFAULT)}")
    return lambda ids: model(input_ids=ids, labels=ids).loss
