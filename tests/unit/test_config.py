"""Settings: TOML, environment overrides, and refused unsafe combinations."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierckpt.service.config import ConfigError, load_settings


def test_embedded_default_is_sqlite_posix_and_loopback() -> None:
    settings = load_settings(None, environ={})
    assert settings.catalog.url.startswith("sqlite+aiosqlite:///")
    assert settings.server.host == "127.0.0.1" and settings.server.port == 8470
    assert [(r.name, r.kind) for r in settings.regions] == [("local", "posix")]


def test_toml_and_environment_overrides(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        """
[server]
port = 9000
[local]
roots = ["/ssd/a"]
[[regions]]
name = "us-east"
kind = "s3"
endpoint_url = "http://127.0.0.1:8333"
bucket = "checkpoints"
prefix = "/prod/"
"""
    )
    settings = load_settings(
        config,
        environ={
            "TIERCKPT_SERVER__PORT": "9100",
            "TIERCKPT_LOCAL__ROOTS": '["/ssd/b", "/ssd/c"]',
            "TIERCKPT_CATALOG__URL": "postgresql+asyncpg://u@h/db",
            "UNRELATED": "x",
        },
    )
    assert settings.server.port == 9100
    assert [str(r) for r in settings.local.roots] == ["/ssd/b", "/ssd/c"]
    assert settings.catalog.url == "postgresql+asyncpg://u@h/db"
    assert settings.primary_region.prefix == "prod"


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[server]\nhost = "0.0.0.0"', "no [[tokens]]"),
        ("[server]\nprot = 1", "prot"),
        ('[catalog]\nurl = "mysql://x"', "catalog.url"),
        ('[[regions]]\nname = "a"\nkind = "s3"', "needs a bucket"),
        ('[[regions]]\nname = "a"\nkind = "posix"', "needs a root"),
        ('[[regions]]\nname = "a b"\nkind = "posix"\nroot = "/x"', "region name"),
        ("[durability]\nmin_regions = 2", "exceeds"),
        ("not toml [", "not valid TOML"),
        ('[[tokens]]\nname = "t"\nsha256 = "abc"', "64-hex"),
    ],
)
def test_unsafe_or_invalid_configs_are_refused(tmp_path: Path, toml: str, message: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text(toml)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_settings(config, environ={})


def test_public_bind_is_allowed_with_tokens(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        '[server]\nhost = "0.0.0.0"\n[[tokens]]\nname = "t"\nrole = "admin"\nsha256 = "'
        + "a" * 64
        + '"\n'
    )
    assert load_settings(config, environ={}).server.host == "0.0.0.0"


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml", environ={})
