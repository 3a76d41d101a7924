"""How often should this run checkpoint? Young's and Daly's answers from observed costs.

The math is pure functions (unit-tested against hand-computed values); the
service only gathers the observations from the catalog.

Definitions, as in Young (1974) and Daly (2006):

- ``C`` (cost): the time the trainer stops training to checkpoint. Two
  observations give two costs, reported side by side:
  ``write`` — the ``write_seconds`` trainers report (local write; tierckpt
  uploads in the background) — and ``upload`` — ``durable_at - created_at``,
  what a trainer that blocks until the copy is durable would pay (it includes
  the wait in the agent's queue, the closest measure there is).
- ``M``: mean time between failures (the ``mtbf_hours`` query parameter).
- ``R``: restart time after a failure (``restart_seconds``, default 0).
- ``τ`` (interval): *compute* time between two checkpoints. The observed wall
  gap between consecutive checkpoints' ``created_at`` contains one write, so
  the observed ``τ`` is that gap minus the checkpoint's ``write_seconds``.

Young: ``τ = √(2CM)``. Daly: ``τ = √(2CM)·[1 + ⅓√(C/2M) + (1/9)(C/2M)] − C``
for ``C < 2M``, else ``τ = M``. Expected fraction of wall time lost (Daly's
complete model, exponential failures): wall time per ``τ`` of work is
``M·e^{R/M}·(e^{(τ+C)/M} − 1)``, so ``waste = 1 − τ / (M·e^{R/M}·(e^{(τ+C)/M} − 1))``.

Without any observation the endpoint answers 409 ``no_observations``, unless
``cost_seconds`` is given: then that cost is used (basis ``override``), and
the run does not even need to exist yet (planning a new run).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession

from ..checkpoints import repository as repo
from ..errors import BadInput, Conflict, NotFound
from . import repository as timings
from .schemas import AdviceOut, Basis, Interval, Observed, Sample, Scenario

HOUR = 3600.0
# A checkpoint is never free; a zero cost would advise "every 0 seconds".
MIN_COST_SECONDS = 1e-3

DESCRIPTIONS: dict[Basis, str] = {
    "write": "the trainer stalls only for the local write (tierckpt uploads in the background)",
    "upload": "the trainer blocks until the checkpoint is durable in the object store",
    "override": "the cost given as cost_seconds",
}


# -- the math (pure) ----------------------------------------------------------


def young_interval(cost: float, mtbf: float) -> float:
    """Young's first-order optimum ``√(2·C·M)`` (seconds in, seconds out)."""
    _check(cost, mtbf)
    return math.sqrt(2.0 * cost * mtbf)


