"""`tierckpt restore RUN DEST --latest --if-any`: the job-script form used by a
Kubernetes initContainer and at the top of an sbatch script."""

from __future__ import annotations

import json

import pytest

from tierckpt.client import CheckpointClient, TransferOptions, cli

try:
    from test_client_fakeapi import BASE_URL, FakeApi
except ImportError:  # tests/unit collected as a package
    from .test_client_fakeapi import BASE_URL, FakeApi


@pytest.fixture
def fake(monkeypatch) -> FakeApi:
    fake = FakeApi()
    transfer = TransferOptions(range_size=512, concurrency=2, window=4)

    def client(args):
        return CheckpointClient(BASE_URL, transport=fake.transport(), transfer=transfer)

    monkeypatch.setattr(cli, "_client", client)
    monkeypatch.setenv("COLUMNS", "200")
    return fake


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_fresh_start_exits_0_and_restores_nothing(fake, capsys, tmp_path):
    dest = tmp_path / "d"
    code, out, err = run(capsys, "restore", "llama", str(dest), "--latest", "--if-any")
    assert (code, out) == (0, "")
    assert err.strip() == "no checkpoint yet"
    assert not dest.exists()


def test_fresh_start_json(fake, capsys, tmp_path):
    dest = tmp_path / "d"
    code, out, err = run(capsys, "--json", "restore", "llama", str(dest), "--latest", "--if-any")
    assert code == 0
    assert json.loads(out) == {"restored": None}
    assert "no checkpoint yet" in err
    assert not dest.exists()


def test_without_if_any_a_fresh_start_is_still_not_found(fake, capsys, tmp_path):
    code, out, err = run(capsys, "restore", "llama", str(tmp_path / "d"), "--latest")
    assert (code, out) == (1, "")
    assert "no valid checkpoint" in err


def test_restores_the_latest_and_prints_its_step(fake, capsys, tmp_path):
    fake.add_checkpoint("llama", 100, {"model.bin": b"old"})
    fake.add_checkpoint("llama", 200, {"model.bin": b"new" * 100})
    dest = tmp_path / "d"
    code, out, err = run(capsys, "restore", "llama", str(dest), "--latest", "--if-any")
    assert code == 0, err
    assert "restored llama:200" in out
    assert (dest / "model.bin").read_bytes() == b"new" * 100


def test_restores_the_latest_json(fake, capsys, tmp_path):
    fake.add_checkpoint("llama", 100, {"model.bin": b"abc"})
    dest = tmp_path / "d"
    code, out, err = run(capsys, "restore", "llama", str(dest), "--if-any", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert set(doc) == {"restored"}
    assert doc["restored"]["run"] == "llama"
    assert doc["restored"]["step"] == 100
    assert doc["restored"]["path"] == str(dest)
    assert (dest / "model.bin").read_bytes() == b"abc"


def test_latest_is_explicit_default_and_excludes_step(fake, capsys, tmp_path):
    fake.add_checkpoint("llama", 100, {"model.bin": b"abc"})
    code, out, _ = run(capsys, "--json", "restore", "llama", str(tmp_path / "d"), "--latest")
    assert code == 0
    assert json.loads(out)["step"] == 100  # the plain (non --if-any) document is unchanged
    code, out, err = run(
        capsys, "restore", "llama", str(tmp_path / "e"), "--latest", "--step", "100"
    )
    assert code == 2 and "not allowed with" in err


def test_real_errors_still_fail_with_if_any(fake, capsys, tmp_path):
    fake.add_checkpoint("llama", 100, {"model.bin": b"abc"})
    fake.broken.update(east=500, west=500)
    code, _, err = run(capsys, "restore", "llama", str(tmp_path / "d"), "--latest", "--if-any")
    assert code == 3 and "could not restore llama:100" in err
    assert not (tmp_path / "d").exists()
