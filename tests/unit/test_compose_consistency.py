"""docker-compose.yml, deploy/compose/config.toml and the Dockerfile agree.

Nobody runs `docker compose up` in CI, so the wiring between the files (service
names, ports, credentials, buckets, the config's keys) is checked statically
here: a rename in one file without the others fails this test, not a user.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CONFIG = ROOT / "deploy" / "compose" / "config.toml"
DOCKERFILE = ROOT / "Dockerfile"
CONFIG_IN_CONTAINER = "/etc/tierckpt/config.toml"
# Documented in docker-compose.yml and config.toml; only its hash is stored.
DEMO_TOKEN = "tierckpt-compose-demo-token"

# The configuration's stable surface ("*" = any key of that table): the demo
# relies on no tuning key (docs/configuration.md lists them all).
ALLOWED_KEYS: dict[str, set[str]] = {
    "server": {"host", "port", "node"},
    "catalog": {"url"},
    "local": {"roots", "keep_last"},
    "regions": {
        "name",
        "kind",
        "endpoint_url",
        "bucket",
        "prefix",
        "access_key_id",
        "secret_access_key",
        "root",
    },
    "durability": {"min_regions"},
    "tokens": {"name", "sha256", "role", "runs"},
    "retention": {"*"},
}
ARRAY_TABLES = {"regions", "tokens"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return tomllib.loads(CONFIG.read_text())


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


def container_ports(service: dict[str, Any]) -> set[int]:
    """Container-side ports of `ports:` ("[ip:]host:container[/proto]") and `expose:`."""
    found: set[int] = set()
    for entry in service.get("ports") or []:
        target = entry.get("target") if isinstance(entry, dict) else str(entry).rsplit(":", 1)[-1]
        found.add(int(str(target).split("/")[0]))
    found.update(int(str(port).split("/")[0]) for port in service.get("expose") or [])
    return found


def command_words(service: dict[str, Any]) -> list[str]:
    command = service.get("command") or []
    return shlex.split(command) if isinstance(command, str) else [str(w) for w in command]


def option(words: list[str], name: str) -> str | None:
    for index, word in enumerate(words[:-1]):
        if word == name:
            return words[index + 1]
    return None


def minio_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services.items() if str(s.get("image", "")).startswith("minio/minio")}


def mc_script(services: dict[str, dict[str, Any]]) -> str:
    mc = [s for s in services.values() if str(s.get("image", "")).startswith("minio/mc")]
    assert len(mc) == 1, "expected exactly one minio/mc one-shot service"
    return "\n".join(command_words(mc[0]))


def mc_aliases(script: str) -> dict[str, tuple[str, str, str]]:
    """alias -> (url, access key, secret) from `mc alias set` lines."""
    pattern = r"mc alias set (\S+) (\S+) (\S+) (\S+)"
    return {a: (url, key, secret) for a, url, key, secret in re.findall(pattern, script)}


def mc_buckets(script: str) -> set[tuple[str, str]]:
    """(alias, bucket) from `mc mb [flags] alias/bucket` lines."""
    return set(re.findall(r"mc mb (?:--?[\w-]+ )*([\w-]+)/([\w.-]+)", script))


def test_depends_on_names_existing_services(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for dependency in service.get("depends_on") or []:
            assert dependency in services, f"{name} depends on unknown service {dependency}"


def test_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for volume in service.get("volumes") or []:
            source = str(volume).split(":", 1)[0]
            if not source.startswith((".", "/")):
                assert source in declared, f"{name} mounts undeclared volume {source}"


def test_tierckpt_service_serves_the_mounted_config(
    services: dict[str, dict[str, Any]], config: dict[str, Any]
) -> None:
    service = services["tierckpt"]
    assert service.get("build"), "the tierckpt service must be built from the Dockerfile"
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in service["volumes"]}
    assert (ROOT / mounts[CONFIG_IN_CONTAINER]).resolve() == CONFIG.resolve()
    words = command_words(service)
    assert words[0] == "serve" and option(words, "--config") == CONFIG_IN_CONTAINER
    dockerfile = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim", dockerfile, re.M)
    assert re.search(r"^RUN pip install \.", dockerfile, re.M)
    assert '"serve", "--config", "' + CONFIG_IN_CONTAINER + '"' in dockerfile
    # The agent port inside the container is the config's, and it is published.
    assert config["server"]["port"] in container_ports(service)
    assert f"{config['server']['port']}:{config['server']['port']}" in service["ports"]
    # The SSD root the agent reads is a mounted volume, shareable with trainers.
    for root in config["local"]["roots"]:
        assert root in mounts, f"local root {root} is not a volume of the tierckpt service"


def test_regions_point_at_minio_services(
    services: dict[str, dict[str, Any]], config: dict[str, Any]
) -> None:
    minios = minio_services(services)
    assert len(config["regions"]) == 2 and len(minios) == 2
    used = set()
    for region in config["regions"]:
        assert region["kind"] == "s3"
        endpoint = urlsplit(region["endpoint_url"])
        assert endpoint.hostname in minios, (
            f"{region['name']}: no MinIO service {endpoint.hostname}"
        )
        service = minios[endpoint.hostname]
        words = command_words(service)
        api_port = int((option(words, "--address") or ":9000").rsplit(":", 1)[-1])
        console = option(words, "--console-address")
        assert endpoint.port == api_port, f"{region['name']}: not MinIO's S3 API port"
        assert console is None or int(console.rsplit(":", 1)[-1]) != endpoint.port
        assert endpoint.port in container_ports(service)
        env = env_of(service)
        assert region["access_key_id"] == env["MINIO_ROOT_USER"]
        assert region["secret_access_key"] == env["MINIO_ROOT_PASSWORD"]
        used.add(endpoint.hostname)
    assert used == set(minios), "every MinIO service is one region"


def test_published_minio_ports(services: dict[str, dict[str, Any]]) -> None:
    published = {name: set(map(str, s["ports"])) for name, s in minio_services(services).items()}
    assert published == {
        "minio-east": {"9000:9000", "9001:9001"},
        "minio-west": {"9002:9000", "9003:9001"},
    }


def test_mc_creates_exactly_the_regions_buckets(
    services: dict[str, dict[str, Any]], config: dict[str, Any]
) -> None:
    script = mc_script(services)
    aliases = mc_aliases(script)
    created = mc_buckets(script)
    expected = set()
    for region in config["regions"]:
        matching = [
            alias
            for alias, (url, key, secret) in aliases.items()
            if url.rstrip("/") == region["endpoint_url"].rstrip("/")
            and (key, secret) == (region["access_key_id"], region["secret_access_key"])
        ]
        assert len(matching) == 1, f"{region['name']}: no mc alias with its endpoint and keys"
        expected.add((matching[0], region["bucket"]))
    assert created == expected
    mc = next(s for s in services.values() if str(s.get("image", "")).startswith("minio/mc"))
    assert set(mc.get("depends_on") or []) == set(minio_services(services))
    tierckpt_deps = services["tierckpt"]["depends_on"]
    init = next(name for name, s in services.items() if s is mc)
    assert tierckpt_deps[init]["condition"] == "service_completed_successfully"


def test_catalog_url_matches_postgres_service(
    services: dict[str, dict[str, Any]], config: dict[str, Any]
) -> None:
    url = urlsplit(config["catalog"]["url"])
    assert url.scheme == "postgresql+asyncpg"
    assert url.hostname in services and services[url.hostname]["image"].startswith("postgres:")
    env = env_of(services[url.hostname])
    assert (url.username, url.password) == (env["POSTGRES_USER"], env["POSTGRES_PASSWORD"])
    assert url.path.lstrip("/") == env["POSTGRES_DB"]
    assert url.port in (None, 5432) and 5432 in container_ports(services[url.hostname])
    assert services["tierckpt"]["depends_on"][url.hostname]["condition"] == "service_healthy"


def test_config_uses_only_the_documented_surface(config: dict[str, Any]) -> None:
    for section, value in config.items():
        assert section in ALLOWED_KEYS, f"[{section}] is not in the configuration's stable surface"
        allowed = ALLOWED_KEYS[section]
        tables = value if section in ARRAY_TABLES else [value]
        assert isinstance(tables, list), f"{section} must be [[{section}]]"
        for table in tables:
            unknown = set(table) - allowed
            assert "*" in allowed or not unknown, f"[{section}] has unknown keys {unknown}"


def test_public_bind_has_the_documented_demo_token(config: dict[str, Any]) -> None:
    assert config["server"]["host"] == "0.0.0.0"
    assert config["server"]["node"] == "compose-node"
    assert config["durability"]["min_regions"] == 1
    (token,) = config["tokens"]
    assert token["sha256"] == hashlib.sha256(DEMO_TOKEN.encode()).hexdigest()
    assert (token["role"], token["runs"]) == ("admin", "*")
    assert DEMO_TOKEN in COMPOSE.read_text(), "the demo token must be documented in compose"


def test_config_loads_in_the_service() -> None:
    from tierckpt.service.config import load_settings

    settings = load_settings(CONFIG, environ={})
    assert [r.name for r in settings.regions] == ["us-east", "us-west"]
    assert settings.server.port == 8470


# -- issue 7: health checks, named volumes, the trainers' shared SSD ---------

ONE_SHOT = {"minio-init", "trainer"}


def mounts_of(service: dict[str, Any]) -> dict[str, str]:
    """container path -> source (a named volume or a host path)."""
    found = {}
    for volume in service.get("volumes") or []:
        source, target = str(volume).split(":")[:2]
        found[target] = source
    return found


def test_every_long_running_service_has_a_health_check(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, service in services.items():
        if name in ONE_SHOT:
            assert service.get("restart") == "no", f"{name} runs once: restart: 'no'"
            continue
        check = service.get("healthcheck") or {}
        assert check.get("test"), f"{name} has no health check"
        assert check.get("retries", 0) >= 3 and check.get("interval"), name
    # Whoever depends on a long-running service waits for it to be healthy.
    for name, service in services.items():
        for dependency, rule in (service.get("depends_on") or {}).items():
            expected = (
                "service_completed_successfully" if dependency in ONE_SHOT else "service_healthy"
            )
            assert rule["condition"] == expected, f"{name} -> {dependency}"


def test_agent_health_check_asks_readyz_on_the_config_port(
    services: dict[str, dict[str, Any]], config: dict[str, Any]
) -> None:
    probe = " ".join(services["tierckpt"]["healthcheck"]["test"])
    assert f"http://127.0.0.1:{config['server']['port']}/readyz" in probe


def test_state_lives_in_named_volumes(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    declared = set(compose["volumes"])
    assert mounts_of(services["postgres"])["/var/lib/postgresql/data"] in declared
    for name, service in minio_services(services).items():
        words = command_words(service)
        data_dir = words[words.index("server") + 1]
        assert mounts_of(service)[data_dir] in declared, f"{name}: {data_dir} not a named volume"
    used = {
        source
        for service in services.values()
        for source in mounts_of(service).values()
        if not source.startswith((".", "/"))
    }
    assert used == declared, f"declared but unused volumes: {declared - used}"


def test_trainer_shares_the_agents_ssd_and_reaches_it(
    services: dict[str, dict[str, Any]], config: dict[str, Any]
) -> None:
    agent, trainer = services["tierckpt"], services["trainer"]
    (root,) = config["local"]["roots"]
    # The same named volume at the same path: a registered path is the same
    # file in both containers.
    assert mounts_of(trainer)[root] == mounts_of(agent)[root]
    assert not mounts_of(trainer)[root].startswith((".", "/")), "the SSD is a named volume"
    assert trainer["image"] == agent["image"], "the trainer runs the client of the same build"
    assert trainer["depends_on"]["tierckpt"]["condition"] == "service_healthy"

    env = env_of(trainer)
    url = urlsplit(env["TIERCKPT_URL"])
    assert (url.hostname, url.port) == ("tierckpt", config["server"]["port"])
    digest = hashlib.sha256(env["TIERCKPT_TOKEN"].encode()).hexdigest()
    token = next(t for t in config["tokens"] if t["sha256"] == digest)
    assert token["role"] in ("trainer", "admin")

    # The script it runs is mounted from this repository and writes under the root.
    entry = [str(w) for w in trainer["entrypoint"]]
    script = entry[-1]
    host_dir = next(src for dst, src in mounts_of(trainer).items() if script.startswith(dst + "/"))
    assert (ROOT / host_dir / Path(script).name).is_file()
    words = command_words(trainer)
    assert option(words, "--root") == root
    assert "--resume" in words
    run = option(words, "--run")
    assert run and re.fullmatch(r"[A-Za-z0-9._-]{1,128}", run)
    assert fnmatch.fnmatchcase(run, token["runs"])


def test_stop_grace_period_covers_the_drain(services: dict[str, dict[str, Any]]) -> None:
    """`docker compose stop` sends SIGTERM, then SIGKILL after stop_grace_period
    (10 s unless set): the agent's drain, and a few seconds to shut down, must fit."""
    from tierckpt.service.config import load_settings

    settings = load_settings(CONFIG, environ={})
    grace = services["tierckpt"]["stop_grace_period"]
    match = re.fullmatch(r"(\d+)s", str(grace))
    assert match, f"stop_grace_period {grace!r}: write it in seconds, e.g. 30s"
    assert settings.worker.drain_seconds > 0
    assert int(match.group(1)) >= settings.worker.drain_seconds + 5
