"""deploy/kubernetes/: schema-valid for the Kubernetes versions we support, and consistent with the app.

The kustomization is rendered here the way `kubectl apply -k` renders it for the transformers it uses
(namespace, labels, images), then every object is validated against the Kubernetes OpenAPI schemas
shipped in the `kubernetes-validate` package, in strict mode (an unknown field is an error).
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from app.config import Settings
from tests.deploy.procs import REPO
from tests.deploy.test_container_files import ENTRYPOINT_ONLY, SETTING_NAMES, secret_names

K8S = REPO / "deploy" / "kubernetes"
# The oldest Kubernetes minor still maintained upstream when this was written, and the newest the
# package knows: the manifests use nothing outside both.
VERSIONS = ("1.31.0", "1.37.0")
CLUSTER_SCOPED = {"Namespace"}
SECRET_TEMPLATE = K8S / "secret.example.yaml"


def load_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomization() -> dict[str, Any]:
    data = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert isinstance(data, dict)
    return data


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj["spec"]["template"]["spec"] if obj["kind"] in ("Deployment", "Job") else {}
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def render() -> list[dict[str, Any]]:
    """The objects `kubectl apply -k deploy/kubernetes` creates."""
    kust = kustomization()
    images = {image["name"]: image for image in kust.get("images", [])}
    objects = []
    for resource in kust["resources"]:
        for doc in load_documents(K8S / resource):
            obj = copy.deepcopy(doc)
            meta = obj.setdefault("metadata", {})
            if obj["kind"] not in CLUSTER_SCOPED and "namespace" in kust:
                meta["namespace"] = kust["namespace"]
            for label_set in kust.get("labels", []):
                meta.setdefault("labels", {}).update(label_set["pairs"])
            for container in containers(obj):
                name, _, tag = container["image"].partition(":")
                if name in images:
                    new = images[name]
                    container["image"] = f"{new.get('newName', name)}:{new.get('newTag', tag or 'latest')}"
            objects.append(obj)
    return objects


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [obj for obj in objects if obj["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return render()


def test_the_kustomization_lists_every_manifest() -> None:
    listed = set(kustomization()["resources"])
    present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", SECRET_TEMPLATE.name}
    assert listed == present
    # The Secret template is applied by hand (or by a secret manager), never with placeholder values.
    assert SECRET_TEMPLATE.name not in listed


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schemas(
    objects: list[dict[str, Any]], version: str
) -> None:
    assert {obj["kind"] for obj in objects} >= {
        "Namespace", "ConfigMap", "Deployment", "Service", "Ingress", "Job",
        "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy",
    }  # fmt: skip
    for obj in [*objects, *load_documents(SECRET_TEMPLATE)]:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes {version}: {exc}")


def test_the_validation_rejects_a_broken_manifest(objects: list[dict[str, Any]]) -> None:
    deployment = copy.deepcopy(one(objects, "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)
    deployment = copy.deepcopy(one(objects, "Deployment"))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


def test_the_deployment_probes_runs_unprivileged_and_shuts_down_gracefully(
    objects: list[dict[str, Any]],
) -> None:
    deployment = one(objects, "Deployment")
    config = one(objects, "ConfigMap")["data"]
    pod = deployment["spec"]["template"]["spec"]
    (app,) = pod["containers"]
    assert app["image"] == "registry.example.com/sparring:0.1.0"
    ports = {p["name"]: p["containerPort"] for p in app["ports"]}
    assert ports == {"http": int(config["SPARRING_PORT"])}
    assert re.search(rf"^EXPOSE {ports['http']}$", (REPO / "Dockerfile").read_text(), re.M)

    assert app["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert app["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert app["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}

    # The image's user (Dockerfile: USER 10001:10001), which runAsNonRoot can verify because it is numeric.
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001
    assert "USER 10001:10001" in (REPO / "Dockerfile").read_text()
    assert app["securityContext"]["allowPrivilegeEscalation"] is False
    assert app["securityContext"]["readOnlyRootFilesystem"] is True
    assert app["securityContext"]["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"] for m in app["volumeMounts"]}
    assert {"/tmp", "/var/lib/sparring"} <= mounts  # the writable places on a read-only root

    resources = app["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]
    # One worker process per requested core.
    assert int(config["SPARRING_WORKERS"]) == int(resources["requests"]["cpu"])

    # SIGTERM arrives after preStop; in-flight calls (up to the tool deadline) finish within the grace.
    pre_stop = app["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    tool_deadline = float(config["SPARRING_TOOL_TIMEOUT_SECONDS"])
    assert pod["terminationGracePeriodSeconds"] > tool_deadline + float(pre_stop[1])
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_service_ingress_hpa_and_pdb_point_at_the_deployment(objects: list[dict[str, Any]]) -> None:
    deployment = one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels)

    service = one(objects, "Service")
    assert selects(service["spec"]["selector"], pod_labels)
    (port,) = service["spec"]["ports"]
    container_ports = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert port["targetPort"] in container_ports

    ingress = one(objects, "Ingress")
    annotations = ingress["metadata"]["annotations"]
    assert "cert-manager.io/cluster-issuer" in annotations
    assert annotations["nginx.ingress.kubernetes.io/ssl-redirect"] == "true"
    # The app accepts 1 MB bodies and calls that run for minutes.
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    tls_hosts = {host for tls in ingress["spec"]["tls"] for host in tls["hosts"]}
    for rule in ingress["spec"]["rules"]:
        assert rule["host"] in tls_hosts, f"{rule['host']} is served without TLS"
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend["name"] == service["metadata"]["name"]
            assert backend["port"]["name"] == port["name"]
    config = one(objects, "ConfigMap")["data"]
    assert config["SPARRING_PUBLIC_BASE_URL"] == f"https://{ingress['spec']['rules'][0]['host']}"

    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"],
    }  # fmt: skip
    assert hpa["spec"]["minReplicas"] >= 2
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]

    pdb = one(objects, "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels)
    assert pdb["spec"]["minAvailable"] >= 1


def test_the_migration_job_runs_the_entrypoints_migrate_command(objects: list[dict[str, Any]]) -> None:
    job = one(objects, "Job")
    (migrate,) = job["spec"]["template"]["spec"]["containers"]
    assert migrate["args"] == ["migrate"]
    assert "\n    migrate)\n" in (REPO / "deploy" / "entrypoint.sh").read_text()
    assert (
        migrate["image"] == one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    )
    assert job["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert job["spec"]["backoffLimit"] >= 1


def test_only_the_ingress_controller_reaches_the_app_and_the_app_only_its_stores(
    objects: list[dict[str, Any]],
) -> None:
    policy = one(objects, "NetworkPolicy")
    spec = policy["spec"]
    assert set(spec["policyTypes"]) == {"Ingress", "Egress"}
    for workload in ("Deployment", "Job"):
        labels = one(objects, workload)["spec"]["template"]["metadata"]["labels"]
        assert selects(spec["podSelector"]["matchLabels"], labels), (
            f"the policy does not cover the {workload}"
        )

    (ingress_rule,) = spec["ingress"]
    (source,) = ingress_rule["from"]
    assert source["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ingress-nginx"}
    assert "podSelector" in source and "ipBlock" not in source
    assert [p["port"] for p in ingress_rule["ports"]] == ["http"]

    egress_ports = {(p["protocol"], p["port"]) for rule in spec["egress"] for p in rule["ports"]}
    assert egress_ports == {("UDP", 53), ("TCP", 53), ("TCP", 5432), ("TCP", 6379)}
    for rule in spec["egress"]:
        assert rule.get("to"), "an egress rule without `to` allows every destination"


def test_settings_and_secrets_are_where_they_belong(objects: list[dict[str, Any]]) -> None:
    config = one(objects, "ConfigMap")
    (secret,) = load_documents(SECRET_TEMPLATE)
    allowed = SETTING_NAMES | ENTRYPOINT_ONLY
    assert set(config["data"]) <= allowed, set(config["data"]) - allowed
    assert set(secret["stringData"]) <= allowed, set(secret["stringData"]) - allowed
    secrets = secret_names() | {"SPARRING_DATABASE_URL", "SPARRING_REDIS_URL"}
    assert not set(config["data"]) & secrets, "a secret in the ConfigMap"
    assert {"SPARRING_API_KEYS", "SPARRING_DATABASE_URL", "SPARRING_REDIS_URL"} <= set(secret["stringData"])
    # Every value parses as the app's settings (the placeholders included, so the template is usable).
    Settings(**{k.removeprefix("SPARRING_").lower(): v for k, v in config["data"].items()})
    for workload in ("Deployment", "Job"):
        for container in containers(one(objects, workload)):
            refs = {(kind, ref["name"]) for source in container["envFrom"] for kind, ref in source.items()}
            assert refs == {
                ("configMapRef", config["metadata"]["name"]), ("secretRef", secret["metadata"]["name"]),
            }  # fmt: skip


def test_probes_and_port_are_the_servers_own(objects: list[dict[str, Any]], tmp_path: Path) -> None:
    """The probes ask routes the app serves, on the port `sparring serve` listens on."""
    from app.main import create_app
    from tests.conftest import make_settings

    app = create_app(make_settings(tmp_path / "home"))
    routes = {getattr(route, "path", None) for route in app.routes}
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] in routes, f"{probe} asks {get['path']}, which the app does not serve"
        assert ports[get["port"]] == int(one(objects, "ConfigMap")["data"]["SPARRING_PORT"])
    # The port the server listens on when nothing is set is the one the image exposes and the pod names.
    assert ports["http"] == Settings.model_fields["port"].default
    service = one(objects, "Service")
    (port,) = service["spec"]["ports"]
    assert ports[port["targetPort"]] == ports["http"]
