"""Hugging Face `Trainer` checkpointing through tierckpt: one callback, one resume call.

A tiny GPT-2 built from a config (nothing downloaded) learns 64 fixed token
sequences on the CPU. Every `--save-steps` steps the `Trainer` writes
`<output-dir>/checkpoint-N`; `TierckptCallback` registers it once written
(the agent uploads it in the background), even though `save_total_limit`
deletes older directories right away. On start, `latest_checkpoint` brings
the latest valid checkpoint back to `<output-dir>/checkpoint-N`, verified
(None on a fresh start), and the `Trainer` resumes from it.

    python examples/hf_train.py --server http://127.0.0.1:8470 --run gpt2-tiny \\
        --output-dir /ssd/hf/gpt2-tiny --steps 6

`--output-dir` must lie under the agent's `[local].roots`. Prints one JSON line
at the end: {"event": "done", "step", "resumed_from"}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from tierckpt.client import CheckpointClient
from tierckpt.client.hf import TierckptCallback, latest_checkpoint


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """64 fixed sequences of 16 tokens (the Trainer shuffles them, seeded)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens}


def make_trainer(
    output_dir: Path, callbacks: list[Any], *, steps: int = 6, save_steps: int = 2, seed: int = 0
) -> Trainer:
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        save_steps=save_steps,
        save_total_limit=1,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    return Trainer(
        model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(), callbacks=callbacks
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="http://127.0.0.1:8470")
    parser.add_argument("--run", required=True)
    parser.add_argument("--output-dir", required=True, help="under the agent's [local].roots")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--node", default=None, help="this node's name as the agent knows it")
    options = parser.parse_args(argv)
    output = Path(options.output_dir)
    with CheckpointClient(options.server) as client:
        resume = latest_checkpoint(client, options.run, output, node=options.node)
        callback = TierckptCallback(client, options.run)
        trainer = make_trainer(
            output, [callback], steps=options.steps, save_steps=options.save_steps
        )
        trainer.train(resume_from_checkpoint=resume)
        resumed_from = None if resume is None else int(Path(resume).name.split("-")[1])
        print(
            json.dumps(
                {"event": "done", "step": trainer.state.global_step, "resumed_from": resumed_from}
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
