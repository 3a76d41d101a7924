"""PyTorch Lightning through tierckpt, one line of configuration::

    trainer = Trainer(..., plugins=[TierckptCheckpointIO(client, run, root)])

Needs the ``lightning`` extra (``pip install 'tierckpt[lightning]'``);
nothing else in ``tierckpt.client`` imports Lightning.

**Saving.** Lightning's ``ModelCheckpoint`` calls ``trainer.save_checkpoint(path)``,
which lands in :meth:`TierckptCheckpointIO.save_checkpoint`. The checkpoint
is one tierckpt checkpoint per ``global_step``, in a directory of its own::

    root/run/step-N/<name Lightning chose>.ckpt

``torch.save`` writes into a hidden staging directory beside it, the file is
fsynced, the directory renamed into place and its parent fsynced: a crash at
any point leaves either the whole file or a hidden leftover (removed at the
next start), never a truncated ``.ckpt`` under a real name (Lightning #688).
The directory is then registered (one HTTP call, the agent uploads in the
background). Why a directory per step rather than registering Lightning's own
file or folder: Lightning reuses names (``last.ckpt`` is rewritten at every
save) and deletes files it no longer ranks (``save_top_k``), while a
registered file must stay exactly as registered until the agent has uploaded
and evicted it; and registering Lightning's folder would sweep every other
checkpoint in it into this one.

Lightning still finds a file at the path it asked for: a hard link to the
registered file (same bytes, no second copy), replaced atomically when the
name is reused. ``best_model_path``, ``ckpt_path="last"`` and plain loads keep
working. When the path is on another filesystem no link is possible and
nothing is written there (a warning says so once): resume through tierckpt.
A second save at a step already written (``last.ckpt`` beside
``epoch=…-step=N.ckpt``) is the same training state: it is not stored twice,
its path is linked to the step's file.

**Removing.** :meth:`remove_checkpoint` (``save_top_k`` dropping a file)
removes Lightning's name only. The registered copy is never deleted behind
the agent's back: the agent evicts it from local disk once it is durable and
beyond ``[local] keep_last``, and deletes durable copies by its
``[retention]`` policies.

**Resuming.** ``trainer.fit(model, ckpt_path=...)`` with

- ``"tierckpt:latest"``: the latest valid (durable) checkpoint of the run;
- ``"tierckpt:<step>"``: that step, which must be valid;
- ``io.resume_path()``: ``"tierckpt:<latest step>"``, or None on a fresh
  start (Lightning then starts from scratch): the form for job scripts;
- a path under ``root/run/step-N/``: that step, loaded only if still valid.

The checkpoint is read from this node's copy when it is verified (the
agent's size/mtime check for the latest, a SHA-256 against the catalog for
an explicit step), else restored from a region (every byte hashed) into a
hidden scratch directory that is removed once loaded. Any other path is
loaded as Lightning's ``TorchCheckpointIO`` would load it. ``io.restored``
says what the last load used.

A ``dirpath`` on remote storage (``s3://…``) gets no link (the regions are
the remote copy): resume through tierckpt. The plugin is for the ``lightning``
package (``lightning.pytorch``), the one ``pip install lightning`` provides.

Lightning saves through ``CheckpointIO`` on global rank 0 only: this covers
single-device and DDP training. Sharded strategies (FSDP, DeepSpeed) write
their own per-rank files; use ``tierckpt.client.torch.save_distributed``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO

from ._files import fsync_dir, fsync_file
from ._frameworks import (
    RESTORE_PREFIX,
    STAGING_PREFIX,
    local_copy,
    remove_leftovers,
    resolve_step,
    scratch_dir,
)
from ._node import confirm_node, default_node
from .errors import ConflictError
from .sync_client import CheckpointClient

log = logging.getLogger("tierckpt.client.lightning")

SCHEME = "tierckpt:"
LINK_INFIX = ".tierckpt-link-"


@dataclass(frozen=True)
class Loaded:
    """What the last :meth:`TierckptCheckpointIO.load_checkpoint` read."""

    step: int | None  # None: a plain file outside tierckpt
    source: str  # "local" (this node's verified copy), "region", or "file"
    path: str  # the file read (a scratch path, gone, for "region")


class TierckptCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO``: atomic saves registered with tierckpt,
    loads of the latest valid checkpoint (see the module's docstring).

    ``root`` must lie under the agent's ``[local].roots``. ``node`` is this
    node's name as the agent knows it (default: $TIERCKPT_NODE or the host
    name). ``metadata`` is added to every registration.
    """

    def __init__(
        self,
        client: CheckpointClient,
        run: str,
        root: str | os.PathLike[str],
        *,
        node: str | None = None,
        fsync: bool = True,
        link: bool = True,
        priority: str = "normal",
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        if not run or "/" in run:
            raise ValueError(f"run must be a non-empty name without '/': {run!r}")
        self.client = client
        self.run = run
        self.root = Path(os.path.abspath(root))
        self.node = node or default_node()
        self.fsync = fsync
        self.link = link
        self.priority = priority
        self.metadata = dict(metadata or {})
        self.restored: Loaded | None = None
        self._torch_io = TorchCheckpointIO()
        self._warned_link = False
        # Lineage: the step loaded or saved last is the parent of the next save.
        self._parent: int | None = None
        self._clean_leftovers()

    @property
    def run_dir(self) -> Path:
        return self.root / self.run

    def step_dir(self, step: int) -> Path:
        return self.run_dir / f"step-{step}"

    def _clean_leftovers(self) -> None:
        # Saves and loads killed in an earlier life of this run: hidden,
        # never registered, never complete.
        remove_leftovers(self.run_dir, (STAGING_PREFIX, RESTORE_PREFIX))

    # -- save -------------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} takes no storage_options (got {storage_options!r})"
            )
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(
                f"checkpoint has no usable 'global_step' ({step!r}); tierckpt keys "
                "Lightning checkpoints by it"
            )
        text = os.fspath(path)
        # A remote dirpath (s3://…, through fsspec) gets no link: tierckpt's
        # regions are the remote copy, and a local path of that name would be junk.
        remote = "://" in text
        name = text.rstrip("/").rsplit("/", 1)[-1]
        if not name:
            raise ValueError(f"checkpoint path {path!r} has no file name")
        requested = Path(text) if remote else Path(os.path.abspath(text))
        began = time.monotonic()
        stored = self._write(checkpoint, step, name)
        written = time.monotonic() - began
        metadata = {**self.metadata, "framework": "lightning", "lightning_path": text}
        epoch = checkpoint.get("epoch")
        try:
            self.client.register(
                self.run,
                step,
                stored.parent,
                parent=self._parent if self._parent != step else None,
                priority=self.priority,
                epoch=epoch if isinstance(epoch, int) else None,
                metadata=metadata,
                write_seconds=written,
            )
        except ConflictError as exc:
            # Registered before with other bytes (a replayed, nondeterministic
            # step): the registered one stays, as steps are immutable.
            log.warning("%s step %d not registered again: %s", self.run, step, exc.message)
        self._parent = step
        if self.link and not remote and requested != stored:
            self._link(stored, requested)

    def _write(self, checkpoint: dict[str, Any], step: int, name: str) -> Path:
        """The step's file, written now or by an earlier save of this step."""
        target = self.step_dir(step)
        existing = _single_file(target)
        if existing is not None:
            return existing
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(
                f"{target} exists but is not one checkpoint file written by "
                f"{type(self).__name__}; move it out of {self.run_dir}"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        staging = scratch_dir(f"{STAGING_PREFIX}step-{step}-", self.run_dir)
        try:
            self._dump(checkpoint, staging / name)
            if self.fsync:
                fsync_file(staging / name)
            staging.chmod(0o755)
            try:
                os.rename(staging, target)
            except OSError:
                # The step appeared meanwhile (empty or complete): keep the
                # complete one, never mix two writes.
                existing = _single_file(target)
                if existing is not None:
                    return existing
                if target.is_dir() and not any(target.iterdir()):
                    target.rmdir()
                    os.rename(staging, target)
                else:
                    raise
            if self.fsync:
                fsync_dir(self.run_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target / name

    def _dump(self, checkpoint: dict[str, Any], file: Path) -> None:
        """Serialize (the one place a test may slow down to kill a save midway)."""
        torch.save(checkpoint, file)

    def _link(self, stored: Path, requested: Path) -> None:
        """Make Lightning's ``requested`` name the registered file's bytes:
        link under a hidden name, then rename over (atomic replacement)."""
        temporary = requested.with_name(f".{requested.name}{LINK_INFIX}{os.getpid()}")
        try:
            requested.parent.mkdir(parents=True, exist_ok=True)
            temporary.unlink(missing_ok=True)
            os.link(stored, temporary)
            os.replace(temporary, requested)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            if not self._warned_link:
                self._warned_link = True
                log.warning(
                    "cannot link %s to %s (%s): Lightning's path stays empty; resume with "
                    "ckpt_path='tierckpt:latest'",
                    requested,
                    stored,
                    exc.strerror or exc,
                )

    # -- remove -----------------------------------------------------------------------

    def remove_checkpoint(self, path: Any) -> None:
        """Drop Lightning's name for a checkpoint; a registered copy (under
        ``root/run``) stays for the agent's retention to evict."""
        text = os.fspath(path)
        if "://" in text:
            return  # never written there (see save_checkpoint)
        target = Path(os.path.abspath(text))
        if target.is_relative_to(self.run_dir):
            log.debug("%s kept: tierckpt's retention evicts registered copies", target)
            return
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)

    # -- load -------------------------------------------------------------------------

    def resume_path(self) -> str | None:
        """``"tierckpt:<step>"`` of the latest valid checkpoint, or None on a
        fresh start: ``trainer.fit(model, ckpt_path=io.resume_path())``."""
        latest = self.client.latest(self.run)
        return None if latest is None else f"{SCHEME}{latest.step}"

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        step = self._step_of(path)
        kwargs: dict[str, Any] = {"weights_only": weights_only}
        if map_location is not None:
            kwargs["map_location"] = map_location
        if step is _PLAIN:
            text = os.fspath(path)
            if "://" not in text and not os.path.exists(text):
                raise FileNotFoundError(
                    f"checkpoint file not found: {text}; to resume from tierckpt, pass "
                    "ckpt_path='tierckpt:latest' or 'tierckpt:<step>'"
                )
            loaded = self._torch_io.load_checkpoint(path, **kwargs)
            self.restored = Loaded(step=None, source="file", path=os.fspath(path))
            return loaded
        confirm_node(self.client, self.node)
        checkpoint = resolve_step(self.client, self.run, step, self.node)
        local = local_copy(checkpoint, self.node)
        if local is not None:
            file = local / _file_name(checkpoint)
            try:
                loaded = self._torch_io.load_checkpoint(file, **kwargs)
            except (OSError, RuntimeError) as exc:
                log.warning("local copy %s unusable (%s); restoring from a region", file, exc)
            else:
                self.restored = Loaded(step=checkpoint.step, source="local", path=str(file))
                self._parent = checkpoint.step
                return loaded
        self.run_dir.mkdir(parents=True, exist_ok=True)
        scratch = scratch_dir(f"{RESTORE_PREFIX}{checkpoint.step}-", self.run_dir)
        try:
            restored = self.client.restore(self.run, scratch / "ckpt", step=checkpoint.step)
            file = restored / _file_name(checkpoint)
            loaded = self._torch_io.load_checkpoint(file, **kwargs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self.restored = Loaded(step=checkpoint.step, source="region", path=str(file))
        self._parent = checkpoint.step
        return loaded

    def _step_of(self, path: Any) -> Any:
        """The step ``path`` names (None: the latest), or _PLAIN for a file
        that is not a tierckpt checkpoint of this run."""
        text = os.fspath(path) if isinstance(path, os.PathLike) else path
        if not isinstance(text, str):
            raise TypeError(f"checkpoint path must be a string or a path, not {type(path)}")
        if text.startswith(SCHEME):
            rest = text[len(SCHEME) :]
            if rest == "latest":
                return None
            if rest.isdigit():
                return int(rest)
            raise ValueError(
                f"ckpt_path {text!r}: expected 'tierckpt:latest' or 'tierckpt:<step>' "
                "(a non-negative integer)"
            )
        absolute = Path(os.path.abspath(text))
        if absolute.is_relative_to(self.run_dir):
            first = absolute.relative_to(self.run_dir).parts[:1]
            if first and first[0].startswith("step-") and first[0][5:].isdigit():
                return int(first[0][5:])
        return _PLAIN


_PLAIN = object()


def _single_file(directory: Path) -> Path | None:
    """The one file of a step directory this plugin renamed into place."""
    if not directory.is_dir():
        return None
    files = [p for p in directory.iterdir() if p.is_file()]
    return files[0] if len(files) == 1 else None


def _file_name(checkpoint: Any) -> str:
    files = [f.path for f in checkpoint.files if f.rank == 0]
    if len(files) != 1 or "/" in files[0]:
        raise ValueError(
            f"{checkpoint.run}:{checkpoint.step} holds {len(files)} files, not the one "
            ".ckpt file TierckptCheckpointIO writes: not a Lightning checkpoint of this plugin"
        )
    return files[0]
