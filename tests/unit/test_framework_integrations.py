"""The Lightning and Hugging Face integrations without an agent: the core
client never imports either framework, and bad input is refused by name
before anything is written or sent (the client points at a closed port:
any request would fail the test with a connection error, not pass it)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierckpt.client import Checkpoint, CheckpointClient
from tierckpt.client._frameworks import matches_catalog, remove_leftovers, scratch_dir

NOWHERE = "http://127.0.0.1:9"


def test_the_core_client_imports_no_framework() -> None:
    probe = (
        "import sys, tierckpt.client, tierckpt.client.cli, tierckpt.client.torch\n"
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers', "
        "'accelerate') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"


def _checkpoint(files: dict[str, bytes]) -> Checkpoint:
    return Checkpoint.model_validate(
        {
            "run": "r",
            "step": 1,
            "state": "durable",
            "files": [
                {"path": p, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                for p, b in files.items()
            ],
        }
    )


def test_a_local_copy_matches_only_with_every_size_and_hash(tmp_path: Path) -> None:
    checkpoint = _checkpoint({"a.bin": b"abc", "sub/b.bin": b"defg"})
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"abc")
    (tmp_path / "sub" / "b.bin").write_bytes(b"defg")
    (tmp_path / "extra").write_bytes(b"a trainer's leftover")
    assert matches_catalog(tmp_path, checkpoint)
    (tmp_path / "a.bin").write_bytes(b"abd")  # same size, other bytes
    assert not matches_catalog(tmp_path, checkpoint)
    assert matches_catalog(tmp_path, checkpoint, hash_files=False)
    (tmp_path / "sub" / "b.bin").unlink()
    assert not matches_catalog(tmp_path, checkpoint, hash_files=False)
    assert not matches_catalog(tmp_path, _checkpoint({}))


def test_leftovers_of_live_processes_stay(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = tmp_path / f".tierckpt-staging-step-4-pid{gone.stdout.strip()}-x"
    unnamed = tmp_path / ".tierckpt-restore-3-y"  # no owner in the name: an old leftover
    mine = scratch_dir(".tierckpt-staging-step-6-", tmp_path)  # this process: in progress
    other = tmp_path / "step-2"
    for directory in (dead, unnamed, other):
        directory.mkdir()
    assert remove_leftovers(tmp_path, (".tierckpt-staging-", ".tierckpt-restore-")) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, "step-2"])


class TestLightning:
    @pytest.fixture
    def plugin(self, tmp_path: Path) -> Iterator[Any]:
        pytest.importorskip("lightning")
        from tierckpt.client.lightning import TierckptCheckpointIO

        with CheckpointClient(NOWHERE, retries=0) as client:
            yield TierckptCheckpointIO(client, "run", tmp_path / "root")

    def test_bad_names_and_checkpoints_are_refused(self, plugin: Any, tmp_path: Path) -> None:
        from tierckpt.client.lightning import TierckptCheckpointIO

        with pytest.raises(ValueError, match="run must be"):
            TierckptCheckpointIO(plugin.client, "a/b", tmp_path)
        with pytest.raises(ValueError, match="global_step"):
            plugin.save_checkpoint({"state_dict": {}}, tmp_path / "x.ckpt")
        with pytest.raises(ValueError, match="global_step"):
            plugin.save_checkpoint({"global_step": -1}, tmp_path / "x.ckpt")
        with pytest.raises(TypeError, match="storage_options"):
            plugin.save_checkpoint({"global_step": 1}, tmp_path / "x.ckpt", storage_options={})
        for wrong in ("tierckpt:", "tierckpt:-3", "tierckpt:last"):
            with pytest.raises(ValueError, match="tierckpt:latest"):
                plugin.load_checkpoint(wrong)
        assert not (tmp_path / "root").exists()  # nothing was written

    def test_a_remote_lightning_path_gets_no_local_junk(
        self, plugin: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # No agent here: the registration is recorded instead of sent; what
        # is checked is the write, and that no local link is made.
        calls: list[Any] = []
        monkeypatch.setattr(plugin.client, "register", lambda *a, **k: calls.append((a, k)))
        monkeypatch.chdir(tmp_path)
        plugin.save_checkpoint({"global_step": 2}, "s3://bucket/ckpts/epoch=0-step=2.ckpt")
        assert (plugin.step_dir(2) / "epoch=0-step=2.ckpt").is_file()
        assert not (tmp_path / "s3:").exists()
        assert calls[0][1]["metadata"]["lightning_path"] == "s3://bucket/ckpts/epoch=0-step=2.ckpt"
        plugin.remove_checkpoint("s3://bucket/ckpts/epoch=0-step=2.ckpt")

    def test_a_plain_file_loads_as_lightning_would(self, plugin: Any, tmp_path: Path) -> None:
        import torch

        torch.save({"global_step": 3, "state_dict": {}}, tmp_path / "foreign.ckpt")
        assert plugin.load_checkpoint(tmp_path / "foreign.ckpt")["global_step"] == 3
        assert plugin.restored.source == "file" and plugin.restored.step is None
        with pytest.raises(FileNotFoundError):
            plugin.load_checkpoint(tmp_path / "missing.ckpt")

    def test_remove_keeps_registered_copies_and_leftovers_go(
        self, plugin: Any, tmp_path: Path
    ) -> None:
        from tierckpt.client.lightning import TierckptCheckpointIO

        registered = plugin.step_dir(4) / "epoch=1-step=4.ckpt"
        registered.parent.mkdir(parents=True)
        registered.write_bytes(b"registered")
        lightnings = tmp_path / "checkpoints" / "epoch=1-step=4.ckpt"
        lightnings.parent.mkdir()
        lightnings.write_bytes(b"lightning's name")
        plugin.remove_checkpoint(registered)
        plugin.remove_checkpoint(lightnings)
        assert registered.read_bytes() == b"registered" and not lightnings.exists()

        # A step directory that is not one checkpoint file is refused by name.
        stranger = plugin.step_dir(5)
        stranger.mkdir()
        (stranger / "a").write_bytes(b"a")
        (stranger / "b").write_bytes(b"b")
        with pytest.raises(FileExistsError, match="not one checkpoint file"):
            plugin.save_checkpoint({"global_step": 5}, tmp_path / "x.ckpt")

        staging = plugin.run_dir / ".tierckpt-staging-step-6-abc"
        staging.mkdir()
        (staging / "half.ckpt").write_bytes(b"half")
        TierckptCheckpointIO(plugin.client, "run", plugin.root)
        assert not staging.exists() and registered.exists()


class TestHuggingFace:
    @pytest.fixture
    def parts(self, tmp_path: Path) -> Iterator[Any]:
        pytest.importorskip("transformers")
        pytest.importorskip("accelerate")
        from transformers import TrainerControl, TrainerState, TrainingArguments

        from tierckpt.client.hf import TierckptCallback

        args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
        with CheckpointClient(NOWHERE, retries=0) as client:
            state = TrainerState(global_step=2)
            yield TierckptCallback(client, "run"), args, state, TrainerControl()

    def test_an_unfinished_checkpoint_is_never_registered(self, parts: Any, tmp_path: Path) -> None:
        callback, args, state, control = parts
        unfinished = tmp_path / "out" / "checkpoint-2"
        unfinished.mkdir(parents=True)
        (unfinished / "model.safetensors").write_bytes(b"weights")
        with pytest.raises(RuntimeError, match=r"trainer_state\.json"):
            callback.on_save(args, state, control)
        state.is_world_process_zero = False  # other processes leave it to process zero
        callback.on_save(args, state, control)
        assert callback.registered == []
        assert not (tmp_path / "out" / ".tierckpt").exists()

    def test_bad_run_names_are_refused(self, parts: Any) -> None:
        from tierckpt.client.hf import TierckptCallback

        with pytest.raises(ValueError, match="run must be"):
            TierckptCallback(parts[0].client, "")
