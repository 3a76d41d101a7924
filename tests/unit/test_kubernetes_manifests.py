"""deploy/kubernetes/ is valid Kubernetes and agrees with the service's config.

No cluster is needed: every manifest is checked against the Kubernetes OpenAPI
schemas shipped with `kubernetes-validate` (strict: unknown fields fail), the
kustomizations' resource lists are resolved, and the wiring (config TOML in the
ConfigMap, env overrides, ports, hostPath, tokens) is checked against
`tierckpt.service.config`.
"""

from __future__ import annotations

import hashlib
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tierckpt.service.config import BaseModel, Settings, load_settings

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes"
KUSTOMIZATIONS = [BASE, BASE / "postgres"]
K8S_VERSION = "1.30"
# Client-side variables (CheckpointClient / CLI), not service settings.
CLIENT_ENV = {"TIERCKPT_URL", "TIERCKPT_TOKEN", "TIERCKPT_NODE"}


def manifest_files() -> list[Path]:
    return sorted(p for p in BASE.rglob("*.yaml") if p.name != "kustomization.yaml")


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.fixture(scope="module")
def resources() -> list[dict[str, Any]]:
    return [doc for path in manifest_files() for doc in documents(path)]


def find(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for doc in resources:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind}/{name} in deploy/kubernetes")


def secret_value(resources: list[dict[str, Any]], name: str, key: str) -> str:
    return str(find(resources, "Secret", name)["stringData"][key])


def pod_containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(BASE)))
def test_manifest_validates_against_the_kubernetes_schema(path):
    docs = documents(path)
    assert docs, f"{path} is empty"
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(
                f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {where}: {exc.message}"
            )


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_kustomization_resources_exist_and_cover_the_directory(directory):
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    assert len(set(listed)) == len(listed)
    for entry in listed:
        assert (directory / entry).is_file(), f"{directory.name}/kustomization.yaml: {entry}"
    here = {p.name for p in directory.glob("*.yaml")} - {"kustomization.yaml"}
    assert here == set(listed), "every manifest of the directory is in its kustomization"


@pytest.fixture(scope="module")
def daemonset(resources) -> dict[str, Any]:
    return find(resources, "DaemonSet", "tierckpt-agent")


@pytest.fixture(scope="module")
def agent(daemonset) -> dict[str, Any]:
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    return container


