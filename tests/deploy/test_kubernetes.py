"""deploy/k8s, checked offline: every kustomization renders with `kubectl kustomize`; the
core objects validate against Kubernetes' schemas (kubernetes-validate); the KEDA objects
use only the fields KEDA documents for its redis-streams scalers; commands name real
modules and flags; ports, probes, streams, GPUs and grace periods agree."""

from __future__ import annotations

import importlib
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from jobs import keys
from producers.routes import health

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(path.parent.name for path in (K8S / "overlays").glob("*/kustomization.yaml"))
TARGETS = ["base", *(f"overlays/{name}" for name in OVERLAYS)]
PARSERS = {"producers.api": "producers.api", "workers": "workers.__main__", "workers.finalizer": "workers.finalizer"}
KUBERNETES_VERSION = "1.32"  # the kubectl on these machines
CRD_KINDS = {"ScaledObject", "TriggerAuthentication", "PodMonitor", "ServiceMonitor"}

# KEDA's documented fields (keda.sh/docs/2.21: ScaledObject spec, the redis-streams and
# redis-cluster-streams scalers, TriggerAuthentication).
SCALED_OBJECT_SPEC = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
                      "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback", "advanced", "triggers"}
TRIGGER_FIELDS = {"type", "metadata", "authenticationRef", "name", "useCachedMetrics", "metricType"}
STREAMS_METADATA = {"stream", "consumerGroup", "pendingEntriesCount", "streamLength", "lagCount",
                    "activationLagCount", "enableTLS", "unsafeSsl", "databaseIndex", "usernameFromEnv",
                    "passwordFromEnv"}
ADDRESS_METADATA = {"redis-streams": {"address", "host", "port", "addressFromEnv", "hostFromEnv", "portFromEnv"},
                    "redis-cluster-streams": {"addresses", "hosts", "ports", "addressesFromEnv", "hostsFromEnv",
                                              "portsFromEnv"}}
METRICS_API_METADATA = {"url", "format", "valueLocation", "targetValue", "activationTargetValue", "authMode",
                        "unsafeSsl"}
AUTH_PARAMETERS = {"username", "password", "tls", "ca", "cert", "key", "keyPassword", "token"}


