"""A plain PyTorch training loop that checkpoints through tierckpt and resumes exactly.

A small MLP classifier (dropout, AdamW, cosine LR schedule) learns a synthetic
dataset (fixed seed) on the CPU, deterministically. Every `--every` steps
`TorchCheckpointer` writes the whole training state — model, optimizer,
scheduler, data-loader position, every RNG — to the local "SSD" root
(`<root>/<run>/step-<N>/`) and registers it with the agent; the upload runs in
the background. On start it asks the agent for the latest valid checkpoint and
continues from it (the T0 copy when this node still holds it, else a verified
download), so a killed-and-restarted run ends with the same weights, bit for
bit, as an uninterrupted one.

A `PreemptionGuard` traps SIGTERM/SIGUSR1 and, with `--notice-url`, polls a
spot-termination notice (AWS or GCP metadata format). On a notice the loop
finishes its step, saves with priority "urgent" (uploaded before normal work
already queued), waits up to `--urgent-wait` seconds for it to be durable, and
exits 0.

Events go to stdout, one JSON object per line, for drivers (examples/demo.py,
the e2e tests): start, fresh | resumed, [step], checkpoint, preempted, done.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from tierckpt.client import CheckpointClient
from tierckpt.client.preemption import PreemptionGuard
from tierckpt.client.torch import ResumableLoader, TorchCheckpointer, default_node

DATA_SEED = 20240611  # the dataset is the same for every run and every resume
FEATURES, CLASSES, SAMPLES = 32, 4, 768


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}, sort_keys=True), flush=True)


def make_dataset() -> TensorDataset:
    """Labels from a hidden random teacher network: learnable, not trivial."""
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    y = (torch.tanh(x @ teacher) + 0.3 * torch.randn(SAMPLES, CLASSES, generator=g)).argmax(1)
    return TensorDataset(x, y)


def make_model(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, width),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),  # draws from torch's global RNG: a resume must restore it
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, CLASSES),
    )


def weights_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def forever(loader: ResumableLoader[Any]) -> Iterator[Any]:
    while True:
        yield from loader


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server",
        default=os.environ.get("TIERCKPT_URL", "http://127.0.0.1:8470"),
        help="tierckpt agent URL (default: $TIERCKPT_URL, else http://127.0.0.1:8470)",
    )
    parser.add_argument("--run", default="torch-demo", help="run name")
    parser.add_argument("--root", required=True, type=Path, help="local checkpoint root")
    parser.add_argument("--steps", type=int, default=100, help="total training steps")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--width", type=int, default=64, help="hidden width of the MLP")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0, help="seed of init, dropout and shuffling")
    parser.add_argument("--node", default=None, help="this node's name at the agent")
    parser.add_argument("--notice-url", help="spot-termination notice URL to poll (AWS or GCP)")
    parser.add_argument("--notice-poll", type=float, default=5.0, help="seconds between polls")
    parser.add_argument(
        "--urgent-wait", type=float, default=60.0, help="seconds to wait for the urgent save"
    )
    parser.add_argument(
        "--staging",
        choices=("memory", "disk"),
        default=None,
        help="where save() puts the state before it returns (default: the agent's "
        "memory tier when it has one, else disk)",
    )
    parser.add_argument(
        "--newest-on-node",
        action="store_true",
        help="resume from the newest checkpoint this node holds, even one not durable yet",
    )
    parser.add_argument("--final-out", type=Path, help="write the final weights here")
    parser.add_argument("--step-events", action="store_true", help="one event per step")
    parser.add_argument(
        "--no-register",
        action="store_true",
        help="no agent, no checkpoints: the uninterrupted reference run",
    )
    args = parser.parse_args(argv)
    if args.steps < 0 or args.every < 1:
        parser.error("--steps must be >= 0 and --every >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Bit-exact resume needs deterministic kernels and one thread (a reduction
    # split across threads may add in another order).
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    model = make_model(args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(args.steps, 1))
    shuffle = torch.Generator().manual_seed(args.seed + 1)
    loader: ResumableLoader[Any] = ResumableLoader(
        DataLoader(make_dataset(), batch_size=args.batch, shuffle=True, generator=shuffle)
    )
    noise = torch.Generator().manual_seed(args.seed + 2)  # input augmentation

    client: CheckpointClient | None = None
    checkpointer: TorchCheckpointer | None = None
    if not args.no_register:
        client = CheckpointClient(args.server, token=os.environ.get("TIERCKPT_TOKEN"))
        checkpointer = TorchCheckpointer(
            client,
            args.run,
            args.root,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            data=loader,
            generators={"noise": noise},
            node=args.node or default_node(),
            staging=args.staging,
        )
    try:
        with PreemptionGuard(notice_url=args.notice_url, poll_interval=args.notice_poll) as guard:
            step = 0
            if checkpointer is not None:
                step = checkpointer.restore_latest(newest_on_node=args.newest_on_node)
                restored = checkpointer.restored
                if restored is None:
                    emit("fresh", reason="no valid checkpoint", run=args.run)
                else:
                    emit(
                        "resumed",
                        step=step,
                        source=restored.source,
                        region=restored.region,
                        regions=list(restored.regions),
                        seconds=round(restored.seconds, 3),
                    )
            emit("start", run=args.run, from_step=step, steps=args.steps, every=args.every)
            batches = forever(loader)
            loss = float("nan")

            def save(priority: str) -> None:
                assert checkpointer is not None
                began = time.monotonic()
                checkpoint = checkpointer.save(
                    step, epoch=loader.epoch, metrics={"loss": loss}, priority=priority
                )
                emit(
                    "checkpoint",
                    step=step,
                    loss=loss,
                    state=checkpoint.state,
                    priority=checkpoint.priority,
                    path=str(checkpointer.path_of(step)),
                    stall_seconds=round(time.monotonic() - began, 4),
                    write_seconds=checkpoint.write_seconds,
                    # The segment the agent reserved for the next save, if any.
                    next_segment=checkpoint.next_segment.id if checkpoint.next_segment else None,
                )

            model.train()
            while step < args.steps:
                x, y = next(batches)
                x = x + 0.05 * torch.randn(x.shape, generator=noise)
                loss_t = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss_t.backward()
                optimizer.step()
                scheduler.step()
                step += 1
                loss = float(loss_t.item())
                if args.step_events:
                    emit("step", step=step, loss=loss)
                if checkpointer is not None and step % args.every == 0:
                    save("normal")
                if guard.preempted:
                    # Save now (urgent: uploaded before queued normal work),
                    # unless this very step was just saved; then give the
                    # upload the time left before the machine goes.
                    state = None
                    if checkpointer is not None:
                        if step % args.every != 0:
                            save("urgent")
                        state = checkpointer.wait_durable(step, args.urgent_wait).state
                    notice = guard.notice
                    emit(
                        "preempted",
                        step=step,
                        reason=notice.detail if notice else None,
                        state=state,
                    )
                    return 0
                if args.sleep:
                    time.sleep(args.sleep)

        digest = weights_sha256(model)
        if args.final_out:
            weights = {k: v.contiguous() for k, v in model.state_dict().items()}
            save_file(weights, str(args.final_out), metadata={"step": str(step), "sha256": digest})
        emit("done", step=step, sha256=digest, loss=loss)
        return 0
    finally:
        if checkpointer is not None:
            checkpointer.close()
        if client is not None:
            client.close()


if __name__ == "__main__":
    sys.exit(main())
