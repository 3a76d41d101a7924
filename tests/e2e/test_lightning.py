"""PyTorch Lightning through tierckpt (tierckpt.client.lightning), end to end:
a real agent and SeaweedFS, real Lightning trainers (in this process, or a
child SIGKILLed mid-save).

- Every epoch-end save is one registered checkpoint (step = global_step),
  uploaded and durable; Lightning's own names are links that its top-k
  rotation removes without touching the registered copies.
- A fresh Trainer resumed with ckpt_path="tierckpt:latest" (from this node's
  copy, and from the region after the local copies are gone) restores the
  weights and the optimizer state and ends bit-identical to a run that was
  never interrupted.
- A save killed halfway is never picked: the latest valid checkpoint is the
  one before it, the half-written file is cleaned up, and the resumed run
  still ends identical.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
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
pytest.importorskip("lightning")

from examples.lightning_train import Tiny, main, make_trainer  # noqa: E402
from tests.e2e.lightning_app import WRITING  # noqa: E402
from tests.e2e.restore_trainer import mapped_under  # noqa: E402
from tierckpt.client import NotFoundError  # noqa: E402
from tierckpt.client.lightning import TierckptCheckpointIO  # noqa: E402

pytestmark = [
    pytest.mark.e2e,
    # Lightning 2.6's own use of torch's pytree, deprecated in torch 2.13: not ours.
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
    # Lightning's note to any job resumed in its own checkpoint directory.
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty"),
]
__all__ = ["framework_agent", "start_agent"]

REPO = Path(__file__).resolve().parents[2]
EPOCHS = 4
FINAL_STEP = 2 * EPOCHS


def weights(module: Any) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same_tensors(a: Any, b: Any) -> bool:
    """Deep equality of nested state (dicts/lists of tensors and numbers)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def train(agent: RunningAgent, run: str, workdir: Path, epochs: int, **fit: Any) -> Any:
    plugin = TierckptCheckpointIO(agent.client, run, agent.ssd / "lightning", node=NODE)
    trainer = make_trainer(plugin, workdir, epochs)
    model = Tiny(seed=99 if "ckpt_path" in fit else 0)  # a resumed model starts elsewhere
    trainer.fit(model, **fit)
    return trainer, model, plugin


