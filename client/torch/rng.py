"""Every random number generator a resume needs, saved and put back.

Python's ``random``, NumPy's global generator (when installed), torch's CPU
and CUDA generators, and any generator the caller names
(``torch.Generator``, ``random.Random``, ``numpy.random.Generator`` or
``RandomState``).
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ._numpy import np

log = logging.getLogger("tierckpt.client.torch")


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


@contextlib.contextmanager
def preserved_global_rng() -> Iterator[None]:
    saved = capture_rng()
    try:
        yield
    finally:
        restore_rng(saved)