@pytest.fixture(scope="module")
def config_text(resources, daemonset, agent) -> str:
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    args = agent["args"]
    config_path = Path(args[args.index("--config") + 1])
    (mount,) = [m for m in agent["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    config_map = find(resources, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
    return str(config_map["data"][config_path.name])


def agent_environ(resources, agent) -> dict[str, str]:
    """The agent's env as the container would see it (Secrets resolved, downward API faked)."""
    environ: dict[str, str] = {}
    for var in agent["env"]:
        if "value" in var:
            environ[var["name"]] = var["value"]
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            environ[var["name"]] = secret_value(resources, ref["name"], ref["key"])
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
            environ[var["name"]] = "gpu-node-17"
    return environ


@pytest.fixture(scope="module")
def settings(resources, agent, config_text, tmp_path_factory) -> Settings:
    path = tmp_path_factory.mktemp("k8s") / "tierckpt.toml"
    path.write_text(config_text)
    return load_settings(path, environ=agent_environ(resources, agent))


def test_config_loads_with_the_daemonset_environment(settings):
    assert settings.server.node == "gpu-node-17"  # from spec.nodeName
    assert settings.catalog.url.startswith("postgresql+asyncpg://")
    assert settings.tokens, "a public bind needs tokens"


def test_node_and_catalog_come_from_downward_api_and_secret(agent):
    env = {var["name"]: var for var in agent["env"]}
    assert env["TIERCKPT_SERVER__NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "secretKeyRef" in env["TIERCKPT_CATALOG__URL"]["valueFrom"]
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "secretKeyRef" in env[name]["valueFrom"], f"{name} must come from a Secret"


def test_config_holds_no_secrets(config_text):
    data = tomllib.loads(config_text)
    assert "url" not in data.get("catalog", {})
    for region in data["regions"]:
        assert "secret_access_key" not in region and "access_key_id" not in region


def test_local_roots_are_the_hostpath_ssd(settings, daemonset, agent):
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    host_mounts = {
        m["mountPath"] for m in agent["volumeMounts"] if "hostPath" in volumes[m["name"]]
    }
    assert [str(root) for root in settings.local.roots] == sorted(host_mounts)


def test_port_matches_container_port_and_service(resources, settings, agent):
    (port,) = agent["ports"]
    assert port["containerPort"] == settings.server.port
    service = find(resources, "Service", "tierckpt-agent")
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] in (settings.server.port, port["name"])
    assert service["spec"]["internalTrafficPolicy"] == "Local"  # the node's own agent
    labels = find(resources, "DaemonSet", "tierckpt-agent")["spec"]["template"]["metadata"]
    assert service["spec"]["selector"].items() <= labels["labels"].items()


def test_every_tierckpt_env_var_maps_to_a_setting(resources):
    names: set[str] = set()
    for doc in resources:
        if doc["kind"] == "Secret":
            names.update(k for k in doc.get("stringData", {}) if k.startswith("TIERCKPT_"))
        spec = doc.get("spec", {})
        pod = spec.get("template", {}).get("spec")
        for container in pod_containers(pod) if pod else []:
            names.update(v["name"] for v in container.get("env", []))
    names = {n for n in names if n.startswith("TIERCKPT_")}
    assert "TIERCKPT_SERVER__NODE" in names
    for name in sorted(names - CLIENT_ENV):
        section, sep, key = name.removeprefix("TIERCKPT_").lower().partition("__")
        assert sep, f"{name}: expected TIERCKPT_<SECTION>__<KEY>"
        assert section in Settings.model_fields, f"{name}: no section [{section}]"
        model = Settings.model_fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel), name
        assert key in model.model_fields, f"{name}: no key {section}.{key}"


def node_name_env(container: dict[str, Any], name: str) -> bool:
    """Whether ``container`` sets ``name`` to the pod's node name (downward API)."""
    return any(
        e["name"] == name and e["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        for e in container.get("env", [])
        if "valueFrom" in e
    )


def test_training_job_prefetches_through_the_node_agent(resources, settings):
    job = find(resources, "Job", "llama-train")
    pod = job["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["args"][:2] == ["prefetch", "llama"]
    assert {"--if-any", "--wait", "--node=$(TIERCKPT_NODE)"} <= set(init["args"])
    # The node prefetched to and the node the trainer asks `latest` for are
    # the name the node's agent has ([server] node, daemonset.yaml).
    agent = find(resources, "DaemonSet", "tierckpt-agent")["spec"]["template"]["spec"]
    assert node_name_env(agent["containers"][0], "TIERCKPT_SERVER__NODE")
    (train,) = pod["containers"]
    assert node_name_env(init, "TIERCKPT_NODE") and node_name_env(train, "TIERCKPT_NODE")
    # The Job's token is one the agents accept, and its URL is the agent Service.
    client = find(resources, "Secret", init["envFrom"][0]["secretRef"]["name"])["stringData"]
    digest = hashlib.sha256(client["TIERCKPT_TOKEN"].encode()).hexdigest()
    assert digest in {token.sha256 for token in settings.tokens}
    assert client["TIERCKPT_URL"].startswith("http://tierckpt-agent.")
    assert client["TIERCKPT_URL"].endswith(f":{settings.server.port}")
    # It writes to the same SSD directory the agent reads.
    volumes = {v["name"]: v for v in pod["volumes"]}
    for container in pod_containers(pod):
        for mount in container.get("volumeMounts", []):
            if "hostPath" in volumes[mount["name"]]:
                assert volumes[mount["name"]]["hostPath"]["path"] == mount["mountPath"]
                assert Path(mount["mountPath"]) in settings.local.roots


def test_training_job_retries_disruptions_and_fails_on_real_errors(resources):
    job = find(resources, "Job", "llama-train")
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    rules = job["spec"]["podFailurePolicy"]["rules"]
    ignore = [r for r in rules if r["action"] == "Ignore"]
    assert any(
        c["type"] == "DisruptionTarget" for r in ignore for c in r.get("onPodConditions", [])
    )
    fail = {
        r["onExitCodes"]["containerName"]: r["onExitCodes"]
        for r in rules
        if r["action"] == "FailJob"
    }
    assert set(fail) == {"prefetch", "train"}
    for codes in fail.values():
        assert codes["operator"] == "In" and 2 in codes["values"]
        assert 3 not in codes["values"], "an unreachable agent is worth a retry"


def test_postgres_statefulset_matches_the_catalog_secret(resources):
    postgres = find(resources, "Secret", "tierckpt-postgres")["stringData"]
    url = secret_value(resources, "tierckpt-catalog", "url")
    user, password, db = (
        postgres["POSTGRES_USER"],
        postgres["POSTGRES_PASSWORD"],
        postgres["POSTGRES_DB"],
    )
    assert url.startswith(f"postgresql+asyncpg://{user}:{password}@tierckpt-postgres.")
    assert url.endswith(f":5432/{db}")
    statefulset = find(resources, "StatefulSet", "tierckpt-postgres")
    assert statefulset["spec"]["replicas"] == 1
    probe = statefulset["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert shlex.join(probe["exec"]["command"]) == f"pg_isready -U {user} -d {db}"


# Seconds the agent needs after its drain: give back running jobs, close the
# registration writer and the catalog.
SHUTDOWN_AFTER_DRAIN = 5


def test_grace_period_covers_the_drain(daemonset, settings):
    """SIGTERM starts the drain ([worker] drain_seconds); the kubelet's SIGKILL
    must not land inside it, or the trainer's urgent upload is cut short."""
    grace = daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert settings.worker.drain_seconds > 0
    assert grace >= settings.worker.drain_seconds + SHUTDOWN_AFTER_DRAIN
