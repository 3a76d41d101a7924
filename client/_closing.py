"""``with thing:`` for the client's objects that hold something to close."""

from __future__ import annotations

from types import TracebackType
from typing import Self


class ClosesOnExit:
    """A context manager that returns itself and calls ``close()`` on exit."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
