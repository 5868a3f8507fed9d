"""The tiny LightningModule and Trainer that the NVRxAsyncCheckpointIO tests and their
subprocess scripts train: CPU, deterministic data, SGD with momentum (so the optimizer has
state to save and restore), no logger or progress bar."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from nvrx_lightning._compat import LightningModule, Trainer, pl


class TinyModel(LightningModule):
    """Remembers where it started, so a test can see what a resume restored."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)
        self.start_step = None
        self.start_weights = None
        self.start_momentum = None

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.layer(x).pow(2).mean()

    def on_train_start(self):
        self.start_step = self.trainer.global_step
        self.start_weights = weights(self)
        self.start_momentum = momentum(self.trainer.optimizers[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        data = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data), batch_size=4)


def weights(module: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def momentum(optimizer: torch.optim.Optimizer) -> list:
    return [s["momentum_buffer"].clone() for s in optimizer.state.values() if "momentum_buffer" in s]


def make_trainer(dirpath: str, max_steps: int, io, every_n_train_steps: int = 2,
                 save_top_k: int = 2, save_last=True, **kwargs) -> Trainer:
    """A Trainer with the plugin and a ModelCheckpoint keeping the `save_top_k` newest steps."""
    checkpoint = pl.callbacks.ModelCheckpoint(
        dirpath=dirpath, every_n_train_steps=every_n_train_steps, save_top_k=save_top_k,
        monitor="step", mode="max", save_last=save_last)
    options = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=dirpath)
    options.update(kwargs)
    return Trainer(max_steps=max_steps, plugins=[io], callbacks=[checkpoint], **options)
