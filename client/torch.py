"""PyTorch training state through tierckpt: save exactly, register, resume exactly.

Needs the ``torch`` extra (``pip install 'tierckpt[torch]'``: torch,
safetensors, numpy); nothing else in ``tierckpt.client`` imports torch.

One checkpoint is a directory on the node's local SSD::

    step-N/model.safetensors    the model's state_dict, its own keys (any safetensors tool reads it)
           state.safetensors    every other tensor: optimizer moments, RNG states, …
           state.json           everything else: step, epoch, optimizer/scheduler structure,
                                data-loader position, Python/NumPy RNG states, extra
           objects.pt           only when something is neither JSON nor a tensor (torch.save)

written in a hidden staging directory, fsynced and renamed into place (the
agent never sees half a checkpoint), then registered with one HTTP call
(``write_seconds`` = the stall the trainer paid). The agent uploads it in the
background.

Exact resume needs every source of randomness back: Python's ``random``,
NumPy's global generator, torch's CPU (and CUDA) generators, plus any
generator the caller passes by name (``torch.Generator``, ``random.Random``,
``numpy.random.Generator``/``RandomState``), and the data-loader position
(:class:`ResumableLoader` wraps a ``DataLoader`` whose shuffling uses a
seeded generator).

:class:`TorchCheckpointer` does both directions for a training loop;
``restore_latest()`` asks the service for the latest valid checkpoint, loads
it straight from the T0 copy when this node still holds a verified one,
otherwise downloads a verified copy from the nearest region, and returns the
step to continue from. :func:`save_distributed` / :func:`restore_distributed`
do the same for ``torch.distributed.checkpoint`` (DCP): every rank writes its
part into its own directory and registers it as its rank; a restore brings
all ranks' files back into one directory, where DCP finds ``.metadata`` and
every ``__R_0.distcp``.

Restoring trusts the checkpoint as much as ``torch.load(weights_only=False)``
would, but only for ``objects.pt`` (absent unless the state held arbitrary
objects); tensors and JSON never run code. Checkpoints come from the service,
SHA-256 verified.
"""

from __future__ import annotations

import base64
import contextlib
import filecmp
import hashlib
import json
import logging
import math
import os
import random
import shutil
import socket
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

import torch
from safetensors.torch import load_file, save_file

from .errors import CheckpointFailedError, ConflictError, NotFoundError, TierckptError
from .models import Checkpoint

if TYPE_CHECKING:
    from .sync_client import CheckpointClient

try:  # NumPy is optional even here: its RNG is saved only when it is installed.
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with the torch extra
    np = None  # type: ignore[assignment]

log = logging.getLogger("tierckpt.client.torch")

FORMAT = "tierckpt.torch/1"
MODEL_FILE = "model.safetensors"
TENSORS_FILE = "state.safetensors"
STATE_FILE = "state.json"
OBJECTS_FILE = "objects.pt"
STAGING_PREFIX = ".tierckpt-staging-"
RESTORE_PREFIX = ".tierckpt-restore-"

T_co = TypeVar("T_co", covariant=True)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


# -- nested state <-> JSON skeleton + flat tensors ---------------------------------


