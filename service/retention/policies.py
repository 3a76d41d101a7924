"""Retention as small composable policies: pure functions over a run's history.

Each policy answers "which steps do I keep?"; ``AnyOf`` keeps what any of
its members keeps. What is not kept by the policy, and not protected (the
latest valid checkpoint, pinned ones and the ancestors a pinned one needs),
is deleted. No policy at all keeps everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol


@dataclass(frozen=True)
class Candidate:
    step: int
    created_at: datetime
    metrics: dict[str, float] = field(default_factory=dict)


class Policy(Protocol):
    def keep(self, history: Sequence[Candidate], now: datetime) -> set[int]: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class KeepLast:
    n: int

    def keep(self, history: Sequence[Candidate], now: datetime) -> set[int]:
        return {c.step for c in sorted(history, key=lambda c: c.step, reverse=True)[: self.n]}

    def describe(self) -> str:
        return f"keep_last={self.n}"


@dataclass(frozen=True)
class KeepEvery:
    steps: int

    def keep(self, history: Sequence[Candidate], now: datetime) -> set[int]:
        return {c.step for c in history if c.step % self.steps == 0}

    def describe(self) -> str:
        return f"keep_every_steps={self.steps}"


@dataclass(frozen=True)
class KeepBest:
    metric: str
    mode: Literal["min", "max"] = "min"
    n: int = 1

    def keep(self, history: Sequence[Candidate], now: datetime) -> set[int]:
        scored = [c for c in history if self.metric in c.metrics]
        # Ties: the later step wins (it carries more training).
        ranked = sorted(
            scored,
            key=lambda c: (
                c.metrics[self.metric] if self.mode == "min" else -c.metrics[self.metric],
                -c.step,
            ),
        )
        return {c.step for c in ranked[: self.n]}

    def describe(self) -> str:
        return f"keep_best={self.metric}/{self.mode}/{self.n}"


@dataclass(frozen=True)
class KeepPeriodic:
    """The newest checkpoint of each of the last ``count`` periods (days, weeks)."""

    period: timedelta
    count: int
    label: str = "periodic"

    def _bucket(self, when: datetime) -> int:
        return int(when.timestamp() // self.period.total_seconds())

    def keep(self, history: Sequence[Candidate], now: datetime) -> set[int]:
        newest: dict[int, Candidate] = {}
        oldest_bucket = self._bucket(now) - self.count + 1
        for candidate in history:
            bucket = self._bucket(candidate.created_at)
            if bucket < oldest_bucket:
                continue
            best = newest.get(bucket)
            if best is None or candidate.step > best.step:
                newest[bucket] = candidate
        return {c.step for c in newest.values()}

    def describe(self) -> str:
        return f"{self.label}={self.count}"


@dataclass(frozen=True)
class AnyOf:
    policies: tuple[Policy, ...]

    def keep(self, history: Sequence[Candidate], now: datetime) -> set[int]:
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.keep(history, now)
        return kept

    def describe(self) -> str:
        return ", ".join(p.describe() for p in self.policies) or "keep everything"


def build_policy(config: dict[str, Any]) -> AnyOf | None:
    """From the ``[retention]`` table (or a run's override); None keeps all."""
    policies: list[Policy] = []
    if config.get("keep_last") is not None:
        policies.append(KeepLast(int(config["keep_last"])))
    if config.get("keep_every_steps"):
        policies.append(KeepEvery(int(config["keep_every_steps"])))
    best = config.get("keep_best")
    if best:
        policies.append(
            KeepBest(str(best["metric"]), best.get("mode", "min"), int(best.get("n", 1)))
        )
    if config.get("keep_daily_days"):
        policies.append(
            KeepPeriodic(timedelta(days=1), int(config["keep_daily_days"]), "keep_daily_days")
        )
    if config.get("keep_weekly_weeks"):
        policies.append(
            KeepPeriodic(timedelta(weeks=1), int(config["keep_weekly_weeks"]), "keep_weekly_weeks")
        )
    return AnyOf(tuple(policies)) if policies else None


@dataclass(frozen=True)
class Plan:
    keep: set[int]
    delete: set[int]
    reason: str


def plan_retention(
    history: Sequence[Candidate],
    policy: AnyOf | None,
    protected: set[int],
    now: datetime,
) -> Plan:
    steps = {c.step for c in history}
    if policy is None:
        return Plan(keep=steps, delete=set(), reason="no retention policy")
    keep = (policy.keep(history, now) | protected) & steps
    return Plan(keep=keep, delete=steps - keep, reason=f"retention ({policy.describe()})")
