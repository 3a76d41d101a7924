"""Hugging Face Trainer through tierckpt (tierckpt.client.hf), end to end: a
real agent and SeaweedFS, a tiny GPT-2 built from a config (never
downloaded) trained by a real `Trainer` in this process.

- TierckptCallback registers every checkpoint-N once the Trainer wrote it;
  all become durable although `save_total_limit=1` rotates the Trainer's
  directories away right after they are written.
- latest_checkpoint brings the latest valid checkpoint to dest/checkpoint-N
  (verified, from this node's copy or from the region), a Trainer resumed
  from it ends bit-identical to an uninterrupted run, and an incomplete
  checkpoint directory left by a crash is never returned.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.framework_support import (
    NODE,
    RunningAgent,
    framework_agent,
    settle,
    start_agent,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from examples.hf_train import main, make_trainer  # noqa: E402
from tierckpt.client import CheckpointClient  # noqa: E402
from tierckpt.client.hf import TierckptCallback, latest_checkpoint  # noqa: E402

pytestmark = pytest.mark.e2e
__all__ = ["framework_agent", "start_agent"]

STEPS = 6


class CrashAfterSave(TrainerCallback):  # type: ignore[misc]
    """The job dies right after the Trainer saved (and tierckpt registered) ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError("simulated crash")


def ask(url: str, run: str, dest: Path) -> str | None:
    with CheckpointClient(url) as client:
        return latest_checkpoint(client, run, dest, node="another-node")


def weights(trainer: Trainer) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_each_checkpoint_is_registered_and_durable_despite_rotation(
    framework_agent: RunningAgent,
) -> None:
    agent = framework_agent
    output = agent.ssd / "hf" / "full"
    callback = TierckptCallback(agent.client, "full")
    make_trainer(output, [callback]).train()

    assert [c.step for c in callback.registered] == [2, 4, 6]
    # The Trainer rotated 2 and 4 away as soon as it had written 4 and 6 …
    assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-6"]
    # … yet every registered copy was uploaded whole.
    assert settle(agent.url, "full") == {2: "durable", 4: "durable", 6: "durable"}
    detail = agent.client.get("full", 4)
    names = {f.path for f in detail.files}
    assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= names
    assert detail.metadata["framework"] == "transformers"
    assert "loss" in detail.metrics
    assert detail.write_seconds is not None and detail.write_seconds > 0  # the Trainer's save
    # The registered copy is tierckpt's own directory, not the Trainer's.
    assert detail.shards[0].path == str(output / ".tierckpt" / "full" / "checkpoint-4")


def test_resume_from_latest_checkpoint_matches_an_uninterrupted_run(
    framework_agent: RunningAgent, tmp_path: Path
) -> None:
    agent = framework_agent
    uninterrupted = make_trainer(agent.ssd / "hf" / "full", [])
    uninterrupted.train()
    expected = weights(uninterrupted)

    assert latest_checkpoint(agent.client, "part", tmp_path / "nothing") is None  # fresh start

    output = agent.ssd / "hf" / "part"
    crashing = make_trainer(output, [TierckptCallback(agent.client, "part"), CrashAfterSave(4)])
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashing.train()
    assert settle(agent.url, "part") == {2: "durable", 4: "durable"}

    # What a crash in the middle of the next save leaves: a checkpoint-6
    # without its optimizer or trainer state. The Trainer's own lookup takes it.
    dest = agent.ssd / "hf" / "part-restarted"
    partial = dest / "checkpoint-6"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"\0" * 100)
    assert get_last_checkpoint(str(dest)) == str(partial)

    # On another node (nothing local): downloaded from the region, verified.
    elsewhere = latest_checkpoint(agent.client, "part", dest, node="another-node")
    assert elsewhere == str(dest / "checkpoint-4")
    registered = {f.path: f.size for f in agent.client.get("part", 4).files}
    assert {
        p.relative_to(elsewhere).as_posix(): p.stat().st_size
        for p in Path(elsewhere).rglob("*")
        if p.is_file()
    } == registered

    # On this node: copied from the registered copy. A damaged checkpoint-4
    # already at the destination is moved aside, never returned.
    local_dest = agent.ssd / "hf" / "part-local"
    shutil.copytree(output / ".tierckpt" / "part" / "checkpoint-4", local_dest / "checkpoint-4")
    with open(local_dest / "checkpoint-4" / "optimizer.pt", "r+b") as handle:
        handle.write(b"garbage")
    here = latest_checkpoint(agent.client, "part", local_dest, node=NODE)
    assert here == str(local_dest / "checkpoint-4")
    assert len(list(local_dest.glob(".tierckpt-stale-checkpoint-4-*"))) == 1
    # Copied, not linked: the trainer's files share no inode with the agent's.
    registered = output / ".tierckpt" / "part" / "checkpoint-4" / "model.safetensors"
    assert not os.path.samefile(Path(here) / "model.safetensors", registered)
    assert (Path(here) / "model.safetensors").read_bytes() == registered.read_bytes()

    # Every process of a job may ask at once, into one destination: each
    # gets the same verified directory.
    shared = agent.ssd / "hf" / "part-shared"
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: ask(agent.url, "part", shared), range(3)))
    assert answers == [str(shared / "checkpoint-4")] * 3
    assert [p.name for p in shared.iterdir()] == ["checkpoint-4"]  # no staging left

    # Resumed from the region's copy, with a differently initialised model.
    resumed = make_trainer(dest, [TierckptCallback(agent.client, "part")], seed=99)
    resumed.train(resume_from_checkpoint=elsewhere)
    assert same(weights(resumed), expected)
    assert settle(agent.url, "part") == {2: "durable", 4: "durable", 6: "durable"}
    parents = {s: agent.client.get("part", s).parent for s in (2, 4, 6)}
    assert {s: p.step if p else None for s, p in parents.items()} == {2: None, 4: 2, 6: 4}


def test_the_example_starts_fresh_then_resumes(
    framework_agent: RunningAgent, capsys: pytest.CaptureFixture[str]
) -> None:
    agent = framework_agent
    common = ["--server", agent.url, "--run", "example", "--node", NODE]
    common += ["--output-dir", str(agent.ssd / "hf" / "example")]
    main([*common, "--steps", "4"])
    settle(agent.url, "example")
    main([*common, "--steps", "6"])
    out = capsys.readouterr().out.splitlines()  # the Trainer prints its logs there too
    done = [json.loads(line) for line in out if line.startswith('{"event"')]
    assert done == [
        {"event": "done", "step": 4, "resumed_from": None},
        {"event": "done", "step": 6, "resumed_from": 4},
    ]