class _Encoder:
    """Turns nested Python state into JSON with references to a flat dict of
    tensors (for safetensors) and, as a last resort, of pickled objects.

    A tensor that is the very same view as one already seen (tied weights) is
    stored once and referenced twice; one that overlaps another differently is
    cloned, since safetensors refuses shared memory.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.objects: dict[str, Any] = {}
        self._views: dict[tuple[Any, ...], str] = {}
        self._ranges: dict[int, list[tuple[int, int]]] = {}

    def _key(self, path: tuple[str, ...], taken: Mapping[str, Any]) -> str:
        key = "/".join(path) or "."
        unique, n = key, 1
        while unique in taken:
            n += 1
            unique = f"{key}#{n}"
        return unique

    def tensor(self, value: torch.Tensor, path: tuple[str, ...]) -> str:
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        view = (ptr, tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        if ptr and view in self._views:
            return self._views[view]
        start = int(tensor.storage_offset()) * tensor.element_size()
        end = start + int(tensor.numel()) * tensor.element_size()
        spans = self._ranges.setdefault(ptr, [])
        if ptr and any(s < end and start < e for s, e in spans):
            tensor = tensor.clone()
        else:
            spans.append((start, end))
        key = self._key(path, self.tensors)
        self.tensors[key] = tensor
        if ptr:
            self._views[view] = key
        return key

    def encode(self, value: Any, path: tuple[str, ...] = ()) -> Any:
        if value is None or isinstance(value, bool | int | str):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"$float": repr(value)}
        if isinstance(value, torch.Tensor) and _plain_tensor(value):
            return {"$tensor": self.tensor(value, path)}
        if isinstance(value, torch.Size):
            return {"$size": list(value)}
        if isinstance(value, torch.dtype):
            return {"$dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"$device": str(value)}
        if isinstance(value, torch.Generator):
            state = self.tensor(value.get_state(), path)
            return {"$generator": state, "device": str(value.device)}
        if np is not None and isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            return {"$ndarray": self.tensor(torch.from_numpy(value.copy()), path)}
        if isinstance(value, bytes):
            return {"$bytes": base64.b64encode(value).decode()}
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return {"$tuple": [self.encode(v, (*path, str(i))) for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [self.encode(v, (*path, str(i))) for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in value):
                return {k: self.encode(v, (*path, k)) for k, v in value.items()}
            return {
                "$dict": [
                    [self.encode(k, (*path, "key")), self.encode(v, (*path, str(k)))]
                    for k, v in value.items()
                ]
            }
        key = self._key(path, self.objects)
        self.objects[key] = value
        return {"$object": key}


def _plain_tensor(value: torch.Tensor) -> bool:
    # safetensors holds dense strided tensors; sparse, quantized or nested
    # ones go through torch.save.
    return value.layout == torch.strided and not value.is_quantized and not value.is_nested


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], objects: Mapping[str, Any]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, objects) for v in value]
    if not isinstance(value, dict):
        return value
    if "$tensor" in value:
        return tensors[value["$tensor"]]
    if "$tuple" in value:
        return tuple(_decode(v, tensors, objects) for v in value["$tuple"])
    if "$dict" in value:
        return {
            _decode(k, tensors, objects): _decode(v, tensors, objects) for k, v in value["$dict"]
        }
    if "$float" in value:
        return float(value["$float"])
    if "$ndarray" in value:
        if np is None:
            raise RuntimeError("this checkpoint holds NumPy arrays; install numpy to load it")
        return tensors[value["$ndarray"]].numpy().copy()
    if "$generator" in value:
        generator = torch.Generator(device=value.get("device", "cpu"))
        generator.set_state(tensors[value["$generator"]])
        return generator
    if "$size" in value:
        return torch.Size(value["$size"])
    if "$dtype" in value:
        return getattr(torch, value["$dtype"])
    if "$device" in value:
        return torch.device(value["$device"])
    if "$bytes" in value:
        return base64.b64decode(value["$bytes"])
    if "$object" in value:
        return objects[value["$object"]]
    return {k: _decode(v, tensors, objects) for k, v in value.items()}


# -- random number generators --------------------------------------------------------


def _generator_state(generator: Any) -> dict[str, Any]:
    if isinstance(generator, torch.Generator):
        return {"kind": "torch", "state": generator.get_state()}
    if isinstance(generator, random.Random):
        return {"kind": "python", "state": generator.getstate()}
    if np is not None and isinstance(generator, np.random.Generator):
        return {"kind": "numpy", "state": generator.bit_generator.state}
    if np is not None and isinstance(generator, np.random.RandomState):
        return {"kind": "numpy-legacy", "state": generator.get_state(legacy=False)}
    raise TypeError(
        f"cannot save the state of a {type(generator).__name__}; pass torch.Generator, "
        "random.Random, numpy.random.Generator or numpy.random.RandomState"
    )


def _set_generator_state(name: str, generator: Any, saved: Mapping[str, Any]) -> None:
    kind, state = saved["kind"], saved["state"]
    expected = _generator_state(generator)["kind"]
    if kind != expected:
        raise ValueError(f"generator {name!r} was saved as {kind}, cannot restore into {expected}")
    if kind == "torch":
        generator.set_state(state)
    elif kind == "python":
        generator.setstate(state)
    elif kind == "numpy":
        generator.bit_generator.state = state
    else:
        generator.set_state(state)


def capture_rng(generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every RNG state a resume needs: Python, NumPy, torch CPU and CUDA, and
    the named ``generators``."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "generators": {name: _generator_state(g) for name, g in (generators or {}).items()},
    }
    if np is not None:
        state["numpy"] = np.random.get_state(legacy=False)
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any], generators: Mapping[str, Any] | None = None) -> None:
    """Put back what :func:`capture_rng` saved; ``generators`` must name the
    same generators (a missing one would make the resume inexact)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning(
                "checkpoint has CUDA RNG states for %d devices, this process sees %d; "
                "CUDA RNGs not restored",
                len(cuda),
                torch.cuda.device_count(),
            )
    saved = state.get("generators", {})
    for name, generator in (generators or {}).items():
        if name not in saved:
            raise ValueError(f"the checkpoint has no state for generator {name!r}")
        _set_generator_state(name, generator, saved[name])


