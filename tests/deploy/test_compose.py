"""compose.yaml, checked statically (no Docker engine runs here): every kvfleet
command names a real module and flags its parser accepts, and ports, hosts and
the bucket agree across services."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from jobs.retention import default_retention
from jobs.tenants import key_ring_from_env

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
PARSERS = {"producers.api": "producers.api", "producers.submit": "producers.submit", "workers": "workers.__main__",
           "workers.finalizer": "workers.finalizer"}


def substitute(value: str) -> str:
    """Compose's ${VAR:-default} with the defaults."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def kvfleet_commands():
    for name, service in SERVICES.items():
        command = [substitute(str(part)) for part in service.get("command") or []]
        if command[:2] == ["python", "-m"]:
            yield name, command[2], command[3:]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_every_service_runs_a_real_module_with_real_flags():
    commands = list(kvfleet_commands())
    assert {module for _, module, _ in commands} == {"producers.api", "workers", "workers.finalizer"}
    for service, module, args in commands:
        parser = importlib.import_module(PARSERS[module]).build_parser()
        parsed, unknown = parser.parse_known_args(args)
        assert unknown == [], f"{service}: {module} does not accept {unknown}"
        assert parsed is not None


def test_the_expected_services_exist():
    assert set(SERVICES) >= {"redis", "minio", "minio-init", "api", "worker", "finalizer", "prometheus", "grafana"}


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard():
    grafana = SERVICES["grafana"]
    mounts = {target: (ROOT / source).resolve() for source, target, *_ in (v.split(":") for v in grafana["volumes"])
              if source.startswith("./")}
    assert mounts["/etc/grafana/provisioning"] == ROOT / "deploy" / "grafana" / "provisioning"
    assert mounts["/var/lib/grafana/dashboards"] == ROOT / "deploy" / "grafana" / "dashboards"
    [source] = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"]
    assert urlparse(source["url"]).hostname == "prometheus" and "127.0.0.1:9090:9090" in [
        substitute(port) for port in SERVICES["prometheus"]["ports"]]
    [provider] = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/kvfleet.yml").read_text())[
        "providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    assert "prometheus" in grafana["depends_on"] and "127.0.0.1:3000:3000" in map(substitute, grafana["ports"])


def test_redis_keeps_an_aof_on_a_volume():
    redis = SERVICES["redis"]
    command = redis["command"]
    assert flag(command, "--appendonly") == "yes" and flag(command, "--appendfsync") == "everysec"
    assert any(volume.endswith(":/data") for volume in redis["volumes"])
    assert redis["volumes"][0].split(":")[0] in COMPOSE["volumes"]


def test_workers_reserve_a_gpu_and_scale():
    deploy = SERVICES["worker"]["deploy"]
    device = deploy["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["count"] == 1
    assert int(substitute(str(deploy["replicas"]))) >= 1
    grace = int(SERVICES["worker"]["stop_grace_period"].rstrip("s"))
    args = next(args for name, _, args in kvfleet_commands() if name == "worker")
    assert grace > float(flag(args, "--drain-seconds"))  # SIGKILL only after the drain


def test_ports_and_hosts_agree():
    commands = {name: args for name, _, args in kvfleet_commands()}
    api_port = flag(commands["api"], "--port")
    assert f"127.0.0.1:{api_port}:{api_port}" in map(substitute, SERVICES["api"]["ports"])
    assert flag(commands["api"], "--host") == "0.0.0.0"
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert jobs["kvfleet-api"]["static_configs"][0]["targets"] == [f"api:{api_port}"]
    workers = jobs["kvfleet-workers"]["dns_sd_configs"][0]
    assert workers["names"] == ["worker", "worker-tp2"]
    assert str(workers["port"]) == flag(commands["worker"], "--metrics-port") == flag(commands["worker-tp2"],
                                                                                      "--metrics-port")
    mounted = SERVICES["prometheus"]["volumes"][0].split(":")
    assert (ROOT / mounted[0]).resolve() == (ROOT / "deploy" / "prometheus.yml")
    assert mounted[1] == "/etc/prometheus/prometheus.yml"
    for name in ("worker", "finalizer"):
        url = urlparse(flag(commands[name], "--redis-url"))
        assert (url.hostname, url.port) == ("redis", 6379)
    env = SERVICES["api"]["environment"]
    assert urlparse(env["KVFLEET_REDIS_URL"]).hostname == "redis"
    assert urlparse(env["KVFLEET_S3_ENDPOINT_URL"]).hostname == "minio"
    assert urlparse(env["KVFLEET_S3_ENDPOINT_URL"]).port == 9000


def test_the_default_output_bucket_is_created():
    bucket = urlparse(SERVICES["api"]["environment"]["KVFLEET_DEFAULT_OUTPUT"]).netloc
    init = " ".join(SERVICES["minio-init"]["command"])
    assert f"local/{bucket}" in init and "mc mb" in init
    assert SERVICES["api"]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"


def test_the_tensor_parallel_worker_reserves_as_many_gpus_as_it_spans():
    service = SERVICES["worker-tp2"]
    args = next(args for name, _, args in kvfleet_commands() if name == "worker-tp2")
    device = service["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["count"] == int(flag(args, "--tensor-parallel-size")) == 2
    assert service["profiles"] == ["tp2"]  # opt-in: the one-GPU worker is the default
    assert service["shm_size"] and service["volumes"] == SERVICES["worker"]["volumes"]


def test_the_model_is_mounted_where_the_worker_reads_it():
    args = next(args for name, _, args in kvfleet_commands() if name == "worker")
    mounts = [substitute(v).split(":") for v in SERVICES["worker"]["volumes"]]
    assert any(target == flag(args, "--model") for _, target, *_ in mounts)


@pytest.mark.parametrize("module", ["producers.api", "workers", "workers.finalizer"])
def test_dockerfile_ships_every_package_a_command_needs(module):
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("engine", "kvfleet_kernels", "jobs", "producers", "workers", "kvfleet", "grammar_support"):
        assert f"COPY {package} ./{package}" in dockerfile
    assert module.split(".")[0] in dockerfile


def test_nothing_with_an_empty_key_or_default_credentials_is_published_beyond_this_host():
    published = {name: [substitute(str(port)) for port in service.get("ports", [])]
                 for name, service in SERVICES.items()}
    assert published["api"] and published["grafana"] and published["minio"]
    for name, ports in published.items():
        for port in ports:
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} to the network by default"


def test_the_image_runs_as_a_non_root_user_on_a_pinned_base():
    dockerfile = (ROOT / "Dockerfile").read_text()
    [base] = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+|[^@]+@sha256:[0-9a-f]{64}", base), base
    [user] = re.findall(r"^USER (\S+)", dockerfile, re.M)
    assert user not in ("root", "0") and dockerfile.index("USER") > dockerfile.rindex("RUN pip install")


def test_the_api_takes_tenants_and_retention_from_the_environment_and_their_defaults_start_it():
    environment = {name: substitute(str(value)) for name, value in SERVICES["api"]["environment"].items()}
    for name in ("KVFLEET_API_KEYS", "KVFLEET_ADMIN_KEY", "KVFLEET_DEFAULT_RETENTION"):
        assert name in environment, name
    # The defaults (all empty) are what an API with no tenants reads: one open team, files kept.
    assert key_ring_from_env(environment).is_open and default_retention(environment) is None
