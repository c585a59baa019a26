"""A ``LightningModule`` trained by Lightning's own loop under ``QuantPrecision``."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch

pl = pytest.importorskip("lightning.pytorch")
from quant_recipes.lightning_precision import QuantPrecision  # noqa: E402


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                       torch.nn.Linear(64, 64), torch.nn.GELU(),
                                       torch.nn.Linear(64, 8))
        self.losses = []

    def training_step(self, batch, _):
        x, y = batch
        loss = (self.net(x) - y).float().pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=gen)
    ds = torch.utils.data.TensorDataset(x, x[:, :8] * 0.5)
    return torch.utils.data.DataLoader(ds, batch_size=32)


def _fit(plugins):
    module = Regressor()
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", devices=1, plugins=plugins,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, _data())
    return module


def test_lightning_trains_under_the_plugin_with_quantized_gemms():
    qr.reset_gemm_paths()
    module = _fit([QuantPrecision("mxfp8", weights_dtype=torch.float32)])
    net = module.net
    assert [type(m) for m in net][::2] == [qr.Linear, qr.Linear, torch.nn.Linear]
    assert sum(qr.gemm_paths().values()) == 6 * (2 + 3)  # every step's GEMMs ran quantized
    assert len(module.losses) == 6 and module.losses[-1] < module.losses[0]
    # the same steps as quant's own loop: the same losses, bit for bit
    ref = Regressor()
    qr.convert(ref.net)
    opt = ref.configure_optimizers()
    losses = []
    for x, y in list(_data())[:6]:
        with qr.autocast(recipe=qr.MXFP8BlockScaling()):
            loss = (ref.net(x) - y).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses == module.losses


def test_the_plugin_takes_a_recipe_object_and_leaves_quant_layers_alone():
    plugin = QuantPrecision(qr.Float8CurrentScaling())
    model = torch.nn.Sequential(qr.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    plugin.convert_module(model)
    assert type(model[1]) is torch.nn.Linear  # already holds quant layers: not converted
    with plugin.forward_context():
        assert qr.current_frame().recipe == qr.Float8CurrentScaling()


class Evaluated(Regressor):
    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", (self.net(x) - y).float().pow(2).mean())

    def test_step(self, batch, _):
        x, y = batch
        self.log("test_loss", (self.net(x) - y).float().pow(2).mean())

    def predict_step(self, batch, _):
        return self.net(batch[0])


def test_validate_test_and_predict_run_under_lightnings_inference_mode():
    """Lightning runs them under ``torch.inference_mode()`` by default: every activation is an
    inference tensor."""
    module = Evaluated()
    qr.convert(module.net)
    assert type(module.net[2]) is qr.Linear  # reads the GELU's output
    plugin = QuantPrecision("mxfp8", weights_dtype=torch.float32)
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, inference_mode=True)
    qr.reset_gemm_paths()
    assert "val_loss" in trainer.validate(module, _data())[0]
    assert "test_loss" in trainer.test(module, _data())[0]
    got = trainer.predict(module, _data())
    assert sum(qr.gemm_paths().values()) == 3 * 8 * 2  # three passes, 8 batches, 2 layers
    with torch.no_grad(), qr.autocast(recipe=qr.MXFP8BlockScaling()):
        want = [module.net(x) for x, _ in _data()]
    assert all(a.is_inference() and torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _head_dtypes(module):
    dtypes = []
    module.net[4].register_forward_hook(lambda m, args, out: dtypes.append(out.dtype))
    return dtypes


class HeadWatched(Regressor):
    def setup(self, stage):
        self.head_dtypes = _head_dtypes(self)


def _fit_watched(plugin, module=None):
    module = module or HeadWatched()
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", devices=1, plugins=[plugin],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, _data())
    return module


def test_by_default_weights_and_the_layers_left_out_run_in_bf16():
    """As Lightning's TransformerEngine plugin: the weights cast to ``weights_dtype`` at setup,
    and a fallback ``torch.autocast`` for what quant leaves out; one plugin, no precision=."""
    qr.reset_gemm_paths()
    module = _fit_watched(QuantPrecision("mxfp8"))
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert sum(qr.gemm_paths().values()) == 6 * (2 + 3)
    assert module.head_dtypes == [torch.bfloat16] * 6
    assert module.losses[-1] < module.losses[0]


def test_fp32_master_weights_with_a_bf16_fallback_autocast_is_bf16_mixed():
    qr.reset_gemm_paths()
    plugin = QuantPrecision("mxfp8", weights_dtype=torch.float32,
                            fallback_compute_dtype=torch.bfloat16)
    module = _fit_watched(plugin)
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert type(module.net[0]) is qr.Linear
    assert sum(qr.gemm_paths().values()) == 6 * (2 + 3)
    assert module.head_dtypes == [torch.bfloat16] * 6  # the fp32 head under the fallback
    assert module.losses[-1] < module.losses[0]


def test_nvfp4_trains_an_fp32_model_cast_to_the_weights_dtype():
    qr.reset_gemm_paths()
    module = _fit_watched(QuantPrecision("nvfp4"))  # the module is built in fp32
    assert type(module.net[0]) is qr.Linear
    assert module.net[0].weight.dtype == torch.bfloat16
    assert sum(qr.gemm_paths().values()) == 6 * (2 + 3)
    assert all(torch.isfinite(torch.tensor(module.losses)))


def test_a_weights_dtype_the_recipe_cannot_take_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"QuantPrecision: weights_dtype=torch.float32 .*"
                                         r"NVFP4BlockScaling"):
        QuantPrecision("nvfp4", weights_dtype=torch.float32)
    QuantPrecision("nvfp4", weights_dtype=torch.float32, disable_rht=True)
    with pytest.raises(TypeError, match="weights_dtype must be a floating torch.dtype"):
        QuantPrecision("mxfp8", weights_dtype="bf16")
