"""Trainer stall per checkpoint: tierckpt, the other ways to save, and the limit.

One PyTorch training state — an MLP's weights plus AdamW's two moments (3×
the parameter bytes), scheduler and RNG states — is checkpointed by each
variant, ``ctx.reps`` times (once with ``--quick``) in a rotating order,
``sync`` before each; one optimizer step before each repetition changes
every weight and moment, so each save holds new bytes, as a trainer's do.
Full mode measures two sizes (~600 MB and ~2 GB), quick mode one small one
(~151 MB).

- ``bare copy``: the same tensors' bytes copied (``Tensor.copy_``) into one
  file in ``/dev/shm``, preallocated, mapped shared (``torch.from_file``) and
  touched once before the copy (outside its timing), removed after it.
  Nothing a staging into memory could skip: it is the limit the other
  stalls are set against, and the memory tier's target is a stall ≤ 2× it.
- ``memory staging``: ``TorchCheckpointer(staging="memory").save``: the
  state copied into a segment of the agent's memory tier (a file in its
  ``/dev/shm`` arena, in safetensors layout, written with ``pwrite`` from
  the tensors) and registered; the agent writes it to T0 (fsync, rename),
  registers it and uploads it afterwards. Target: stall ≤ 2× the bare copy.
  Three untimed saves come first: a trainer's first save writes into new
  tmpfs pages; each later one into the segment reserved with the save
  before, whose files the checkpointer mapped in the background meanwhile
  (client/torch/segment_mappings.py), as the bare copy's buffer is touched
  before its copy.
- ``disk staging``: ``TorchCheckpointer(staging="disk").save``: safetensors
  + JSON written to the local root, fsynced, renamed into place, and one
  register call. The upload runs in the agent afterwards.
- For both: save returned → durable (the agent's ``durable_at`` minus the
  trainer's clock when ``save`` returned; one machine, one clock), waited
  for outside the timing. Target: memory staging no slower than disk.
  Beside it, save called → durable (the stall added): how long after the
  trainer decided to checkpoint a copy is in a region, labelled as not the
  target's measure.
  Beside it, the store's CPU seconds per GB over the same time: on the
  benchmark machine the store shares the cores (a remote one would not),
  and its CPU per upload varies on its own.
- ``torch.save + fsync``: one ``torch.save`` of the same state dicts to a file
  on the agent's disk, then ``fsync``.
- ``DCP async_save``: ``torch.distributed.checkpoint.async_save`` of the same
  state dicts into a directory on that disk, single process without a process
  group (DCP's own single-process mode). The stall is the time until it
  returns (its staging copy into memory); the time until its future completes
  (the files written and fsynced by DCP's writer) is beside it, not a stall.
- On the first size only (the 2 GB one would add minutes of uploads):
  ``write + boto3``, the same files as tierckpt's written the same way and
  each uploaded with boto3 ``upload_file`` (default TransferConfig) before
  training goes on; ``torch.save + boto3``, ``torch.save`` into memory then
  one ``upload_fileobj``. These two keep their ratio to tierckpt's stall.

Uploads (tierckpt's and the boto3 baselines') go to a SeaweedFS server whose
data is on a tmpfs (``tmpfs_store``), emptied after each variant: a remote
store shares nothing with the agent's disk, and one on that disk would make
the memory tier's T0 write, which runs after the save returns, compete with
the store's own writes of the same upload. The boto3 client is configured as
``ctx.s3()`` is (CRC checksums only when required).
Skipped, with the reason, when PyTorch is not installed.
"""

from __future__ import annotations

import gc
import io
import os
import shutil
import time
import warnings
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from devsupport.seaweed import SeaweedServer, boto3_client
from tierckpt.client import CheckpointClient

from ..context import BASELINE_PREFIX, BenchContext, log, s3_region, settle
from ..procstat import cpu_seconds
from ..stats import ratios, row
from ..tmpfs_store import empty, tmpfs_seaweed

NAME = "trainer_stall"
TITLE = "Trainer stall per checkpoint: copy into memory, disk staging, torch.save, DCP, S3 (s)"
REQUIRES: tuple[str, ...] = ()

