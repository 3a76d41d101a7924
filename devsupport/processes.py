"""Run the real `tierckpt` CLI and `tierckpt serve` as subprocesses (e2e tests, benchmarks)."""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

TIERCKPT = str(Path(sys.executable).with_name("tierckpt"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(url: str, predicate: Any, timeout: float = 120) -> dict[str, Any]:
    """GET ``url`` (a JSON answer) until ``predicate`` holds for it; that answer."""
    deadline = time.monotonic() + timeout
    while True:
        answer: dict[str, Any] = httpx.get(url, timeout=5).json()
        if predicate(answer):
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting on {url}: {answer}")
        time.sleep(0.05)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def write_config(
    path: Path,
    sections: dict[str, dict[str, Any]],
    regions: list[dict[str, Any]],
    tokens: Sequence[dict[str, Any]] = (),
) -> Path:
    """A TOML config: ``sections`` as tables, ``regions`` and ``tokens`` as
    arrays of tables (``[[regions]]``, ``[[tokens]]``)."""
    lines: list[str] = []
    if "dir" not in sections.get("memory", {}):
        # A test agent's memory tier lives beside its config, not in /dev/shm
        # (the newest checkpoint of each run stays there after the test).
        sections = {
            **sections,
            "memory": {**sections.get("memory", {}), "dir": str(path.parent / "memory")},
        }
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in values.items())
        lines.append("")
    for array, entries in (("regions", regions), ("tokens", tokens)):
        for entry in entries:
            lines.append(f"[[{array}]]")
            lines.extend(f"{key} = {toml_value(value)}" for key, value in entry.items())
            lines.append("")
    path.write_text("\n".join(lines))
    return path


@dataclass(frozen=True)
class AgentConfig:
    """A test agent's config file, the port it serves on, and its local root."""

    path: Path
    port: int
    ssd: Path

    def serve(self, log: Path | None = None, *, worker: bool = True) -> ServeProcess:
        """Its `tierckpt serve`, not started; the log beside the config by default."""
        return ServeProcess(
            self.path, self.port, log or self.path.with_suffix(".log"), worker=worker
        )


def agent_config(
    directory: Path,
    *,
    name: str = "tierckpt",
    node: str = "e2e-node",
    host: str = "127.0.0.1",
    catalog_url: str | None = None,
    ssd: Path | None = None,
    regions: list[dict[str, Any]] | None = None,
    tokens: Sequence[dict[str, Any]] = (),
    **sections: dict[str, Any],
) -> AgentConfig:
    """``directory/<name>.toml`` for one `tierckpt serve` of a test, on a free
    loopback port: by default a SQLite catalog, one local root (``ssd``,
    created) and one POSIX region, all in ``directory``. ``sections`` are
    merged into the config's tables (``server={"rate_limit_per_second": 0}``,
    ``worker={...}``, ``catalog={"register_ack": ...}``)."""
    ssd = ssd or directory / "ssd"
    ssd.mkdir(parents=True, exist_ok=True)
    port = free_port()
    tables: dict[str, dict[str, Any]] = {
        "server": {"host": host, "port": port, "node": node},
        "catalog": {
            "url": catalog_url or f"sqlite+aiosqlite:///{directory / f'{name}-catalog.db'}"
        },
        "local": {"roots": [str(ssd)]},
    }
    for section, values in sections.items():
        tables.setdefault(section, {}).update(values)
    regions = (
        regions
        if regions is not None
        else [{"name": "local", "kind": "posix", "root": str(directory / "region")}]
    )
    path = write_config(directory / f"{name}.toml", tables, regions, tokens)
    return AgentConfig(path, port, ssd)


def node_config(directory: Path, node: str, **kwargs: Any) -> AgentConfig:
    """One of several agents (nodes) in ``directory``: its config file, log and
    default catalog named after the node, and a local root of its own
    (``ssd-<node>``); ``kwargs`` as for ``agent_config``."""
    return agent_config(directory, name=node, node=node, ssd=directory / f"ssd-{node}", **kwargs)


_STARTED: list[subprocess.Popen[bytes]] = []


@atexit.register
def _kill_leftovers() -> None:
    # The agents run in their own session (so a test can SIGKILL exactly
    # them); an interrupted test run must still not leave them behind.
    for proc in _STARTED:
        if proc.poll() is None:
            proc.kill()


class ServeProcess:
    """`tierckpt serve --config FILE` in the background, its log in a file."""

    def __init__(self, config: Path, port: int, log: Path, *, worker: bool = True) -> None:
        self.config, self.port, self.log = config, port, log
        self.worker = worker
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> ServeProcess:
        env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true"}
        if not self.worker:
            env["TIERCKPT_WORKER__ENABLED"] = "false"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [TIERCKPT, "serve", "--config", str(self.config)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        _STARTED.append(self.proc)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"tierckpt serve exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(
            f"tierckpt serve not ready after {timeout}s:\n{self.log.read_text()[-3000:]}"
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self, timeout: float = 60) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def __enter__(self) -> ServeProcess:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.kill()


def cli(
    *args: str,
    server: str | None = None,
    check: bool = False,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run the CLI; ``env`` entries are added to this process's environment."""
    command = [TIERCKPT, *args]
    if server:
        command += ["--server", server]
    environment = None
    if env is not None:
        environment = {**os.environ, **env}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, check=check, env=environment
    )
