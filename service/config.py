"""Typed settings for one tierckpt agent.

Loaded from a TOML file and overridable key by key from the environment as
``TIERCKPT_<SECTION>__<KEY>``. With no file at all the agent runs on the
embedded default: a SQLite catalog and a POSIX region under ``./.tierckpt/``,
bound to loopback.

Each key's attribute docstring is its user documentation: docs/configuration.md
is generated from them (``python -m tierckpt.service.config_reference``), and a
key without one fails the test that keeps that file current.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .names import NAME_CHARS, is_region_name
from .settings_base import BaseModel
from .worker_settings import WorkerSettings

DEFAULT_HOME = Path(".tierckpt")

# TIERCKPT_<SECTION>__<KEY> overrides one key of a table; the arrays of tables
# cannot be addressed that way (which entry?) and come from the file only.
ENV_PREFIX = "TIERCKPT_"
ENV_SEPARATOR = "__"
FILE_ONLY_SECTIONS = ("regions", "tokens")


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which key and why."""


class ServerSettings(BaseModel):
    """The agent's HTTP server: API, dashboard and /metrics."""

    host: str = "127.0.0.1"
    """Address to bind. Anything but loopback is refused unless [[tokens]] are configured."""
    port: int = Field(8470, ge=0, le=65535)
    """TCP port of the API, the dashboard and /metrics."""
    node: str = Field(default_factory=socket.gethostname)
    """This agent's node name. Upload jobs run on the node that holds the files,
    so every agent sharing a catalog needs its own."""
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    """Largest request body accepted; a larger one is answered 413."""
    rate_limit_per_second: float = Field(200.0, ge=0)
    """Requests per second per token (per client address for unauthenticated
    callers and for the loopback admin when no tokens are configured), as a
    token bucket of `rate_limit_burst`; 0 turns the limit off. Health probes,
    the POSIX object downloads of a restore and the peer copies' routes
    (pushes, reads from a peer) are not counted."""
    rate_limit_burst: int = Field(400, ge=1)
    """Size of the rate limit's token bucket: how many requests may come at once."""
    metrics_public: bool = True
    """Serve /metrics without a token (scrapers rarely carry one); false
    requires a token that may read."""
    log_format: Literal["auto", "json", "console"] = "auto"
    """Log lines of `serve`: `json` (one object a line), `console` (for
    people), or `auto`: console on a terminal, JSON otherwise."""
    failure_domain: str | None = Field(None, min_length=1, max_length=255)
    """What fails together with this node (a rack, a power feed, a zone);
    peer copies go only to agents of other failure domains. Unset: the node
    name (every node its own domain)."""
    advertise_url: str | None = Field(None, min_length=8, max_length=2048)
    """Base URL other agents and restoring clients reach this agent at
    (`http://host:port`); recorded in the agents catalog. Unset: built from
    `host` and `port` (a wildcard host is replaced by this machine's name)."""

    @field_validator("advertise_url")
    @classmethod
    def _base_url(cls, url: str | None) -> str | None:
        if url is not None and not re.fullmatch(r"https?://[^/\s]+/?", url):
            raise ValueError(f"server.advertise_url must be http(s)://host[:port], got {url!r}")
        return url

    @property
    def domain(self) -> str:
        return self.failure_domain or self.node

    @property
    def url(self) -> str:
        """The advertised base URL, without a trailing slash."""
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = socket.gethostname()
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


