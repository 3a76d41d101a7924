"""Checkpoint interval advice: Young's and Daly's formulas and the waste model
against values computed by hand, and the observations taken from checkpoints."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

import pytest

from tierckpt.service.advice.service import (
    Point,
    advise,
    daly_interval,
    expected_waste,
    observe,
    young_interval,
)

HOUR = 3600.0
T0 = datetime(2026, 11, 22, 11, 0, 0)


# -- the formulas, by hand ---------------------------------------------------------


def test_seed_case_five_minutes_twelve_hours_is_1_41_hours() -> None:
    # C = 300 s, M = 12 h = 43200 s: 2·C·M = 25 920 000 = 2·3600², so
    # √(2CM) = 3600·√2 = 5091.1688 s = 1.41421 h.
    young = young_interval(300.0, 12 * HOUR)
    assert young == pytest.approx(5091.168824543142, rel=1e-12)
    assert young / HOUR == pytest.approx(1.41, abs=0.005)
    assert young / HOUR == pytest.approx(math.sqrt(2), rel=1e-12)


def test_daly_refinement_seed_case() -> None:
    # C/2M = 300/86400 = 0.00347222; √ = 0.05892557;
    # 1 + 0.05892557/3 + 0.00347222/9 = 1 + 0.01964186 + 0.00038580 = 1.02002766;
    # 5091.16882 · 1.02002766 − 300 = 5193.13301 − 300 = 4893.13301 s (1.35920 h).
    daly = daly_interval(300.0, 12 * HOUR)
    assert daly == pytest.approx(4893.13301, abs=1e-4)
    assert daly / HOUR == pytest.approx(1.35920, abs=1e-5)


def test_daly_when_the_cost_reaches_twice_the_mtbf_is_the_mtbf() -> None:
    assert daly_interval(7200.0, 3600.0) == 3600.0
    assert daly_interval(10_000.0, 3600.0) == 3600.0
    # Just below 2M the formula still applies: C = 7000, M = 3600:
    # √(2CM) = √50 400 000 = 7099.2957; C/2M = 0.97222, √ = 0.98601;
    # 7099.2957·(1 + 0.32867 + 0.10802) − 7000 = 7099.2957·1.43669 − 7000 = 3199.5
    assert daly_interval(7000.0, 3600.0) == pytest.approx(3199.5, abs=0.5)


def test_young_other_values() -> None:
    # C = 4 s (a local write), M = 1 h: √(2·4·3600) = √28 800 = 169.7056 s.
    assert young_interval(4.0, HOUR) == pytest.approx(169.7056, abs=1e-4)
    # C = 60 s, M = 24 h: √(2·60·86400) = √10 368 000 = 3219.9379 s.
    assert young_interval(60.0, 24 * HOUR) == pytest.approx(3219.9379, abs=1e-4)


def test_expected_waste_by_hand() -> None:
    # τ = 1 h, C = 300 s, M = 12 h, R = 0:
    # (τ + C)/M = 3900/43200 = 0.0902778; e^0.0902778 − 1 = 0.0944751;
    # wall per τ of work = 43200 · 0.0944751 = 4081.461 s;
    # waste = 1 − 3600/4081.461 = 0.117963.
    assert expected_waste(3600.0, 300.0, 12 * HOUR) == pytest.approx(0.117963, abs=1e-6)
    # The same with R = 600 s: e^(600/43200) = 1.0139858, wall = 4138.543 s,
    # waste = 1 − 3600/4138.543 = 0.130129.
    assert expected_waste(3600.0, 300.0, 12 * HOUR, restart=600.0) == pytest.approx(
        0.130129, abs=1e-6
    )
    # At Young's interval: (5091.169 + 300)/43200 = 0.1247956, e^x − 1 = 0.1329168,
    # wall = 5742.007, waste = 1 − 5091.169/5742.007 = 0.113347.
    assert expected_waste(young_interval(300.0, 12 * HOUR), 300.0, 12 * HOUR) == pytest.approx(
        0.113347, abs=1e-6
    )


def test_daly_interval_wastes_no_more_than_young_and_the_optimum_is_a_minimum() -> None:
    for cost, mtbf in ((300.0, 12 * HOUR), (30.0, HOUR), (1800.0, 4 * HOUR), (5.0, 100 * HOUR)):
        young, daly = young_interval(cost, mtbf), daly_interval(cost, mtbf)
        at_daly = expected_waste(daly, cost, mtbf)
        assert at_daly <= expected_waste(young, cost, mtbf) + 1e-12
        assert at_daly < expected_waste(daly * 0.5, cost, mtbf)
        assert at_daly < expected_waste(daly * 2.0, cost, mtbf)


def test_expected_waste_edges() -> None:
    assert expected_waste(0.0, 10.0, HOUR) == 1.0
    assert 0.0 <= expected_waste(1e-9, 0.0, HOUR) < 1e-9
    assert expected_waste(1e6, 10.0, 1.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        young_interval(-1.0, HOUR)
    with pytest.raises(ValueError):
        daly_interval(1.0, 0.0)
    with pytest.raises(ValueError):
        expected_waste(10.0, 1.0, math.inf)
    with pytest.raises(ValueError):
        expected_waste(10.0, 1.0, HOUR, restart=-1.0)


# -- observations ---------------------------------------------------------------------


def point(
    step: int,
    at: float,
    write: float | None = None,
    upload: float | None = None,
    urgent: bool = False,
) -> Point:
    created = T0 + timedelta(seconds=at)
    durable = created + timedelta(seconds=upload) if upload is not None else None
    return Point(step, created, durable, write, urgent)


def test_observe_medians_gaps_and_rates() -> None:
    points = [
        point(100, 0, write=4.0, upload=30.0),
        point(200, 604, write=4.0, upload=40.0),
        point(300, 1210, write=6.0, upload=35.0),
        point(400, 1810, write=None, upload=None),  # not durable yet, no write reported
    ]
    observed = observe(list(reversed(points)))  # order does not matter
    assert observed.checkpoints == 4
    assert sorted(observed.write) == [4.0, 4.0, 6.0]
    assert sorted(observed.upload) == [30.0, 35.0, 40.0]
    assert observed.gaps == [604.0, 606.0, 600.0]
    # each gap minus the write of the checkpoint that ends it
    assert observed.computes == [600.0, 600.0, 600.0]
    assert observed.steps_per_second == pytest.approx(100 / 600)


def test_observe_skips_urgent_saves_and_restarts() -> None:
    points = [
        point(100, 0, write=2.0),
        point(200, 302, write=2.0),
        point(250, 400, write=1.0, urgent=True),  # preemption save: off schedule
        point(200, 5000, write=2.0),  # restarted from 200 after the failure
        point(300, 5302, write=2.0),
    ]
    observed = observe(points)
    assert observed.gaps == [302.0, 302.0]
    assert observed.computes == [300.0, 300.0]
    assert len(observed.write) == 5  # the urgent write still is a cost sample


def test_advise_seed_case_from_observations() -> None:
    points = [point(i * 500, i * 3900.0, write=300.0, upload=600.0) for i in range(6)]
    answer = advise("gpt", points, mtbf_hours=12, window=50)
    by_basis = {s.basis: s for s in answer.scenarios}
    assert set(by_basis) == {"write", "upload"}
    write = by_basis["write"]
    assert write.cost_seconds == 300.0
    assert write.young.interval_hours == pytest.approx(1.41421, abs=1e-5)
    assert write.daly.interval_seconds == pytest.approx(4893.13301, abs=1e-4)
    # Observed: a checkpoint every 3900 s of wall time, 300 s of it writing.
    assert answer.observed.interval_seconds.median_seconds == 3900.0
    assert write.current is not None
    assert write.current.interval_seconds == 3600.0
    assert write.current.waste_fraction == pytest.approx(0.117963, abs=1e-6)
    # 500 steps per 3600 s of compute → Young's 5091 s is 707 steps.
    assert write.young.every_steps == round(5091.168824543142 * 500 / 3600)
    upload = by_basis["upload"]
    assert upload.cost_seconds == 600.0
    assert upload.young.interval_seconds == pytest.approx(math.sqrt(2 * 600 * 43200))
    assert (
        upload.current is not None and upload.current.waste_fraction > write.current.waste_fraction
    )


def test_advise_override_and_no_observations() -> None:
    answer = advise("new-run", [], mtbf_hours=12, cost_seconds=300.0, window=50)
    assert [s.basis for s in answer.scenarios] == ["override"]
    only = answer.scenarios[0]
    assert only.young.interval_seconds == pytest.approx(5091.168824543142)
    assert only.current is None and only.young.every_steps is None
    assert answer.observed.checkpoints == 0
    assert advise("empty", [point(1, 0)], mtbf_hours=1, window=50).scenarios == []


def test_zero_cost_is_floored_not_zero_interval() -> None:
    answer = advise("r", [point(1, 0, write=0.0), point(2, 10, write=0.0)], mtbf_hours=1, window=9)
    write = answer.scenarios[0]
    assert write.cost_seconds > 0 and write.young.interval_seconds > 0