RUN = "bench-torch"
# 4 layers of width × width: ~12.6 M, ~50 M and ~165 M parameters, i.e.
# ~151 MB, ~604 MB and ~1.98 GB with AdamW's two moments.
QUICK_WIDTHS = (2048,)
FULL_WIDTHS = (4096, 7424)
TARGET = "memory-staged stall ≤ 2× the bare copy"
DURABLE_TARGET = "save returned → durable: memory staging no slower than disk staging"

WARM_UP_STEP = 1_000_000
BARE = "bare copy"
MEMORY = "memory staging"
DISK = "disk staging"
TORCH_SAVE = "torch.save + fsync"
DCP = "DCP async_save"
WRITE_BOTO3 = "write + boto3"
SAVE_BOTO3 = "torch.save + boto3"


def _model(torch: Any, width: int) -> tuple[Any, Any, Any]:
    layers: list[Any] = []
    for _ in range(3):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    model = torch.nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)
    # One real step so AdamW holds its moments (the state a resume needs).
    _train_step(torch, model, optimizer, scheduler, width)
    return model, optimizer, scheduler


def _train_step(torch: Any, model: Any, optimizer: Any, scheduler: Any, width: int) -> None:
    """One optimizer step: every weight and moment changes in place, as
    between a trainer's saves. Without it each save would repeat the bytes
    of the one before, and the agent would deduplicate its upload into
    server-side copies (uploads/dedup.py): save → durable would time a
    copy, not the upload of a new checkpoint."""
    model(torch.randn(8, width)).sum().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _tensors(torch: Any, model: Any, optimizer: Any) -> list[Any]:
    """Every tensor of the state, in a fixed order, as contiguous CPU tensors."""
    found: list[Any] = list(model.state_dict().values())
    for per_param in optimizer.state_dict()["state"].values():
        found += [value for value in per_param.values() if isinstance(value, torch.Tensor)]
    return [tensor.detach().contiguous() for tensor in found]


def _wait_on_t0(
    client: CheckpointClient, run: str, step: int, timeout: float = 300
) -> float | None:
    """Until the agent's memory tier holds no staged (not yet on T0) segment
    of ``run`` step ``step``; when T0 held it (the segment's ``persisted_at``,
    the agent's clock: asked only once durable, so that no poll of the memory
    tier runs during the upload that is being timed). None when the segment
    is gone already (its room taken for a newer save): no figure then."""
    deadline = time.monotonic() + timeout
    while True:
        segments = client._http.get("/v1/memory").json()["segments"]
        mine = [s for s in segments if s["run"] == run and s["step"] == step]
        if not any(s["state"] == "staged" for s in mine):
            persisted = [s["persisted_at"] for s in mine if s.get("persisted_at")]
            return datetime.fromisoformat(persisted[0]).timestamp() if persisted else None
        if time.monotonic() > deadline:
            raise RuntimeError(f"{run} step {step} not written to T0 in {timeout} s")
        time.sleep(0.02)


class _SharedArena:
    """One preallocated, pre-faulted file in /dev/shm mapped shared: the copy's destination."""

    def __init__(self, torch: Any, nbytes: int, name: str) -> None:
        self.path = Path("/dev/shm") / name
        with open(self.path, "wb") as handle:
            handle.truncate(nbytes)
        self.buffer = torch.from_file(str(self.path), shared=True, size=nbytes, dtype=torch.uint8)
        # Touch every page once: a memory tier keeps its buffers across saves,
        # so page faults on first use are not part of a save's stall.
        self.buffer.fill_(1)

    def copy_in(self, tensors: list[Any]) -> None:
        offset = 0
        for tensor in tensors:
            raw = tensor.reshape(-1).view(dtype=self.buffer.dtype)
            self.buffer[offset : offset + raw.numel()].copy_(raw)
            offset += raw.numel()

    def close(self) -> None:
        del self.buffer
        self.path.unlink(missing_ok=True)