class CatalogSettings(BaseModel):
    """Where the catalog (runs, checkpoints, replicas, jobs) lives."""

    url: str = f"sqlite+aiosqlite:///{DEFAULT_HOME}/catalog.db"
    """SQLAlchemy URL: `sqlite+aiosqlite://` for one agent, `postgresql+asyncpg://`
    for several agents sharing one catalog. Migrations run at `serve` start."""

    register_ack: Literal["auto", "recorded", "committed", "on_disk"] = "auto"
    """When a registration is answered. `recorded`: once recorded in the agent's
    inbox on the node's SSD (`<first [local] root>/.tierckpt-inbox/`) after one
    catalog read that refuses what the catalog would (409), its write behind the
    answer (another rank of a checkpoint the catalog holds: as `committed`).
    `committed`: once committed. Both survive a kill -9; a power loss within the
    catalog's next log flush (milliseconds) can lose the registration, not its
    files. `on_disk`: once on disk. `auto`: `recorded` on SQLite, else `committed`."""

    @property
    def answer_at(self) -> str:
        """``register_ack`` with ``auto`` resolved."""
        auto = "recorded" if self.is_sqlite else "committed"
        return auto if self.register_ack == "auto" else self.register_ack

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
    """The node's local SSD (T0), where trainers write checkpoints."""

    roots: list[Path] = Field(default_factory=lambda: [DEFAULT_HOME / "local"])
    """Directories a registered checkpoint must lie under; anything outside
    them (symlinks leading out included) is refused."""
    keep_last: int = Field(2, ge=0)
    """Newest local copies kept per run; older ones are deleted from the SSD
    once the checkpoint is durable in the regions. Prefetched copies (`tierckpt
    prefetch`) count among them; a run's newest prefetched copy always stays."""
    max_files_per_checkpoint: int = Field(100_000, ge=1)
    """Most files one registered checkpoint (shard) may hold."""
    max_path_length: int = Field(1024, ge=16)
    """Longest relative file path (in UTF-8 bytes) inside a checkpoint."""


class RegionSettings(BaseModel):
    """One region: an S3 bucket or a POSIX directory. The first is the primary."""

    name: str
    """The region's name, used in the API, the CLI and the metrics."""
    kind: Literal["s3", "posix"] = "s3"
    """The store: `s3` (any S3-compatible store) or `posix` (a mounted file
    system: NFS, EFS, Lustre)."""
    endpoint_url: str | None = None
    """S3 endpoint; unset: AWS. Regions on one endpoint copy server-side."""
    bucket: str | None = None
    """S3 bucket (required for kind `s3`)."""
    prefix: str = ""
    """Key prefix every object of this region is stored under; surrounding
    slashes are dropped."""
    access_key_id: str | None = None
    """S3 access key; unset: the usual AWS credential chain."""
    secret_access_key: str | None = None
    """S3 secret key; unset: the usual AWS credential chain."""
    region_name: str = "us-east-1"
    """S3 signing region."""
    root: Path | None = None
    """Directory of a POSIX region (required for kind `posix`)."""
    sse: Literal["AES256", "aws:kms"] | None = None
    """S3 server-side encryption of every object written: `AES256` (SSE-S3)
    or `aws:kms` (SSE-KMS, with `sse_kms_key_id` or the bucket's default
    key); unset: the bucket's default. Reads need nothing more."""
    sse_kms_key_id: str | None = Field(None, min_length=1, max_length=2048)
    """The KMS key (id, ARN or alias) for `sse = "aws:kms"`."""
    storage_class: (
        Literal[
            "STANDARD",
            "STANDARD_IA",
            "ONEZONE_IA",
            "INTELLIGENT_TIERING",
            "GLACIER_IR",
            "REDUCED_REDUNDANCY",
            "EXPRESS_ONEZONE",
        ]
        | None
    ) = None
    """S3 storage class of every object written; unset: the bucket's default.
    Only classes that read back at once: `GLACIER` and `DEEP_ARCHIVE` would
    make every restore wait hours for a thaw, and are refused."""
    hashed_prefix: bool = False
    """Store each rank's objects under a short hash of run, step and rank
    (`<prefix>/<4 hex>/<run>/step-…/rank-…/…`), so that many ranks writing at
    once spread over S3's prefix partitions instead of throttling one
    (503 SlowDown). Recorded in each MANIFEST.json (`key_layout`); manifests
    stay at `<run>/step-…/MANIFEST.json`. Choose it before the region holds
    checkpoints: the agent reads a region with the layout configured."""
    connect_timeout_seconds: float = Field(10.0, gt=0, le=300)
    """How long opening a connection to the store may take."""
    read_timeout_seconds: float = Field(120.0, gt=0, le=3600)
    """How long the store may stay silent on an open connection."""
    request_attempts: int = Field(4, ge=1, le=20)
    """Tries of one request (throttling, 5xx, a refused connection) before
    the job attempt fails, with the S3 SDK's backoff in between; the job is
    then retried on `[worker]`'s schedule. Lower it where an unreachable
    store should fail fast."""

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str) -> str:
        if not is_region_name(name):
            raise ValueError(f"region name must match {NAME_CHARS}")
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
        if self.kind != "s3" and (self.sse or self.storage_class or self.hashed_prefix):
            raise ValueError(
                f"region {self.name!r}: sse, storage_class and hashed_prefix are S3 settings"
            )
        if self.sse_kms_key_id and self.sse != "aws:kms":
            raise ValueError(f'region {self.name!r}: sse_kms_key_id needs sse = "aws:kms"')
        return self


