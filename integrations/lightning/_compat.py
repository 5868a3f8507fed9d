"""The installed Lightning: the unified `lightning` package, or the standalone
`pytorch_lightning` that older projects still pin. Every nvrx_lightning module takes
Lightning from here, so both work and a missing one is named once, with the fix."""

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        import pytorch_lightning as pl
    except ImportError:
        raise ImportError(
            "nvrx_lightning needs Lightning (lightning.pytorch or pytorch_lightning): "
            "pip install 'nvrx-suite[lightning]'"
        ) from None

from importlib import import_module

Callback = pl.Callback
Trainer = pl.Trainer
LightningModule = pl.LightningModule
EarlyStopping = pl.callbacks.EarlyStopping
Timer = pl.callbacks.Timer
CheckpointIO = import_module(pl.__name__ + ".plugins.io").CheckpointIO

__all__ = ["pl", "Callback", "Trainer", "LightningModule", "EarlyStopping", "Timer", "CheckpointIO"]
