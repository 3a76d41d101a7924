"""A real one-node Slurm cluster runs examples/slurm/train.sbatch, is requeued
mid-run with `scontrol requeue`, and the job resumes from tierckpt's latest
valid checkpoint, ending with weights bit-identical to an uninterrupted run.

The fixture configures and starts munged, slurmctld and slurmd (foreground,
`-D`) from Debian's `slurm-wlm` + `munge` (the Makefile installs them as
root). It needs root (SlurmUser=root); without root, or without the binaries
outside CI, it skips with the reason; in CI a missing binary fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devsupport.agent import posix_region
from devsupport.processes import ServeProcess, agent_config, free_port

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors.torch import load_file

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"
TORCH_TRAIN = REPO / "examples" / "torch_train.py"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "squeue")
NODE = "slurm-node"
RUN = "slurm-requeue"
STEPS, EVERY, SLEEP = 60, 5, 0.1


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm test needs root (slurmctld/slurmd run as SlurmUser=root)"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        message = f"missing {', '.join(missing)} (apt-get install slurm-wlm munge; `make test`)"
        if os.environ.get("CI"):
            pytest.fail(message)
        return message
    return None


class Slurm:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log: Any = None

    def run(self, *argv: str, check: bool = True) -> str:
        done = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=60, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{argv}: {done.returncode} {done.stdout} {done.stderr}")
        return done.stdout

    def start(self) -> Slurm:
        r = self.root
        for sub in ("state", "spool", "log", "munge"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        # munged wants every directory above its socket executable by all.
        r.chmod(0o755)
        (r / "munge").chmod(0o755)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = r / "munge" / "munge.sock"
        ports = free_port(), free_port()
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=tierckpt",
                    "SlurmctldHost=localhost",
                    "SlurmUser=root",
                    f"SlurmctldPort={ports[0]}",
                    f"SlurmdPort={ports[1]}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={sock}",
                    "CryptoType=crypto/munge",
                    "MpiDefault=none",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "ReturnToService=2",
                    "JobRequeue=1",
                    "KillWait=30",
                    "NodeName=localhost CPUs=2 RealMemory=1000 State=UNKNOWN",
                    "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        self.log = log = open(r / "log" / "daemons.out", "ab")
        for argv in (
            [
                "munged",
                "-F",
                f"--key-file={key}",
                f"--socket={sock}",
                f"--pid-file={r / 'munge' / 'munged.pid'}",
                f"--log-file={r / 'munge' / 'munged.log'}",
                f"--seed-file={r / 'munge' / 'seed'}",
            ],
            ["slurmctld", "-D", "-i", "-f", str(self.conf)],
            ["slurmd", "-D", "-f", str(self.conf)],
        ):
            self.procs.append(
                subprocess.Popen(argv, env=self.env, stdout=log, stderr=log, start_new_session=True)
            )
            time.sleep(0.5 if argv[0] == "munged" else 0)
        deadline = time.monotonic() + 60
        while "idle" not in self.run("sinfo", "-h", "-o", "%T", check=False):
            assert time.monotonic() < deadline, f"Slurm node never idle:\n{self.logs()}"
            for proc in self.procs:
                assert proc.poll() is None, f"{proc.args[0]} exited:\n{self.logs()}"
            time.sleep(0.5)
        return self

    def logs(self) -> str:
        texts = []
        for path in sorted((self.root / "log").glob("*")):
            texts.append(f"--- {path.name}\n" + "\n".join(path.read_text().splitlines()[-20:]))
        return "\n".join(texts)

    def job_state(self, job: str) -> str:
        return self.run("scontrol", "show", "job", job, "-o", check=False)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.log is not None:
            self.log.close()


@pytest.fixture
def slurm() -> Iterator[Slurm]:
    reason = _unavailable()
    if reason:
        pytest.skip(reason)
    # Slurm resolves paths of its spool/state; a short path under /tmp avoids
    # socket-path length limits of deep pytest tmp dirs.
    root = Path(
        subprocess.check_output(["mktemp", "-d", "/tmp/tierckpt-slurm.XXXX"]).decode().strip()
    )
    cluster = Slurm(root)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[ServeProcess, Path]]:
    config = agent_config(
        tmp_path,
        node=NODE,
        catalog_url=f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}",
        regions=[posix_region("east", tmp_path / "region")],
        worker={"poll_interval": 0.05, "lease_seconds": 10, "backoff_base": 0.2},
    )
    with config.serve(tmp_path / "serve.log").start() as serve:
        yield serve, config.ssd


def checkpoints(url: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/v1/runs/{RUN}/checkpoints", params={"limit": 1000}, timeout=10)
    if answer.status_code == 404:
        return []
    answer.raise_for_status()
    return list(answer.json()["checkpoints"])


# Slurm delays a requeued job's new start (about two minutes) unless released.
@pytest.mark.timeout(600)
def test_requeued_job_resumes_bit_identical(slurm: Slurm, agent, tmp_path: Path) -> None:
    serve, ssd = agent
    reference = tmp_path / "reference.safetensors"
    common = ["--steps", str(STEPS), "--every", str(EVERY), "--seed", "7", "--width", "32"]
    subprocess.run(
        [
            *(sys.executable, str(TORCH_TRAIN), "--root", str(ssd), "--no-register"),
            *(*common, "--final-out", str(reference)),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )

    final = tmp_path / "final.safetensors"
    out = tmp_path / "job.out"
    train_args = [*common, "--sleep", str(SLEEP), "--node", NODE, "--final-out", str(final)]
    exports = {
        "TIERCKPT_URL": serve.url,
        "RUN": RUN,
        "CKPT_ROOT": str(ssd),
        "PYTHON": sys.executable,
        "TIERCKPT": str(Path(sys.executable).parent / "tierckpt"),
        "EXAMPLES": str(REPO / "examples"),
        "TRAIN_ARGS": " ".join(train_args),
        # Slurm calls the node "localhost"; its agent is NODE.
        "TIERCKPT_NODES": NODE,
    }
    env = {**slurm.env, **exports}
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={out}", f"--chdir={tmp_path}", str(SBATCH)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job = submitted.stdout.strip().split(";")[0]

    # Let it write a few checkpoints, then requeue it mid-run.
    deadline = time.monotonic() + 120
    while not [c for c in checkpoints(serve.url) if c["step"] >= 2 * EVERY]:
        assert time.monotonic() < deadline, (
            f"no checkpoints:\n{slurm.job_state(job)}\n{slurm.logs()}"
        )
        time.sleep(0.2)
    slurm.run("scontrol", "requeue", job)
    # Slurm holds a requeued job for about two minutes before it may start
    # again (its BeginTime); an operator can release it at once, as here, so
    # the test does not sit out the delay. What restarts is unchanged.
    deadline = time.monotonic() + 240
    while True:
        state = slurm.job_state(job)
        if "JobState=PENDING" in state:
            slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
        if "JobState=COMPLETED" in state and final.exists():
            break
        assert "JobState=FAILED" not in state, f"{state}\n{out.read_text()}"
        assert time.monotonic() < deadline, f"{state}\n{slurm.logs()}"
        time.sleep(0.5)

    log = out.read_text()
    assert "restart 0" in log and "restart 1" in log, log
    ours, theirs = load_file(str(final)), load_file(str(reference))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype
        assert ours[name].numpy().tobytes() == theirs[name].numpy().tobytes(), name

    found = checkpoints(serve.url)
    restarted = [
        c for c in found if int((c.get("metadata") or {}).get("SLURM_RESTART_COUNT", 0)) >= 1
    ]
    assert restarted, found
    assert all((c.get("metadata") or {}).get("SLURM_JOB_ID") == job for c in found)
    # The restart is in the lineage: the first checkpoint of the second life
    # has the checkpoint it resumed from as parent.
    first = min(restarted, key=lambda c: c["step"])
    detail = httpx.get(f"{serve.url}/v1/runs/{RUN}/checkpoints/{first['step']}", timeout=10)
    parent = detail.json().get("parent")
    assert parent is not None and parent["step"] < first["step"], detail.json()
