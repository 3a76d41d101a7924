"""The base of every settings section (service/config.py)."""

from __future__ import annotations

from pydantic import BaseModel as _PydanticModel
from pydantic import ConfigDict


class BaseModel(_PydanticModel):
    # A misspelt key must fail loudly, not be ignored: the agent guards data.
    model_config = ConfigDict(extra="forbid")
