"""The data-loader position: which batches of the epoch were consumed."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch

from .rng import preserved_global_rng

T_co = TypeVar("T_co", covariant=True)


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
            with preserved_global_rng():
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
