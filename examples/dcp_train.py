"""Distributed training (2 ranks, gloo, CPU) checkpointed with torch.distributed.checkpoint.

Every rank trains a `DistributedDataParallel` MLP on its share of a synthetic
dataset. Every `--every` steps all ranks save with DCP (`FileSystemWriter`):
rank R writes its part into `<root>/<run>/step-<N>/rank-R/` (rank 0 also the
global `.metadata`) and registers it as rank R of world size 2
(`tierckpt.client.torch.save_distributed`; with `--async-save`,
`save_distributed_async`: DCP's `async_save` stages the state into memory,
training goes on, and each rank registers once its files are written). The
checkpoint is valid once every rank's part is durable. On start the ranks ask
for the latest valid checkpoint (`latest_distributed`, `restore_distributed`):
each downloads all ranks' files into one directory — `.metadata`,
`__0_0.distcp`, `__1_0.distcp`, what DCP reads — and loads it.

Batches are a pure function of (seed, step, rank), so the step is the whole
data position: a resumed run ends with the same weights as an uninterrupted one.

    python examples/dcp_train.py --root /ssd/ckpt --steps 40 --every 10   # spawns 2 ranks
    torchrun --nproc-per-node 2 examples/dcp_train.py --root /ssd/ckpt      # or under torchrun

Rank 0 prints one JSON event per line (start, fresh | resumed, checkpoint, done).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from tierckpt.client import CheckpointClient
from tierckpt.client.torch import (
    PendingSave,
    latest_distributed,
    restore_distributed_report,
    save_distributed,
    save_distributed_async,
)

DATA_SEED = 20240611
FEATURES, CLASSES, SAMPLES = 32, 4, 1024


def emit(rank: int, event: str, **fields: Any) -> None:
    if rank == 0:
        print(json.dumps({"event": event, **fields}, sort_keys=True), flush=True)


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    return x, (x @ teacher).argmax(1)


def batch_of(step: int, rank: int, world: int, batch: int, seed: int) -> torch.Tensor:
    """Sample indices of ``rank`` at ``step``: a fresh permutation each epoch,
    split between ranks; nothing to save but the step."""
    per_epoch = SAMPLES // (batch * world)
    epoch, position = divmod(step, per_epoch)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    start = (position * world + rank) * batch
    return order[start : start + batch]


def weights_sha256(state: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train(rank: int, world: int, args: argparse.Namespace) -> None:
    # A rank that never shows up must fail the job, not hang it for 30 minutes.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        torch.use_deterministic_algorithms(True)
        torch.set_num_threads(1)
        torch.manual_seed(args.seed)
        net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, args.width),
            torch.nn.ReLU(),
            torch.nn.Linear(args.width, CLASSES),
        )
        model = DistributedDataParallel(net)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        x, y = dataset()
        client = None if args.no_register else CheckpointClient(args.server)

        def state(step: int) -> dict[str, Any]:
            model_state, optim_state = get_state_dict(model, optimizer)
            return {"model": model_state, "optim": optim_state, "step": step}

        # Asynchronous saves write (and run DCP's collectives) in a background
        # thread: on a process group of their own, never DDP's.
        saves_group = dist.new_group(backend="gloo") if args.async_save else None
        pending: PendingSave | None = None
        step = 0
        if client is not None:
            latest = latest_distributed(client, args.run)
            if latest is None:
                emit(rank, "fresh", run=args.run)
            else:
                # Built only now: get_state_dict() steps a fresh optimizer
                # once (lr 0) to create its state, which a fresh run must not see.
                loaded = state(0)
                restored = restore_distributed_report(
                    client, args.run, loaded, args.root, step=latest, node=args.node
                )
                step = restored.step
                set_state_dict(
                    model,
                    optimizer,
                    model_state_dict=loaded["model"],
                    optim_state_dict=loaded["optim"],
                )
                if loaded["step"] != step:
                    raise RuntimeError(f"checkpoint says step {loaded['step']}, not {step}")
                # Every rank's files hard-linked from this node's T0 copies
                # ("local") or downloaded ("region"): rank 0 tells.
                emit(rank, "resumed", step=step, source=restored.source)
        emit(rank, "start", from_step=step, steps=args.steps, world_size=world)
        while step < args.steps:
            index = batch_of(step, rank, world, args.batch, args.seed)
            loss = torch.nn.functional.cross_entropy(model(x[index]), y[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            step += 1
            if client is not None and step % args.every == 0:
                save = save_distributed_async if args.async_save else save_distributed
                registered = save(
                    client,
                    args.run,
                    step,
                    state(step),
                    args.root,
                    metrics={"loss": float(loss.item())},
                    parent=step - args.every if step > args.every else None,
                    process_group=saves_group,
                )
                if isinstance(registered, PendingSave):
                    pending = registered
                    emit(rank, "checkpoint", step=step, loss=float(loss.item()), state="staged")
                else:
                    emit(
                        rank,
                        "checkpoint",
                        step=step,
                        loss=float(loss.item()),
                        state=registered.state if registered else "registered before",
                    )
        if pending is not None:
            pending.result()  # the last write registered before the job ends
        weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
        if rank == 0 and args.final_out:
            save_file(weights, str(args.final_out))
        emit(rank, "done", step=step, sha256=weights_sha256(weights))
        if client is not None:
            client.close()
        # Both ranks reach the end before the group is torn down: a rank
        # leaving early can leave gloo's teardown waiting on the other.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, args: argparse.Namespace) -> None:
    train(rank, world, args)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server",
        default=os.environ.get("TIERCKPT_URL", "http://127.0.0.1:8470"),
        help="tierckpt agent URL (default: $TIERCKPT_URL, else http://127.0.0.1:8470)",
    )
    parser.add_argument("--run", default="dcp-demo")
    parser.add_argument("--root", required=True, type=Path, help="local checkpoint root")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn (without torchrun)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--final-out", type=Path, help="rank 0 writes the final weights here")
    parser.add_argument("--no-register", action="store_true", help="reference run, no agent")
    parser.add_argument(
        "--node", default=None, help="this node's name as the agent knows it (default: host name)"
    )
    parser.add_argument(
        "--async-save",
        action="store_true",
        help="save with DCP async_save: training goes on while the files are written",
    )
    args = parser.parse_args(argv)
    args.root = args.root.resolve()
    if args.every < 1 or args.steps < 0 or args.nproc < 1:
        parser.error("--every and --nproc must be >= 1, --steps >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        train(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
        return 0
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    # Every rank is on this machine: gloo must talk over loopback, not over
    # whatever interface the host name resolves to (which may be unreachable
    # in a sandbox and makes the mesh setup hang).
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.multiprocessing as mp

    # Forked: the ranks inherit the imports above (seconds of CPU each)
    # instead of importing them again. Safe because this process has started
    # no thread and touched no GPU before the fork; under torchrun (above)
    # every rank is a process of its own anyway.
    mp.start_processes(
        _spawned, args=(args.nproc, args), nprocs=args.nproc, join=True, start_method="fork"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
