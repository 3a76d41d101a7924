"""NumPy when it is installed, else None: its RNG and arrays are handled
only then (it ships with the torch extra)."""

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with the torch extra
    np = None  # type: ignore[assignment]

__all__ = ["np"]