class DurabilitySettings(BaseModel):
    """When a checkpoint counts as durable."""

    min_regions: int = Field(1, ge=1)
    """Regions a checkpoint must be committed in to be durable (and a candidate for `latest`)."""
    incomplete_timeout_hours: float = Field(24.0, gt=0)
    """A sharded checkpoint still missing ranks this long after its first one
    is failed: it can never become valid and must not linger as "uploading"."""


class TokenSettings(BaseModel):
    """One API token, stored as its SHA-256 only."""

    name: str
    """Who holds the token (named in the refusals it gets)."""
    sha256: str
    """Hex SHA-256 of the token; the token itself is never configured."""
    role: Literal["trainer", "reader", "admin", "peer"] = "reader"
    """What the token may do: `reader` reads, `trainer` also registers,
    `admin` also deletes, pins, quarantines and sets retention; `peer` may
    only push peer copies to this agent (the token agents present to each
    other, `[peers] token`), nothing else, and no other role may push."""
    runs: str = "*"
    """Shell-style pattern of the run names the token may touch."""

    @field_validator("sha256")
    @classmethod
    def _hex_digest(cls, value: str) -> str:
        value = value.lower()
        if not re.fullmatch(r"[0-9a-f]{64}", value):
            raise ValueError("token sha256 must be the 64-hex-digit SHA-256 of the token")
        return value


class UploadSettings(BaseModel):
    """How checkpoints are sent to the regions."""

    part_size_mb: int = Field(16, ge=5, le=512)
    """Multipart part size in MiB (S3 refuses parts under 5 MiB)."""
    parts_in_flight: int = Field(8, ge=1, le=256)
    """Parts being sent at once; with `part_size_mb` it bounds the upload's
    memory (parts_in_flight × part_size_mb)."""
    files_in_flight: int = Field(8, ge=1, le=256)
    """Files of one checkpoint being sent at once."""
    chunk_size_mb: int = Field(8, ge=0, le=512)
    """Besides each file's SHA-256, the upload hashes every chunk of this many
    MiB in the same read; catalog and manifest keep the chunk hashes so a
    reader can verify any byte range it reads (the DCP reader,
    `tierckpt.client.dcp`) without reading the whole file. Applies to files
    uploaded from then on. The second SHA-256 pass costs agent CPU (measured
    ~0.6 s/GB; it runs in another thread beside the first); 0 turns it off,
    and readers then read and verify whole files."""
    dedup: bool = True
    """A file whose SHA-256 equals one already committed in the region is not
    sent again but copied server-side into its own key (CopyObject /
    UploadPartCopy, or an in-kernel copy on POSIX): checkpoints that leave
    most files unchanged (frozen layers, data-loader state) cost only their
    changed bytes. false: every byte is always sent (e.g. to measure the
    pipeline on new bytes)."""
    fan_out: bool = True
    """Upload a single-shard checkpoint from T0 to every region at once rather
    than primary first, then replicate: register → replicated then takes
    about as long as register → durable (the regions fill in parallel)."""


