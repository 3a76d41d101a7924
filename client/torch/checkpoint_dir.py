"""One checkpoint directory: the training state written to files and read back.

``step-N/model.safetensors`` (the model's state_dict), ``state.safetensors``
(every other tensor), ``state.json`` (everything else, see :mod:`.codec`)
and, only when needed, ``objects.pt``. :func:`save_state` writes them in a
hidden sibling, fsyncs and renames it into place: a reader (the agent) sees
all or nothing.
"""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from safetensors.torch import load_file, save_file

from .._files import fsync_dir, fsync_file
from .codec import Encoder, decode
from .rng import capture_rng, restore_rng

FORMAT = "tierckpt.torch/1"
MODEL_FILE = "model.safetensors"
TENSORS_FILE = "state.safetensors"
STATE_FILE = "state.json"
OBJECTS_FILE = "objects.pt"
STAGING_PREFIX = ".tierckpt-staging-"
RESTORE_PREFIX = ".tierckpt-restore-"
SAFETENSORS_METADATA = {"format": "pt"}


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


@dataclass
class TrainingState:
    """What :func:`load_state` gives back besides the objects it loaded into."""

    step: int
    epoch: int | None = None
    extra: Any = None
    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class EncodedState:
    """The training state split into what each file of the checkpoint holds:
    tensors for the two safetensors files, objects to pickle (``objects.pt``,
    None when there are none) and the JSON skeleton (``state.json``)."""

    model_tensors: dict[str, torch.Tensor] | None
    state_tensors: dict[str, torch.Tensor]
    objects: dict[str, Any] | None
    skeleton: str


def encode_state(
    *,
    step: int,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    data: Stateful | None = None,
    generators: Mapping[str, Any] | None = None,
    epoch: int | None = None,
    extra: Any = None,
) -> EncodedState:
    """The training state as :class:`EncodedState`: the same split whether it
    is written to a directory (:func:`write_state`) or into a memory segment
    (:mod:`.memory_stage`), so both hold the same files."""
    model_enc, state_enc = Encoder(), Encoder()
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
    text = json.dumps(skeleton, sort_keys=True, allow_nan=False, separators=(",", ":"))
    return EncodedState(
        model_tensors=model_enc.tensors if model is not None else None,
        state_tensors=state_enc.tensors,
        objects=state_enc.objects or None,
        skeleton=text + "\n",
    )


def write_state(
    directory: str | os.PathLike[str], *, fsync: bool = True, **state: Any
) -> list[Path]:
    """Write the training state (the arguments of :func:`encode_state`) into
    ``directory`` (created; must not exist or be empty). Returns the files
    written. Not atomic by itself: see :func:`save_state`."""
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    if any(target.iterdir()):
        raise FileExistsError(f"{target} is not empty")
    encoded = encode_state(**state)
    written = []
    if encoded.model_tensors is not None:
        save_file(encoded.model_tensors, str(target / MODEL_FILE), metadata=SAFETENSORS_METADATA)
        written.append(target / MODEL_FILE)
    save_file(encoded.state_tensors, str(target / TENSORS_FILE), metadata=SAFETENSORS_METADATA)
    written.append(target / TENSORS_FILE)
    if encoded.objects is not None:
        torch.save(encoded.objects, target / OBJECTS_FILE)
        written.append(target / OBJECTS_FILE)
    (target / STATE_FILE).write_text(encoded.skeleton)
    written.append(target / STATE_FILE)
    if fsync:
        for path in written:
            fsync_file(path)
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
    tensors = _owned_tensors(source / TENSORS_FILE)
    objects: dict[str, Any] = {}
    if (source / OBJECTS_FILE).exists():
        objects = torch.load(source / OBJECTS_FILE, weights_only=False)
    if model is not None:
        if "model" not in skeleton:
            raise ValueError(f"{source} holds no model state")
        # Mapped, not copied: load_state_dict copies every tensor into the
        # module's own, and the mapping goes with ``model_tensors``.
        model_tensors = load_file(str(source / MODEL_FILE))
        state = decode(skeleton["model"], model_tensors, {})
        metadata = decode(skeleton.get("model_metadata"), tensors, objects)
        if metadata is not None:
            state = _with_metadata(state, metadata)
        model.load_state_dict(state, strict=strict)
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("data", data)):
        if obj is None:
            continue
        if name not in skeleton:
            raise ValueError(f"{source} holds no {name} state")
        obj.load_state_dict(decode(skeleton[name], tensors, objects))
    if restore_rngs:
        restore_rng(decode(skeleton["rng"], tensors, objects), generators)
    return TrainingState(
        step=int(skeleton["step"]),
        epoch=skeleton.get("epoch"),
        extra=decode(skeleton.get("extra"), tensors, objects),
        path=source,
        meta={"torch": skeleton.get("torch")},
    )


def _owned_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, in memory of this process's own.

    ``load_file`` maps the file, and ``Optimizer.load_state_dict`` (as a
    scheduler's, or a user's ``extra``) keeps the tensors it is given: the
    trainer's live state would stay backed by a file it does not own (the
    agent's memory tier, T0, a download's scratch directory), and whoever
    truncates or rewrites that file changes the state under it, without an
    error. Each tensor is cloned out of the mapping, which then goes.
    """
    mapped = load_file(str(path))
    owned = {}
    while mapped:
        name, tensor = mapped.popitem()
        owned[name] = tensor.clone()
    return owned


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
            fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target, [target / f.name for f in files]


def same_files(a: Path, b: Path) -> bool:
    names_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    names_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    if names_a != names_b:
        return False
    return all(filecmp.cmp(a / n, b / n, shallow=False) for n in names_a)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
