"""The tierckpt CLI: subcommands, --json output and exit codes."""

from __future__ import annotations

import json
import socket
import sys
import types

import httpx
import pytest

from tierckpt.client import CheckpointClient, TransferOptions, cli

try:
    from test_client_fakeapi import BASE_URL, FakeApi, error
except ImportError:  # tests/unit collected as a package
    from .test_client_fakeapi import BASE_URL, FakeApi, error


@pytest.fixture
def fake(monkeypatch) -> FakeApi:
    fake = FakeApi()
    transfer = TransferOptions(range_size=512, concurrency=2, window=4)

    def client(args):
        assert args.server in (None, BASE_URL)
        return CheckpointClient(BASE_URL, transport=fake.transport(), transfer=transfer)

    monkeypatch.setattr(cli, "_client", client)
    monkeypatch.setenv("COLUMNS", "200")
    return fake


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- exit codes -----------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["register", "llama", "notastep", "/ssd/x"],
        ["register", "llama", "-1", "/ssd/x"],
        ["register", "llama", "1", "/ssd/x", "--metric", "loss"],
        ["register", "llama", "1", "/ssd/x", "--priority", "whenever"],
        ["status"],
        ["frobnicate"],
        [],
    ],
)
def test_usage_errors_exit_2(fake, capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert "usage:" in err
    assert out == ""


def test_not_found_exits_1(fake, capsys):
    code, out, err = run(capsys, "status", "llama", "5")
    assert (code, out) == (1, "")
    assert err.strip() == "error: no checkpoint llama:5"
    code, out, err = run(capsys, "latest", "llama", "--json")
    assert (code, out) == (1, "")
    assert "no valid checkpoint" in err


def test_conflict_and_invalid_input_exit_2(fake, capsys):
    assert run(capsys, "register", "llama", "1", "/ssd/a")[0] == 0
    code, _, err = run(capsys, "register", "llama", "1", "/ssd/b")
    assert code == 2
    assert err.strip() == "error: step already registered with other content"
    code, _, err = run(capsys, "register", "bad/run", "1", "/ssd/a")
    assert code == 2
    assert err.startswith("error: run must match")


def test_server_error_exits_3(fake, capsys):
    fake.forced[("GET", "/v1/runs")] = error(500, "internal", "catalog exploded")
    code, out, err = run(capsys, "runs")
    assert (code, out) == (3, "")
    assert err.strip() == "error: catalog exploded"


@pytest.mark.parametrize("before", [True, False])
def test_nothing_listening_exits_3(capsys, before):
    server = ["--server", f"http://127.0.0.1:{closed_port()}"]
    argv = [*server, "latest", "llama"] if before else ["latest", "llama", *server, "--json"]
    code, out, err = run(capsys, *argv)
    assert (code, out) == (3, "")
    assert err.startswith("error: cannot reach the tierckpt service")


def test_server_url_from_environment(capsys, monkeypatch):
    monkeypatch.setenv("TIERCKPT_URL", f"http://127.0.0.1:{closed_port()}")
    code, _, err = run(capsys, "runs")
    assert code == 3
    assert "127.0.0.1" in err and "8470" not in err


# -- commands -------------------------------------------------------------------


def test_register_then_wait_json(fake, capsys, tmp_path):
    fake.state_script[("llama", 7)] = ["uploading", "durable"]
    code, out, err = run(
        capsys,
        "--json",
        "register",
        "llama",
        "7",
        str(tmp_path),
        "--metric",
        "val_loss=1.25",
        "--metric",
        "acc=0.5",
        "--parent",
        "llama:6",
        "--world-size",
        "2",
        "--wait",
        "--timeout",
        "5",
    )
    assert code == 0, err
    document = json.loads(out)
    assert (document["run"], document["step"], document["state"]) == ("llama", 7, "durable")
    body = json.loads(next(r for r in fake.requests if r.method == "POST").content)
    assert body["metrics"] == {"val_loss": 1.25, "acc": 0.5}
    assert body["parent"] == {"run": "llama", "step": 6}
    assert body["world_size"] == 2


def test_register_human_output(fake, capsys):
    code, out, _ = run(capsys, "register", "llama", "3", "/ssd/llama/3", "--parent", "2")
    assert code == 0
    assert "registered llama:3 rank 0: registered" in out
    assert json.loads(fake.requests[-1].content)["parent"] == {"run": "llama", "step": 2}


def test_register_wait_failure_exits_3(fake, capsys):
    fake.state_script[("llama", 7)] = ["uploading", "failed"]
    code, _, err = run(capsys, "register", "llama", "7", "/ssd/x", "--wait")
    assert code == 3
    assert "failed: file model.bin changed during upload" in err


def test_register_wait_timeout_exits_3(fake, capsys):
    code, _, err = run(capsys, "register", "llama", "7", "/ssd/x", "--timeout", "0.01")
    assert code == 3
    assert "still registered" in err


def test_status_lists_checkpoints_with_region_columns(fake, capsys):
    fake.add_checkpoint("llama", 100, {"a.bin": b"x" * 2000})
    fake.add_checkpoint("llama", 200, {"a.bin": b"x"}, state="uploading", regions=("east",))
    code, out, _ = run(capsys, "status", "llama")
    assert code == 0
    header = out.splitlines()[1]
    assert header.split() == ["step", "state", "size", "files", "created", "east", "west"]
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line.strip()}
    assert rows["100"][:4] == ["100", "durable", "2.0", "kB"]
    assert rows["100"][-2:] == ["committed", "committed"]
    assert rows["200"][1] == "uploading" and rows["200"][-1] == "-"

    code, out, _ = run(capsys, "status", "llama", "--json")
    assert code == 0
    assert [c["step"] for c in json.loads(out)["checkpoints"]] == [200, 100]


