"""Nested training state <-> a JSON skeleton plus flat dicts of tensors.

Tensors go to safetensors files, everything JSON can say goes to the
skeleton (with ``$``-tagged markers for tuples, non-string keys, dtypes,
generators, …), and only what is neither goes to ``torch.save``.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import Any

import torch

from ._numpy import np


class Encoder:
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
        if isinstance(value, torch.Tensor) and plain_tensor(value):
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


def plain_tensor(value: torch.Tensor) -> bool:
    # safetensors holds dense strided tensors; sparse, quantized or nested
    # ones go through torch.save.
    return value.layout == torch.strided and not value.is_quantized and not value.is_nested


def decode(value: Any, tensors: Mapping[str, torch.Tensor], objects: Mapping[str, Any]) -> Any:
    if isinstance(value, list):
        return [decode(v, tensors, objects) for v in value]
    if not isinstance(value, dict):
        return value
    if "$tensor" in value:
        return tensors[value["$tensor"]]
    if "$tuple" in value:
        return tuple(decode(v, tensors, objects) for v in value["$tuple"])
    if "$dict" in value:
        return {decode(k, tensors, objects): decode(v, tensors, objects) for k, v in value["$dict"]}
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
    return {k: decode(v, tensors, objects) for k, v in value.items()}