def _memory_against_disk(
    label: str, metric: tuple[str, str], values: dict[str, list[float]], notes: tuple[str, str]
) -> list[dict[str, Any]]:
    """Two rows, disk staging then memory staging with its ratio to disk."""
    return [
        row(f"{label}, disk staging", *metric, values[DISK], note=notes[0]),
        row(
            f"{label}, memory staging",
            *metric,
            values[MEMORY],
            ratio_label="memory / disk",
            ratio_values=ratios(values[MEMORY], values[DISK]),
            note=notes[1],
        ),
    ]


def _measure_size(
    ctx: BenchContext,
    torch: Any,
    client: CheckpointClient,
    store: SeaweedServer,
    width: int,
    *,
    with_s3: bool,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    from tierckpt.client.torch import TorchCheckpointer, write_state

    torch.manual_seed(0)
    model, optimizer, scheduler = _model(torch, width)
    tensors = _tensors(torch, model, optimizer)
    tensor_bytes = sum(t.numel() * t.element_size() for t in tensors)
    run_name = f"{RUN}-{width}"
    s3 = boto3_client(store.endpoint_url)  # as ctx.s3(), on the tmpfs store
    scratch = ctx.work / "trainer-stall"
    scratch.mkdir(exist_ok=True)
    names = [BARE, MEMORY, DISK, TORCH_SAVE, DCP] + ([WRITE_BOTO3, SAVE_BOTO3] if with_s3 else [])
    results: dict[str, list[float]] = {name: [] for name in names}
    dcp_done: list[float] = []
    durable: dict[str, list[float]] = {MEMORY: [], DISK: []}
    # The same from the save's call: the stall plus the above, i.e. how long
    # after the trainer decided to checkpoint the state is safe in a region.
    from_call: dict[str, list[float]] = {MEMORY: [], DISK: []}
    # The store's CPU seconds per GB from the return to durable: on these two
    # cores it is the largest share of an upload's work, and it varies on its
    # own from one upload to the next; beside each save → durable it shows
    # how much of that figure's spread is the store's, not the agent's.
    store_cpu: dict[str, list[float]] = {MEMORY: [], DISK: []}
    on_t0: dict[str, list[float]] = {MEMORY: []}
    boto3_upload: list[float] = []
    state_bytes = 0
    store_pid = store.pid
    assert store_pid is not None, "the store is running"

    def state(step: int) -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "step": step,
        }

    checkpointers = {
        staging: TorchCheckpointer(
            client,
            f"{run_name}-{staging}",
            ctx.ssd,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            node="bench-node",
            staging=staging,
        )
        for staging in ("memory", "disk")
    }

    def bare_copy(step: int) -> None:
        # The arena lives only around its copy: at ~2 GB, held through the
        # other variants beside the memory tier's segments and the tmpfs
        # store, it was what pushed a 24 GB machine into the OOM killer.
        # Named after the work directory, as every /dev/shm entry of the
        # benchmark (leftovers.py).
        arena = _SharedArena(torch, tensor_bytes, f"{ctx.work.name}-stall-{width}")
        try:
            began = time.perf_counter()
            arena.copy_in(tensors)
            results[BARE].append(time.perf_counter() - began)
        finally:
            arena.close()

    def staged_save(name: str, staging: str, step: int) -> None:
        nonlocal state_bytes
        checkpointer = checkpointers[staging]
        called = time.time()
        began = time.perf_counter()
        checkpoint = checkpointer.save(step)
        results[name].append(time.perf_counter() - began)
        returned = time.time()
        store_before = cpu_seconds(store_pid)
        if staging == "memory" and checkpoint.state != "staged":
            raise RuntimeError(f"memory staging went to disk: {checkpoint.state}")
        done = client.wait(checkpointer.run, step, state="durable", timeout=900, poll_interval=0.02)
        if done.durable_at is not None:
            durable[name].append(done.durable_at.timestamp() - returned)
            from_call[name].append(done.durable_at.timestamp() - called)
            gigabytes = (done.total_bytes or tensor_bytes) / 1e9
            store_cpu[name].append((cpu_seconds(store_pid) - store_before) / gigabytes)
        state_bytes = done.total_bytes or state_bytes
        if staging == "memory":
            # Its T0 copy, written during the upload (or after it, with
            # [memory] t0_wait_seconds: service/memory/upload_first.py), is
            # waited for, so that it runs into no other variant's timing.
            persisted_at = _wait_on_t0(client, checkpointer.run, step)
            if persisted_at is not None:
                on_t0[name].append(persisted_at - returned)
        # Durable: the T0 copy is not needed by the benchmark any more.
        shutil.rmtree(checkpointer.path_of(step), ignore_errors=True)

    def memory_staging(step: int) -> None:
        staged_save(MEMORY, "memory", step)

    def disk_staging(step: int) -> None:
        staged_save(DISK, "disk", step)

    def torch_save_fsync(step: int) -> None:
        path = scratch / f"torch-save-{width}-{step}.pt"
        began = time.perf_counter()
        with open(path, "wb") as handle:
            torch.save(state(step), handle)
            handle.flush()
            os.fsync(handle.fileno())
        results[TORCH_SAVE].append(time.perf_counter() - began)
        path.unlink()

    def dcp_async_save(step: int) -> None:
        directory = scratch / f"dcp-{width}-{step}"
        with warnings.catch_warnings():
            # "torch.distributed is disabled ...": single process is the intent.
            warnings.simplefilter("ignore", UserWarning)
            began = time.perf_counter()
            response = dcp.async_save(state(step), checkpoint_id=str(directory))
            returned = time.perf_counter()
            # An AsyncSaveResponse only with a stager staging in the background,
            # which the default one does not.
            if isinstance(response, AsyncSaveResponse):
                response.upload_completion.result()
            else:
                response.result()
            done = time.perf_counter()
        results[DCP].append(returned - began)
        dcp_done.append(done - began)
        shutil.rmtree(directory)

    def write_and_upload(step: int) -> None:
        directory = scratch / f"boto3-{width}-{step}"
        prefix = f"{BASELINE_PREFIX}/torch/{width}/step-{step}"
        began = time.perf_counter()
        files = write_state(
            directory, step=step, model=model, optimizer=optimizer, scheduler=scheduler
        )
        written = time.perf_counter()
        for path in files:
            s3.upload_file(str(path), ctx.bucket, f"{prefix}/{path.name}")
        done = time.perf_counter()
        results[WRITE_BOTO3].append(done - began)
        boto3_upload.append(done - written)
        shutil.rmtree(directory)

    def save_and_put(step: int) -> None:
        began = time.perf_counter()
        buffer = io.BytesIO()
        torch.save(state(step), buffer)
        buffer.seek(0)
        s3.upload_fileobj(buffer, ctx.bucket, f"{BASELINE_PREFIX}/torch/{width}/save-{step}.pt")
        results[SAVE_BOTO3].append(time.perf_counter() - began)

    every: dict[str, Callable[[int], None]] = {
        BARE: bare_copy,
        MEMORY: memory_staging,
        DISK: disk_staging,
        TORCH_SAVE: torch_save_fsync,
        DCP: dcp_async_save,
        WRITE_BOTO3: write_and_upload,
        SAVE_BOTO3: save_and_put,
    }
    variants = [every[name] for name in names]
    # Three untimed memory-staged saves first, as the bare copy's arena is
    # touched before each copy: a trainer's first save writes into new tmpfs
    # pages; each later one into the segment reserved ahead with the save
    # before, mapped (and its pages allocated) in the background after it.
    # From the fourth save on, the three sets of files taking turns (kept,
    # staged, reserved ahead) are recycled ones the trainer has mapped.
    for warm_step in (WARM_UP_STEP, WARM_UP_STEP + 1, WARM_UP_STEP + 2):
        staged_save(MEMORY, "memory", warm_step)
    # Nothing else has run yet: what the memory lists hold is the warm-up's.
    for values in (results, durable, from_call, store_cpu, on_t0):
        values[MEMORY].clear()
    # Quick mode: one repetition (torch's import and the model are most of
    # this scenario's time, and the ratios are several-fold).
    reps = 1 if ctx.quick else ctx.reps
    for rep in range(reps):
        # Above the warm-up's steps, as a run's steps go: the memory tier
        # keeps each run's newest persisted segment (the highest step), and
        # each repetition's is then the one kept, as a trainer's last save
        # is; with lower steps the warm-up's last stayed the newest, every
        # repetition's segment was freed as it reached T0, and its
        # persisted_at was gone before the on-T0 row could read it.
        step = WARM_UP_STEP + 3 + rep
        # New bytes for this repetition's saves (outside every timing).
        _train_step(torch, model, optimizer, scheduler, width)
        for offset in range(len(variants)):
            settle()
            variants[(rep + offset) % len(variants)](step)
            # The tmpfs is memory: each variant's objects (durable, measured)
            # give their room back before the next variant, so the store
            # never holds more than one state.
            empty(store, ctx.bucket)
        log(
            f"trainer stall {tensor_bytes / 1e6:.0f} MB rep {rep + 1}/{reps}: "
            + ", ".join(f"{name} {results[name][-1]:.2f} s" for name in names)
        )

    size = f"{tensor_bytes / 1e6:.0f} MB"
    bare = results[BARE]

    def to_bare(label: str, values: list[float], note: str) -> dict[str, Any]:
        return row(
            f"{size}: {label}",
            "stall",
            "s",
            values,
            ratio_label="stall / bare copy",
            ratio_values=ratios(values, bare),
            note=note,
        )

    rows = [
        row(
            f"{size}: bare copy into /dev/shm (the limit)",
            "stall",
            "s",
            bare,
            note="Tensor.copy_ into a preallocated, pre-faulted shared mmap (torch.from_file)",
        ),
        to_bare(
            'memory staging: TorchCheckpointer(staging="memory").save',
            results[MEMORY],
            "copy into the agent's memory tier (/dev/shm segment, safetensors layout), register",
        ),
        to_bare(
            'disk staging: TorchCheckpointer(staging="disk").save',
            results[DISK],
            "safetensors + JSON, fsync, rename, register",
        ),
        to_bare("torch.save + fsync", results[TORCH_SAVE], "one file on the agent's disk"),
        to_bare(
            "DCP async_save (until it returns)",
            results[DCP],
            "single process, no process group",
        ),
        row(
            f"{size}: DCP async_save future completed",
            "background",
            "s",
            dcp_done,
            ratio_label="time / bare copy",
            ratio_values=ratios(dcp_done, bare),
            note="not a stall: files written + fsynced",
        ),
        *_memory_against_disk(
            f"{size}: save returned → durable",
            ("background", "s"),
            durable,
            ("not a stall", "not a stall; the agent uploads from the segment while it writes T0"),
        ),
        *_memory_against_disk(
            f"{size}: save called → durable",
            ("background", "s"),
            from_call,
            (
                "the stall + returned → durable: the trainer's decision to a copy in a region",
                "the same; not the target's measure (that is from the return, above)",
            ),
        ),
        row(
            f"{size}: save returned → on T0, memory staging",
            "background",
            "s",
            on_t0[MEMORY],
            note="not a stall; the segment's persisted_at (written during the upload by "
            "default; with [memory] t0_wait_seconds, after it); disk staging: on T0 when "
            "save returns",
        ),
        *_memory_against_disk(
            f"{size}: the store's CPU from save returned to durable",
            ("store CPU", "s/GB"),
            store_cpu,
            (
                "SeaweedFS (it stands for a remote store; here it shares the 2 cores)",
                "the same bytes: its spread is the store's own, which the durable times follow",
            ),
        ),
    ]
    s3_notes = {
        WRITE_BOTO3: ("write + boto3 upload_file", "same files"),
        SAVE_BOTO3: ("torch.save to memory + boto3 upload_fileobj", "one object"),
    }
    for key, (label, note) in s3_notes.items():
        if key in results:
            rows.append(
                row(
                    f"{size}: {label}",
                    "stall",
                    "s",
                    results[key],
                    ratio_label="stall / tierckpt's",
                    ratio_values=ratios(results[key], results[DISK]),
                    note=note,
                )
            )
    if boto3_upload:
        rows.append(
            row(f"{size}: boto3 upload part of write + boto3", "stall part", "s", boto3_upload)
        )
    details = {
        "width": width,
        "tensor_bytes": tensor_bytes,
        "state_bytes": state_bytes,
        "parameters": sum(p.numel() for p in model.parameters()),
        "reps": reps,
        **{name: values for name, values in results.items()},
        "dcp_future_done": dcp_done,
        "returned_to_durable": durable,
        "called_to_durable": from_call,
        "returned_to_t0_memory": on_t0[MEMORY],
        "store_cpu_seconds_per_gb": store_cpu,
        "boto3_upload_only": boto3_upload,
    }
    return rows, details