def uninterrupted(agent: RunningAgent, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    trainer, model, _ = train(agent, "full", tmp_path / "full", EPOCHS)
    return weights(model), trainer.optimizers[0].state_dict()


def test_saves_are_registered_durable_and_survive_lightnings_rotation(
    framework_agent: RunningAgent, tmp_path: Path
) -> None:
    agent = framework_agent
    workdir = tmp_path / "work"
    _, _, plugin = train(agent, "saves", workdir, EPOCHS)

    states = settle(agent.url, "saves")
    assert states == {step: "durable" for step in (2, 4, 6, 8)}
    # One file per step, under tierckpt's directory, never touched by Lightning
    # (the agent's T0 retention keeps the newest [local] keep_last = 2 of them).
    for step in (6, 8):
        files = os.listdir(plugin.step_dir(step))
        assert len(files) == 1 and files[0].endswith(".ckpt"), files
    # Lightning kept its newest epoch file and last.ckpt (it removed the
    # others): both are links to the registered file of step 8.
    kept = sorted(os.listdir(workdir / "checkpoints"))
    assert kept == ["epoch=3-step=8.ckpt", "last.ckpt"]
    registered = plugin.step_dir(8) / "epoch=3-step=8.ckpt"
    for name in kept:
        assert os.path.samefile(workdir / "checkpoints" / name, registered)
    detail = agent.client.get("saves", 8)
    assert detail.metadata["framework"] == "lightning"
    assert detail.epoch == 3
    assert [f.path for f in detail.files] == ["epoch=3-step=8.ckpt"]

    # Removing through the plugin never deletes a registered copy.
    plugin.remove_checkpoint(registered)
    assert registered.is_file()
    plugin.remove_checkpoint(workdir / "checkpoints" / "last.ckpt")
    assert not (workdir / "checkpoints" / "last.ckpt").exists() and registered.is_file()


def test_resume_through_tierckpt_matches_an_uninterrupted_run(
    framework_agent: RunningAgent, tmp_path: Path
) -> None:
    agent = framework_agent
    full_weights, full_optimizer = uninterrupted(agent, tmp_path)

    fresh = TierckptCheckpointIO(agent.client, "part", agent.ssd / "lightning", node=NODE)
    assert fresh.resume_path() is None  # a fresh start: Lightning starts from scratch
    with pytest.raises(NotFoundError, match="no valid checkpoint"):
        fresh.load_checkpoint("tierckpt:latest")

    train(agent, "part", tmp_path / "part", EPOCHS // 2)
    assert settle(agent.url, "part") == {2: "durable", 4: "durable"}
    assert fresh.resume_path() == "tierckpt:4"

    # From this node's copy (the agent vouches for it).
    trainer, model, plugin = train(
        agent, "part", tmp_path / "part", EPOCHS, ckpt_path="tierckpt:latest"
    )
    assert plugin.restored is not None
    assert (plugin.restored.step, plugin.restored.source) == (4, "local")
    assert mapped_under([str(agent.ssd)]) == []  # the state is the trainer's own memory
    # last.ckpt names the newest save, not the first run's last one.
    checkpoints = tmp_path / "part" / "checkpoints"
    assert not list(checkpoints.glob("last-v*.ckpt"))
    newest = {p.stat().st_ino for p in plugin.step_dir(8).glob("*.ckpt")}
    assert os.stat(checkpoints / "last.ckpt").st_ino in newest
    parents = {s: agent.client.get("part", s).parent for s in (4, 6, 8)}
    assert {s: p.step if p else None for s, p in parents.items()} == {4: 2, 6: 4, 8: 6}
    assert same_tensors(weights(model), full_weights)
    assert same_tensors(trainer.optimizers[0].state_dict(), full_optimizer)


def test_resume_from_the_region_when_the_node_lost_its_copies(
    framework_agent: RunningAgent, tmp_path: Path
) -> None:
    agent = framework_agent
    full_weights, full_optimizer = uninterrupted(agent, tmp_path)
    train(agent, "moved", tmp_path / "moved", EPOCHS // 2)
    settle(agent.url, "moved")
    # A new node: nothing local, neither tierckpt's copies nor Lightning's names.
    shutil.rmtree(agent.ssd / "lightning" / "moved")
    shutil.rmtree(tmp_path / "moved" / "checkpoints")

    trainer, model, plugin = train(
        agent, "moved", tmp_path / "moved", EPOCHS, ckpt_path="tierckpt:4"
    )
    assert plugin.restored is not None
    assert (plugin.restored.step, plugin.restored.source) == (4, "region")
    assert not Path(plugin.restored.path).exists()  # the scratch copy is gone
    assert same_tensors(weights(model), full_weights)
    assert same_tensors(trainer.optimizers[0].state_dict(), full_optimizer)

    # A registered path names its step (read here, hashed against the
    # catalog); a step that is not valid is refused.
    settle(agent.url, "moved")
    loaded = plugin.load_checkpoint(plugin.step_dir(8) / "epoch=3-step=8.ckpt")
    assert loaded["global_step"] == 8 and plugin.restored.source == "local"
    with pytest.raises(NotFoundError):
        plugin.load_checkpoint("tierckpt:5")
    with pytest.raises(ValueError, match="tierckpt:<step>"):
        plugin.load_checkpoint("tierckpt:newest")


def test_a_save_killed_halfway_is_never_picked(
    framework_agent: RunningAgent, tmp_path: Path
) -> None:
    agent = framework_agent
    full_weights, _ = uninterrupted(agent, tmp_path)
    root = agent.ssd / "lightning"
    argv = [
        sys.executable,
        "-m",
        "tests.e2e.lightning_app",
        "--server",
        agent.url,
        "--run",
        "killed",
        "--root",
        str(root),
        "--workdir",
        str(tmp_path / "killed"),
        "--node",
        NODE,
        "--hang-at",
        "6",
    ]
    child = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.strip() == WRITING:
                break
        else:
            raise AssertionError(f"the child ended before saving step 6: {child.wait()}")
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
        if child.stdout is not None:
            child.stdout.close()

    # Half of step 6 is on disk, only under a hidden staging name.
    leftovers = list((root / "killed").glob(".tierckpt-staging-step-6-*"))
    assert len(leftovers) == 1 and any(leftovers[0].iterdir())
    assert not (root / "killed" / "step-6").exists()
    assert settle(agent.url, "killed") == {2: "durable", 4: "durable"}

    _, model, plugin = train(
        agent, "killed", tmp_path / "killed", EPOCHS, ckpt_path="tierckpt:latest"
    )
    assert plugin.restored is not None and plugin.restored.step == 4
    assert not leftovers[0].exists()  # cleaned when the plugin started
    assert same_tensors(weights(model), full_weights)
    assert settle(agent.url, "killed") == {step: "durable" for step in (2, 4, 6, 8)}
    checkpoints = tmp_path / "killed" / "checkpoints"
    assert not list(checkpoints.glob("last-v*.ckpt"))


def test_the_example_starts_fresh_then_resumes(
    framework_agent: RunningAgent, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    agent = framework_agent
    common = ["--server", agent.url, "--run", "example", "--root", str(agent.ssd / "ex")]
    common += ["--workdir", str(tmp_path / "ex"), "--node", NODE]
    main([*common, "--epochs", "2"])
    settle(agent.url, "example")
    main([*common, "--epochs", "3"])
    done = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert done == [
        {"event": "done", "step": 4, "resumed_from": None, "source": None},
        {"event": "done", "step": 6, "resumed_from": 4, "source": "local"},
    ]
