"""The machine's floor for one HTTP call: a server that does nothing.

A trivial ASGI app answers every request with an empty JSON object, served
the way the agent is (uvicorn, with the uvloop loop and the httptools parser
it picks by itself), in a process and session of its own. A call to it
from the benchmark's process, with the client's HTTP library and settings,
costs what any call on this machine costs before the agent does any work:
the client's and the server's CPU, the loopback, and the wake-ups of both
processes (on a virtual machine whose idle CPUs halt, each wake-up of a
halted vCPU waits for the hypervisor). `register_latency` interleaves one
such call with each timed register, so the floor is taken under the same
load, beside the figure it bounds.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from devsupport.processes import free_port

EMPTY = b"{}"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"  # served with --lifespan off
    while (await receive()).get("more_body"):
        pass  # the body read to its end, as the agent reads a registration's
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")],
        }
    )
    await send({"type": "http.response.body", "body": EMPTY})


@contextlib.contextmanager
def empty_server(timeout: float = 30.0) -> Iterator[str]:
    """A running empty server; its base URL."""
    port = free_port()
    command = [sys.executable, "-m", "uvicorn", f"{__name__}:app", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--lifespan", "off", "--log-level", "warning"]
    command.append("--no-access-log")
    process = subprocess.Popen(
        command,
        cwd=Path(__file__).resolve().parents[1],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                httpx.get(url, timeout=2, trust_env=False).raise_for_status()
                break
            except httpx.TransportError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the empty server did not start on {url}") from None
                time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
