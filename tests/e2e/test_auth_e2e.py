"""End to end: the real `tierckpt serve` refuses a public bind without tokens,
and the real CLI authenticates with $TIERCKPT_TOKEN (exit codes as the README lists them)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from devsupport.agent import token_entry, write_checkpoint
from devsupport.processes import TIERCKPT, agent_config, cli

pytestmark = pytest.mark.e2e

TRAINER = "e2e-trainer-token"
READER = "e2e-reader-token"


def test_public_bind_without_tokens_exits_2_with_the_reason(tmp_path: Path) -> None:
    catalog = tmp_path / "catalog.db"
    config = agent_config(
        tmp_path, name="public", host="0.0.0.0", catalog_url=f"sqlite+aiosqlite:///{catalog}"
    )
    done = subprocess.run(
        [TIERCKPT, "serve", "--config", str(config.path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "server.host='0.0.0.0' is not loopback" in done.stderr
    assert "add tokens before binding a public address" in done.stderr
    assert "Traceback" not in done.stderr
    # It refused before touching anything: no catalog was created.
    assert not catalog.exists()

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
    config = agent_config(
        tmp_path,
        name="tokens",
        worker={"poll_interval": 0.1},
        tokens=[
            token_entry("trainers", TRAINER, "trainer", runs="llama-*"),
            token_entry("ro", READER, "reader", runs="llama-*"),
        ],
    )
    ckpt = write_checkpoint(config.ssd / "step-5", {"model.bin": 3 << 20, "meta.json": b"{}"})
    with config.serve().start() as agent:
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
