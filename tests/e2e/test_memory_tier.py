"""The memory tier end to end: the real agent (`tierckpt serve`), real
SeaweedFS, trainer processes, kill -9.

- A trainer killed -9 right after `save` returned (the state only in the
  agent's memory): the segment it held for its next save is freed at once,
  the checkpoint still becomes durable, the restarted
  trainer resumes from memory on the same node, and its final weights are
  bit-identical to an uninterrupted run's.
- The agent killed -9 while it writes a staged segment to T0: restarted, it
  finishes the work; the checkpoint becomes durable with the right bytes and
  no half-written directory is left on T0.
- The arena full: saves wait for room (`when_full = "wait"`) or go to disk
  (`"disk"`, or a state larger than the whole tier); none is lost.
- The segment a save reserved ahead for the next one: used (one call per
  save), given back when half its lease is gone, reserved anew when the
  agent no longer knows it, given back when its step is refused (the save
  then goes to disk), and given back when the trainer closes its
  checkpointer.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_torch_resume import (  # noqa: F401
    NODE,
    AgentFactory,
    Trainer,
    start_agent,
    trainer_argv,
    weights_sha256,
)
from tierckpt.client import CheckpointClient

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402

from tierckpt.client.torch import TorchCheckpointer  # noqa: E402

pytestmark = pytest.mark.e2e


def detail(url: str, run: str, step: int) -> dict[str, Any]:
    answer = httpx.get(f"{url}/v1/runs/{run}/checkpoints/{step}", timeout=10)
    answer.raise_for_status()
    return dict(answer.json())


def memory_info(url: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/v1/memory", timeout=10)
    answer.raise_for_status()
    return dict(answer.json())


def wait_durable(url: str, run: str, step: int, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = detail(url, run, step)
        except httpx.HTTPStatusError:
            found = {"state": "unknown"}
        if found["state"] in ("durable", "replicated"):
            return found
        assert found["state"] not in ("failed", "corrupt", "deleted"), found
        assert time.monotonic() < deadline, f"{run} step {step} stuck: {found}"
        time.sleep(0.05)


def on_t0(directory: Path, timeout: float = 60) -> Path:
    """``directory`` once the agent wrote it to T0: after the checkpoint's
    upload (service/memory/upload_first.py), renamed into place whole."""
    deadline = time.monotonic() + timeout
    while not directory.is_dir():
        assert time.monotonic() < deadline, f"{directory} not written to T0"
        time.sleep(0.02)
    return directory


def test_trainer_killed_after_save_resumes_from_memory_bit_identical(
    start_agent: AgentFactory,  # noqa: F811
    tmp_path: Path,
) -> None:
    agent, ssd = start_agent(memory={"bytes": 64 << 20})
    run = "killed-after-save"
    reference = tmp_path / "reference.safetensors"
    argv = trainer_argv(agent.url, ssd, run, "--steps", "40", "--every", "5")
    trainer = Trainer([*argv, "--no-register", "--final-out", str(reference)], tmp_path / "r.log")
    assert trainer.until("done")["step"] == 40
    assert trainer.wait() == 0

    # Life 1: killed the moment save() of step 15 returns. Its steps sleep:
    # on a busy machine the kill can otherwise come after step 20's save,
    # whose segment then takes step 15's place as the run's newest in memory.
    trainer = Trainer([*argv, "--sleep", "0.3"], tmp_path / "trainer-1.log")
    try:
        saved = trainer.until("checkpoint", step=15)
        trainer.signal(signal.SIGKILL)
    finally:
        assert trainer.wait() == -signal.SIGKILL
    assert saved["state"] == "staged", saved  # in the agent's memory, nowhere else yet
    assert saved["write_seconds"] is not None and saved["write_seconds"] < saved["stall_seconds"]

    # The segment it held for its next save is freed once its lock dies
    # with it (segment_holds.py), not at the end of its 600 s lease.
    assert saved["next_segment"] is not None, saved
    deadline = time.monotonic() + 30
    while saved["next_segment"] in {s["id"] for s in memory_info(agent.url)["segments"]}:
        assert time.monotonic() < deadline, "the killed trainer's reserved segment is still held"
        time.sleep(0.1)

    # Nothing of the trainer is needed any more: the agent makes it durable.
    done = wait_durable(agent.url, run, 15)
    assert {c["tier"] for c in done["copies"]} >= {"memory", "t0", "region"}

    # Life 2 on the same node: from memory (the newest segment is kept).
    final = tmp_path / "final.safetensors"
    trainer = Trainer([*argv, "--final-out", str(final)], tmp_path / "trainer-2.log")
    resumed = trainer.until("resumed")
    finished = trainer.until("done")
    assert trainer.wait() == 0
    assert (resumed["step"], resumed["source"]) == (15, "memory"), resumed
    assert finished["step"] == 40

    ours, theirs = load_file(str(final)), load_file(str(reference))
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].numpy().tobytes() == tensor.numpy().tobytes(), name
    assert finished["sha256"] == weights_sha256(theirs)
    for step in (20, 25, 30, 35, 40):
        wait_durable(agent.url, run, step)


def test_restart_on_the_node_may_resume_from_a_checkpoint_not_durable_yet(
    start_agent: AgentFactory,  # noqa: F811
    tmp_path: Path,
    seaweed: Any,
) -> None:
    agent, ssd = start_agent(memory={"bytes": 64 << 20})
    run = "newest-on-node"
    argv = trainer_argv(agent.url, ssd, run, "--steps", "10", "--every", "5")
    # Slow steps: step 10 is saved well after step 5 is durable.
    trainer = Trainer([*argv, "--sleep", "0.3"], tmp_path / "trainer-1.log")
    trainer.until("checkpoint", step=5)
    # Held until step 5 is durable: on a busy machine its upload can take
    # longer than the trainer's way to step 10, which must not reach the store.
    os.kill(trainer.proc.pid, signal.SIGSTOP)
    try:
        wait_durable(agent.url, run, 5)
        # The store stalls: step 10 reaches T0 and the catalog but not the region.
        os.kill(seaweed.pid, signal.SIGSTOP)
    finally:
        os.kill(trainer.proc.pid, signal.SIGCONT)
    try:
        trainer.until("done")
        assert trainer.wait() == 0
        deadline = time.monotonic() + 30
        while detail(agent.url, run, 10)["state"] == "staged":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert detail(agent.url, run, 10)["state"] in ("registered", "uploading")
        # The durable latest is step 5 (held in memory no more: step 10 freed it).
        durable_only = Trainer(argv, tmp_path / "trainer-2.log")
        event = durable_only.until("resumed")
        assert durable_only.wait() == 0
        assert (event["step"], event["source"]) == (5, "local"), event
        newest = Trainer([*argv, "--newest-on-node"], tmp_path / "trainer-3.log")
        event = newest.until("resumed")
        assert newest.wait() == 0
        assert (event["step"], event["source"]) == (10, "memory"), event
    finally:
        os.kill(seaweed.pid, signal.SIGCONT)
    wait_durable(agent.url, run, 10)


def _files_of(directory: Path) -> dict[str, str]:
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_agent_killed_while_persisting_finishes_after_restart(
    start_agent: AgentFactory,  # noqa: F811
    tmp_path: Path,
) -> None:
    agent, ssd = start_agent(memory={"bytes": 1 << 30})
    assert agent.proc is not None
    files = {"a.bin": os.urandom(96 << 20), "b/c.bin": os.urandom(96 << 20), "d.json": b"{}"}
    run, step = "agent-killed", 1
    target = ssd / run / "step-1"
    with CheckpointClient(agent.url) as client:
        segment = client.reserve_segment(run, step, {p: len(d) for p, d in files.items()})
        for relative, data in files.items():
            path = Path(segment.path) / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        staged = client.register_segment(segment.id, run, step, target)
        assert staged.state == "staged"
        # Step the agent in 1 ms slices until its copy to T0 is under way,
        # then kill it there.
        hidden = ssd / run / f".tierckpt-persist-{segment.id}"
        caught = False
        while not target.exists():
            os.kill(agent.proc.pid, signal.SIGSTOP)
            if hidden.exists():
                caught = True
                break
            os.kill(agent.proc.pid, signal.SIGCONT)
            time.sleep(0.001)
        agent.kill()
        assert caught, "the copy to T0 finished before the agent could be stopped in it"
        assert not target.exists()

    agent.start()
    done = wait_durable(agent.url, run, step)
    assert _files_of(on_t0(target)) == {p: hashlib.sha256(d).hexdigest() for p, d in files.items()}
    assert {f["path"]: f["sha256"] for f in done["files"]} == _files_of(target)
    assert sorted(p.name for p in (ssd / run).iterdir()) == ["step-1"]  # no leftover
    with CheckpointClient(agent.url) as client:
        restored = client.restore(run, tmp_path / "restored")
    assert _files_of(restored) == _files_of(target)


@pytest.mark.parametrize("when_full", ["wait", "disk"])
def test_full_arena_waits_or_goes_to_disk_and_loses_nothing(
    start_agent: AgentFactory,  # noqa: F811
    tmp_path: Path,
    when_full: str,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)  # ~260 KB of weights; the arena holds one save
    agent, ssd = start_agent(
        memory={"bytes": 400_000, "when_full": when_full, "wait_seconds": 60},
        # Every step's T0 copy is read below: none evicted once durable.
        local={"keep_last": 10},
    )
    run = f"full-{when_full}"
    with CheckpointClient(agent.url) as client:
        checkpointer = TorchCheckpointer(client, run, ssd, model=model, node=NODE)
        states, expected = [], {}
        for step in range(1, 7):
            with torch.no_grad():
                model.weight.add_(1.0)
            expected[step] = model.weight.detach().clone()
            states.append(checkpointer.save(step).state)
        big = TorchCheckpointer(
            client, f"{run}-big", ssd, model=torch.nn.Linear(512, 512), node=NODE
        )
        too_big = big.save(1).state  # larger than the whole tier: to disk at once
    assert too_big == "registered"
    if when_full == "wait":
        # Every save waited for room rather than going to disk.
        assert states == ["staged"] * 6, states
    else:
        assert states[0] == "staged" and set(states) <= {"staged", "registered"}, states
    for step in range(1, 7):
        wait_durable(agent.url, run, step)
        weights = load_file(str(on_t0(ssd / run / f"step-{step}") / "model.safetensors"))
        assert torch.equal(weights["weight"], expected[step]), step
    info = memory_info(agent.url)
    assert info["used"] <= info["bytes"]


def test_a_worker_process_uploads_a_staged_checkpoint_from_memory(
    start_agent: AgentFactory,  # noqa: F811
) -> None:
    """The worker in a process of its own ([worker] separate_process, the
    default on PostgreSQL) holds no arena: it reads a staged checkpoint from
    the segment's own files (memory/reader.py). Here T0 cannot be written
    (a file is in the way of the run's directory), so the checkpoint becomes
    durable from memory alone; once T0 can be written, the segment reaches it."""
    agent, ssd = start_agent(memory={"bytes": 64 << 20}, worker={"separate_process": "yes"})
    files = {"a.bin": os.urandom(3 << 20), "b/c.json": b"{}"}
    run, step = "blocked", 1
    (ssd / run).write_bytes(b"")  # the blocker
    target = ssd / run / "step-1"
    with CheckpointClient(agent.url) as client:
        segment = client.reserve_segment(run, step, {p: len(d) for p, d in files.items()})
        for relative, data in files.items():
            path = Path(segment.path) / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        assert client.register_segment(segment.id, run, step, target).state == "staged"
    done = wait_durable(agent.url, run, step)
    assert {f["path"]: f["sha256"] for f in done["files"]} == {
        p: hashlib.sha256(d).hexdigest() for p, d in files.items()
    }
    (ssd / run).unlink()
    deadline = time.monotonic() + 60
    while not target.exists():
        assert time.monotonic() < deadline, "the segment never reached T0"
        time.sleep(0.05)
    assert _files_of(target) == {p: hashlib.sha256(d).hexdigest() for p, d in files.items()}


def _reservations(log: Path) -> int:
    """The agent's answered `POST /v1/memory/segments` calls (its request log)."""
    count = 0
    for line in log.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("method") == "POST" and entry.get("path") == "/v1/memory/segments":
            count += 1
    return count


def test_each_save_after_the_first_is_one_call_into_the_segment_reserved_ahead(
    start_agent: AgentFactory,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Staging a save reserves the next one's segment (same files), which the
    next save writes and stages at whatever step it has, its small files'
    sizes changed: one call per save.
    The bytes on T0 are each step's, and a restart loads the newest from
    memory. A segment reserved ahead with less than half its lease left is
    given back and the save reserves anew."""
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 128)
    agent, ssd = start_agent(
        memory={"bytes": 64 << 20, "lease_seconds": 4},
        local={"keep_last": 10},  # every step's T0 copy is read below
    )
    run = "ahead"
    expected: dict[int, Any] = {}
    with CheckpointClient(agent.url) as client:
        checkpointer = TorchCheckpointer(client, run, ssd, model=model, node=NODE)
        for step in (10, 20, 35, 50):
            with torch.no_grad():
                model.weight.add_(1.0)
            expected[step] = model.weight.detach().clone()
            # Metrics of different lengths: state.json's size changes each save.
            assert checkpointer.save(step, metrics={"loss": 1 / step}).state == "staged"
        assert _reservations(agent.log) == 1
        time.sleep(2.5)  # more than half the reservation's lease gone
        with torch.no_grad():
            model.weight.add_(1.0)
        expected[60] = model.weight.detach().clone()
        assert checkpointer.save(60).state == "staged"
        assert _reservations(agent.log) == 2
        for step in expected:
            wait_durable(agent.url, run, step)
            weights = load_file(str(on_t0(ssd / run / f"step-{step}") / "model.safetensors"))
            assert torch.equal(weights["weight"], expected[step]), step
        restored = TorchCheckpointer(client, run, ssd, model=torch.nn.Linear(128, 128), node=NODE)
        assert restored.restore_latest() == 60
        assert restored.restored is not None and restored.restored.source == "memory"
        assert torch.equal(restored.objects["model"].weight, expected[60])


def test_closing_the_checkpointer_gives_back_the_segment_reserved_ahead(
    start_agent: AgentFactory,  # noqa: F811
) -> None:
    """A trainer that is done (``close``, or the end of a ``with`` block)
    hands back the segment reserved for its next save at once instead of
    leaving a state's worth of the arena held until the lease ends; the
    checkpoints it saved are unaffected, and a save after ``close`` reserves
    anew."""
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 128)
    agent, ssd = start_agent(memory={"bytes": 64 << 20}, local={"keep_last": 10})
    run = "closing"
    with CheckpointClient(agent.url) as client:
        with TorchCheckpointer(client, run, ssd, model=model, node=NODE) as checkpointer:
            assert checkpointer.save(1).state == "staged"
            ahead = [s for s in memory_info(agent.url)["segments"] if s["step"] is None]
            assert [s["state"] for s in ahead] == ["reserved"]
        after = memory_info(agent.url)
        assert all(s["id"] != ahead[0]["id"] for s in after["segments"]), after
        assert not Path(ahead[0]["path"]).exists()
        checkpointer.close()  # idempotent: nothing more to give back

        with torch.no_grad():
            model.weight.add_(1.0)
        assert checkpointer.save(2).state == "staged"
        assert _reservations(agent.log) == 2  # the first save's, and this one's
        checkpointer.close()
        for step in (1, 2):
            wait_durable(agent.url, run, step)
        weights = load_file(str(on_t0(ssd / run / "step-2") / "model.safetensors"))
        assert torch.equal(weights["weight"], model.weight.detach())
        assert not [s for s in memory_info(agent.url)["segments"] if s["state"] == "reserved"]


def test_the_next_saves_segment_is_mapped_while_the_trainer_trains(
    start_agent: AgentFactory,  # noqa: F811
    shm_dir: Path,
) -> None:
    """The segment reserved with a save, for the next one, has its
    safetensors files' pages allocated and mapped by the checkpointer in the
    background before that next save, which then copies through those
    mappings (it maps nothing in its stall), with the right bytes on T0.
    The arena on a tmpfs, as by default (/dev/shm): on a disk file system a
    mapping's faults allocate no blocks, and the save writes with pwrite."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    agent, ssd = start_agent(memory={"bytes": 64 << 20, "dir": str(shm_dir)})
    run = "prepared"
    with CheckpointClient(agent.url) as client:
        with TorchCheckpointer(client, run, ssd, model=model, node=NODE) as checkpointer:
            assert checkpointer.save(1).state == "staged"
            ahead = checkpointer._ahead
            assert ahead is not None
            checkpointer._mappings._settle()  # as the next save does first
            files = sorted(Path(ahead.path).glob("*.safetensors"))
            assert files, list(Path(ahead.path).iterdir())
            kept = checkpointer._mappings._maps
            for path in files:
                info = path.stat()
                assert info.st_blocks * 512 >= info.st_size, path  # no holes left
                assert (info.st_dev, info.st_ino) in kept, path
            targets: list[bool] = []
            target = checkpointer._mappings.target

            def recording(fd: int, size: int, used: set[tuple[int, int]]) -> Any:
                found = target(fd, size, used)
                targets.append(found is not None)
                return found

            checkpointer._mappings.target = recording  # type: ignore[method-assign]
            with torch.no_grad():
                model.weight.add_(1.0)
            assert checkpointer.save(2).state == "staged"
            assert targets and all(targets)  # every file through its prepared mapping
            wait_durable(agent.url, run, 2)
            weights = load_file(str(on_t0(ssd / run / "step-2") / "model.safetensors"))
            assert torch.equal(weights["weight"], model.weight.detach())


def _agent_and_model(start_agent: AgentFactory) -> tuple[Any, Path, Any]:  # noqa: F811
    """An agent with a memory tier whose T0 keeps every step (each is read
    back), and a small seeded model."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    agent, ssd = start_agent(memory={"bytes": 64 << 20}, local={"keep_last": 10})
    return agent, ssd, model


def test_a_segment_reserved_ahead_that_the_agent_no_longer_knows_is_reserved_anew(
    start_agent: AgentFactory,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent restarted on another arena directory (`[memory] dir`
    changed) while the old one, with the segment reserved ahead, is still
    there: staging it answers 404 `segment_not_found`, and the save reserves
    a segment of the new arena, still in memory, the bytes its own."""
    agent, ssd, model = _agent_and_model(start_agent)
    run = "ahead-gone"
    expected: dict[int, Any] = {}
    with CheckpointClient(agent.url) as client:
        checkpointer = TorchCheckpointer(client, run, ssd, model=model, node=NODE)
        for step in (1, 2):
            with torch.no_grad():
                model.weight.add_(1.0)
            expected[step] = model.weight.detach().clone()
            assert checkpointer.save(step).state == "staged"
            wait_durable(agent.url, run, step)
            on_t0(ssd / run / f"step-{step}")  # nothing of it left for the old arena
        reserved_ahead = checkpointer._ahead
        assert reserved_ahead is not None
        assert _reservations(agent.log) == 1

        agent.kill()
        monkeypatch.setenv("TIERCKPT_MEMORY__DIR", str(tmp_path / "another-arena"))
        agent.start()
        assert Path(reserved_ahead.path).is_dir()  # the old arena's files remain

        with torch.no_grad():
            model.weight.add_(1.0)
        expected[3] = model.weight.detach().clone()
        saved = checkpointer.save(3)
        assert saved.state == "staged"  # in the new arena's memory, not on disk
        assert _reservations(agent.log) == 2
        segments = memory_info(agent.url)["segments"]
        assert all(Path(s["path"]).is_relative_to(tmp_path / "another-arena") for s in segments), (
            segments
        )
        for step in expected:
            wait_durable(agent.url, run, step)
            weights = load_file(str(on_t0(ssd / run / f"step-{step}") / "model.safetensors"))
            assert torch.equal(weights["weight"], expected[step]), step


def test_a_replayed_step_through_the_segment_reserved_ahead_goes_to_disk(
    start_agent: AgentFactory,  # noqa: F811
) -> None:
    """A trainer killed after reserving step 5 and before staging it leaves
    that reservation until its lease ends. Restarted from step 3, the trainer
    saves 4 (reserving ahead) and replays 5 into the segment reserved ahead:
    the agent refuses that step (409 `segment_exists`), the save writes to
    disk instead and registers there, and the segment it did not use is
    given back. The next save reserves anew; nothing is lost."""
    agent, ssd, model = _agent_and_model(start_agent)
    run = "ahead-replayed"
    expected: dict[int, Any] = {}
    with CheckpointClient(agent.url) as client:
        checkpointer = TorchCheckpointer(client, run, ssd, model=model, node=NODE)
        # The killed trainer's reservation (its sizes do not matter: its step does).
        leftover = client.reserve_segment(run, 5, {"model.safetensors": 4096})
        states = {}
        for step in (4, 5, 6):
            with torch.no_grad():
                model.weight.add_(1.0)
            expected[step] = model.weight.detach().clone()
            saved = checkpointer.save(step)
            states[step] = saved.state
            if step == 4:
                assert saved.next_segment is not None
                unused = saved.next_segment.id
        assert states == {4: "staged", 5: "registered", 6: "staged"}, states
        # The leftover, the save of step 4, and step 6's (step 5's was refused).
        assert _reservations(agent.log) == 3
        segments = {s["id"]: s for s in memory_info(agent.url)["segments"]}
        assert unused not in segments  # given back, not left to its lease
        assert segments[leftover.id]["state"] == "reserved"
        for step in expected:
            wait_durable(agent.url, run, step)
            weights = load_file(str(on_t0(ssd / run / f"step-{step}") / "model.safetensors"))
            assert torch.equal(weights["weight"], expected[step]), step
