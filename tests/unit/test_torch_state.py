"""tierckpt.client.torch without a service: the state format round-trips
exactly, training continues bit for bit after a load, the data-loader
position is restored, and the checkpointer's save/resume logic (replayed
steps, local vs region restore) against an in-memory client."""

from __future__ import annotations

import json
import random
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from tierckpt.client import NotFoundError  # noqa: E402
from tierckpt.client.models import Checkpoint  # noqa: E402
from tierckpt.client.torch import (  # noqa: E402
    MODEL_FILE,
    OBJECTS_FILE,
    STATE_FILE,
    ResumableLoader,
    TorchCheckpointer,
    load_state,
    save_state,
)
from tierckpt.client.torch.codec import Encoder, decode  # noqa: E402


class Net(torch.nn.Module):
    """Dropout (torch RNG), BatchNorm (state-dict metadata), tied weights."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 16, bias=False)
        self.norm = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.2)
        self.out = torch.nn.Linear(16, 8, bias=False)
        self.out.weight = torch.nn.Parameter(self.embed.weight.t().contiguous())
        self.head = torch.nn.Linear(8, 2)
        self.head2 = self.head  # the same module twice: tied parameters

    def forward(self, x: Any) -> Any:
        return self.head(torch.relu(self.out(self.drop(self.norm(self.embed(x))))))


class Trainer:
    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        self.model = Net()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        data = torch.Generator().manual_seed(1234)
        xs = torch.randn(40, 8, generator=data)
        ys = torch.randint(0, 2, (40,), generator=data)
        self.loader = ResumableLoader(
            DataLoader(
                TensorDataset(xs, ys),
                batch_size=6,
                shuffle=True,
                generator=torch.Generator().manual_seed(7),
            )
        )
        self.noise = torch.Generator().manual_seed(99)
        self.py = random.Random(5)
        self.npg = np.random.default_rng(11)
        self.step = 0
        self._batches: Any = None

    @property
    def generators(self) -> dict[str, Any]:
        return {"noise": self.noise, "py": self.py, "np": self.npg}

    def train(self, steps: int) -> None:
        for _ in range(steps):
            if self._batches is None:
                self._batches = iter(self.loader)
            try:
                x, y = next(self._batches)
            except StopIteration:
                self._batches = iter(self.loader)
                x, y = next(self._batches)
            jitter = torch.randn(x.shape, generator=self.noise) * 0.01
            scale = 1.0 + self.py.random() * 0.01 + float(self.npg.random()) * 0.01
            scale += random.random() * 0.001 + float(np.random.rand()) * 0.001
            loss = torch.nn.functional.cross_entropy(self.model((x + jitter) * scale), y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.sched.step()
            self.step += 1

    def save(self, directory: Path) -> None:
        save_state(
            directory,
            step=self.step,
            model=self.model,
            optimizer=self.opt,
            scheduler=self.sched,
            data=self.loader,
            generators=self.generators,
            epoch=self.loader.epoch,
            extra={"note": "hi", 3: (1.5, float("nan"))},
        )

    def load(self, directory: Path) -> Any:
        state = load_state(
            directory,
            model=self.model,
            optimizer=self.opt,
            scheduler=self.sched,
            data=self.loader,
            generators=self.generators,
        )
        self.step = state.step
        self._batches = None
        return state


def params(model: Any) -> dict[str, bytes]:
    return {k: v.detach().numpy().tobytes() for k, v in model.state_dict().items()}


@pytest.fixture
def deterministic() -> Any:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("split", [5, 7, 13])  # mid-epoch, last batch of an epoch, 2nd epoch
def test_resume_is_bit_exact(tmp_path: Path, split: int, deterministic: None) -> None:
    reference = Trainer()
    reference.train(20)

    first = Trainer()
    first.train(split)
    first.save(tmp_path / "ckpt")
    first.train(3)  # state moves on after the save; must not leak into the file

    # Different seeds everywhere: only the checkpoint can make it exact.
    second = Trainer(seed=1)
    for g in (second.noise,):
        g.manual_seed(1)
    state = second.load(tmp_path / "ckpt")
    assert state.step == split and state.extra["note"] == "hi"
    assert state.extra[3][0] == 1.5 and state.extra[3][1] != state.extra[3][1]  # nan
    second.train(20 - split)
    assert params(second.model) == params(reference.model)
    assert second.opt.state_dict()["param_groups"] == reference.opt.state_dict()["param_groups"]
    assert second.sched.state_dict() == reference.sched.state_dict()
    assert second.loader.state_dict()["batches"] == reference.loader.state_dict()["batches"]


def test_files_are_standard_and_json_is_plain(tmp_path: Path) -> None:
    trainer = Trainer()
    trainer.train(2)
    trainer.save(tmp_path / "c")
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == sorted([MODEL_FILE, "state.safetensors", STATE_FILE])  # no pickle needed
    weights = load_file(str(tmp_path / "c" / MODEL_FILE))
    assert torch.equal(weights["head.weight"], trainer.model.head.weight)
    assert "head2.weight" not in weights  # tied: stored once, referenced twice
    skeleton = json.loads((tmp_path / "c" / STATE_FILE).read_text(), parse_constant=None)
    assert skeleton["model"]["head2.weight"] == skeleton["model"]["head.weight"]
    assert skeleton["model_metadata"]["norm"]["version"] == 2
    assert skeleton["step"] == 2 and skeleton["format"].startswith("tierckpt.torch/")
    # Leftover staging directories are not left behind.
    assert [p.name for p in tmp_path.iterdir()] == ["c"]
    with pytest.raises(FileExistsError):
        save_state(tmp_path / "c", step=3, model=trainer.model)


def test_encoder_round_trip_of_odd_values(tmp_path: Path) -> None:
    base = torch.arange(12.0)
    value = {
        "views": [base[:4], base[2:6], base[:4]],  # overlapping views, a repeated one
        "strided": torch.arange(16).reshape(4, 4).t(),
        "int_keys": {1: "a", 2: torch.tensor(3)},
        "$weird": 1,
        "tuple": (1, 2.5, None, True),
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "floats": [float("inf"), -float("inf")],
        "bytes": b"\x00\xff",
        "array": np.arange(5, dtype=np.uint32),
        "gen": torch.Generator().manual_seed(3),
        "object": {1, 2},
    }
    encoder = Encoder()
    skeleton = json.loads(json.dumps(encoder.encode(value), allow_nan=False))
    assert len(encoder.tensors) == 6  # the repeated view is stored once
    assert set(encoder.objects) == {"object"}
    back = decode(skeleton, encoder.tensors, encoder.objects)
    assert [torch.equal(a, b) for a, b in zip(back["views"], value["views"], strict=True)]
    assert back["views"][1].tolist() == [2.0, 3.0, 4.0, 5.0]
    assert torch.equal(back["strided"], value["strided"])
    assert back["int_keys"][1] == "a" and back["int_keys"][2].item() == 3
    assert back["$weird"] == 1 and back["tuple"] == (1, 2.5, None, True)
    assert back["size"] == torch.Size([2, 3]) and isinstance(back["size"], torch.Size)
    assert back["dtype"] is torch.bfloat16 and back["device"] == torch.device("cpu")
    assert back["floats"] == [float("inf"), -float("inf")] and back["bytes"] == b"\x00\xff"
    assert back["array"].dtype == np.uint32 and back["array"].tolist() == [0, 1, 2, 3, 4]
    assert torch.equal(back["gen"].get_state(), value["gen"].get_state())
    assert back["object"] == {1, 2}


def test_arbitrary_objects_go_to_a_pickle_file(tmp_path: Path) -> None:
    save_state(tmp_path / "c", step=1, extra={"s": {1, 2}})
    assert (tmp_path / "c" / OBJECTS_FILE).exists()
    assert load_state(tmp_path / "c", restore_rngs=False).extra == {"s": {1, 2}}


def test_missing_generator_or_wrong_kind_is_refused(tmp_path: Path) -> None:
    save_state(tmp_path / "c", step=1, generators={"g": torch.Generator()})
    with pytest.raises(ValueError, match="no state for generator 'other'"):
        load_state(tmp_path / "c", generators={"other": torch.Generator()})
    with pytest.raises(ValueError, match="saved as torch"):
        load_state(tmp_path / "c", generators={"g": random.Random()})


def test_resumable_loader_replays_the_rest_of_the_epoch() -> None:
    data = TensorDataset(torch.arange(10))

    def loader() -> ResumableLoader[Any]:
        return ResumableLoader(
            DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(4))
        )

    whole = loader()
    epochs = [[b[0].tolist() for b in whole] for _ in range(2)]
    assert sorted(i for batch in epochs[0] for i in batch) == list(range(10))
    assert epochs[0] != epochs[1]

    partial = loader()
    it = iter(partial)
    seen = [next(it)[0].tolist(), next(it)[0].tolist()]
    saved = partial.state_dict()
    assert saved["epoch"] == 0 and saved["batches"] == 2
    before = torch.get_rng_state()
    resumed = loader()
    resumed.generator.manual_seed(999)
    resumed.load_state_dict(saved)
    rest = [b[0].tolist() for b in resumed]
    assert seen + rest == epochs[0]
    assert torch.equal(torch.get_rng_state(), before)  # skipping did not draw from it
    assert [b[0].tolist() for b in resumed] == epochs[1]
    assert resumed.epoch == 2
    with pytest.raises(ValueError, match="generator"):
        ResumableLoader(DataLoader(data, batch_size=2))


# -- TorchCheckpointer against an in-memory client ------------------------------------------


class FakeClient:
    """Just enough of CheckpointClient: registrations keyed by step; the
    'region' is a copy taken at registration time."""

    def __init__(self, region: Path, node: str = "here") -> None:
        self.region = region
        self.node = node
        self.registered: dict[int, dict[str, Any]] = {}
        self.calls: list[tuple[str, Any]] = []

    def memory_info(self) -> Any:
        # An agent without a memory tier: saves go to disk.
        from tierckpt.client.models import MemoryInfo

        return MemoryInfo(enabled=False)

    def _checkpoint(self, step: int, **extra: Any) -> Checkpoint:
        entry = self.registered[step]
        return Checkpoint.model_validate(
            {
                "run": "r",
                "step": step,
                "state": "durable",
                "created_at": datetime.now(UTC),
                "shards": [{"rank": 0, "state": "uploaded", "path": entry["path"]}],
                **extra,
            }
        )

    def register(self, run: str, step: int, path: Any, **kwargs: Any) -> Checkpoint:
        self.calls.append(("register", (step, kwargs["parent"], kwargs["priority"])))
        fingerprint = sorted(
            (p.name, p.stat().st_mtime_ns, p.read_bytes()) for p in Path(path).iterdir()
        )
        if step in self.registered:
            if self.registered[step]["fingerprint"] != fingerprint:
                from tierckpt.client import ConflictError

                raise ConflictError("different content", status=409)
            return self._checkpoint(step)
        shutil.copytree(path, self.region / str(step))
        self.registered[step] = {"path": str(path), "fingerprint": fingerprint, **kwargs}
        return self._checkpoint(step)

    def get(self, run: str, step: int) -> Checkpoint:
        if step not in self.registered:
            raise NotFoundError("no such checkpoint")
        return self._checkpoint(step)

    def latest(self, run: str, region: Any = None, node: Any = None) -> Checkpoint | None:
        if not self.registered:
            return None
        step = max(self.registered)
        path = self.registered[step]["path"]
        rank = self.registered[step].get("rank", 0)
        local = (
            {"node": node, "path": path if rank == 0 else None, "ranks": {rank: path}}
            if node == self.node and Path(path).exists()
            else None
        )
        return self._checkpoint(step, local=local, locations=[{"region": "east"}])

    def restore(self, run: str, dest: Any, step: int, region: Any = None, rank: Any = None) -> Path:
        self.calls.append(("restore", step))
        shutil.copytree(self.region / str(step), dest)
        return Path(dest)


def test_checkpointer_saves_resumes_locally_then_from_the_region(tmp_path: Path) -> None:
    client = FakeClient(tmp_path / "region")
    (tmp_path / "region").mkdir()
    first = Trainer()
    ckpt = TorchCheckpointer(
        client,  # type: ignore[arg-type]
        "r",
        tmp_path / "ssd",
        model=first.model,
        optimizer=first.opt,
        scheduler=first.sched,
        data=first.loader,
        generators=first.generators,
        node="here",
    )
    for _ in range(2):
        first.train(3)
        ckpt.save(first.step, metrics={"loss": 1.0})
    assert client.registered[6]["write_seconds"] > 0
    assert [c[1] for c in client.calls] == [(3, None, "normal"), (6, 3, "normal")]

    def fresh() -> tuple[Trainer, TorchCheckpointer]:
        t = Trainer(seed=3)
        return t, TorchCheckpointer(
            client,  # type: ignore[arg-type]
            "r",
            tmp_path / "ssd",
            model=t.model,
            optimizer=t.opt,
            scheduler=t.sched,
            data=t.loader,
            generators=t.generators,
            node="here",
        )

    local_trainer, local = fresh()
    assert local.restore_latest() == 6
    assert local.restored is not None and local.restored.source == "local"
    assert params(local_trainer.model) == params(first.model)

    # The T0 copy is gone: the restore goes through the region.
    shutil.rmtree(tmp_path / "ssd" / "r" / "step-6")
    remote_trainer, remote = fresh()
    assert remote.restore_latest() == 6
    assert remote.restored is not None and remote.restored.source == "region"
    assert params(remote_trainer.model) == params(first.model)
    assert not list((tmp_path / "ssd" / "r").glob(".tierckpt-*"))  # scratch removed

    # Replaying step 6 with other content (nondeterministic training): the
    # registered step is immutable, so its directory is kept as it is.
    remote_trainer.step = 6
    shutil.copytree(tmp_path / "region" / "6", tmp_path / "ssd" / "r" / "step-6")
    before = (tmp_path / "ssd" / "r" / "step-6" / MODEL_FILE).stat().st_mtime_ns
    remote_trainer.model.head.bias.data += 1
    kept = remote.save(6)
    assert kept.step == 6
    assert (tmp_path / "ssd" / "r" / "step-6" / MODEL_FILE).stat().st_mtime_ns == before
    assert len([c for c in client.calls if c[0] == "register"]) == 2


def test_a_rank_of_many_restores_its_own_local_copy(tmp_path: Path) -> None:
    """world_size 2: rank 1 saved on this node resumes from its T0 directory."""
    client = FakeClient(tmp_path / "region")
    (tmp_path / "region").mkdir()
    first = Trainer()
    saver = TorchCheckpointer(
        client,  # type: ignore[arg-type]
        "r",
        tmp_path / "ssd",
        model=first.model,
        optimizer=first.opt,
        rank=1,
        world_size=2,
        node="here",
    )
    first.train(3)
    saver.save(3)
    assert client.registered[3]["path"].endswith("step-3/rank-00001")

    again = Trainer(seed=5)
    loader = TorchCheckpointer(
        client,  # type: ignore[arg-type]
        "r",
        tmp_path / "ssd",
        model=again.model,
        optimizer=again.opt,
        rank=1,
        world_size=2,
        node="here",
    )
    assert loader.restore_latest() == 3
    assert loader.restored is not None and loader.restored.source == "local"
    assert params(again.model) == params(first.model)
    assert ("restore", 3) not in client.calls


def test_checkpointer_cleans_leftovers_and_replaces_unregistered_dirs(tmp_path: Path) -> None:
    client = FakeClient(tmp_path / "region")
    (tmp_path / "region").mkdir()
    run_dir = tmp_path / "ssd" / "r"
    (run_dir / ".tierckpt-staging-step-9-abc").mkdir(parents=True)
    (run_dir / ".tierckpt-restore-9-rank0-xyz").mkdir()
    (run_dir / "step-4").mkdir()
    (run_dir / "step-4" / "garbage").write_text("half a checkpoint of an earlier life")
    trainer = Trainer()
    ckpt = TorchCheckpointer(client, "r", tmp_path / "ssd", model=trainer.model)  # type: ignore[arg-type]
    assert sorted(p.name for p in run_dir.iterdir()) == ["step-4"]
    trainer.step = 4
    ckpt.save(4)
    assert sorted(p.name for p in (run_dir / "step-4").iterdir()) == sorted(
        [MODEL_FILE, "state.safetensors", STATE_FILE]
    )
    assert 4 in client.registered
    # Same bytes again (deterministic replay): kept, registered idempotently.
    ckpt.save(4)
    assert len([c for c in client.calls if c[0] == "register"]) == 2
