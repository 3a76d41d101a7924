"""Trainer stall per checkpoint: tierckpt against a synchronous upload of the same state.

One PyTorch training state — an MLP's weights plus AdamW's two moments (3×
the parameter bytes), scheduler and RNG states — is checkpointed by each
variant, ``ctx.reps`` times (once with ``--quick``) in a rotating order,
``sync`` before each:

- ``tierckpt``: ``TorchCheckpointer.save`` — the files written to the local
  root (safetensors + JSON, fsynced, renamed into place) and one register
  call. The stall is what the training loop waits for; the upload runs in the
  agent afterwards, and register → durable is reported beside it.
- ``write + boto3``: the same files written the same way, then each uploaded
  with boto3 ``upload_file`` (default TransferConfig) before training goes on.
- ``torch.save + boto3``: ``torch.save`` of the same state dicts into memory,
  then one ``upload_fileobj`` (what saving straight to S3 with torch.save
  and a file object amounts to).

The boto3 client is ``ctx.s3()`` (CRC checksums only when required).
Skipped, with the reason, when PyTorch is not installed.
"""

from __future__ import annotations

import io
import shutil
import time
from typing import Any

from tierckpt.client import CheckpointClient

from ..context import BASELINE_PREFIX, BenchContext, log, settle
from ..stats import ratios, row

NAME = "trainer_stall"
TITLE = "Trainer stall per checkpoint: local write + register vs synchronous S3 upload (s)"
REQUIRES: tuple[str, ...] = ()

RUN = "bench-torch"


def _model(torch: Any, quick: bool) -> tuple[Any, Any, Any]:
    width = 2048 if quick else 4096  # 4 layers: ~12.6 M / ~50 M parameters
    layers: list[Any] = []
    for _ in range(3):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    # One real step so AdamW holds its moments (the state a resume needs).
    model(torch.randn(8, width)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def run(ctx: BenchContext) -> dict[str, Any]:
    try:
        import torch

        from tierckpt.client.torch import TorchCheckpointer, write_state
    except ImportError as exc:
        return {"rows": [], "notes": [f"skipped: PyTorch not installed ({exc})"], "details": {}}

    torch.manual_seed(0)
    model, optimizer, scheduler = _model(torch, ctx.quick)
    s3 = ctx.s3()
    scratch = ctx.work / "trainer-stall"
    scratch.mkdir(exist_ok=True)
    results: dict[str, list[float]] = {
        "tierckpt": [],
        "write + boto3": [],
        "torch.save + boto3": [],
    }
    durable: list[float] = []
    boto3_upload: list[float] = []
    state_bytes = 0

    with CheckpointClient(ctx.agent.url, timeout=120) as client:
        checkpointer = TorchCheckpointer(
            client,
            RUN,
            ctx.ssd,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            node="bench-node",
        )

        def tierckpt(step: int) -> None:
            began = time.perf_counter()
            checkpoint = checkpointer.save(step)
            results["tierckpt"].append(time.perf_counter() - began)
            done = client.wait(RUN, step, state="durable", timeout=900, poll_interval=0.02)
            if done.created_at and done.durable_at:
                durable.append((done.durable_at - done.created_at).total_seconds())
            nonlocal state_bytes
            state_bytes = checkpoint.total_bytes or state_bytes

        def write_and_upload(step: int) -> None:
            directory = scratch / f"boto3-{step}"
            prefix = f"{BASELINE_PREFIX}/torch/step-{step}"
            began = time.perf_counter()
            files = write_state(
                directory, step=step, model=model, optimizer=optimizer, scheduler=scheduler
            )
            written = time.perf_counter()
            for path in files:
                s3.upload_file(str(path), ctx.bucket, f"{prefix}/{path.name}")
            done = time.perf_counter()
            results["write + boto3"].append(done - began)
            boto3_upload.append(done - written)
            shutil.rmtree(directory)

        def save_and_put(step: int) -> None:
            began = time.perf_counter()
            buffer = io.BytesIO()
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": torch.get_rng_state(),
                    "step": step,
                },
                buffer,
            )
            buffer.seek(0)
            s3.upload_fileobj(buffer, ctx.bucket, f"{BASELINE_PREFIX}/torch/save-{step}.pt")
            results["torch.save + boto3"].append(time.perf_counter() - began)

        variants = [tierckpt, write_and_upload, save_and_put]
        # Quick mode: one repetition (torch's import and the model are most of
        # this scenario's time, and the stall ratio is several-fold).
        reps = 1 if ctx.quick else ctx.reps
        for rep in range(reps):
            step = rep + 1
            for offset in range(len(variants)):
                variant = variants[(rep + offset) % len(variants)]
                settle()
                variant(step)
            log(
                f"trainer stall rep {rep + 1}/{reps}: tierckpt "
                f"{results['tierckpt'][-1]:.2f} s, write + boto3 "
                f"{results['write + boto3'][-1]:.2f} s, torch.save + boto3 "
                f"{results['torch.save + boto3'][-1]:.2f} s"
            )
            # Durable: the T0 copy is not needed by the benchmark any more.
            shutil.rmtree(checkpointer.path_of(step), ignore_errors=True)

    size = f"{state_bytes / 1e6:.0f} MB"
    rows = [
        row("tierckpt save (write + register)", "stall", "s", results["tierckpt"], note=size),
        row(
            "write + boto3 upload_file",
            "stall",
            "s",
            results["write + boto3"],
            ratio_label="stall / tierckpt's",
            ratio_values=ratios(results["write + boto3"], results["tierckpt"]),
            note="same files",
        ),
        row(
            "torch.save to memory + boto3 upload_fileobj",
            "stall",
            "s",
            results["torch.save + boto3"],
            ratio_label="stall / tierckpt's",
            ratio_values=ratios(results["torch.save + boto3"], results["tierckpt"]),
            note="one object",
        ),
        row("tierckpt register → durable", "background", "s", durable, note="not a stall"),
        row("boto3 upload part of write + boto3", "stall part", "s", boto3_upload),
    ]
    return {
        "rows": rows,
        "notes": [
            f"One training state of {size} (MLP weights + AdamW moments + scheduler + RNGs); "
            f"{reps} repetition(s), rotating order, sync before each.",
            "tierckpt's stall is the local write (fsynced safetensors + JSON, renamed into "
            "place) and one register call; the upload to S3 happens in the agent afterwards.",
        ],
        "details": {
            "state_bytes": state_bytes,
            "parameters": sum(p.numel() for p in model.parameters()),
            **{name: values for name, values in results.items()},
            "register_to_durable": durable,
            "boto3_upload_only": boto3_upload,
        },
    }