# -- the data-loader position ----------------------------------------------------------


class ResumableLoader(Generic[T_co]):
    """Epoch-by-epoch iteration over a ``DataLoader`` whose position can be saved.

    The loader must shuffle with an explicit generator
    (``DataLoader(..., shuffle=True, generator=g)``); that generator's state at
    the start of the epoch and the number of batches consumed since are the
    position. A restored loader replays the epoch's order from that state and
    skips the consumed batches (they are loaded, not trained on; the global
    RNGs are put back afterwards, so a dataset that draws random numbers
    while loading does not shift them).
    """

    def __init__(self, loader: Any, generator: torch.Generator | None = None) -> None:
        self.loader = loader
        generator = generator if generator is not None else getattr(loader, "generator", None)
        if not isinstance(generator, torch.Generator):
            raise ValueError(
                "ResumableLoader needs the DataLoader's shuffling generator: "
                "DataLoader(..., generator=torch.Generator().manual_seed(seed))"
            )
        self.generator = generator
        self.epoch = 0
        self.batches = 0  # consumed in the current epoch
        self._epoch_start: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[T_co]:
        if self._epoch_start is None:
            self._epoch_start = self.generator.get_state()
        else:
            self.generator.set_state(self._epoch_start)
        iterator = iter(self.loader)
        if self.batches:
            with _preserved_global_rng():
                for _ in range(self.batches):
                    next(iterator)
        for batch in iterator:
            self.batches += 1
            yield batch
        self.epoch += 1
        self.batches = 0
        self._epoch_start = None

    def state_dict(self) -> dict[str, Any]:
        start = self._epoch_start if self._epoch_start is not None else self.generator.get_state()
        return {"epoch": self.epoch, "batches": self.batches, "generator": start.clone()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.batches = int(state["batches"])
        self._epoch_start = state["generator"].clone()
        self.generator.set_state(self._epoch_start)


@contextlib.contextmanager
def _preserved_global_rng() -> Iterator[None]:
    saved = capture_rng()
    try:
        yield
    finally:
        restore_rng(saved)


# -- one checkpoint directory -------------------------------------------------------------


@dataclass
class TrainingState:
    """What :func:`load_state` gives back besides the objects it loaded into."""

    step: int
    epoch: int | None = None
    extra: Any = None
    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_state(
    directory: str | os.PathLike[str],
    *,
    step: int,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    data: Stateful | None = None,
    generators: Mapping[str, Any] | None = None,
    epoch: int | None = None,
    extra: Any = None,
    fsync: bool = True,
) -> list[Path]:
    """Write the training state into ``directory`` (created; must not exist
    or be empty). Returns the files written. Not atomic by itself: see
    :func:`save_state`."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    if any(target.iterdir()):
        raise FileExistsError(f"{target} is not empty")
    model_enc, state_enc = _Encoder(), _Encoder()
    skeleton: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "epoch": epoch,
        # No timestamp: a replayed step must produce the very same bytes.
        "torch": torch.__version__,
    }
    if model is not None:
        state_dict = model.state_dict()
        skeleton["model"] = model_enc.encode(dict(state_dict))
        skeleton["model_metadata"] = state_enc.encode(getattr(state_dict, "_metadata", None))
        if model_enc.objects:
            raise ValueError(
                f"model state has non-tensor entries {sorted(model_enc.objects)}; "
                "save them through extra="
            )
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("data", data)):
        if obj is not None:
            skeleton[name] = state_enc.encode(obj.state_dict(), (name,))
    skeleton["rng"] = state_enc.encode(capture_rng(generators), ("rng",))
    skeleton["extra"] = state_enc.encode(extra, ("extra",))

    written = []
    if model is not None:
        save_file(model_enc.tensors, str(target / MODEL_FILE), metadata={"format": "pt"})
        written.append(target / MODEL_FILE)
    save_file(state_enc.tensors, str(target / TENSORS_FILE), metadata={"format": "pt"})
    written.append(target / TENSORS_FILE)
    if state_enc.objects:
        torch.save(state_enc.objects, target / OBJECTS_FILE)
        written.append(target / OBJECTS_FILE)
    text = json.dumps(skeleton, sort_keys=True, allow_nan=False, separators=(",", ":"))
    (target / STATE_FILE).write_text(text + "\n")
    written.append(target / STATE_FILE)
    if fsync:
        for path in written:
            _fsync_file(path)
    return written


def load_state(
    directory: str | os.PathLike[str],
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    data: Stateful | None = None,
    generators: Mapping[str, Any] | None = None,
    restore_rngs: bool = True,
    strict: bool = True,
) -> TrainingState:
    """Load a directory written by :func:`write_state` into the given objects."""
    source = Path(directory)
    skeleton = json.loads((source / STATE_FILE).read_text())
    if skeleton.get("format") != FORMAT:
        raise ValueError(f"{source} is not a {FORMAT} checkpoint: {skeleton.get('format')!r}")
    tensors = load_file(str(source / TENSORS_FILE))
    objects: dict[str, Any] = {}
    if (source / OBJECTS_FILE).exists():
        objects = torch.load(source / OBJECTS_FILE, weights_only=False)
    if model is not None:
        if "model" not in skeleton:
            raise ValueError(f"{source} holds no model state")
        model_tensors = load_file(str(source / MODEL_FILE))
        state = _decode(skeleton["model"], model_tensors, {})
        metadata = _decode(skeleton.get("model_metadata"), tensors, objects)
        if metadata is not None:
            state = _with_metadata(state, metadata)
        model.load_state_dict(state, strict=strict)
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("data", data)):
        if obj is None:
            continue
        if name not in skeleton:
            raise ValueError(f"{source} holds no {name} state")
        obj.load_state_dict(_decode(skeleton[name], tensors, objects))
    if restore_rngs:
        restore_rng(_decode(skeleton["rng"], tensors, objects), generators)
    return TrainingState(
        step=int(skeleton["step"]),
        epoch=skeleton.get("epoch"),
        extra=_decode(skeleton.get("extra"), tensors, objects),
        path=source,
        meta={"torch": skeleton.get("torch")},
    )


def _with_metadata(state: dict[str, Any], metadata: Any) -> dict[str, Any]:
    # load_state_dict reads per-module versions from this attribute (e.g.
    # BatchNorm's); an OrderedDict can carry it, a dict cannot.
    ordered: Any = OrderedDict(state)
    ordered._metadata = metadata
    return cast(dict[str, Any], ordered)


def save_state(
    directory: str | os.PathLike[str], *, fsync: bool = True, **state: Any
) -> tuple[Path, list[Path]]:
    """:func:`write_state` into a hidden sibling, then rename it to
    ``directory`` (which must not exist): a reader sees all or nothing."""
    target = Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target} exists; a checkpoint directory is written once")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{target.name}-", dir=target.parent))
    try:
        files = write_state(staging, fsync=fsync, **state)
        staging.chmod(0o755)
        os.rename(staging, target)
        if fsync:
            _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target, [target / f.name for f in files]


def _same_files(a: Path, b: Path) -> bool:
    names_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    names_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    if names_a != names_b:
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names_a)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# -- the trainer's side ------------------------------------------------------------------


@dataclass(frozen=True)
class Restored:
    """Where the last ``restore_latest`` came from."""

    step: int
    source: str  # "local" (the T0 copy on this node) or "region"
    region: str | None
    seconds: float
    path: str | None = None
    regions: tuple[str, ...] = ()  # where the checkpoint is committed


def default_node() -> str:
    """This node's name as the agent knows it: $TIERCKPT_NODE, else the host
    name (the agent's default ``[server].node``)."""
    return os.environ.get("TIERCKPT_NODE") or socket.gethostname()


class TorchCheckpointer:
    """Save and resume a PyTorch training loop through a tierckpt agent.

    ``root`` is a directory under the agent's ``[local].roots``; checkpoints go
    to ``root/run/step-N`` (``…/step-N/rank-R`` when ``world_size > 1``: then
    every rank saves its own state, RNGs included, and restores only its own).
    """

    def __init__(
        self,
        client: CheckpointClient,
        run: str,
        root: str | os.PathLike[str],
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        data: Stateful | None = None,
        generators: Mapping[str, Any] | None = None,
        rank: int = 0,
        world_size: int = 1,
        node: str | None = None,
        fsync: bool = True,
        send_hashes: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        self.client = client
        self.run = run
        self.root = Path(os.path.abspath(root))
        self.objects: dict[str, Any] = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "data": data,
            "generators": dict(generators or {}),
        }
        self.rank, self.world_size = rank, world_size
        self.node = node or default_node()
        self.fsync = fsync
        self.send_hashes = send_hashes
        self.restored: Restored | None = None
        self.state: TrainingState | None = None  # what the last restore loaded
        self._parent: int | None = None
        self._clean_leftovers()

    @property
    def run_dir(self) -> Path:
        return self.root / self.run

    def path_of(self, step: int) -> Path:
        path = self.run_dir / f"step-{step}"
        return path / f"rank-{self.rank:05d}" if self.world_size > 1 else path

    def _clean_leftovers(self) -> None:
        # Staging and restore directories of an earlier life of this rank,
        # killed mid-write or mid-restore: never registered, never complete.
        if not self.run_dir.is_dir():
            return
        if self.world_size == 1:
            pattern = f"{STAGING_PREFIX}step-*"
        else:
            pattern = f"step-*/{STAGING_PREFIX}rank-{self.rank:05d}-*"
        leftovers = [*self.run_dir.glob(pattern)]
        leftovers += self.run_dir.glob(f"{RESTORE_PREFIX}*-rank{self.rank}-*")
        for entry in leftovers:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)

    # -- save ---------------------------------------------------------------------------

    def save(
        self,
        step: int,
        *,
        epoch: int | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        extra: Any = None,
        priority: str = "normal",
        wait_durable: float | None = None,
    ) -> Checkpoint:
        """Write the state of ``step`` to local SSD and register it; returns at
        once unless ``wait_durable`` (seconds) asks to wait until the copy is
        durable (the last save before a preemption).

        Saving a step again (a resumed run replaying steps) keeps the first
        copy when the bytes are the same; if they differ and the first one is
        registered already, it stays, with a warning: a step is immutable.
        """
        began = time.monotonic()
        target = self.path_of(step)
        o = self.objects
        state = {
            "step": step,
            "epoch": epoch,
            "extra": extra,
            "model": o["model"],
            "optimizer": o["optimizer"],
            "scheduler": o["scheduler"],
            "data": o["data"],
            "generators": o["generators"],
        }
        if target.exists():
            existing = self._resave(target, state)
            if existing is not None:
                return self._wait(existing, wait_durable)
        else:
            save_state(target, fsync=self.fsync, **state)
        files = None
        if self.send_hashes:
            files = {
                p.relative_to(target).as_posix(): _sha256(p)
                for p in target.rglob("*")
                if p.is_file()
            }
        written = time.monotonic() - began
        try:
            checkpoint = self.client.register(
                self.run,
                step,
                target,
                rank=self.rank,
                world_size=self.world_size,
                metrics=metrics,
                parent=self._parent,
                priority=priority,
                epoch=epoch,
                metadata=metadata,
                files=files,
                write_seconds=written,
            )
        except ConflictError as exc:
            log.warning("%s step %d not registered: %s", self.run, step, exc.message)
            checkpoint = self.client.get(self.run, step)
        self._parent = step
        log.debug("%s step %d: %.3f s write + register", self.run, step, time.monotonic() - began)
        return self._wait(checkpoint, wait_durable)

    def _resave(self, target: Path, state: dict[str, Any]) -> Checkpoint | None:
        """``target`` exists from an earlier life. Keep it if it holds the same
        bytes (return None: register it, idempotently); replace it if it was
        never registered; keep the registered one otherwise (returned)."""
        scratch = Path(
            tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{target.name}-", dir=target.parent)
        )
        try:
            write_state(scratch, fsync=False, **state)
            if _same_files(scratch, target):
                return None
            try:
                registered: Checkpoint | None = self.client.get(self.run, state["step"])
            except NotFoundError:
                registered = None
            mine = registered is not None and any(s.rank == self.rank for s in registered.shards)
            if mine and registered is not None and registered.state not in ("failed", "deleted"):
                log.warning(
                    "%s step %d was registered before with other content (nondeterministic "
                    "training?); keeping the registered one",
                    self.run,
                    state["step"],
                )
                self._parent = state["step"]
                return registered
            shutil.rmtree(target)
            if self.fsync:
                for path in scratch.iterdir():
                    _fsync_file(path)
            scratch.chmod(0o755)
            os.rename(scratch, target)
            return None
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def wait_durable(self, step: int, timeout: float) -> Checkpoint:
        """Wait up to ``timeout`` seconds for a saved step to be durable (e.g.
        on preemption, when the last save was a normal one); returns it in
        whatever state it reached."""
        return self._wait(self.client.get(self.run, step), timeout)

    def _wait(self, checkpoint: Checkpoint, timeout: float | None) -> Checkpoint:
        if timeout is None:
            return checkpoint
        try:
            return self.client.wait(self.run, checkpoint.step, state="durable", timeout=timeout)
        except (TimeoutError, CheckpointFailedError) as exc:
            log.warning("%s step %d not durable: %s", self.run, checkpoint.step, exc)
            return self.client.get(self.run, checkpoint.step)

    # -- restore ------------------------------------------------------------------------

    def restore_latest(self, *, region: str | None = None, restore_rngs: bool = True) -> int:
        """Load the latest valid checkpoint of the run into the objects;
        returns its step (the number of steps done), 0 when there is none."""
        began = time.monotonic()
        latest = self.client.latest(self.run, region=region, node=self.node)
        if latest is None:
            self.restored, self.state = None, None
            return 0
        kwargs: dict[str, Any] = {
            "model": self.objects["model"],
            "optimizer": self.objects["optimizer"],
            "scheduler": self.objects["scheduler"],
            "data": self.objects["data"],
            "generators": self.objects["generators"],
            "restore_rngs": restore_rngs,
        }
        state: TrainingState | None = None
        source, used_region, path = "local", None, None
        if latest.local is not None and self.world_size == 1:
            try:
                state = load_state(latest.local.path, **kwargs)
                path = latest.local.path
                if state.step != latest.step:
                    raise ValueError(f"holds step {state.step}, not {latest.step}")
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                log.warning("local copy %s unusable (%s); restoring from a region", path, exc)
                state = None
        if state is None:
            source = "region"
            self.run_dir.mkdir(parents=True, exist_ok=True)
            scratch = Path(
                tempfile.mkdtemp(
                    prefix=f"{RESTORE_PREFIX}{latest.step}-rank{self.rank}-", dir=self.run_dir
                )
            )
            try:
                restored = self.client.restore(
                    self.run,
                    scratch / "ckpt",
                    step=latest.step,
                    region=region,
                    rank=self.rank if self.world_size > 1 else None,
                )
                state = load_state(restored, **kwargs)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            used_region = region or (latest.locations[0].region if latest.locations else None)
        self._parent = latest.step
        self.state = state
        self.restored = Restored(
            step=latest.step,
            source=source,
            region=used_region,
            seconds=time.monotonic() - began,
            path=path,
            regions=tuple(location.region for location in latest.locations),
        )
        return state.step


# -- torch.distributed.checkpoint ----------------------------------------------------------


def _broadcast(value: Any, process_group: Any) -> Any:
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, group=process_group)
    return box[0]


