"""Typed settings for one tierckpt agent.

Loaded from a TOML file (DESIGN.md's fixed surface) and overridable key by key
from the environment as ``TIERCKPT_<SECTION>__<KEY>``. With no file at all the
agent runs on the embedded default: a SQLite catalog and a POSIX region under
``./.tierckpt/``, bound to loopback.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel as _PydanticModel
from pydantic import ConfigDict, Field, field_validator, model_validator

NAME_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
DEFAULT_HOME = Path(".tierckpt")


class BaseModel(_PydanticModel):
    # A misspelt key must fail loudly, not be ignored: the agent guards data.
    model_config = ConfigDict(extra="forbid")


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which key and why."""


class ServerSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(8470, ge=0, le=65535)
    node: str = Field(default_factory=socket.gethostname)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # Requests per second per token (per client address for unauthenticated
    # callers and for the loopback admin when no tokens are configured), as a
    # token bucket of `rate_limit_burst`; 0 turns the limit off. Health probes
    # and the POSIX object downloads of a restore are not counted.
    rate_limit_per_second: float = Field(200.0, ge=0)
    rate_limit_burst: int = Field(400, ge=1)
    # /metrics without a token (scrapers rarely carry one); false: a READ token.
    metrics_public: bool = True
    # Log lines of `serve`: "json" (one object a line), "console" (for people),
    # or "auto": console on a terminal, JSON otherwise.
    log_format: Literal["auto", "json", "console"] = "auto"


class CatalogSettings(BaseModel):
    url: str = f"sqlite+aiosqlite:///{DEFAULT_HOME}/catalog.db"

    @field_validator("url")
    @classmethod
    def _supported_driver(cls, url: str) -> str:
        if not url.startswith(("sqlite+aiosqlite://", "postgresql+asyncpg://")):
            raise ValueError(
                "catalog.url must start with sqlite+aiosqlite:// or postgresql+asyncpg://"
            )
        return url

    @property
    def is_sqlite(self) -> bool:
        return self.url.startswith("sqlite")


class LocalSettings(BaseModel):
    roots: list[Path] = Field(default_factory=lambda: [DEFAULT_HOME / "local"])
    keep_last: int = Field(2, ge=0)
    max_files_per_checkpoint: int = Field(100_000, ge=1)
    max_path_length: int = Field(1024, ge=16)


class RegionSettings(BaseModel):
    name: str
    kind: Literal["s3", "posix"] = "s3"
    endpoint_url: str | None = None
    bucket: str | None = None
    prefix: str = ""
    access_key_id: str | None = None
    secret_access_key: str | None = None
    region_name: str = "us-east-1"
    root: Path | None = None

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str) -> str:
        if not NAME_PATTERN.match(name) or name in (".", ".."):
            raise ValueError("region name must match [A-Za-z0-9._-]{1,128}")
        return name

    @field_validator("prefix")
    @classmethod
    def _clean_prefix(cls, prefix: str) -> str:
        prefix = prefix.strip("/")
        if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
            raise ValueError("region prefix must not contain empty, '.' or '..' segments")
        return prefix

    @model_validator(mode="after")
    def _kind_fields(self) -> RegionSettings:
        if self.kind == "s3" and not self.bucket:
            raise ValueError(f"region {self.name!r}: kind 's3' needs a bucket")
        if self.kind == "posix" and self.root is None:
            raise ValueError(f"region {self.name!r}: kind 'posix' needs a root")
        return self


class DurabilitySettings(BaseModel):
    min_regions: int = Field(1, ge=1)
    # A checkpoint still missing ranks this long after its first one is
    # failed: it can never become valid and must not linger as "uploading".
    incomplete_timeout_hours: float = Field(24.0, gt=0)


class TokenSettings(BaseModel):
    name: str
    sha256: str
    role: Literal["trainer", "reader", "admin"] = "reader"
    runs: str = "*"

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str) -> str:
        value = value.lower()
        if not re.fullmatch(r"[0-9a-f]{64}", value):
            raise ValueError("token sha256 must be the 64-hex-digit SHA-256 of the token")
        return value


class UploadSettings(BaseModel):
    part_size_mb: int = Field(16, ge=5, le=512)
    parts_in_flight: int = Field(8, ge=1, le=256)
    files_in_flight: int = Field(8, ge=1, le=256)
    # A file whose SHA-256 equals one already committed in the region is not
    # sent again but copied server-side into its own key (CopyObject /
    # UploadPartCopy, or an in-kernel copy on POSIX): checkpoints that leave
    # most files unchanged (frozen layers, data-loader state) cost only their
    # changed bytes. false: every byte is always sent (e.g. to measure the
    # pipeline on new bytes). See service/uploads/dedup.py.
    dedup: bool = True
    # Upload a single-shard checkpoint from T0 to every region at once rather
    # than primary first, then replicate: register -> replicated then takes
    # about as long as register -> durable (the regions fill in parallel).
    fan_out: bool = True


