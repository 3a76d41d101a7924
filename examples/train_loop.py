"""A small, real training loop that checkpoints through tierckpt.

Logistic regression trained by minibatch SGD with momentum on a synthetic
dataset (fixed seed), in pure Python: no NumPy, no PyTorch. Every `--every`
steps it writes a checkpoint directory to the local "SSD" root

    <root>/<run>/step-<N>/weights.bin      weights + bias, little-endian float64
                          optimizer.json   lr, momentum, velocity
                          rng.json         random.getstate() of the batch sampler
                          meta/info.json   run, step, loss, shapes

and registers it with the agent (`CheckpointClient.register`), then keeps
training: the upload happens in the background. With `--resume` it asks the
agent for the latest valid checkpoint, restores a verified copy into a fresh
directory and continues from it. Resume is bit-exact: an interrupted and
resumed run ends with the same weights (`--final-out`) as an uninterrupted one.

Events go to stdout as one JSON object per line, for drivers (examples/demo.py,
the e2e tests):
    {"event": "start", ...}  {"event": "resumed", "step": N, ...}
    {"event": "checkpoint", "step": N, "loss": ..., "state": ...}
    {"event": "done", "step": N, "sha256": ...}
SIGTERM (a preemption notice) writes an urgent checkpoint of the current
step before exiting, as a real trainer should.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tierckpt.client import CheckpointClient, ConflictError

FORMAT_VERSION = 1
DATA_SEED = 20240611  # the dataset is the same for every run and every resume
FEATURES = 16
SAMPLES = 1024


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}, sort_keys=True), flush=True)


# -- the model -------------------------------------------------------------


def make_dataset() -> list[tuple[list[float], float]]:
    """Linearly separable-ish data from a hidden weight vector, plus label noise."""
    rng = random.Random(DATA_SEED)
    hidden = [rng.gauss(0.0, 1.0) for _ in range(FEATURES)]
    data = []
    for _ in range(SAMPLES):
        x = [rng.gauss(0.0, 1.0) for _ in range(FEATURES)]
        margin = sum(h * v for h, v in zip(hidden, x, strict=True))
        label = 1.0 if margin + rng.gauss(0.0, 0.5) > 0 else 0.0
        data.append((x, label))
    return data


def sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def loss_of(params: list[float], data: list[tuple[list[float], float]]) -> float:
    """Mean binary cross-entropy over the whole dataset."""
    weights, bias = params[:-1], params[-1]
    total = 0.0
    for x, y in data:
        p = sigmoid(sum(w * v for w, v in zip(weights, x, strict=True)) + bias)
        p = min(max(p, 1e-12), 1.0 - 1e-12)
        total -= y * math.log(p) + (1.0 - y) * math.log(1.0 - p)
    return total / len(data)


class Trainer:
    """All the state a resume needs: parameters, momentum, sampler RNG, step."""

    def __init__(self, lr: float, momentum: float, batch: int, seed: int) -> None:
        self.data = make_dataset()
        self.params = [0.0] * (FEATURES + 1)  # weights..., bias
        self.velocity = [0.0] * (FEATURES + 1)
        self.lr = lr
        self.momentum = momentum
        self.batch = batch
        self.rng = random.Random(seed)
        self.step = 0

    def train_step(self) -> None:
        batch = [self.data[self.rng.randrange(len(self.data))] for _ in range(self.batch)]
        grad = [0.0] * len(self.params)
        weights, bias = self.params[:-1], self.params[-1]
        for x, y in batch:
            error = sigmoid(sum(w * v for w, v in zip(weights, x, strict=True)) + bias) - y
            for i, v in enumerate(x):
                grad[i] += error * v
            grad[-1] += error
        for i, g in enumerate(grad):
            self.velocity[i] = self.momentum * self.velocity[i] + g / len(batch)
            self.params[i] -= self.lr * self.velocity[i]
        self.step += 1

    def loss(self) -> float:
        return loss_of(self.params, self.data)

    def weights_bytes(self) -> bytes:
        # float64: Python floats are doubles, so nothing is rounded and a
        # restore gives back exactly the same numbers.
        return struct.pack(f"<{len(self.params)}d", *self.params)

    def weights_sha256(self) -> str:
        return hashlib.sha256(self.weights_bytes()).hexdigest()

    # -- checkpoint files --------------------------------------------------

    def checkpoint_files(self, run: str, loss: float) -> dict[str, bytes]:
        version, internal, gauss_next = self.rng.getstate()
        optimizer = {
            "kind": "sgd_momentum",
            "lr": self.lr,
            "momentum": self.momentum,
            "batch": self.batch,
            # float.hex: exact, whatever the JSON library does with floats.
            "velocity": [v.hex() for v in self.velocity],
        }
        info = {
            "format": FORMAT_VERSION,
            "run": run,
            "step": self.step,
            "loss": loss,
            "features": FEATURES,
            "samples": SAMPLES,
            "data_seed": DATA_SEED,
            "weights": {"file": "weights.bin", "dtype": "<f8", "count": len(self.params)},
        }
        rng_state = {"version": version, "internal": list(internal), "gauss_next": gauss_next}
        return {
            "weights.bin": self.weights_bytes(),
            "optimizer.json": (json.dumps(optimizer, indent=1) + "\n").encode(),
            "rng.json": (json.dumps(rng_state) + "\n").encode(),
            "meta/info.json": (json.dumps(info, indent=1, sort_keys=True) + "\n").encode(),
        }

    def load(self, directory: Path) -> None:
        info = json.loads((directory / "meta" / "info.json").read_text())
        if info.get("format") != FORMAT_VERSION or info.get("features") != FEATURES:
            raise SystemExit(f"checkpoint {directory} has an incompatible format: {info}")
        raw = (directory / "weights.bin").read_bytes()
        self.params = list(struct.unpack(f"<{FEATURES + 1}d", raw))
        optimizer = json.loads((directory / "optimizer.json").read_text())
        self.velocity = [float.fromhex(v) for v in optimizer["velocity"]]
        self.lr, self.momentum = optimizer["lr"], optimizer["momentum"]
        self.batch = optimizer["batch"]
        state = json.loads((directory / "rng.json").read_text())
        self.rng.setstate((state["version"], tuple(state["internal"]), state["gauss_next"]))
        self.step = int(info["step"])


def write_checkpoint(directory: Path, files: dict[str, bytes]) -> None:
    """Write `files` as `directory`, atomically: a reader (the agent) never sees
    a half-written checkpoint, whatever kills us."""
    if directory.is_dir() and all(
        (directory / rel).is_file() and (directory / rel).read_bytes() == data
        for rel, data in files.items()
    ):
        # Same bytes from an earlier life of this run (killed after writing,
        # maybe after registering): leave it alone, since rewriting would change
        # mtimes under an upload that may be in flight.
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    for rel, data in files.items():
        target = staging / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    staging.chmod(0o755)
    if directory.exists():
        shutil.rmtree(directory)  # a different, never-valid leftover
    os.rename(staging, directory)
    dir_fd = os.open(directory.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# -- the loop --------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--server",
        default=os.environ.get("TIERCKPT_URL", "http://127.0.0.1:8470"),
        help="tierckpt agent URL (default: $TIERCKPT_URL, else http://127.0.0.1:8470)",
    )
    parser.add_argument("--run", default="logreg-demo", help="run name")
    parser.add_argument("--root", required=True, type=Path, help="local checkpoint root")
    parser.add_argument("--steps", type=int, default=100, help="total training steps")
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--resume", action="store_true", help="resume from the latest valid")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep per step")
    parser.add_argument("--final-out", type=Path, help="write the final weights' hash here")
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="seed of the batch sampler")
    parser.add_argument(
        "--no-register",
        action="store_true",
        help="write checkpoints but do not talk to the agent (a reference run)",
    )
    args = parser.parse_args(argv)
    if args.steps < 0 or args.every < 1:
        parser.error("--steps must be >= 0 and --every >= 1")
    if args.resume and args.no_register:
        parser.error("--resume needs the agent; drop --no-register")
    return args


def resume(trainer: Trainer, client: CheckpointClient, run: str) -> None:
    latest = client.latest(run)
    if latest is None:
        emit("fresh", reason="no valid checkpoint", run=run)
        return
    scratch = Path(tempfile.mkdtemp(prefix=f"tierckpt-restore-{run}-"))
    try:
        began = time.monotonic()
        # Pin the step: `latest` may move on between the two calls.
        restored = client.restore(run, scratch / f"step-{latest.step}", step=latest.step)
        trainer.load(Path(restored))
        emit(
            "resumed",
            step=trainer.step,
            state=latest.state,
            seconds=round(time.monotonic() - began, 3),
            local=latest.local.path if latest.local else None,
            regions=[loc.region for loc in latest.locations],
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trainer = Trainer(args.lr, args.momentum, args.batch, args.seed)
    client: CheckpointClient | None = None
    if not args.no_register:
        client = CheckpointClient(args.server, token=os.environ.get("TIERCKPT_TOKEN"))

    preempted = False

    def on_sigterm(signum: int, frame: Any) -> None:
        nonlocal preempted
        preempted = True

    signal.signal(signal.SIGTERM, on_sigterm)
    run_dir = args.root.resolve() / args.run
    try:
        if args.resume and client is not None:
            resume(trainer, client, args.run)
        emit("start", run=args.run, from_step=trainer.step, steps=args.steps, every=args.every)
        parent: int | None = trainer.step if trainer.step > 0 else None

        def checkpoint(priority: str) -> None:
            nonlocal parent
            began = time.monotonic()
            loss = trainer.loss()
            files = trainer.checkpoint_files(args.run, loss)
            path = run_dir / f"step-{trainer.step}"
            write_checkpoint(path, files)
            written = time.monotonic() - began
            state = "unregistered"
            if client is not None:
                try:
                    registered = client.register(
                        args.run,
                        trainer.step,
                        path,
                        metrics={"loss": loss},
                        parent=parent,
                        priority=priority,
                        files={
                            rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()
                        },
                        write_seconds=written,
                    )
                    state = registered.state
                except ConflictError as error:
                    # Registered before with other content: keep training, say so.
                    state = f"conflict: {error.message}"
            parent = trainer.step
            emit(
                "checkpoint",
                step=trainer.step,
                loss=loss,
                path=str(path),
                state=state,
                priority=priority,
                write_seconds=round(written, 4),
            )

        while trainer.step < args.steps:
            trainer.train_step()
            if trainer.step % args.every == 0:
                checkpoint("normal")
            if preempted:
                if trainer.step % args.every != 0:
                    checkpoint("urgent")
                emit("preempted", step=trainer.step)
                return 0
            if args.sleep:
                time.sleep(args.sleep)

        digest = trainer.weights_sha256()
        if args.final_out:
            args.final_out.write_text(
                json.dumps({"run": args.run, "step": trainer.step, "sha256": digest}) + "\n"
            )
        emit("done", step=trainer.step, sha256=digest, loss=trainer.loss())
        return 0
    finally:
        if client is not None:
            client.close()


if __name__ == "__main__":
    sys.exit(main())
