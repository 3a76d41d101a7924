"""The Lightning job of examples/lightning_train.py with a save that hangs
halfway: run as a module, a child tests/e2e/test_lightning.py SIGKILLs in the
middle of writing a checkpoint."""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from examples.lightning_train import Tiny, make_trainer
from tierckpt.client import CheckpointClient
from tierckpt.client.lightning import TierckptCheckpointIO

WRITING = "writing-half-a-checkpoint"


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