def run(ctx: BenchContext) -> dict[str, Any]:
    try:
        import torch
        import torch.distributed.checkpoint

        import tierckpt.client.torch  # noqa: F401
    except ImportError as exc:
        return {"rows": [], "notes": [f"skipped: PyTorch not installed ({exc})"], "details": {}}

    widths = QUICK_WIDTHS if ctx.quick else FULL_WIDTHS
    rows: list[dict[str, Any]] = []
    details: dict[str, Any] = {}
    # The uploads go to a store whose data is on a tmpfs: a remote store does
    # not share the agent's disk, where the memory tier's T0 write (after the
    # save returns) would otherwise compete with the store's own writes.
    with tmpfs_seaweed(ctx.work, (ctx.bucket,)) as (store, where):
        agent = ctx.start_agent("stall", regions=[s3_region("east", store)])
        try:
            with CheckpointClient(agent.url, timeout=120) as client:
                for index, width in enumerate(widths):
                    size_rows, size_details = _measure_size(
                        ctx, torch, client, store, width, with_s3=index == 0
                    )
                    rows += size_rows
                    details[f"{size_details['tensor_bytes'] / 1e6:.0f} MB"] = size_details
                    gc.collect()  # the previous size's model and state before the next one
        finally:
            ctx.stop_agent(agent)
    log(f"trainer stall target: {TARGET}; {DURABLE_TARGET}")
    return {
        "rows": rows,
        "notes": [
            f"S3 (uploads of tierckpt and of the boto3 baselines): a SeaweedFS server whose "
            f"data is on a tmpfs ({where}), emptied after each variant, not the agent's disk.",
            "One training state per size (MLP weights + AdamW moments + scheduler + RNGs); "
            f"{1 if ctx.quick else ctx.reps} repetition(s) per size, rotating order, "
            "sync before each. Sizes are the tensors' bytes.",
            f"Target: {TARGET}. Target: {DURABLE_TARGET}.",
            "Memory staging: the agent runs with memory.bytes = 6 GiB in /dev/shm (room "
            "for two of the largest state: the newest kept for restarts and the next save).",
            "The bare copy is the limit: the tensors' bytes copied into a preallocated, "
            "pre-faulted file in /dev/shm mapped shared, nothing else.",
            "Memory staging is measured after three untimed saves of the same run (the bare "
            "copy's buffer is likewise touched before): a trainer's first save writes into "
            "new tmpfs pages (several times the stall); each later one writes into the "
            "segment the agent reserved with the save before (one call per save), which the "
            "checkpointer mapped, its pages allocated, in the background after that save.",
            "Disk staging: the stall is the local write (fsynced safetensors + JSON, renamed "
            "into place) and one register call; the upload to S3 happens in the agent "
            "afterwards. Memory staging: the stall is the copy into the agent's memory tier "
            "and one register call; the agent uploads it afterwards, from the segment, "
            "while it writes T0 (the benchmark waits for the T0 copy before the next "
            "variant).",
            "DCP async_save's stall is until it returns (its copy into memory); its future "
            "completing (files written and fsynced by DCP's writer) is not a stall.",
            "The boto3 rows are measured on the first size only.",
        ],
        "details": details,
    }
