"""`tierckpt prefetch`: usage errors are refused before any request (the
requests themselves run against real agents in tests/e2e/test_prefetch.py)."""

from __future__ import annotations

import pytest

from tierckpt.client import cli


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(list(argv))
    _out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, err


def test_a_node_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(capsys, "prefetch", "llama")
    assert code == cli.BAD_INPUT and "--node" in err


def test_timeout_needs_wait(capsys: pytest.CaptureFixture[str]) -> None:
    # The URL is never contacted: refused before the client is built.
    code, err = run(
        capsys, "prefetch", "llama", "--node", "a", "--timeout", "5", "--server", "http://0.0.0.0:1"
    )
    assert code == cli.BAD_INPUT and "--timeout needs --wait" in err


@pytest.mark.parametrize("bad", [["--step", "-1"], ["--timeout", "x", "--wait"]])
def test_bad_numbers(capsys: pytest.CaptureFixture[str], bad: list[str]) -> None:
    code, _err = run(capsys, "prefetch", "llama", "--node", "a", *bad)
    assert code == cli.BAD_INPUT


def test_help_names_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["prefetch", "--help"])
    out = capsys.readouterr().out
    for option in ("--node", "--step", "--if-any", "--wait", "--timeout"):
        assert option in out