def render(target: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render deploy/k8s (it renders kustomize offline)"
    result = subprocess.run([kubectl, "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


RENDERED = {target: render(target) for target in TARGETS}


def objects(target: str, kind: str) -> dict[str, dict]:
    return {obj["metadata"]["name"]: obj for obj in RENDERED[target] if obj["kind"] == kind}


def container(deployment: dict) -> dict:
    [only] = deployment["spec"]["template"]["spec"]["containers"]
    return only


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_every_overlay_renders():
    assert OVERLAYS == ["dev", "redis-cluster", "tp2"]
    for target in TARGETS:
        kinds = {obj["kind"] for obj in RENDERED[target]}
        assert {"Deployment", "Service", "ScaledObject", "TriggerAuthentication", "PodMonitor"} <= kinds, target


@pytest.mark.parametrize("target", TARGETS)
def test_core_objects_validate_against_the_kubernetes_schema(target):
    for obj in RENDERED[target]:
        if obj["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("target", TARGETS)
def test_every_command_names_a_real_module_and_real_flags(target):
    modules = set()
    for deployment in objects(target, "Deployment").values():
        command = container(deployment)["command"]
        if command[:2] != ["python", "-m"]:
            continue
        modules.add(command[2])
        parser = importlib.import_module(PARSERS[command[2]]).build_parser()
        parser.parse_args(command[3:])  # exits on an unknown flag or a bad value
    assert modules == set(PARSERS)


@pytest.mark.parametrize("target", TARGETS)
def test_ports_probes_and_services_agree(target):
    deployments, services = objects(target, "Deployment"), objects(target, "Service")
    for name, deployment in deployments.items():
        spec = container(deployment)
        ports = {port["name"]: port["containerPort"] for port in spec.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe"):
            if probe in spec:
                action = spec[probe].get("httpGet") or spec[probe].get("tcpSocket")
                assert action["port"] in ports, (name, probe)
        command = spec["command"]
        if "--metrics-port" in command:
            assert int(flag(command, "--metrics-port")) == ports["metrics"]
            assert spec["readinessProbe"]["httpGet"]["path"] == "/healthz"
            assert spec["livenessProbe"]["httpGet"]["path"] == "/livez"
        if "--port" in command:
            assert int(flag(command, "--port")) == ports["http"]
    for name, service in services.items():
        pods = [container(d) for d in deployments.values()
                if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        if not pods:  # the dev Redis: a StatefulSet
            pods = [s["spec"]["template"]["spec"]["containers"][0] for s in objects(target, "StatefulSet").values()]
        for port in service["spec"]["ports"]:
            assert any(port["targetPort"] in {p["name"] for p in pod["ports"]} for pod in pods), (name, port)
    for monitor in objects(target, "PodMonitor").values():
        worker = [d for d in deployments.values() if monitor["spec"]["selector"]["matchLabels"].items()
                  <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert worker and all(e["port"] in {p["name"] for p in container(worker[0])["ports"]}
                              for e in monitor["spec"]["podMetricsEndpoints"])
    for monitor in objects(target, "ServiceMonitor").values():
        [service] = [s for s in services.values()
                     if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"].get("labels", {}).items()]
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}


@pytest.mark.parametrize("target", TARGETS)
def test_workers_drain_within_their_grace_period_ask_their_gpus_and_read_the_model_read_only(target):
    worker = objects(target, "Deployment")["kvfleet-worker"]
    pod, spec = worker["spec"]["template"]["spec"], container(worker)
    drain = float(flag(spec["command"], "--drain-seconds"))
    assert pod["terminationGracePeriodSeconds"] >= drain + 10  # SIGTERM drains, then hands back and exits
    assert flag(spec["command"], "--drain-mode") == "migrate"  # a spot reclaim's notice loses no tokens
    tensor_parallel_size = int(flag(spec["command"], "--tensor-parallel-size"))
    assert int(spec["resources"]["limits"]["nvidia.com/gpu"]) == tensor_parallel_size
    mounts = {m["name"]: m for m in spec["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True and flag(spec["command"], "--model").startswith(
        mounts["models"]["mountPath"] + "/")
    volume = {v["name"]: v for v in pod["volumes"]}["models"]
    assert volume["persistentVolumeClaim"]["readOnly"] is True


@pytest.mark.parametrize("target", TARGETS)
def test_keda_objects_use_only_documented_fields_and_kvfleets_streams(target):
    auths = objects(target, "TriggerAuthentication")
    for name, auth in auths.items():
        for ref in auth["spec"]["secretTargetRef"]:
            assert set(ref) == {"parameter", "name", "key"} and ref["parameter"] in AUTH_PARAMETERS
        parameters = {ref["parameter"] for ref in auth["spec"]["secretTargetRef"]}
        assert parameters >= {"password", "tls"} or parameters == {"token"}, name  # Redis, or the API's bearer key
    deployments = objects(target, "Deployment")
    for scaled in objects(target, "ScaledObject").values():
        assert scaled["apiVersion"] == "keda.sh/v1alpha1" and set(scaled["spec"]) <= SCALED_OBJECT_SPEC
        spec = scaled["spec"]
        assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1
        worker = container(deployments[spec["scaleTargetRef"]["name"]])
        env = {variable["name"] for variable in worker["env"]}
        model = flag(worker["command"], "--served-model-name")
        batch_urls, online_metrics = [], []
        for trigger in spec["triggers"]:
            if trigger["type"] == "metrics-api":  # the batch backlog, summed over every batch's queue by the API
                metadata = trigger["metadata"]
                assert set(trigger) <= TRIGGER_FIELDS and set(metadata) <= METRICS_API_METADATA, set(metadata)
                assert metadata["format"] == "json" and metadata["valueLocation"] == "lag"
                assert "activationTargetValue" in metadata and int(metadata["targetValue"]) > 0
                assert metadata["authMode"] == "bearer"  # /queue/MODEL needs KVFLEET_METRICS_KEY
                [token] = auths[trigger["authenticationRef"]["name"]]["spec"]["secretTargetRef"]
                assert (token["parameter"], token["name"], token["key"]) == ("token", "kvfleet-api", "metrics-key")
                batch_urls.append(metadata["url"])
                continue
            assert set(trigger) <= TRIGGER_FIELDS and trigger["type"] in ADDRESS_METADATA
            metadata = trigger["metadata"]
            assert set(metadata) <= STREAMS_METADATA | ADDRESS_METADATA[trigger["type"]], set(metadata)
            assert all(isinstance(value, str) for value in metadata.values())  # KEDA metadata is strings
            assert metadata["consumerGroup"] == keys.CONSUMER_GROUP
            assert "streamLength" not in metadata
            from_env = [value for field, value in metadata.items() if field.endswith("FromEnv")]
            assert from_env and set(from_env) <= env  # read from the scale target's environment
            assert trigger["authenticationRef"]["name"] in auths
            if metadata["stream"] == keys.online_stream(model):
                online_metrics.append("lag" if "lagCount" in metadata else "pending")
                continue
            raise AssertionError(f"a stream trigger on {metadata['stream']}: batch work has a stream per batch")
        # The API Service of the namespace the target deploys to, at the route that answers it.
        namespace = "kvfleet-dev" if target.endswith("dev") else "kvfleet"
        assert batch_urls == [f"http://kvfleet-api.{namespace}.svc.cluster.local:8000/queue/{model}"]
        assert "/queue/{model}" in {route.path for route in health.router.routes}
        # Online demand: its lag wakes a worker from zero, its pending requests keep workers up.
        assert sorted(online_metrics) == ["lag", "pending"]


@pytest.mark.parametrize("target", TARGETS)
def test_every_container_is_locked_down_and_bounded(target):
    """Non-root, no privilege escalation, no capabilities, a read-only root filesystem, and
    limits on memory and ephemeral storage, for every container of every workload."""
    workloads = {**objects(target, "Deployment"), **objects(target, "StatefulSet")}
    assert workloads
    for name, workload in workloads.items():
        for spec in workload["spec"]["template"]["spec"]["containers"]:
            security = spec.get("securityContext", {})
            assert security.get("runAsNonRoot") is True and security.get("allowPrivilegeEscalation") is False, name
            assert security.get("readOnlyRootFilesystem") is True, name
            assert security.get("capabilities", {}).get("drop") == ["ALL"], name
            limits = spec.get("resources", {}).get("limits", {})
            assert "memory" in limits and "ephemeral-storage" in limits, name


@pytest.mark.parametrize("target", TARGETS)
def test_the_api_key_secret_is_required(target):
    api = container(objects(target, "Deployment")["kvfleet-api"])
    [key] = [variable for variable in api["env"] if variable["name"] == "KVFLEET_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"].get("optional") in (None, False)
    tenants = {v["name"]: v["valueFrom"]["secretKeyRef"] for v in api["env"]
               if v["name"] in ("KVFLEET_ADMIN_KEY", "KVFLEET_API_KEYS")}  # tenants: from the same Secret, optional
    assert tenants == {"KVFLEET_ADMIN_KEY": {"name": "kvfleet-api", "key": "admin-key", "optional": True},
                       "KVFLEET_API_KEYS": {"name": "kvfleet-api", "key": "tenant-keys", "optional": True}}
    # /metrics and /queue/MODEL name tenants and models: Prometheus and KEDA send this key.
    [metrics] = [variable for variable in api["env"] if variable["name"] == "KVFLEET_METRICS_KEY"]
    assert metrics["valueFrom"]["secretKeyRef"] == {"name": "kvfleet-api", "key": "metrics-key"}
    [monitor] = objects(target, "ServiceMonitor").values()
    assert all(endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "kvfleet-api",
                                                                                "key": "metrics-key"}}
               for endpoint in monitor["spec"]["endpoints"])


@pytest.mark.parametrize("target", TARGETS)
def test_no_secret_is_in_a_manifest(target):
    secrets = objects(target, "Secret")
    if target.endswith("dev"):  # its Redis has no password: the generated Secret holds none
        assert list(secrets) == ["kvfleet-redis"]
        assert secrets["kvfleet-redis"]["data"]["password"] == ""
    else:
        assert secrets == {}
    for deployment in objects(target, "Deployment").values():
        for variable in container(deployment).get("env", []):
            if any(word in variable["name"] for word in ("PASSWORD", "SECRET", "API_KEY", "REDIS_URL")):
                assert "value" not in variable and "secretKeyRef" in variable["valueFrom"], variable["name"]


@pytest.mark.parametrize("target", TARGETS)
def test_the_grafana_dashboard_ships_as_a_configmap_for_grafanas_sidecar(target):
    dashboard = objects(target, "ConfigMap")["kvfleet-grafana-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["kvfleet.json"] == (ROOT / "deploy" / "grafana" / "dashboards" / "kvfleet.json").read_text()
