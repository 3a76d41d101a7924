"""Answer of `GET /v1/runs/{run}/advice`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Basis = Literal["write", "upload", "override"]


class Sample(BaseModel):
    """The median of one kind of observation over the run's recent checkpoints."""

    median_seconds: float | None = Field(description="null without samples")
    samples: int


class Observed(BaseModel):
    checkpoints: int = Field(description="checkpoints looked at (the most recent `window`)")
    write_seconds: Sample = Field(description="what trainers reported as write_seconds")
    upload_seconds: Sample = Field(description="durable_at - created_at (queue wait + upload)")
    interval_seconds: Sample = Field(description="wall time between consecutive checkpoints")
    compute_seconds: Sample = Field(description="that gap minus the checkpoint's write_seconds")
    steps_per_second: float | None = Field(description="training steps per compute second")


class Interval(BaseModel):
    interval_seconds: float = Field(description="compute time between two checkpoints")
    interval_hours: float
    every_steps: int | None = Field(description="the interval in steps, from the observed rate")
    waste_fraction: float = Field(description="expected fraction of wall time lost, 0..1")


class Scenario(BaseModel):
    basis: Basis
    description: str
    cost_seconds: float
    young: Interval
    daly: Interval
    current: Interval | None = Field(description="the run's observed interval; null if unknown")


class AdviceOut(BaseModel):
    run: str
    mtbf_hours: float
    restart_seconds: float
    window: int
    observed: Observed
    scenarios: list[Scenario]
