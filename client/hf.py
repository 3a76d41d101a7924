"""Hugging Face ``Trainer`` through tierckpt: one callback and one resume call::

    trainer = Trainer(..., callbacks=[TierckptCallback(client, run)])
    trainer.train(resume_from_checkpoint=latest_checkpoint(client, run, args.output_dir))

Needs the ``hf`` extra (``pip install 'tierckpt[hf]'``); nothing else in
``tierckpt.client`` imports transformers.

**Registering.** The ``Trainer`` writes ``output_dir/checkpoint-N`` (model,
optimizer, scheduler, RNG states, ``trainer_state.json`` last), then rotates
old ones (``save_total_limit``), then calls ``on_save``. Only then does
:class:`TierckptCallback` act, so it never sees half a checkpoint; it still
refuses a directory without ``trainer_state.json``.

It does not register ``checkpoint-N`` itself: the ``Trainer`` deletes
rotated directories with ``rmtree``, possibly before the agent has uploaded
them, and the agent fails a checkpoint whose files vanished or changed
(tests/integration/test_t0_disappears.py). Instead every file is hard-linked
(same bytes, no copy; copied only across filesystems) into a directory tierckpt
owns, ``<output_dir>/.tierckpt/<run>/checkpoint-N`` by default (``root=``),
which is registered. Rotation then removes the ``Trainer``'s names only; the
agent evicts its copy from local disk once durable and beyond
``[local] keep_last``. The ``Trainer`` never writes into an existing
checkpoint directory during normal training; should a file be rewritten in
place anyway, the agent sees its size/mtime change and fails that checkpoint
instead of uploading mixed bytes, and ``latest`` never answers it.

**Resuming.** :func:`latest_checkpoint` asks for the latest valid (durable)
checkpoint and brings it to ``dest/checkpoint-N``: from this node's copy when
the agent vouches for it (hard-linked, then hashed against the catalog),
else downloaded from a region (every byte hashed), in a hidden directory
renamed into place. It returns that path, or None on a fresh start. An
existing ``dest/checkpoint-N`` is used only if it hashes to the catalog;
otherwise it is moved aside (``.tierckpt-stale-…``, kept for a person to
look at) and replaced. A ``checkpoint-M`` a crash left half-written is never
returned: the answer comes from the catalog, not from the directory listing
``transformers.trainer_utils.get_last_checkpoint`` reads.

Registration happens on the world's process zero; with several processes,
each writes its own ``rng_state_R.pth`` into the same directory before the
``Trainer``'s barrier, so the directory is complete by then only on a shared
filesystem. Per-node checkpoints of sharded trainers (FSDP, DeepSpeed) are
not covered.
"""

from __future__ import annotations

import filecmp
import logging
import math
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ._files import fsync_dir
from ._frameworks import (
    RESTORE_PREFIX,
    STAGING_PREFIX,
    link_or_copy,
    matches_catalog,
    place_verified,
    remove_leftovers,
    scratch_dir,
)
from ._node import confirm_node, default_node
from .errors import ConflictError, NotFoundError, TierckptError
from .models import Checkpoint
from .sync_client import CheckpointClient

log = logging.getLogger("tierckpt.client.hf")

PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.json"  # the Trainer writes it last
OWN_DIR = ".tierckpt"
STALE_PREFIX = ".tierckpt-stale-"