def test_status_of_one_checkpoint(fake, capsys):
    fake.add_checkpoint("llama", 100, {"a.bin": b"x"}, metrics={"val_loss": 1.5})
    code, out, _ = run(capsys, "status", "llama", "100")
    assert code == 0
    assert "val_loss=1.5" in out and "node-a" in out and "s3://b/llama/" in out
    code, out, _ = run(capsys, "--json", "status", "llama", "100")
    assert json.loads(out)["files"] == [
        {
            "rank": 0,
            "path": "a.bin",
            "size": 1,
            "sha256": fake.checkpoints[("llama", 100)]["files"][0]["sha256"],
        }
    ]


def test_status_of_unknown_run_exits_1(fake, capsys):
    code, _, err = run(capsys, "status", "nobody")
    assert code == 1
    assert "no checkpoints" in err


def test_latest(fake, capsys):
    fake.add_checkpoint("llama", 100, {"a.bin": b"x"})
    code, out, _ = run(capsys, "latest", "llama", "--node", "node-a")
    assert code == 0
    assert "100" in out and "east: s3://b/llama/" in out and "/ssd/local/copy" in out
    code, out, _ = run(capsys, "latest", "llama", "--json", "--region", "west")
    document = json.loads(out)
    assert document["step"] == 100
    assert [loc["region"] for loc in document["locations"]] == ["east", "west"]
    assert fake.requests[-1].url.params["region"] == "west"


def test_runs(fake, capsys):
    fake.add_checkpoint("llama", 100, {"a.bin": b"x"})
    code, out, _ = run(capsys, "runs", "--json")
    assert code == 0
    assert json.loads(out)["runs"][0] == {
        "run": "llama",
        "checkpoints": 1,
        "latest_step": 100,
        "created_at": "2026-11-22T11:00:00Z",
        "regions": [],
    }
    code, out, _ = run(capsys, "runs")
    assert "llama" in out


def test_restore(fake, capsys, tmp_path):
    data = bytes(range(256)) * 10
    fake.add_checkpoint("llama", 100, {"model.bin": data, "empty": b""})
    code, out, err = run(capsys, "--json", "restore", "llama", str(tmp_path / "d"))
    assert code == 0, err
    assert json.loads(out) == {
        "run": "llama",
        "step": 100,
        "path": str(tmp_path / "d"),
        "bytes": len(data),
    }
    assert (tmp_path / "d" / "model.bin").read_bytes() == data
    assert (tmp_path / "d" / "empty").read_bytes() == b""

    code, out, _ = run(capsys, "restore", "llama", str(tmp_path / "e"), "--step", "100")
    assert code == 0
    assert "restored llama:100" in out and "verified" in out


def test_restore_exit_codes(fake, capsys, tmp_path):
    code, _, err = run(capsys, "restore", "llama", str(tmp_path / "d"))
    assert code == 1 and "no valid checkpoint" in err
    fake.add_checkpoint("llama", 100, {"model.bin": b"abc"})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    code, _, err = run(capsys, "restore", "llama", str(tmp_path / "full"))
    assert code == 2 and "not empty" in err
    fake.broken.update(east=500, west=500)
    code, _, err = run(capsys, "restore", "llama", str(tmp_path / "d"), "--step", "100")
    assert code == 3 and "could not restore llama:100" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_restore_fallback_warns_on_stderr(fake, capsys, tmp_path):
    fake.add_checkpoint("llama", 100, {"model.bin": b"abc"})
    fake.broken["east"] = 404
    code, out, err = run(capsys, "--json", "restore", "llama", str(tmp_path / "d"))
    assert code == 0
    assert json.loads(out)["step"] == 100
    assert err.startswith("warning: restore of llama:100 from east failed")


def test_serve_and_migrate_import_the_service_lazily(monkeypatch, capsys):
    calls = []
    module = types.ModuleType("tierckpt.service.main")
    module.serve = lambda path: calls.append(("serve", path))
    module.migrate = lambda path: calls.append(("migrate", path))
    monkeypatch.setitem(sys.modules, "tierckpt.service.main", module)
    assert cli.main(["serve", "--config", "tierckpt.toml"]) == 0
    assert cli.main(["migrate"]) == 0
    assert calls == [("serve", "tierckpt.toml"), ("migrate", None)]


def test_transport_errors_never_leak_as_tracebacks(monkeypatch, capsys):
    def broken(request):
        raise httpx.RemoteProtocolError("server hung up", request=request)

    monkeypatch.setattr(
        cli,
        "_client",
        lambda args: CheckpointClient(BASE_URL, transport=httpx.MockTransport(broken), retries=0),
    )
    code, _, err = run(capsys, "runs")
    assert code == 3
    assert "server hung up" in err


def test_restore_shows_a_progress_bar_on_a_terminal(fake, capsys, tmp_path, monkeypatch):
    fake.add_checkpoint("llama", 100, {"model.bin": bytes(5000)})
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, out, _ = run(capsys, "restore", "llama", str(tmp_path / "d"))
    assert code == 0
    assert "llama:100" in out and "5.0/5.0 kB" in out
    assert "restored llama:100" in out
