"""End to end: a 2-rank torch.distributed.checkpoint (gloo, CPU) through the
real agent and SeaweedFS (examples/dcp_train.py as the training job).

Each rank registers its own part (rank R of world size 2); the checkpoint is
valid once both are durable; `tierckpt restore` brings the whole checkpoint
back into one directory (`.metadata`, `__0_0.distcp`, `__1_0.distcp`) that
`torch.distributed.checkpoint.load` reads; and a relaunched job resumes from
it to the same weights as an uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest

from devsupport.processes import cli
from tests.e2e.test_torch_resume import NODE, AgentFactory, settle, start_agent  # noqa: F401

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

import torch.distributed.checkpoint as dcp  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DCP_TRAIN = REPO / "examples" / "dcp_train.py"
RUN = "dcp"


def launch(*args: str, log: Path) -> list[dict[str, Any]]:
    """Run the 2-rank job to its end; rank 0's events.

    The 2-rank gloo job has been seen to hang now and then on this 2-core
    sandbox (not yet understood; the job itself is deterministic): one
    relaunch after a timeout, and the hang is counted in the log."""
    command = [sys.executable, str(DCP_TRAIN), "--run", RUN, "--every", "4", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as hung:
        log.with_suffix(".hung").write_text(str(hung.stdout or "") + str(hung.stderr or ""))
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def reference16(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """The same job run straight through for 16 steps without tierckpt, what
    a resumed job must end identical to: (its "done" event, its weights file).

    One run for the module: the job is deterministic and never talks to an
    agent, so both tests compare against the same run instead of each paying
    for another 2-rank launch."""
    directory = tmp_path_factory.mktemp("dcp-reference")
    events = launch(
        "--root",
        str(directory / "unused"),
        "--steps",
        "16",
        "--no-register",
        "--final-out",
        str(directory / "ref16.st"),
        log=directory / "ref.log",
    )
    assert events[-1]["event"] == "done" and events[-1]["step"] == 16, events
    return events[-1], directory / "ref16.st"


def test_two_rank_dcp_checkpoint_registers_restores_and_resumes(
    start_agent: AgentFactory,  # noqa: F811
    tmp_path: Path,
    reference16: tuple[dict[str, Any], Path],
) -> None:
    agent, ssd = start_agent()
    job = ("--server", agent.url, "--root", str(ssd), "--node", NODE)

    events = launch(
        *job, "--steps", "12", "--final-out", str(tmp_path / "w12.st"), log=tmp_path / "a.log"
    )
    assert events[0]["event"] == "fresh"
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [4, 8, 12]

    found = {c["step"]: c for c in settle(agent.url, RUN)}
    assert {s: c["state"] for s, c in found.items()} == {4: "durable", 8: "durable", 12: "durable"}
    detail = httpx.get(f"{agent.url}/v1/runs/{RUN}/checkpoints/12", timeout=10).json()
    assert detail["world_size"] == 2 and detail["parent"] == {"run": RUN, "step": 8}
    assert sorted(s["rank"] for s in detail["shards"]) == [0, 1]
    assert sorted((f["rank"], f["path"]) for f in detail["files"]) == [
        (0, ".metadata"),
        (0, "__0_0.distcp"),
        (1, "__1_0.distcp"),
    ]

    # The whole checkpoint back in one directory, with the real CLI ...
    dest = tmp_path / "restored"
    restored = cli("--json", "restore", RUN, str(dest), server=agent.url)
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["step"] == 12
    assert sorted(p.name for p in dest.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # ... and DCP reads it (here in one process: DCP reshards on load).
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    state = {"model": net.state_dict(), "step": 0}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(dest)))
    assert state["step"] == 12
    final = load_file(str(tmp_path / "w12.st"))
    assert sorted(final) == sorted(state["model"])
    for name, tensor in final.items():
        assert torch.equal(state["model"][name], tensor), name

    # Relaunched on the same node: both ranks restore step 12 from this node's
    # T0 copies (hard-linked, no download) and train on to 16, ending where an
    # uninterrupted 16-step run ends, bit for bit.
    events = launch(
        *job, "--steps", "16", "--final-out", str(tmp_path / "w16.st"), log=tmp_path / "b.log"
    )
    assert events[0] == {"event": "resumed", "step": 12, "source": "local"}
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [16]
    reference, reference_weights = reference16
    assert events[-1]["sha256"] == reference["sha256"]
    ours, theirs = load_file(str(tmp_path / "w16.st")), load_file(str(reference_weights))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    settled = {c["step"]: c["state"] for c in settle(agent.url, RUN)}
    assert settled[16] == "durable"


def test_asynchronous_dcp_saves_register_once_written_and_resume_exactly(
    start_agent: AgentFactory,  # noqa: F811
    tmp_path: Path,
    reference16: tuple[dict[str, Any], Path],
) -> None:
    """``save_distributed_async`` (DCP ``async_save`` on a process group of its
    own): training goes on while the files are written; each rank registers
    its part once written, so every step becomes durable, with both ranks'
    files, and a resumed job (saving asynchronously too) ends bit-identical to
    an uninterrupted run."""
    agent, ssd = start_agent()
    job = ("--server", agent.url, "--root", str(ssd), "--node", NODE, "--async-save")

    events = launch(*job, "--steps", "12", log=tmp_path / "a.log")
    assert [(e["step"], e["state"]) for e in events if e["event"] == "checkpoint"] == [
        (4, "staged"),
        (8, "staged"),
        (12, "staged"),
    ]
    found = {c["step"]: c for c in settle(agent.url, RUN)}
    assert {s: c["state"] for s, c in found.items()} == {4: "durable", 8: "durable", 12: "durable"}
    detail = httpx.get(f"{agent.url}/v1/runs/{RUN}/checkpoints/12", timeout=10).json()
    assert sorted((f["rank"], f["path"]) for f in detail["files"]) == [
        (0, ".metadata"),
        (0, "__0_0.distcp"),
        (1, "__1_0.distcp"),
    ]
    assert detail["parent"] == {"run": RUN, "step": 8}
    # write_seconds is the stall (the staging), reported by both ranks.
    assert detail["write_seconds"] is not None

    # Rank 1's T0 copy is gone (a replaced disk): this node no longer holds
    # every rank, so both ranks download step 12 (verified) instead.
    shutil.rmtree(ssd / RUN / "step-12" / "rank-00001")
    events = launch(
        *job, "--steps", "16", "--final-out", str(tmp_path / "w16.st"), log=tmp_path / "b.log"
    )
    assert events[0] == {"event": "resumed", "step": 12, "source": "region"}
    assert events[-1]["sha256"] == reference16[0]["sha256"]
    settled = {c["step"]: c["state"] for c in settle(agent.url, RUN)}
    assert settled[16] == "durable"
