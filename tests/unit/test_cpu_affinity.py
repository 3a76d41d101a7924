"""``[worker] cpus``: the CPU list read as the kernel writes it, refused with
a message when it is not one, and applied to threads of this process."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from tierckpt.service import cpu_affinity
from tierckpt.service.config import ConfigError, WorkerSettings, load_settings
from tierckpt.service.main import check_machine as serve_checks


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("", set()),
        ("  ", set()),
        ("2", {2}),
        ("2-5", {2, 3, 4, 5}),
        ("0, 2,4-7", {0, 2, 4, 5, 6, 7}),
        ("3-3", {3}),
    ],
)
def test_cpu_lists_are_read_as_the_kernel_writes_them(text: str, cpus: set[int]) -> None:
    assert cpu_affinity.parse(text) == cpus


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("x", "is not a CPU number or range"),
        ("1,,2", "is not a CPU number or range"),
        ("-1", "is not a CPU number or range"),
        ("a-b", "is not a CPU number or range"),
        ("1-", "is not a CPU number or range"),
        ("5-2", "ends before it starts"),
        ("0-65536", "out of range"),
    ],
)
def test_a_bad_list_is_refused_with_what_is_wrong(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        cpu_affinity.parse(text)
    with pytest.raises(ConfigError, match=says):
        load_settings(environ={"TIERCKPT_WORKER__CPUS": text})


def test_the_list_is_written_back_with_runs_joined() -> None:
    assert cpu_affinity.format_list(frozenset({0, 1, 2, 5, 7, 8})) == "0-2,5,7-8"
    assert cpu_affinity.format_list(frozenset()) == "none"


def test_a_number_or_an_array_of_numbers_means_the_list_it_spells(tmp_path: Path) -> None:
    assert load_settings(environ={"TIERCKPT_WORKER__CPUS": "3"}).worker.cpu_set == {3}
    config = tmp_path / "agent.toml"
    config.write_text("[worker]\ncpus = [1, 4]\n")
    assert load_settings(config, environ={}).worker.cpu_set == {1, 4}
    config.write_text('[worker]\ncpus = [1, "x"]\n')
    with pytest.raises(ConfigError, match="is not a CPU list"):
        load_settings(config, environ={})


def test_a_cpu_list_needs_the_worker_in_a_process_of_its_own() -> None:
    with pytest.raises(ValueError, match="separate_process"):
        WorkerSettings(cpus="0", separate_process="no")
    assert WorkerSettings(cpus=" 0-1 ").cpu_set == {0, 1}
    # `auto` and `all` name no list: with the worker in the agent's process
    # they confine nothing rather than refuse.
    assert WorkerSettings(cpus="auto", separate_process="no").cpu_set == frozenset()
    assert WorkerSettings(cpus="all", separate_process="no").cpu_set == frozenset()


@pytest.mark.parametrize(
    ("allowed", "share"),
    [
        (set(), set()),
        ({0}, set()),
        ({3}, set()),
        ({0, 1}, {1}),
        ({0, 1, 2}, {2}),
        ({0, 1, 2, 3}, {3}),
        ({0, 1, 2, 3, 4}, {3, 4}),
        (set(range(8)), {6, 7}),
        (set(range(96)), set(range(72, 96))),
        ({0, 2, 4, 6, 9}, {6, 9}),  # a cpuset with holes: its own highest
    ],
)
def test_auto_gives_the_background_the_highest_quarter_of_the_agents_cpus(
    allowed: set[int], share: set[int]
) -> None:
    assert cpu_affinity.background_share(frozenset(allowed)) == share


def test_auto_is_the_default_and_takes_the_highest_quarter() -> None:
    mine = cpu_affinity.allowed_cpus()
    assert WorkerSettings().cpus == "auto"
    for text in ("all", "All", "", "  "):
        settings = WorkerSettings(cpus=text)
        assert settings.cpus == "all" and settings.cpu_set == frozenset()
    assert load_settings(environ={"TIERCKPT_WORKER__CPUS": "all"}).worker.cpu_set == frozenset()
    auto = load_settings(environ={}).worker.cpu_set
    assert auto == cpu_affinity.background_share(mine)
    if len(mine) > 1:  # the background leaves the agent's requests a CPU
        assert auto < mine
    assert WorkerSettings(cpus=" AUTO ").cpus == "auto"


def test_cpus_the_agent_may_not_use_are_dropped_and_none_left_is_refused() -> None:
    allowed = frozenset(os.sched_getaffinity(0))
    outside = max(allowed) + 1
    assert cpu_affinity.usable(allowed | {outside}) == allowed
    with pytest.raises(ValueError, match=f"names CPUs {outside}, none of which"):
        cpu_affinity.usable(frozenset({outside}))


def test_confining_a_thread_leaves_the_others_of_its_process_alone() -> None:
    allowed = frozenset(os.sched_getaffinity(0))
    one = frozenset({max(allowed)})
    seen: dict[str, object] = {}

    def confined() -> None:
        seen["applied"] = cpu_affinity.confine_thread(one, "a test thread")
        seen["own"] = os.sched_getaffinity(0)
        # A thread started afterwards inherits its creator's CPUs.
        child = threading.Thread(target=lambda: seen.setdefault("child", os.sched_getaffinity(0)))
        child.start()
        child.join()

    thread = threading.Thread(target=confined)
    thread.start()
    thread.join()
    assert seen == {"applied": one, "own": one, "child": one}
    assert os.sched_getaffinity(0) == allowed
    assert cpu_affinity.confine_thread(frozenset(), "nothing") is None


def test_serve_refuses_cpus_the_agent_may_not_use(capsys: pytest.CaptureFixture[str]) -> None:
    outside = max(os.sched_getaffinity(0)) + 1
    settings = load_settings(environ={"TIERCKPT_WORKER__CPUS": str(outside)})
    with pytest.raises(SystemExit) as exited:
        serve_checks(settings)
    assert exited.value.code == 2
    assert f"names CPUs {outside}, none of which this agent may run on" in capsys.readouterr().err
    serve_checks(load_settings(environ={}))  # nothing asked: nothing refused