def daly_interval(cost: float, mtbf: float) -> float:
    """Daly's higher-order optimum; ``M`` itself once ``C ≥ 2M``."""
    _check(cost, mtbf)
    if cost >= 2.0 * mtbf:
        return mtbf
    ratio = cost / (2.0 * mtbf)
    return math.sqrt(2.0 * cost * mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost


def expected_waste(interval: float, cost: float, mtbf: float, restart: float = 0.0) -> float:
    """Expected fraction of wall time not spent on useful work (0..1) when
    checkpointing every ``interval`` seconds of compute (Daly's model)."""
    _check(cost, mtbf)
    if restart < 0:
        raise ValueError("restart must be >= 0")
    if interval <= 0:
        return 1.0
    try:
        wall = mtbf * math.exp(restart / mtbf) * math.expm1((interval + cost) / mtbf)
    except OverflowError:
        return 1.0  # intervals of hundreds of MTBFs: nothing ever completes
    return min(1.0, max(0.0, 1.0 - interval / wall))


def median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _check(cost: float, mtbf: float) -> None:
    if not (cost >= 0 and math.isfinite(cost)):
        raise ValueError(f"cost must be a finite number >= 0, got {cost}")
    if not (mtbf > 0 and math.isfinite(mtbf)):
        raise ValueError(f"mtbf must be a finite number > 0, got {mtbf}")


@dataclass(frozen=True)
class Point:
    """What the catalog knows about one checkpoint's timing."""

    step: int
    created_at: datetime
    durable_at: datetime | None = None
    write_seconds: float | None = None
    urgent: bool = False


@dataclass(frozen=True)
class Observations:
    checkpoints: int
    write: list[float]
    upload: list[float]
    gaps: list[float]  # wall seconds between consecutive scheduled checkpoints
    computes: list[float]  # the same minus the later checkpoint's write_seconds
    rates: list[float]  # steps per compute second, per gap

    @property
    def steps_per_second(self) -> float | None:
        return median_or_none(self.rates)


def observe(points: Sequence[Point]) -> Observations:
    """Costs and intervals from a run's checkpoints (any order)."""
    ordered = sorted(points, key=lambda p: (p.created_at, p.step))
    write = [p.write_seconds for p in ordered if p.write_seconds is not None]
    upload = [
        (p.durable_at - p.created_at).total_seconds()
        for p in ordered
        if p.durable_at is not None and p.durable_at >= p.created_at
    ]
    # Urgent (preemption) saves are off the schedule: they say nothing about
    # the interval. A step that goes back is a restart from an older
    # checkpoint: the gap holds downtime, not training.
    scheduled = [p for p in ordered if not p.urgent]
    gaps, computes, rates = [], [], []
    for before, after in itertools.pairwise(scheduled):
        steps = after.step - before.step
        gap = (after.created_at - before.created_at).total_seconds()
        if steps <= 0 or gap <= 0:
            continue
        compute = gap - (after.write_seconds or 0.0)
        if compute <= 0:
            compute = gap
        gaps.append(gap)
        computes.append(compute)
        rates.append(steps / compute)
    return Observations(len(ordered), write, upload, gaps, computes, rates)


def interval(
    seconds: float, cost: float, mtbf: float, restart: float, rate: float | None
) -> Interval:
    return Interval(
        interval_seconds=seconds,
        interval_hours=seconds / HOUR,
        every_steps=max(1, round(seconds * rate)) if rate else None,
        waste_fraction=expected_waste(seconds, cost, mtbf, restart),
    )


def scenario(
    basis: Basis, cost: float, mtbf: float, restart: float, observed: Observations
) -> Scenario:
    cost = max(cost, MIN_COST_SECONDS)
    rate = observed.steps_per_second
    current = median_or_none(observed.computes)
    return Scenario(
        basis=basis,
        description=DESCRIPTIONS[basis],
        cost_seconds=cost,
        young=interval(young_interval(cost, mtbf), cost, mtbf, restart, rate),
        daly=interval(daly_interval(cost, mtbf), cost, mtbf, restart, rate),
        current=interval(current, cost, mtbf, restart, rate) if current is not None else None,
    )


def advise(
    run: str,
    points: Sequence[Point],
    *,
    mtbf_hours: float,
    restart_seconds: float = 0.0,
    cost_seconds: float | None = None,
    window: int,
) -> AdviceOut:
    """The whole answer from the observed points (pure)."""
    mtbf = mtbf_hours * HOUR
    observed = observe(points)
    scenarios = []
    if cost_seconds is not None:
        scenarios.append(scenario("override", cost_seconds, mtbf, restart_seconds, observed))
    measured: tuple[tuple[Basis, list[float]], ...] = (
        ("write", observed.write),
        ("upload", observed.upload),
    )
    for basis, values in measured:
        cost = median_or_none(values)
        if cost is not None:
            scenarios.append(scenario(basis, cost, mtbf, restart_seconds, observed))
    return AdviceOut(
        run=run,
        mtbf_hours=mtbf_hours,
        restart_seconds=restart_seconds,
        window=window,
        observed=Observed(
            checkpoints=observed.checkpoints,
            write_seconds=_sample(observed.write),
            upload_seconds=_sample(observed.upload),
            interval_seconds=_sample(observed.gaps),
            compute_seconds=_sample(observed.computes),
            steps_per_second=observed.steps_per_second,
        ),
        scenarios=scenarios,
    )


def _sample(values: list[float]) -> Sample:
    return Sample(median_seconds=median_or_none(values), samples=len(values))


# -- the service ----------------------------------------------------------------


class AdviceService:
    def __init__(self, session: AsyncSession) -> None:
        self.session = session

    async def advise(
        self,
        run: str,
        *,
        mtbf_hours: float,
        restart_seconds: float,
        cost_seconds: float | None,
        window: int,
    ) -> AdviceOut:
        if not (math.isfinite(mtbf_hours) and mtbf_hours > 0):
            raise BadInput("mtbf_hours must be a number > 0", code="invalid_mtbf")
        run_row = await repo.find_run(self.session, run)
        points: list[Point] = []
        if run_row is not None:
            points = await self._recent(run_row.id, window)
        elif cost_seconds is None:
            raise NotFound(
                f"run {run!r} has no checkpoints; register some, or pass cost_seconds= to plan",
                code="run_not_found",
            )
        answer = advise(
            run,
            points,
            mtbf_hours=mtbf_hours,
            restart_seconds=restart_seconds,
            cost_seconds=cost_seconds,
            window=window,
        )
        if not answer.scenarios:
            raise Conflict(
                f"run {run!r} has no observed checkpoint cost yet: no checkpoint reported "
                "write_seconds and none is durable. Register with write_seconds, wait until "
                "one is durable, or pass cost_seconds=",
                code="no_observations",
            )
        return answer

    async def _recent(self, run_id: int, window: int) -> list[Point]:
        rows = await timings.recent_timings(self.session, run_id, window)
        return [
            Point(
                step=step,
                created_at=created_at,
                durable_at=durable_at,
                write_seconds=write_seconds,
                urgent=priority == "urgent",
            )
            for step, created_at, durable_at, write_seconds, priority in rows
        ]
