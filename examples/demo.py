"""`make demo`: a trainer crashes, tierckpt brings it back from the latest valid step.

Everything runs for real on this machine, in a temporary work directory:
two SeaweedFS S3 servers (regions east and west), the tierckpt agent (`tierckpt serve`,
SQLite catalog), and examples/torch_train.py, a plain PyTorch loop (MLP, AdamW,
cosine schedule, dropout, shuffled DataLoader; CPU, deterministic) as the
trainer. The demo

1. starts SeaweedFS and the agent, and waits until the agent is ready;
2. runs the trainer, which checkpoints its whole state (model, optimizer,
   scheduler, data-loader position, every RNG) every few steps, and SIGKILLs
   it once some checkpoints are registered (a node failure: no goodbye);
3. shows the checkpoints' states and waits until the newest is durable;
4. restarts the trainer: it asks the agent for the latest valid checkpoint,
   loads it (from this node's memory tier, where the agent keeps the newest
   checkpoint, or its T0 copy, still verified by the agent, or a verified
   download from a region) and continues;
5. checks that the final weights equal an uninterrupted reference run
   bit for bit, and prints a summary with the checkpoint interval advice
   (Young/Daly) for the costs this run showed.

Whatever happens, it stops everything it started. Exit code 0 on success;
non-zero with a message (and the logs' tails) on failure. `--keep` keeps the
work directory for a look around.

Run it from the repository root as a module, `python -m examples.demo` (what
`make demo` does): the SeaweedFS launcher comes from `devsupport`, the
development package that lives in the repository and is not installed.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

import httpx

from devsupport.processes import free_port
from devsupport.seaweed import SeaweedServer
from tierckpt.client import CheckpointClient
from tierckpt.client.models import Advice

TRAINER = Path(__file__).resolve().with_name("torch_train.py")
RUN = "demo-torch"
NODE = "demo-node"
MTBF_HOURS = 12.0
BUCKET = "checkpoints"


class DemoError(RuntimeError):
    """A step of the demo did not go as it should; the message says which."""


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


def tierckpt_command() -> list[str]:
    """`tierckpt` from this interpreter's environment (the venv), else PATH."""
    beside = Path(sys.executable).parent / "tierckpt"
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("tierckpt")
    if found:
        return [found]
    return [sys.executable, "-m", "tierckpt.client.cli"]


def memory_dir(work: Path) -> Path:
    """The agent's memory tier: in /dev/shm (RAM) when there is one, named
    after the work directory, removed at the end."""
    shm = Path("/dev/shm")
    return shm / work.name if shm.is_dir() else work / "memory"


def write_config(work: Path, port: int, seaweed: SeaweedServer, west: SeaweedServer) -> Path:
    config = work / "config.toml"
    config.write_text(
        f"""\
# Written by examples/demo.py
[server]
host = "127.0.0.1"
port = {port}
node = "{NODE}"

[catalog]
url = "sqlite+aiosqlite:///{work / "catalog.db"}"

[local]
roots = ["{work / "ssd"}"]
keep_last = 2

[[regions]]
name = "east"
kind = "s3"
endpoint_url = "{seaweed.endpoint_url}"
bucket = "{BUCKET}"
prefix = "demo"
access_key_id = "demo"
secret_access_key = "demo-secret"

# A second, independent SeaweedFS server: another region. Checkpoints are
# durable once in "east"; replicate jobs then copy them here.
[[regions]]
name = "west"
kind = "s3"
endpoint_url = "{west.endpoint_url}"
bucket = "{BUCKET}"
prefix = "demo"
access_key_id = "demo"
secret_access_key = "demo-secret"

[durability]
min_regions = 1

# The memory tier: the trainer's saves are copied into shared memory and
# registered; the agent writes them to T0 and uploads them afterwards.
[memory]
dir = "{memory_dir(work)}"
"""
    )
    return config


class Process:
    """A child process with its output in a log file, stopped for sure."""

    def __init__(self, name: str, argv: list[str], log: Path, *, pipe_stdout: bool = False):
        self.name = name
        self.log_path = log
        self._log = open(log, "ab")  # closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if pipe_stdout else self._log,
            stderr=self._log,
            cwd=log.parent,
            start_new_session=True,  # Ctrl-C reaches the demo, which stops us in order
        )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader: threading.Thread | None = None
        if pipe_stdout:
            assert self.proc.stdout is not None
            self._reader = threading.Thread(
                target=self._read_events, args=(self.proc.stdout,), daemon=True
            )
            self._reader.start()

    def _read_events(self, stream: IO[bytes]) -> None:
        # One JSON object per line (torch_train.py's protocol); copy to the log too.
        for raw in stream:
            self._log.write(raw)
            self._log.flush()
            with contextlib.suppress(ValueError):
                self.events.put(json.loads(raw))
        self.events.put(None)  # end of output
        stream.close()

    def next_event(self, timeout: float) -> dict[str, Any] | None:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty as exc:
            raise DemoError(f"{self.name}: no output for {timeout:.0f} s") from exc

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, grace: float = 20.0) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait()
        if self._reader is not None:
            # It still copies the dead process's last lines into the log.
            self._reader.join(timeout=10)
        if not self._log.closed:
            self._log.close()


