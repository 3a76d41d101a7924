"""A DCP save or load through tierckpt.client.dcp in N ranks (gloo, CPU), for
tests/e2e/test_dcp_plugin.py and the benchmark's dcp_plugin scenario.

    python devsupport/dcp_plugin_job.py save|load|load-whole|load-fs --server URL
        --root DIR --world N [--step S] [--node NODE] [--rows R] [--cols C]
        [--async-save] [--local DIR]

``load`` reads through ``TierckptReader``; ``load-whole`` is the restore
before it (every rank downloads the whole checkpoint, verified, then DCP's
``FileSystemReader``: ``restore_distributed``); ``load-fs`` is plain DCP's
``FileSystemReader`` on an already-local copy (``--local``, flat), its bytes
counted by the kernel (``rchar`` of /proc/self/io around the load).

The state: "w", a ROWS x COLS float32 tensor (its values known to every
rank: torch.arange) sharded by rows over the ranks (a DTensor, Shard(0);
a plain tensor with one rank), a small replicated tensor "b", and a
non-tensor "extra". Every rank prints one JSON line: what it read, and
whether its loaded values equal the saved ones.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from tierckpt.client import CheckpointClient
from tierckpt.client.dcp import TierckptReader, TierckptWriter
from tierckpt.client.torch.dcp import restore_distributed_report

RUN = "plugin"


def full(rows: int, cols: int) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)


def state(args: argparse.Namespace, rank: int, world: int, fill: bool) -> dict[str, Any]:
    weights = full(args.rows, args.cols) if fill else torch.zeros(args.rows, args.cols)
    bias = torch.arange(8.0) if fill else torch.zeros(8)
    if world > 1:
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        w: Any = distribute_tensor(weights, mesh, [Shard(0)])
    else:
        w = weights
    return {"w": w, "b": bias, "extra": {"lr": 0.5 if fill else 0.0}}


def run_rank(rank: int, world: int, args: argparse.Namespace) -> None:
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    client = CheckpointClient(args.server, timeout=60)
    report: dict[str, Any] = {"rank": rank, "world": world}
    try:
        began = time.monotonic()
        if args.mode == "save" and args.async_save:
            # DCP's advice: the background write's collectives on a group of their own.
            group = dist.new_group(backend="gloo") if world > 1 else None
            writer = TierckptWriter(client, RUN, args.step, args.root, process_group=group)
            pending = dcp.async_save(
                state(args, rank, world, True), storage_writer=writer, process_group=group
            )
            if not isinstance(pending, Future):  # AsyncSaveResponse
                pending = pending.upload_completion
            pending.result()
            report["registered"] = writer.checkpoint is not None
        elif args.mode == "save":
            writer = TierckptWriter(client, RUN, args.step, args.root)
            dcp.save(state(args, rank, world, True), storage_writer=writer)
            report["registered"] = writer.checkpoint is not None
        else:
            loaded = state(args, rank, world, False)
            load_began = time.monotonic()
            if args.mode == "load":
                reader = TierckptReader(client, RUN, args.root, step=args.step, node=args.node)
                dcp.load(loaded, storage_reader=reader)
                report.update(
                    step=reader.step, bytes_read=reader.bytes_read, by_source=reader.bytes_by_source
                )
            elif args.mode == "load-whole":
                done = restore_distributed_report(
                    client, RUN, loaded, args.root, step=args.step, node=args.node
                )
                whole = sum(f.size for f in client.get(RUN, done.step).files)
                report.update(step=done.step, bytes_read=whole, by_source={done.source: whole})
            else:
                before = _rchar()
                dcp.load(loaded, storage_reader=dcp.FileSystemReader(args.local))
                report.update(step=args.step, bytes_read=_rchar() - before)
            report["load_seconds"] = time.monotonic() - load_began
            report.update(_check(loaded, args, rank, world))
        report["seconds"] = time.monotonic() - began  # save/load, process group up
    finally:
        client.close()
        if world > 1:
            dist.destroy_process_group()
    # One write per line: ranks share the pipe, and print() writes the text
    # and its newline apart (lines of two ranks could interleave).
    os.write(1, (json.dumps(report) + "\n").encode())


def _check(
    loaded: dict[str, Any], args: argparse.Namespace, rank: int, world: int
) -> dict[str, Any]:
    """Whether this rank's loaded values are the saved ones, and its tensor bytes."""
    w = loaded["w"]
    local = w.to_local() if hasattr(w, "to_local") else w
    rows = args.rows // world
    expected = full(args.rows, args.cols)[rank * rows : rank * rows + local.shape[0]]
    return {
        "tensor_bytes": local.numel() * local.element_size(),
        "equal": bool(
            torch.equal(local, expected)
            and torch.equal(loaded["b"], torch.arange(8.0))
            and loaded["extra"] == {"lr": 0.5}
        ),
    }


def _rchar() -> int:
    """Bytes this process has read through read() so far (any file or socket)."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load", "load-whole", "load-fs"])
    parser.add_argument("--server", required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--node", default=None)
    parser.add_argument("--rows", type=int, default=3072)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--async-save", action="store_true", help="dcp.async_save")
    parser.add_argument("--local", help="load-fs: the flat local copy FileSystemReader reads")
    args = parser.parse_args(argv)
    if args.mode == "load-fs" and args.local is None:
        parser.error("load-fs needs --local")
    if args.mode == "save" and args.step is None:
        parser.error("save needs --step")
    if args.world == 1:
        run_rank(0, 1, args)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    # Forked, not spawned: the ranks inherit this process's imports (torch and
    # DCP, seconds of CPU each) instead of importing them again; nothing here
    # has started a thread before the fork.
    mp.start_processes(
        run_rank, args=(args.world, args), nprocs=args.world, join=True, start_method="fork"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