def save_distributed(
    client: CheckpointClient,
    run: str,
    step: int,
    state_dict: dict[str, Any],
    root: str | os.PathLike[str],
    *,
    metrics: Mapping[str, float] | None = None,
    metadata: Mapping[str, Any] | None = None,
    parent: int | None = None,
    priority: str = "normal",
    process_group: Any = None,
) -> Checkpoint | None:
    """Collective: every rank writes its part of ``state_dict`` with DCP's
    ``FileSystemWriter`` into ``root/run/step-N/rank-R`` and registers it as
    rank R of the world. Returns this rank's registration, or None when the
    step was registered before (a replayed step: left as it is)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank(process_group)
    world = dist.get_world_size(process_group)
    directory = Path(os.path.abspath(root)) / run / f"step-{step}" / f"rank-{rank:05d}"
    # A replayed step (resumed from an older checkpoint) may be registered
    # already, wholly or for some ranks. dcp.save is collective, so every rank
    # writes; a rank whose part is registered writes to a throwaway directory
    # and leaves its registered files alone.
    known: tuple[str | None, list[int]] = (None, [])
    if rank == 0:
        try:
            detail = client.get(run, step)
            known = (detail.state, [shard.rank for shard in detail.shards])
        except NotFoundError:
            pass
    state, registered_ranks = _broadcast(known, process_group)
    usable = state is not None and state not in ("failed", "deleted")
    if usable and len(set(registered_ranks)) == world:
        log.info("%s step %d is registered already (%s); not saved again", run, step, state)
        return None
    mine = usable and rank in registered_ranks
    began = time.monotonic()
    scratch = None
    if mine:
        directory.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(
            tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}rank-{rank:05d}-", dir=directory.parent)
        )
    elif directory.exists():
        shutil.rmtree(directory)  # an unregistered leftover of an earlier life
    try:
        dcp.save(
            state_dict,
            storage_writer=dcp.FileSystemWriter(str(scratch or directory)),
            process_group=process_group,
        )
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if mine:
        return None
    written = time.monotonic() - began
    try:
        return client.register(
            run,
            step,
            directory,
            rank=rank,
            world_size=world,
            metrics=metrics,
            metadata=metadata,
            parent=parent,
            priority=priority,
            write_seconds=written,
        )
    except TierckptError as exc:
        log.warning("%s step %d rank %d not registered: %s", run, step, rank, exc)
        return None


def latest_distributed(
    client: CheckpointClient, run: str, *, region: str | None = None, process_group: Any = None
) -> int | None:
    """Collective: the step of ``run``'s latest valid checkpoint as rank 0
    sees it, the same on every rank (None when there is none)."""
    import torch.distributed as dist

    step = None
    if dist.get_rank(process_group) == 0:
        latest = client.latest(run, region=region)
        step = latest.step if latest is not None else None
    found = _broadcast(step, process_group)
    return None if found is None else int(found)


def restore_distributed(
    client: CheckpointClient,
    run: str,
    state_dict: dict[str, Any],
    root: str | os.PathLike[str],
    *,
    step: int | None = None,
    region: str | None = None,
    process_group: Any = None,
) -> int:
    """Collective: load a DCP checkpoint of ``run`` (``step``, default the
    latest valid one, see :func:`latest_distributed`) into ``state_dict`` in
    place, as ``dcp.load`` does. Every rank downloads the whole checkpoint
    (all ranks' files in one directory, which is what DCP reads) next to its
    data, loads it and removes the download. Returns the step, 0 when there
    is none.

    Build ``state_dict`` only once you know there is something to load:
    ``get_state_dict(model, optimizer)`` initialises a fresh optimizer's state
    by stepping it (with lr 0), which shifts Adam's step count of a fresh run.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if step is None:
        step = latest_distributed(client, run, region=region, process_group=process_group)
        if step is None:
            return 0
    rank = dist.get_rank(process_group)
    run_dir = Path(os.path.abspath(root)) / run
    run_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"{RESTORE_PREFIX}{step}-rank{rank}-", dir=run_dir))
    try:
        restored = client.restore(run, scratch / "ckpt", step=step, region=region)
        dcp.load(
            state_dict,
            storage_reader=dcp.FileSystemReader(str(restored)),
            process_group=process_group,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return int(step)