class ScrubSettings(BaseModel):
    """The scrubber: periodic re-reading and re-hashing of committed copies."""

    enabled: bool = True
    """Run the scrubber in this agent."""
    interval_seconds: float = Field(600.0, gt=0)
    """Seconds between scrub rounds."""
    bytes_per_hour: int = Field(100 * 1024**3, ge=0)
    """Re-read budget in bytes per hour: scrubbing must not compete with
    uploads for the store."""
    min_age_hours: float = Field(24.0, ge=0)
    """A replica verified more recently than this is not re-read."""


class KeepBestSettings(BaseModel):
    """Keep the best checkpoints by a metric sent at registration."""

    metric: str = Field(min_length=1, max_length=128)
    """Name of the metric (as in `--metric val_loss=1.93`)."""
    mode: Literal["min", "max"] = "min"
    """Which end is best: `min` (lower is better) or `max`."""
    n: int = Field(1, ge=1)
    """How many of the best to keep."""


class RetentionPolicySettings(BaseModel):
    """One run's retention (also the body of PUT /v1/runs/{run}/retention).
    Nothing set keeps everything."""

    keep_last: int | None = Field(None, ge=1)
    """Keep the newest N checkpoints."""
    keep_every_steps: int | None = Field(None, ge=1)
    """Keep every checkpoint whose step is a multiple of N."""
    keep_best: KeepBestSettings | None = None
    """Keep the best checkpoints by a metric (a table: metric, mode, n)."""
    keep_daily_days: int | None = Field(None, ge=1)
    """Keep the newest checkpoint of each of the last N days."""
    keep_weekly_weeks: int | None = Field(None, ge=1)
    """Keep the newest checkpoint of each of the last N weeks."""


class RetentionSettings(RetentionPolicySettings):
    """The default policy of every run without its own (set with
    PUT /v1/runs/{run}/retention), plus how often the agent applies retention.
    Nothing set keeps everything; the latest valid checkpoint, pinned ones and
    their ancestors are always kept."""

    interval_seconds: float = Field(300.0, gt=0)
    """Seconds between retention rounds over every run (which also evict local
    copies). A run's retention is also applied as soon as one of its
    checkpoints becomes durable; the rounds catch what that missed (a policy
    changed, a retain job that gave up)."""


SHM = Path("/dev/shm")
MEMORY_DEFAULT_CAP = 1024**3


def default_memory_dir() -> Path:
    """/dev/shm/tierckpt where /dev/shm exists (RAM-backed), else under the home."""
    return SHM / "tierckpt" if SHM.is_dir() else DEFAULT_HOME / "memory"


