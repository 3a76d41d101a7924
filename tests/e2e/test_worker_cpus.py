"""End to end: `tierckpt serve` with `[worker] cpus`, real processes. A list
the agent may not use, or one that is not a list, is refused before anything
is created (exit 2, the reason on stderr); a usable one puts every thread of
the worker process on those CPUs, the agent's own threads on all of them; so
does `auto`, with the highest quarter of the agent's CPUs."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from devsupport.agent import write_checkpoint
from devsupport.processes import TIERCKPT, agent_config
from tierckpt.service.cpu_affinity import background_share, format_list

pytestmark = pytest.mark.e2e
ALLOWED = sorted(os.sched_getaffinity(0))
OUTSIDE = ALLOWED[-1] + 1


def _cpus_of_threads(pid: int) -> set[str]:
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found.add(line.split(":", 1)[1].strip())
    return found


@pytest.mark.parametrize(
    ("cpus", "says"),
    [
        (
            str(ALLOWED[-1] + 1),
            f"names CPUs {ALLOWED[-1] + 1}, none of which this agent may run on",
        ),
        ("2-1", "ends before it starts"),
    ],
)
def test_serve_refuses_cpus_it_cannot_use_and_creates_nothing(
    tmp_path: Path, cpus: str, says: str
) -> None:
    config = agent_config(tmp_path, worker={"cpus": cpus})
    refused = subprocess.run(
        [TIERCKPT, "serve", "--config", str(config.path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2, refused.stderr
    assert says in refused.stderr
    # Refused before the catalog or the region was touched.
    assert not (tmp_path / "tierckpt-catalog.db").exists()
    assert not (tmp_path / "region").exists()


@pytest.mark.parametrize("cpus", ["named", "auto"])
def test_serve_confines_the_worker_process_to_the_cpus_named(tmp_path: Path, cpus: str) -> None:
    if len(ALLOWED) < 2:
        pytest.skip("one CPU: nothing to confine the worker away from")
    if cpus == "named":
        background = str(ALLOWED[-1])
        config = agent_config(tmp_path, worker={"cpus": background})
    else:  # the highest quarter of the agent's CPUs
        background = format_list(background_share(frozenset(ALLOWED)))
        config = agent_config(tmp_path, worker={"cpus": "auto"})
    with config.serve(tmp_path / "serve.log").start() as agent:
        assert agent.proc is not None
        source = write_checkpoint(config.ssd / "step-1", {"model.bin": 200_000})
        answer = httpx.post(
            f"{agent.url}/v1/checkpoints",
            json={"run": "cpus", "step": 1, "path": str(source)},
            timeout=30,
        )
        assert answer.status_code == 202, answer.text
        deadline = time.monotonic() + 60
        while httpx.get(f"{agent.url}/v1/runs/cpus/checkpoints/1").json()["state"] != "durable":
            assert time.monotonic() < deadline, "the checkpoint did not become durable"
            time.sleep(0.1)
        pid = agent.proc.pid
        (worker,) = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        assert _cpus_of_threads(worker) == {background}
        assert _cpus_of_threads(pid) == {format_list(frozenset(ALLOWED))}
