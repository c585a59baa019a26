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
    module = _fit([QuantPrecision("mxfp8")])
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