def wait_ready(agent: Process, url: str, timeout: float = 90.0) -> float:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if not agent.running():
            raise DemoError(f"tierckpt serve exited with code {agent.proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return time.monotonic() - began
        time.sleep(0.25)
    raise DemoError(f"tierckpt serve not ready at {url}/readyz after {timeout:.0f} s")


def trainer_argv(url: str, root: Path, args: argparse.Namespace, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(TRAINER),
        "--server",
        url,
        "--run",
        RUN,
        "--root",
        str(root),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--node",
        NODE,
        *extra,
    ]


def first_life(url: str, work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train until `args.kill_after` checkpoints are registered, then SIGKILL."""
    trainer = Process(
        "trainer",
        trainer_argv(url, work / "ssd", args, "--sleep", str(args.sleep)),
        work / "trainer-1.log",
        pipe_stdout=True,
    )
    checkpoints: list[dict[str, Any]] = []
    try:
        while len(checkpoints) < args.kill_after:
            event = trainer.next_event(timeout=60)
            if event is None:
                raise DemoError("the trainer exited early (its log is below)")
            if event["event"] == "checkpoint":
                checkpoints.append(event)
                say(
                    f"trainer saved step {event['step']} (loss {event['loss']:.4f}) in "
                    f"{event['stall_seconds'] * 1000:.0f} ms, registered ({event['state']})"
                )
        trainer.kill()
        say(f"SIGKILL trainer after step {checkpoints[-1]['step']}: the node is gone")
    finally:
        trainer.stop()
    return checkpoints


def second_life(url: str, work: Path, args: argparse.Namespace) -> tuple[int, str, dict[str, Any]]:
    trainer = Process(
        "trainer",
        trainer_argv(url, work / "ssd", args, "--final-out", str(work / "final.safetensors")),
        work / "trainer-2.log",
        pipe_stdout=True,
    )
    resumed: int | None = None
    source = "?"
    try:
        while True:
            event = trainer.next_event(timeout=120)
            if event is None:
                raise DemoError("the resumed trainer exited before finishing (log below)")
            if event["event"] == "resumed":
                resumed = int(event["step"])
                source = {
                    "memory": "this node's memory tier (shared memory)",
                    "local": "this node's T0 copy (local SSD)",
                }.get(event["source"], f"region {event['region']} (verified download)")
                say(
                    f"trainer resumed from step {resumed}: loaded from {source} in "
                    f"{event['seconds']} s (committed in {', '.join(event['regions'])})"
                )
            elif event["event"] == "fresh":
                raise DemoError("the resumed trainer found no valid checkpoint")
            elif event["event"] == "checkpoint":
                say(f"trainer wrote step {event['step']} (loss {event['loss']:.4f})")
            elif event["event"] == "done":
                if resumed is None:
                    raise DemoError("the trainer finished without resuming")
                if trainer.proc.wait(timeout=30) != 0:
                    raise DemoError(f"resumed trainer exited with {trainer.proc.returncode}")
                return resumed, source, event
    finally:
        trainer.stop()


def reference_hash(work: Path, args: argparse.Namespace) -> str:
    """The same training without interruption and without the agent."""
    argv = trainer_argv("http://unused", work / "reference", args, "--no-register")
    done = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300)
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return str(events[-1]["sha256"])


def advice_rows(advice: Advice) -> list[tuple[str, str]]:
    """Checkpoint interval advice for the costs this run showed (GET …/advice)."""

    def minutes(seconds: float) -> str:
        return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"

    rows = []
    for scenario in advice.scenarios:
        name = {"write": "save stall", "upload": "blocking upload"}[scenario.basis]
        rows.append(
            (
                f"advice, C = {name}",
                f"C {scenario.cost_seconds * 1000:.0f} ms, MTBF {advice.mtbf_hours:g} h: every "
                f"{minutes(scenario.young.interval_seconds)} (Young), "
                f"{minutes(scenario.daly.interval_seconds)} (Daly), "
                f"{scenario.daly.waste_fraction:.2%} lost",
            )
        )
    return rows


def print_states(client: CheckpointClient, title: str) -> list[Any]:
    checkpoints = sorted(client.list_checkpoints(RUN), key=lambda c: c.step)
    say(title)
    print(f"    {'step':>6}  {'state':<11} {'loss':>8}  regions", flush=True)
    for c in checkpoints:
        regions = ",".join(r.region for r in c.replicas if r.state == "committed") or "-"
        loss = c.metrics.get("loss")
        shown = f"{loss:8.4f}" if loss is not None else f"{'-':>8}"
        print(f"    {c.step:>6}  {c.state:<11} {shown}  {regions}", flush=True)
    return checkpoints


class Demo:
    """The demo's steps, and everything it started (for the failure report)."""

    def __init__(self, work: Path, args: argparse.Namespace) -> None:
        self.work = work
        self.args = args
        self.logs: list[tuple[str, Path]] = []

    def report_logs(self) -> None:
        for name, path in self.logs:
            try:
                tail = "\n".join(path.read_text(errors="replace").splitlines()[-25:])
            except OSError:
                continue
            print(f"--- {name} log, last lines ({path}):\n{tail}", file=sys.stderr)

    def run(self, stack: contextlib.ExitStack) -> None:
        work, args = self.work, self.args
        began = time.monotonic()
        seaweed = SeaweedServer(work / "seaweed")
        self.logs.append(("seaweed", seaweed.log_path))
        stack.callback(seaweed.stop)
        west = SeaweedServer(work / "seaweed-west")
        self.logs.append(("seaweed-west", west.log_path))
        stack.callback(west.stop)
        seaweed.start()
        seaweed.create_bucket(BUCKET)
        say(f"region east: S3 up at {seaweed.endpoint_url} in {seaweed.start_seconds:.1f} s")
        west.start()
        west.create_bucket(BUCKET)
        say(f"region west: S3 up at {west.endpoint_url} in {west.start_seconds:.1f} s")

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        config = write_config(work, port, seaweed, west)
        (work / "ssd").mkdir()
        agent = Process(
            "agent", [*tierckpt_command(), "serve", "--config", str(config)], work / "agent.log"
        )
        self.logs.append(("agent", agent.log_path))
        stack.callback(agent.stop)
        ready = wait_ready(agent, url)
        say(f"tierckpt agent ready at {url} in {ready:.1f} s (config {config})")

        client = stack.enter_context(CheckpointClient(url))
        self.logs.append(("trainer (first life)", work / "trainer-1.log"))
        written = first_life(url, work, args)
        print_states(client, "checkpoints right after the crash:")

        newest = written[-1]["step"]
        waited = time.monotonic()
        final = client.wait(RUN, newest, state="durable", timeout=120)
        say(f"step {newest} is {final.state} after {time.monotonic() - waited:.1f} s more")
        latest = client.latest(RUN)
        if latest is None or latest.step != newest:
            raise DemoError(f"latest valid is {latest and latest.step}, expected {newest}")
        say(f"latest valid checkpoint of {RUN}: step {latest.step}")

        self.logs.append(("trainer (resumed)", work / "trainer-2.log"))
        resumed, source, done = second_life(url, work, args)
        if resumed != newest:
            raise DemoError(f"trainer resumed from step {resumed}, expected {newest}")
        last = (args.steps // args.every) * args.every
        client.wait(RUN, last, state="durable", timeout=120)
        waited = time.monotonic()
        for checkpoint in client.list_checkpoints(RUN):
            client.wait(RUN, checkpoint.step, state="replicated", timeout=120)
        say(f"every checkpoint replicated to west {time.monotonic() - waited:.1f} s later")
        in_west = client.latest(RUN, region="west")
        say(f"latest valid in region west (a restart there): step {in_west and in_west.step}")
        states = print_states(client, "checkpoints at the end:")
        reference = reference_hash(work, args)
        identical = reference == done["sha256"]
        advice = client.advice(RUN, MTBF_HOURS)

        print(flush=True)
        say("summary")
        rows = [
            ("steps trained", f"{done['step']}"),
            ("checkpoints", f"{len(states)} (every {args.every} steps)"),
            ("states", ", ".join(sorted({c.state for c in states}))),
            ("crashed after step", f"{newest} (SIGKILL)"),
            ("restored step", f"{resumed}, from {source}"),
            ("final loss", f"{done['loss']:.6f}"),
            ("bit-exact vs uninterrupted", "yes" if identical else "NO"),
            *advice_rows(advice),
            ("wall time", f"{time.monotonic() - began:.1f} s"),
        ]
        for name, value in rows:
            print(f"    {name:<28} {value}", flush=True)
        if not identical:
            raise DemoError(
                f"final weights differ from the uninterrupted run: {done['sha256']} != {reference}"
            )


def _interrupt(signum: int, frame: Any) -> None:
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, through the cleanup.
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--sleep", type=float, default=0.15, help="seconds per training step")
    parser.add_argument("--kill-after", type=int, default=3, help="checkpoints before SIGKILL")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    if args.kill_after < 1 or args.kill_after * args.every >= args.steps:
        parser.error("need 1 <= --kill-after and --kill-after * --every < --steps")

    work = Path(tempfile.mkdtemp(prefix="tierckpt-demo-"))
    say(f"work directory {work}")
    signal.signal(signal.SIGTERM, _interrupt)
    run = Demo(work, args)
    # The memory tier keeps the newest checkpoint in RAM: never left behind.
    atexit.register(shutil.rmtree, memory_dir(work), ignore_errors=True)
    try:
        # The ExitStack stops, in reverse order, whatever was started so far.
        with contextlib.ExitStack() as stack:
            run.run(stack)
    except (Exception, KeyboardInterrupt) as error:
        if not isinstance(error, DemoError | KeyboardInterrupt):
            traceback.print_exc()
        reason = "interrupted" if isinstance(error, KeyboardInterrupt) else error
        print(f"\n[demo] FAILED: {type(error).__name__}: {reason}", file=sys.stderr)
        run.report_logs()
        print(f"[demo] work directory kept for inspection: {work}", file=sys.stderr)
        return 1
    if args.keep:
        say(f"work directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    say("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