class TierckptCallback(TrainerCallback):
    """Registers every ``checkpoint-N`` the ``Trainer`` finished writing.

    ``root`` (default ``<output_dir>/.tierckpt``) must be on the same
    filesystem as ``output_dir`` for hard links, and both under the agent's
    ``[local].roots``. The latest logged numbers of the step (loss, eval
    metrics) are registered as the checkpoint's metrics, the time the
    ``Trainer`` spent saving as its ``write_seconds``.
    """

    def __init__(
        self,
        client: CheckpointClient,
        run: str,
        *,
        root: str | os.PathLike[str] | None = None,
        priority: str = "normal",
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        if not run or "/" in run:
            raise ValueError(f"run must be a non-empty name without '/': {run!r}")
        self.client = client
        self.run = run
        self.root = None if root is None else Path(os.path.abspath(root))
        self.priority = priority
        self.metadata = dict(metadata or {})
        self.registered: list[Checkpoint] = []
        # Lineage: the step training resumed from, then the last one registered.
        self._parent: int | None = None
        self._mark: float | None = None

    # The Trainer's save runs between its last callback of the step (on_step_end,
    # then on_log / on_evaluate when it logs or evaluates) and on_save: that
    # interval, plus the linking, is what the checkpoint cost the trainer
    # (registered as write_seconds, which `tierckpt advise` uses).
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._mark = time.monotonic()

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._mark = time.monotonic()

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._mark = time.monotonic()

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        # A resumed Trainer has loaded trainer_state.json by now: global_step
        # is the checkpoint it resumed from (0 on a fresh start).
        self._parent = state.global_step or None
        if state.is_world_process_zero:
            # Links of a save killed midway (never registered).
            remove_leftovers(self.run_dir(args), (STAGING_PREFIX,))

    def run_dir(self, args: TrainingArguments) -> Path:
        root = self.root or _output_dir(args) / OWN_DIR
        return root / self.run

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if not state.is_world_process_zero:
            return
        step = state.global_step
        source = _output_dir(args) / f"{PREFIX}{step}"
        if not (source / TRAINER_STATE).is_file():
            raise RuntimeError(
                f"{source} has no {TRAINER_STATE} after on_save: the Trainer did not finish "
                "writing it; not registering an incomplete checkpoint"
            )
        began = self._mark if self._mark is not None else time.monotonic()
        target = self._own_copy(source, self.run_dir(args), step)
        if target is None:
            return
        metadata = {**self.metadata, "framework": "transformers", "checkpoint_dir": str(source)}
        if state.epoch is not None:
            metadata["epoch"] = state.epoch
        try:
            checkpoint = self.client.register(
                self.run,
                step,
                target,
                parent=self._parent if self._parent != step else None,
                priority=self.priority,
                metrics=_metrics_of(state),
                metadata=metadata,
                write_seconds=time.monotonic() - began,
            )
        except ConflictError as exc:
            log.warning("%s step %d not registered again: %s", self.run, step, exc.message)
            return
        self._parent = step
        self.registered.append(checkpoint)

    def _own_copy(self, source: Path, run_dir: Path, step: int) -> Path | None:
        """``run_dir/checkpoint-N``: ``source``'s files hard-linked, renamed
        into place whole. None when a registered copy with other bytes
        already holds the step (steps are immutable: it stays)."""
        target = run_dir / f"{PREFIX}{step}"
        if target.exists():
            if _same_files(source, target):
                return target
            try:
                registered = self.client.get(self.run, step)
            except NotFoundError:
                registered = None
            if registered is not None and registered.state not in ("failed", "deleted"):
                log.warning(
                    "%s step %d was registered before with other content; keeping it",
                    self.run,
                    step,
                )
                return None
            shutil.rmtree(target)
        run_dir.mkdir(parents=True, exist_ok=True)
        staging = scratch_dir(f"{STAGING_PREFIX}{target.name}-", run_dir)
        try:
            for path in sorted(source.rglob("*")):
                if path.is_file():
                    link = staging / path.relative_to(source)
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link_or_copy(path, link)
            staging.chmod(0o755)
            os.rename(staging, target)
            fsync_dir(run_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target


def latest_checkpoint(
    client: CheckpointClient,
    run: str,
    dest: str | os.PathLike[str],
    *,
    node: str | None = None,
) -> str | None:
    """The path of the latest valid checkpoint of ``run``, brought to
    ``dest/checkpoint-N`` verified, for ``resume_from_checkpoint``; None on a
    fresh start (no valid checkpoint yet)."""
    node = node or default_node()
    confirm_node(client, node)
    latest = client.latest(run, node=node)
    if latest is None:
        return None
    if latest.world_size != 1:
        raise ValueError(f"{run}:{latest.step} has {latest.world_size} ranks; expected one")
    dest_dir = Path(os.path.abspath(dest))
    target = dest_dir / f"{PREFIX}{latest.step}"
    remove_leftovers(dest_dir, (RESTORE_PREFIX,))  # restores killed midway
    if target.exists():
        if target.is_dir() and matches_catalog(target, latest):
            return str(target)
        aside = dest_dir / f"{STALE_PREFIX}{target.name}-{time.time_ns()}"
        log.warning(
            "%s does not match the registered %s:%d; moved to %s, restoring a verified copy",
            target,
            run,
            latest.step,
            aside,
        )
        try:
            os.rename(target, aside)
        except FileNotFoundError:
            pass  # another process of this job moved it first
    try:
        path, source = place_verified(client, latest, target, node=node)
    except (OSError, TierckptError):
        # Every process of a job may ask at once: one of them renamed its
        # verified copy into place first, which is as good as ours.
        if target.is_dir() and matches_catalog(target, latest):
            return str(target)
        raise
    log.info("%s:%d restored to %s from %s", run, latest.step, path, source)
    return str(path)


def _output_dir(args: TrainingArguments) -> Path:
    if not args.output_dir:
        raise ValueError("TrainingArguments.output_dir is not set: the Trainer saves nothing")
    return Path(os.path.abspath(args.output_dir))


def _metrics_of(state: TrainerState) -> dict[str, float]:
    """The numbers logged at this step (loss, learning rate, eval metrics)."""
    metrics: dict[str, float] = {}
    for entry in state.log_history:
        if entry.get("step") != state.global_step:
            continue
        for key, value in entry.items():
            if key in ("step", "epoch") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)) and math.isfinite(value):
                metrics[key] = float(value)
    return metrics


def _same_files(a: Path, b: Path) -> bool:
    names_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    names_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    if names_a != names_b:
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names_a)
