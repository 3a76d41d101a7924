"""A training loop for the restore tests, run alone or under ``torchrun``
(DDP on gloo, one process per rank).

Every rank saves its own state through ``TorchCheckpointer`` with its
defaults (memory staging when the agent has a memory tier), ``extra``
holding the loss history (so ``state.json`` grows with every save, as a
trainer's metrics do), and resumes with ``restore_latest()``. Right after
the restore it reports every file of the agent's directories its memory
maps (``/proc/self/maps``): a live tensor backed by such a file changes
when the agent frees or rewrites it. At the end it writes its model and
optimizer tensors to ``--final-out/rank-R.safetensors``, for a bit-for-bit
comparison with an uninterrupted run (``--no-register``).

Events go to stdout, one JSON object per line (torchrun passes its workers'
stdout through): resumed | fresh, checkpoint, paused, done.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tierckpt.client import CheckpointClient
from tierckpt.client.torch import TorchCheckpointer

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
LIFE = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def emit(event: str, **fields: Any) -> None:
    record = {"event": event, "rank": RANK, "pid": os.getpid(), "life": LIFE, **fields}
    # One write per line: torchrun's workers share one stdout, and print's
    # two writes (text, then newline) of two ranks can interleave.
    os.write(1, (json.dumps(record, sort_keys=True) + "\n").encode())


def mapped_under(directories: list[str]) -> list[str]:
    """The files under ``directories`` that this process maps, deleted ones too."""
    roots = [os.path.realpath(d).rstrip("/") + "/" for d in directories]
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6:
                continue
            path = fields[5].strip().removesuffix(" (deleted)")
            if any(path.startswith(root) for root in roots):
                found.add(path)
    return sorted(found)


def init_process_group() -> None:
    """gloo's rendezvous, made to survive torchrun's restarts: torchrun keeps
    one store for the whole job, and the keys of the last life (every
    rank's address) are still there when the workers of the next one
    meet; a worker then dials a dead peer and fails. A prefix per life
    (torchrun's restart count) gives each life keys of its own."""
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), WORLD, is_master=False
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"life-{LIFE}", store), rank=RANK, world_size=WORLD
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server")
    parser.add_argument("--run-name", default="restore")
    parser.add_argument("--root", type=Path)
    parser.add_argument("--node-name")
    parser.add_argument("--agent-dir", action="append", default=[])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--pause-after", type=int, help="first life: wait here for a kill")
    parser.add_argument("--final-out", type=Path, required=True)
    parser.add_argument("--no-register", action="store_true")
    return parser.parse_args()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's batch of each step, whatever life computes it."""
    g = torch.Generator().manual_seed(1_000_003 * (RANK + 1) + step)
    x = torch.randn(16, 32, generator=g)
    return x, (x[:, :4] * 3).argmax(1)


def main() -> int:
    args = parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if WORLD > 1:
        init_process_group()
    model = torch.nn.Sequential(
        torch.nn.Linear(32, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 4)
    )
    trained: torch.nn.Module = model
    if WORLD > 1:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    losses: list[float] = []
    client = checkpointer = None
    step = 0
    if not args.no_register:
        client = CheckpointClient(args.server)
        checkpointer = TorchCheckpointer(
            client,
            args.run_name,
            args.root,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            node=args.node_name,
            rank=RANK,
            world_size=WORLD,
        )
        step = checkpointer.restore_latest()
        if checkpointer.restored is None:
            emit("fresh")
        else:
            assert checkpointer.state is not None
            losses = list(checkpointer.state.extra["losses"])
            emit(
                "resumed",
                step=step,
                source=checkpointer.restored.source,
                mapped=mapped_under(args.agent_dir),
            )
    try:
        while step < args.steps:
            x, y = batch(step)
            loss = torch.nn.functional.cross_entropy(trained(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            losses.append(loss.item())
            if checkpointer is not None and step % args.every == 0:
                saved = checkpointer.save(step, extra={"losses": losses})
                emit("checkpoint", step=step, state=saved.state)
            if step == args.pause_after and LIFE == 0 and checkpointer is not None:
                emit("paused", step=step)
                time.sleep(600)  # the test kills a rank here
        final: dict[str, torch.Tensor] = {
            f"model.{k}": v.contiguous() for k, v in model.state_dict().items()
        }
        for index, state in optimizer.state_dict()["state"].items():
            for key, value in state.items():
                final[f"optimizer.{index}.{key}"] = torch.as_tensor(value).contiguous()
        args.final_out.mkdir(parents=True, exist_ok=True)
        save_file(final, str(args.final_out / f"rank-{RANK}.safetensors"))
        emit("done", step=step, loss=losses[-1] if losses else None)
    finally:
        if checkpointer is not None:
            checkpointer.close()
        if client is not None:
            client.close()
        if WORLD > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