class WorkerSettings(BaseModel):
    enabled: bool = True
    concurrency: int = Field(4, ge=1, le=64)
    poll_interval: float = Field(0.5, gt=0)
    lease_seconds: float = Field(30.0, ge=1)
    max_attempts: int = Field(10, ge=1)
    backoff_base: float = Field(1.0, gt=0)
    backoff_max: float = Field(300.0, gt=0)
    shutdown_timeout: float = Field(10.0, ge=0)


class ScrubSettings(BaseModel):
    enabled: bool = True
    interval_seconds: float = Field(600.0, gt=0)
    # Re-read budget: scrubbing must not compete with uploads for the store.
    bytes_per_hour: int = Field(100 * 1024**3, ge=0)
    # A replica verified more recently than this is not re-read by the scrubber.
    min_age_hours: float = Field(24.0, ge=0)


class KeepBestSettings(BaseModel):
    metric: str = Field(min_length=1, max_length=128)
    mode: Literal["min", "max"] = "min"
    n: int = Field(1, ge=1)


class RetentionPolicySettings(BaseModel):
    """One run's retention (also the body of PUT /v1/runs/{run}/retention).
    Nothing set keeps everything."""

    keep_last: int | None = Field(None, ge=1)
    keep_every_steps: int | None = Field(None, ge=1)
    keep_best: KeepBestSettings | None = None
    keep_daily_days: int | None = Field(None, ge=1)
    keep_weekly_weeks: int | None = Field(None, ge=1)


class RetentionSettings(RetentionPolicySettings):
    """The server default, plus how often the agent applies retention."""

    interval_seconds: float = Field(300.0, gt=0)


class Settings(BaseModel):
    server: ServerSettings = Field(default_factory=ServerSettings)
    catalog: CatalogSettings = Field(default_factory=CatalogSettings)
    local: LocalSettings = Field(default_factory=LocalSettings)
    regions: list[RegionSettings] = Field(
        default_factory=lambda: [
            RegionSettings(name="local", kind="posix", root=DEFAULT_HOME / "regions" / "local")
        ]
    )
    durability: DurabilitySettings = Field(default_factory=DurabilitySettings)
    tokens: list[TokenSettings] = Field(default_factory=list)
    retention: RetentionSettings = Field(default_factory=RetentionSettings)
    upload: UploadSettings = Field(default_factory=UploadSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    scrub: ScrubSettings = Field(default_factory=ScrubSettings)

    @model_validator(mode="after")
    def _safe_combinations(self) -> Settings:
        if not self.regions:
            raise ValueError("at least one [[regions]] entry is needed")
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"region names must be unique, got {names}")
        if self.durability.min_regions > len(self.regions):
            raise ValueError(
                f"durability.min_regions={self.durability.min_regions} exceeds the "
                f"{len(self.regions)} configured region(s)"
            )
        if not self.tokens and not is_loopback(self.server.host):
            raise ValueError(
                f"server.host={self.server.host!r} is not loopback and no [[tokens]] are "
                "configured; add tokens before binding a public address"
            )
        return self

    @property
    def primary_region(self) -> RegionSettings:
        return self.regions[0]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    """``TIERCKPT_SECTION__KEY=value`` → ``{"section": {"key": value}}``.

    Values are parsed as TOML literals when they parse (numbers, booleans,
    arrays), else taken as strings, so ``TIERCKPT_LOCAL__ROOTS='["/ssd"]'``
    and ``TIERCKPT_CATALOG__URL=postgresql+asyncpg://…`` both work.
    """
    overrides: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith("TIERCKPT_") or "__" not in name:
            continue
        section, _, key = name[len("TIERCKPT_") :].lower().partition("__")
        if not section or not key or section in ("regions", "tokens"):
            continue
        try:
            value: Any = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        overrides.setdefault(section, {})[key] = value
    return overrides


def load_settings(
    path: str | os.PathLike[str] | None = None, environ: dict[str, str] | None = None
) -> Settings:
    environ = dict(os.environ if environ is None else environ)
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {path} does not exist") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    for section, values in _env_overrides(environ).items():
        current = data.setdefault(section, {})
        if not isinstance(current, dict):
            raise ConfigError(f"TIERCKPT_{section.upper()}__* overrides a non-table section")
        current.update(values)
    try:
        return Settings.model_validate(data)
    except ValueError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc
