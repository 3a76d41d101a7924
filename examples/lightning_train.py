"""PyTorch Lightning checkpointing through tierckpt: one plugin, resume from the latest valid one.

A tiny regression model (two batches per epoch, no shuffling, Adam) trained
on the CPU, deterministically. `ModelCheckpoint` saves at every epoch end
through `TierckptCheckpointIO`: each save is written atomically under
`<root>/<run>/step-N/`, registered, and uploaded by the agent in the
background. On start, `ckpt_path=plugin.resume_path()` resumes from the latest
valid checkpoint (None on a fresh start), so a killed-and-restarted run ends
with the same weights as an uninterrupted one.

    python examples/lightning_train.py --server http://127.0.0.1:8470 --run tiny \\
        --root /ssd/ckpt --workdir /tmp/tiny --epochs 4

Prints one JSON line at the end: {"event": "done", "step", "resumed_from", "source"}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from tierckpt.client import CheckpointClient
from tierckpt.client.lightning import TierckptCheckpointIO


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


def make_trainer(plugin: TierckptCheckpointIO, workdir: Path, epochs: int) -> Trainer:
    """Saves at the end of every epoch (global_step 2, 4, ...): the newest
    under Lightning's name plus last.ckpt (a second save at the same step)."""
    return Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(workdir),
        callbacks=[ModelCheckpoint(dirpath=str(workdir / "checkpoints"), save_last=True)],
        plugins=[plugin],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="http://127.0.0.1:8470")
    parser.add_argument("--run", required=True)
    parser.add_argument("--root", required=True, help="under the agent's [local].roots")
    parser.add_argument("--workdir", required=True, help="Lightning's default_root_dir")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--node", default=None, help="this node's name as the agent knows it")
    options = parser.parse_args(argv)
    with CheckpointClient(options.server) as client:
        plugin = TierckptCheckpointIO(client, options.run, options.root, node=options.node)
        trainer = make_trainer(plugin, Path(options.workdir), options.epochs)
        trainer.fit(Tiny(), ckpt_path=plugin.resume_path())
        restored = plugin.restored
        print(
            json.dumps(
                {
                    "event": "done",
                    "step": trainer.global_step,
                    "resumed_from": None if restored is None else restored.step,
                    "source": None if restored is None else restored.source,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
