"""A tiny, deterministic Lightning training job for tests/e2e/test_lightning.py,
and (run as a module) a child that is SIGKILLed in the middle of a save.

Two batches per epoch, no shuffling, Adam: a run resumed from an epoch-end
checkpoint reproduces the uninterrupted run bit for bit on CPU.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from tierckpt.client import CheckpointClient
from tierckpt.client.lightning import TierckptCheckpointIO

WRITING = "writing-half-a-checkpoint"


class Tiny(LightningModule):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layer = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(1234)
        x = torch.randn(8, 4, generator=generator)
        y = x.sum(dim=1, keepdim=True) ** 2
        return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


def make_trainer(io_plugin: TierckptCheckpointIO, workdir: Path, epochs: int) -> Trainer:
    """Saves at the end of every epoch (global_step 2, 4, ...), keeps the
    newest under Lightning's name plus last.ckpt (a second save per step)."""
    return Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(workdir),
        callbacks=[ModelCheckpoint(dirpath=str(workdir / "checkpoints"), save_last=True)],
        plugins=[io_plugin],
    )


class HangsMidSave(TierckptCheckpointIO):
    """Writes half of step ``hang_at``'s file, says so, and waits to be killed."""

    hang_at = -1

    def _dump(self, checkpoint: dict[str, Any], file: Path) -> None:
        if checkpoint["global_step"] != self.hang_at:
            return super()._dump(checkpoint, file)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getvalue()
        with open(file, "wb") as handle:
            handle.write(data[: len(data) // 2])
            handle.flush()
            os.fsync(handle.fileno())
        print(WRITING, flush=True)
        time.sleep(600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--hang-at", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=4)
    options = parser.parse_args()
    with CheckpointClient(options.server) as client:
        plugin = HangsMidSave(client, options.run, options.root, node=options.node)
        plugin.hang_at = options.hang_at
        make_trainer(plugin, Path(options.workdir), options.epochs).fit(Tiny())
    sys.exit(0)


if __name__ == "__main__":
    main()
