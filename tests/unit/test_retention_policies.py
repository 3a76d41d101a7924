"""Retention policies as pure functions over synthetic histories."""

from __future__ import annotations

from datetime import datetime, timedelta

from tierckpt.service.retention.policies import (
    AnyOf,
    Candidate,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepPeriodic,
    build_policy,
    plan_retention,
)

NOW = datetime(2026, 11, 22, 12, 0)


def history(n: int, every_hours: float = 1.0, loss=lambda s: 10.0 / (s + 1)) -> list[Candidate]:  # type: ignore[no-untyped-def]
    return [
        Candidate(
            step=s * 100,
            created_at=NOW - timedelta(hours=every_hours * (n - 1 - s)),
            metrics={"loss": loss(s)},
        )
        for s in range(n)
    ]


def test_keep_last_and_every() -> None:
    h = history(12)
    assert KeepLast(3).keep(h, NOW) == {900, 1000, 1100}
    assert KeepEvery(500).keep(h, NOW) == {0, 500, 1000}


def test_keep_best_min_max_and_ties() -> None:
    h = [
        Candidate(1, NOW, {"val": 0.5}),
        Candidate(2, NOW, {"val": 0.3}),
        Candidate(3, NOW, {"val": 0.3}),
        Candidate(4, NOW, {}),
        Candidate(5, NOW, {"val": 0.9}),
    ]
    assert KeepBest("val", "min", 1).keep(h, NOW) == {3}  # tie: the later step
    assert KeepBest("val", "min", 2).keep(h, NOW) == {2, 3}
    assert KeepBest("val", "max", 1).keep(h, NOW) == {5}
    assert KeepBest("missing", "min", 1).keep(h, NOW) == set()


def test_daily_and_weekly_keep_the_newest_per_period() -> None:
    h = history(24 * 20, every_hours=1)  # 20 days, one checkpoint an hour
    daily = KeepPeriodic(timedelta(days=1), 7).keep(h, NOW)
    assert len(daily) == 7
    # Each kept one is the last of its day.
    for step in daily:
        created = next(c.created_at for c in h if c.step == step)
        later_same_day = [c for c in h if c.created_at.date() == created.date() and c.step > step]
        assert not later_same_day
    weekly = KeepPeriodic(timedelta(weeks=1), 2).keep(h, NOW)
    assert 1 <= len(weekly) <= 2 and max(c.step for c in h) in weekly


def test_any_of_is_the_union_and_protected_always_stays() -> None:
    h = history(10)
    policy = AnyOf((KeepLast(2), KeepEvery(400)))
    assert policy.keep(h, NOW) == {800, 900, 0, 400}
    plan = plan_retention(h, policy, protected={300}, now=NOW)
    assert plan.keep == {0, 300, 400, 800, 900}
    assert plan.delete == {100, 200, 500, 600, 700}
    assert "keep_last=2" in plan.reason


def test_no_policy_keeps_everything() -> None:
    h = history(5)
    assert build_policy({}) is None
    plan = plan_retention(h, None, protected=set(), now=NOW)
    assert plan.delete == set() and len(plan.keep) == 5


def test_build_policy_from_config() -> None:
    policy = build_policy(
        {
            "keep_last": 2,
            "keep_every_steps": 1000,
            "keep_best": {"metric": "loss", "mode": "min", "n": 1},
            "keep_daily_days": 3,
            "keep_weekly_weeks": None,
        }
    )
    assert policy is not None
    assert (
        policy.describe()
        == "keep_last=2, keep_every_steps=1000, keep_best=loss/min/1, keep_daily_days=3"
    )
    h = history(30, every_hours=24, loss=lambda s: abs(s - 10))  # best loss at step 1000
    kept = policy.keep(h, NOW)
    assert {2800, 2900, 0, 1000, 2000} <= kept