def default_memory_bytes() -> int:
    """1 GiB, or a quarter of /dev/shm's size when that is less."""
    try:
        info = os.statvfs(SHM)
    except OSError:
        return MEMORY_DEFAULT_CAP
    return min(MEMORY_DEFAULT_CAP, info.f_blocks * info.f_frsize // 4)


class MemorySettings(BaseModel):
    """The memory tier (M), above T0: a shared-memory arena the agent owns.
    A trainer copies its state into a segment there, registers it and goes
    on; the agent registers it as usual, uploads it from memory and writes it
    to T0 (fsync, rename) meanwhile."""

    bytes: int = Field(default_factory=default_memory_bytes, ge=0)
    """Budget of the arena in bytes: the segments it holds (a freed
    segment's files are deleted, never reused); 0 turns the memory tier off
    (trainers then write to T0 themselves)."""
    dir: Path = Field(default_factory=default_memory_dir)
    """Directory of the arenas; each agent uses its own subdirectory (named
    after its node and catalog). Use a tmpfs (RAM): segments are files, so
    they outlive a killed trainer and a killed agent, but not a reboot."""
    when_full: Literal["wait", "disk"] = "disk"
    """When a save does not fit in the arena: `disk` (the trainer writes to
    T0 itself, as without the tier: its stall is the disk write) or `wait`
    (it waits up to `wait_seconds` for space, then writes to T0)."""
    wait_seconds: float = Field(60.0, ge=0, le=3600)
    """With `when_full = "wait"`: how long a trainer waits for space before
    it writes to T0 itself."""
    keep_newest: bool = True
    """Keep the newest segment of each run (and rank) in memory once T0 holds
    it, so a restart on this node loads it at memory speed; the next one
    persisted frees it. false: a segment is freed as soon as T0 holds it."""
    lease_seconds: float = Field(600.0, ge=1)
    """A reserved segment not registered within this long (its trainer died
    mid-copy) is reclaimed. A trainer that holds the segment's `holder` lock
    (`TorchCheckpointer` does) has it freed within seconds of dying instead."""
    t0_wait_seconds: float = Field(0.0, ge=0, le=3600)
    """How long a staged checkpoint's T0 write may wait for its upload (from
    the segment) to end, so that the upload, the copy that makes it durable,
    has the node's disk, CPUs and memory bandwidth to itself (where T0 is a
    network disk on the uploads' link, say). Past this, or as soon as a
    reservation finds the arena full, it is written at once. 0 (the
    default): written at once, during the upload; on the benchmark's
    machines waiting did not make checkpoints durable measurably sooner.
    Until T0 holds it, a node that reboots loses a checkpoint that is not
    durable yet (a killed trainer or agent does not: the segment is a file)."""
    persist_nice: int = Field(10, ge=0, le=19)
    """Niceness of the thread that writes staged segments to T0: when the
    CPUs are busy, the upload of the same checkpoint (the copy that makes it
    durable) gets them first; the T0 copy takes what is left. 0: equal shares."""


class PeersSettings(BaseModel):
    """The peer tier: each shard's fast copy on other agents' T0, pushed agent
    to agent, so a restart reads from a peer at LAN speed and a checkpoint
    outlives its node before it is durable."""

    copies: int = Field(0, ge=0, le=16)
    """Peer copies of every shard once it is on T0: pushed to this many live
    agents of other failure domains. Costs the checkpoint's size in network
    and peer disk per copy. 0 turns the peer tier off."""
    keep_last: int = Field(2, ge=1)
    """Newest checkpoints per run whose peer copies a peer keeps; older ones
    are evicted, never the only copy of a checkpoint not yet durable."""
    lease_seconds: float = Field(30.0, ge=1)
    """An agent whose heartbeat is older than this is dead: it gets no pushes
    and a peer holding a copy of its not yet durable shards uploads them."""
    interval_seconds: float = Field(2.0, gt=0)
    """Seconds between the agent's peer passes: heartbeat, takeover of a dead
    agent's uploads, peer retention, re-pushes of missing copies. With
    `copies = 0` only the heartbeat runs, every `lease_seconds` / 3 at most."""
    token: str | None = Field(None, min_length=16, max_length=4096)
    """The secret this agent presents when it pushes to a peer: a token of
    role `peer` in the peers' `[[tokens]]`. Needed when tokens are configured."""
    chunk_bytes: int = Field(1024 * 1024, ge=4096, le=64 * 1024 * 1024)
    """Buffer of a push and of its receipt: memory per file in flight."""


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
    memory: MemorySettings = Field(default_factory=MemorySettings)
    peers: PeersSettings = Field(default_factory=PeersSettings)

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
        if self.peers.copies and self.tokens and not self.peers.token:
            raise ValueError(
                "peers.copies is set and [[tokens]] are configured: set peers.token to a "
                "token of role 'peer' (peers refuse pushes without it)"
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
        if not name.startswith(ENV_PREFIX) or ENV_SEPARATOR not in name:
            continue
        section, _, key = name[len(ENV_PREFIX) :].lower().partition(ENV_SEPARATOR)
        if not section or not key or section in FILE_ONLY_SECTIONS:
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
