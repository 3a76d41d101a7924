"""End to end: the real `tierckpt serve` refuses a public bind without tokens,
and the real CLI authenticates with $TIERCKPT_TOKEN (exit codes per DESIGN.md)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from devsupport.agent import write_checkpoint
from devsupport.processes import TIERCKPT, ServeProcess, cli, free_port, write_config

pytestmark = pytest.mark.e2e

TRAINER = "e2e-trainer-token"
READER = "e2e-reader-token"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def test_public_bind_without_tokens_exits_2_with_the_reason(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "public.toml",
        {
            "server": {"host": "0.0.0.0", "port": free_port(), "node": "e2e"},
            "catalog": {"url": f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"},
            "local": {"roots": [str(tmp_path / "ssd")]},
        },
        [{"name": "local", "kind": "posix", "root": str(tmp_path / "region")}],
    )
    done = subprocess.run(
        [TIERCKPT, "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "server.host='0.0.0.0' is not loopback" in done.stderr
    assert "add tokens before binding a public address" in done.stderr
    assert "Traceback" not in done.stderr
    # It refused before touching anything: no catalog was created.
    assert not (tmp_path / "catalog.db").exists()

    # The same through the environment override.
    env_bind = subprocess.run(
        [TIERCKPT, "serve"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**_clean_env(), "TIERCKPT_SERVER__HOST": "0.0.0.0"},
    )
    assert env_bind.returncode == 2 and "is not loopback" in env_bind.stderr


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TIERCKPT_")}


def test_cli_sends_the_token_from_the_environment(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    port = free_port()
    config = write_config(
        tmp_path / "tokens.toml",
        {
            "server": {"host": "127.0.0.1", "port": port, "node": "e2e"},
            "catalog": {"url": f"sqlite+aiosqlite:///{tmp_path / 'catalog.db'}"},
            "local": {"roots": [str(ssd)]},
            "worker": {"poll_interval": 0.1},
        },
        [{"name": "local", "kind": "posix", "root": str(tmp_path / "region")}],
    )
    # write_config has no [[tokens]] helper: append the array of tables.
    with open(config, "a") as handle:
        for name, token, role in (("trainers", TRAINER, "trainer"), ("ro", READER, "reader")):
            handle.write(
                f'\n[[tokens]]\nname = "{name}"\nsha256 = "{digest(token)}"\n'
                f'role = "{role}"\nruns = "llama-*"\n'
            )
    ckpt = write_checkpoint(ssd / "step-5", {"model.bin": 3 << 20, "meta.json": b"{}"})
    with ServeProcess(config, port, tmp_path / "serve.log").start() as agent:
        anonymous = cli("latest", "llama-1", server=agent.url, env={"TIERCKPT_TOKEN": ""})
        assert anonymous.returncode == 2, anonymous.stderr
        assert "missing bearer token" in anonymous.stderr

        wrong = cli("latest", "llama-1", server=agent.url, env={"TIERCKPT_TOKEN": "nope"})
        assert wrong.returncode == 2 and "invalid token" in wrong.stderr

        as_reader = {"TIERCKPT_TOKEN": READER}
        denied = cli("register", "llama-1", "5", str(ckpt), server=agent.url, env=as_reader)
        assert denied.returncode == 2 and "may not write" in denied.stderr

        as_trainer = {"TIERCKPT_TOKEN": TRAINER}
        outside = cli("register", "gpt-1", "5", str(ckpt), server=agent.url, env=as_trainer)
        assert outside.returncode == 2 and "'gpt-1'" in outside.stderr

        registered = cli(
            "--json",
            "register",
            "llama-1",
            "5",
            str(ckpt),
            "--wait",
            "--timeout",
            "120",
            server=agent.url,
            env=as_trainer,
        )
        assert registered.returncode == 0, registered.stderr
        assert json.loads(registered.stdout)["state"] == "durable"

        latest = cli("--json", "latest", "llama-1", server=agent.url, env=as_reader)
        assert latest.returncode == 0 and json.loads(latest.stdout)["step"] == 5
        # POSIX region: the objects come from the agent, which wants the token.
        dest = tmp_path / "restored"
        restored = cli("restore", "llama-1", str(dest), server=agent.url, env=as_reader)
        assert restored.returncode == 0, restored.stderr
        assert (dest / "model.bin").read_bytes() == (ckpt / "model.bin").read_bytes()
        no_token = cli(
            "restore", "llama-1", str(tmp_path / "r2"), server=agent.url, env={"TIERCKPT_TOKEN": ""}
        )
        assert no_token.returncode == 2 and not (tmp_path / "r2").exists()
