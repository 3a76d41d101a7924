"""`tierckpt serve` with no config at all: SQLite + POSIX region under ./.tierckpt/."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from devsupport.agent import write_checkpoint
from devsupport.processes import TIERCKPT, cli, free_port

pytestmark = pytest.mark.e2e


def test_serve_without_config_uses_the_embedded_default(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "TIERCKPT_SERVER__PORT": str(port),
        "TIERCKPT_SERVER__NODE": "laptop",
        # The memory tier's default directory is /dev/shm: the test's own instead.
        "TIERCKPT_MEMORY__DIR": str(tmp_path / "memory"),
    }
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        [TIERCKPT, "serve"], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)

        home = tmp_path / ".tierckpt"
        assert (home / "catalog.db").is_file()
        ckpt = write_checkpoint(home / "local" / "step-1", {"w.bin": 2 << 20})
        registered = cli(
            "register", "demo", "1", str(ckpt), "--wait", "--timeout", "60", server=url
        )
        assert registered.returncode == 0, registered.stderr
        copy = home / "regions" / "local" / "demo" / "step-000000000001" / "rank-00000" / "w.bin"
        assert (
            hashlib.sha256(copy.read_bytes()).digest()
            == hashlib.sha256((ckpt / "w.bin").read_bytes()).digest()
        )
        assert (
            home / "regions" / "local" / "demo" / "step-000000000001" / "MANIFEST.json"
        ).is_file()

        # The memory tier is on by default, with a modest budget.
        memory = httpx.get(f"{url}/v1/memory", timeout=10).json()
        assert memory["enabled"] is True and 0 < memory["bytes"] <= 1 << 30, memory

        # Outside the default root: refused, exit code 2.
        stray = write_checkpoint(tmp_path / "elsewhere", {"w": b"1"})
        assert cli("register", "demo", "2", str(stray), server=url).returncode == 2
    finally:
        proc.kill()
        proc.wait(10)
        log.close()
