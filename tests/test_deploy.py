"""The deployment files: Dockerfile, compose.yaml (and its .env), the Kubernetes overlays, the
autoscaling example and the Grafana dashboard.

Each is checked by a real implementation (hadolint and BuildKit's Dockerfile parser,
docker-compose, kustomize and the Kubernetes schemas), every environment variable they set is one
the services read, and the start commands of the cpu profile and the cpu overlay are run as plain
processes on 127.0.0.1 (addresses, model and cache swapped for local ones; the overlay's DNS names
resolve to 127.0.0.1), become healthy and serve a request end to end. Plain ``docker compose up``
starts the GPU stack, ``--profile cpu`` the CPU one; the gateway alone publishes its gRPC and HTTP
ports. The expert-parallel variants (compose profile ``gpu-ep``, overlay ``gpu-ep``) give each
prefill and decode ``--ep N`` and exactly N GPUs, and fix their ranks' internal ports; their compose
start commands run too, on the CPU over gloo with the tiny DeepSeekMoE. Network policies open the
engines' internal ports to pdserve pods only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dockerfile  # type: ignore[import-not-found]
import kubernetes_validate  # type: ignore[import-untyped]
import psutil
import pytest

from pdserve.config import DecodeConfig, GatewayConfig, PrefillConfig, flags
from pdserve.config.ep_ports import ep_port_range, ep_rank_ports
from pdserve.rpc.health_client import poll_until_serving
from tests import deploy_tools
from tests.grpc_client import generate_many, make_request
from tests.stack import REPO_ROOT, TEST_TOKEN, free_port, scrape, service_env

CONFIGS: dict[str, type] = {"prefill": PrefillConfig, "decode": DecodeConfig, "gateway": GatewayConfig}
# Read by the libraries the services run (NCCL), not by pdserve's own settings.
LIBRARY_VARIABLES = {"NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_HOSTID", "NCCL_P2P_DISABLE"}
PORT_VARIABLES = ("PDSERVE_PORT", "PDSERVE_METRICS_PORT", "PDSERVE_KV_PORT", "PDSERVE_HTTP_PORT")
TOKEN_FILE_VARIABLE = "PDSERVE_INTERNAL_TOKEN_FILE"
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
OVERLAYS = REPO_ROOT / "deploy" / "k8s" / "overlays"
# Compose profile or kustomize overlay -> the image target it runs.
VARIANTS = {"cpu": "cpu", "gpu": "gpu", "gpu-ep": "gpu"}
# What each variant's start commands run as on this machine: the model of its family.
LOCAL_MODELS = {"cpu": "tiny-llama", "gpu-ep": "tiny-deepseek-moe"}
# `docker compose [--profile P] up` -> the variant it starts: plain `up` is the GPU stack.
COMPOSE_UPS = {(): "gpu", ("cpu",): "cpu", ("gpu-ep",): "gpu-ep"}
GATEWAY_PORTS = {50051, 8000}  # published by every compose stack, on the same host ports


@dataclass
class Start:
    """One container's start command, as a deployment file states it."""

    name: str
    reach: str  # the host name the other containers use for it
    argv: list[str]
    env: dict[str, str]  # a value the platform fills in (the pod IP) is ""
    health: list[str]  # the health command, run inside the container
    grace_s: float = 0.0  # SIGTERM to SIGKILL
    extra: dict[str, Any] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()  # other names that reach it (a headless Service's)

    @property
    def service(self) -> str:
        return self.argv[1]

    @property
    def ep(self) -> int:
        """The expert-parallel group size its command gives (1 without ``--ep``)."""
        options = self.argv[2:]
        if not options:
            return 1
        assert self.service in ("prefill", "decode"), f"{self.name}: only engines take --ep"
        assert options[0] == "--ep" and len(options) == 2, (
            f"{self.name}: {self.argv}: the group size is the only option, other settings belong in "
            "the environment"
        )
        assert options[1].isdigit() and int(options[1]) >= 2, f"{self.name}: --ep {options[1]}"
        return int(options[1])


def read_variables() -> dict[str, set[str]]:
    """Per service, the environment variables it reads: its settings, and those read in code."""
    in_code = set()
    packages = ("pdserve", "prefill_service", "decode_service", "gateway")
    for path in (p for package in packages for p in (REPO_ROOT / package).rglob("*.py")):
        in_code.update(re.findall(r"environ(?:\.get\(|\[)\"(PDSERVE_[A-Z_]+)\"", path.read_text()))
    return {name: set(flags.env_names(cls)) | in_code for name, cls in CONFIGS.items()}


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' internal token as a file: what a secret mounted into a container is here."""
    path = tmp_path_factory.mktemp("secrets") / "internal-token"
    path.write_text(TEST_TOKEN + "\n")
    return path


def parse_duration_s(text: str) -> float:
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"unreadable duration {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


# --- compose -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tools() -> Path:
    return deploy_tools.tool_env()


@pytest.fixture(scope="module")
def compose(tools: Path) -> dict[str, Any]:
    return deploy_tools.compose_config(tools, REPO_ROOT / "compose.yaml", tuple(VARIANTS))


@pytest.fixture(scope="module")
def compose_ups(tools: Path) -> dict[tuple[str, ...], list[str]]:
    """The services each `docker compose [--profile P] up` starts, as docker-compose chooses them."""
    return {
        given: deploy_tools.compose_up_services(tools, REPO_ROOT / "compose.yaml", given)["services"]
        for given in COMPOSE_UPS
    }


def compose_starts(config: dict[str, Any], profile: str) -> list[Start]:
    """The services of a profile's stack."""
    return compose_services(
        config, [n for n, svc in config["services"].items() if profile in svc["profiles"]]
    )


def compose_services(config: dict[str, Any], names: list[str]) -> list[Start]:
    starts = []
    for name, svc in sorted(config["services"].items()):
        if name not in names:
            continue
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD", f"{name}: the health check runs a command without a shell"
        starts.append(
            Start(
                name,
                name,
                list(svc["command"]),
                {k: str(v) for k, v in svc["environment"].items()},
                list(test[1:]),
                parse_duration_s(svc["stop_grace_period"]),
                svc,
            )
        )
    return starts


def test_plain_compose_up_is_the_gpu_stack_and_each_profile_its_own(
    compose: dict[str, Any], compose_ups: dict[tuple[str, ...], list[str]]
) -> None:
    assert sorted(compose_ups[()]) == ["decode", "gateway", "prefill"], "plain `docker compose up`"
    for given, variant in COMPOSE_UPS.items():
        assert sorted(compose_ups[given]) == sorted(s.name for s in compose_starts(compose, variant)), given
        gpus = [s for s in compose_services(compose, compose_ups[given]) if "deploy" in s.extra]
        assert sorted(s.service for s in gpus) == ([] if variant == "cpu" else ["decode", "prefill"]), given
    assert not set(compose_ups[("cpu",)]) & set(compose_ups[()]), "--profile cpu starts no GPU service"


@pytest.mark.parametrize("given", list(COMPOSE_UPS))
def test_compose_ups_run_the_three_services(
    compose: dict[str, Any], compose_ups: dict[tuple[str, ...], list[str]], given: tuple[str, ...]
) -> None:
    starts = compose_services(compose, compose_ups[given])
    assert sorted(s.service for s in starts) == ["decode", "gateway", "prefill"]
    for start in starts:
        svc = start.extra
        # Only the gateway is published: its gRPC and HTTP ports, on the same host ports.
        published = {(p["published"], p["target"]) for p in svc.get("ports", [])}
        if start.service == "gateway":
            served = {int(start.env["PDSERVE_PORT"]), int(start.env["PDSERVE_HTTP_PORT"])}
            assert published == {(port, port) for port in GATEWAY_PORTS} and served == GATEWAY_PORTS
            assert {d: c["condition"] for d, c in svc["depends_on"].items()} == {
                s.name: "service_healthy" for s in starts if s.service != "gateway"
            }
        else:
            assert not published, f"{start.name}: internal ports stay unpublished"
        assert start.grace_s > float(start.env["PDSERVE_GRACE_S"]), start.name
    # The gateway tokenizes for the model the engines run.
    assert len({s.env["PDSERVE_MODEL"] for s in starts}) == 1, given


@pytest.mark.parametrize("profile", ["gpu", "gpu-ep"])
def test_compose_gpu_profiles_give_each_engine_its_own_gpus(compose: dict[str, Any], profile: str) -> None:
    starts = {s.service: s for s in compose_starts(compose, profile)}
    assert "deploy" not in starts["gateway"].extra, "the gateway needs no GPU"
    # One host id: NCCL moves the KV between the two containers through their shared memory.
    assert starts["prefill"].env["NCCL_HOSTID"] == starts["decode"].env["NCCL_HOSTID"] != ""
    # ...and not over peer-to-peer, closed between containers that see only their own GPUs.
    assert starts["prefill"].env["NCCL_P2P_DISABLE"] == starts["decode"].env["NCCL_P2P_DISABLE"] == "1"
    device_ids = {}
    for name in ("prefill", "decode"):
        start = starts[name]
        (devices,) = start.extra["deploy"]["resources"]["reservations"]["devices"]
        assert devices["driver"] == "nvidia" and devices["capabilities"] == ["gpu"], start.name
        device_ids[name] = set(devices["device_ids"])
        # The group is as large as the GPUs it sees, one rank per GPU (rank r on cuda:r).
        assert len(device_ids[name]) == len(devices["device_ids"]) == start.ep, start.name
        assert start.env["PDSERVE_DEVICE"] == ("cuda" if start.ep > 1 else "cuda:0"), start.name
        assert start.env["PDSERVE_KV_BACKEND"] == "nccl"
        assert start.extra["ulimits"]["memlock"] == -1, f"{start.name}: NCCL pins memory"
    assert not device_ids["prefill"] & device_ids["decode"], "prefill and decode must have GPUs of their own"
    # One IPC namespace and one sized /dev/shm for the two of them.
    prefill, decode = starts["prefill"].extra, starts["decode"].extra
    assert prefill["ipc"] == "shareable" and prefill["shm_size"]
    assert decode["ipc"] == f"service:{starts['prefill'].name}"
    if profile == "gpu-ep":
        assert {starts[name].ep for name in ("prefill", "decode")} == {2}
        assert parse_bytes(prefill["shm_size"]) >= 16 << 30, "NCCL among four ranks needs a large /dev/shm"
        # DeepSeekMoE by default: the preset of DeepSeekMoE-16B's shapes.
        assert {s.env["PDSERVE_MODEL"] for s in starts.values()} == {"deepseek-moe-16b-shape"}
        # The ranks' internal ports are fixed, never chosen at random.
        assert all(int(starts[name].env["PDSERVE_EP_PORT_BASE"]) > 0 for name in ("prefill", "decode"))


def parse_bytes(text: str | int) -> int:
    units = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    match = re.fullmatch(r"(\d+)([bkmg]?)b?", str(text).lower())
    assert match, f"unreadable size {text!r}"
    return int(match.group(1)) * units[match.group(2)]


def test_compose_sets_only_variables_the_services_read(compose: dict[str, Any], token_file: Path) -> None:
    read = read_variables()
    for profile in VARIANTS:
        for start in compose_starts(compose, profile):
            assert start.argv[:2] == ["pdserve", start.service] and start.ep >= 1, start.name
            unknown = set(start.env) - read[start.service] - LIBRARY_VARIABLES
            assert not unknown, f"{start.name} sets variables that {start.service} does not read: {unknown}"
            assert_env_builds_a_config(start, token_file)


def test_compose_and_k8s_give_every_service_the_internal_token_from_a_secret(
    compose: dict[str, Any], overlays: dict[str, list[dict[str, Any]]]
) -> None:
    assert compose["secrets"]["internal-token"]["file"].endswith("secrets/internal-token")
    for profile in VARIANTS:
        for start in compose_starts(compose, profile):
            assert start.env[TOKEN_FILE_VARIABLE] == "/run/secrets/internal-token", start.name
            assert [s["source"] for s in start.extra["secrets"]] == ["internal-token"], start.name
    for overlay, resources in overlays.items():
        for start in k8s_starts(resources):
            pod = start.extra["spec"]["template"]["spec"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
            assert volumes["internal-token"]["secret"]["secretName"] == "pdserve-internal-token"
            path = Path(mounts["internal-token"]["mountPath"]) / "internal-token"
            assert start.env[TOKEN_FILE_VARIABLE] == str(path), (overlay, start.name)


def test_env_example_documents_what_compose_reads(compose: dict[str, Any]) -> None:
    """.env.example sets every variable compose.yaml interpolates (and .env's profile); .env makes
    plain `up` the GPU stack."""
    text = (REPO_ROOT / "compose.yaml").read_text()
    interpolated = set(re.findall(r"\$\{([A-Z_]+)(?::?-[^}]*)?\}", text))
    example = dict(
        line.split("=", 1)
        for line in (REPO_ROOT / ".env.example").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    assert interpolated | {"COMPOSE_PROFILES"} == set(example), sorted(interpolated ^ set(example))
    assert {"PDSERVE_MODEL", "PREFILL_GPU", "DECODE_GPU", "PDSERVE_API_KEY"} <= set(example)
    env = dict(
        line.split("=", 1)
        for line in (REPO_ROOT / ".env").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    assert env == {"COMPOSE_PROFILES": "gpu"} and example["COMPOSE_PROFILES"] == "gpu"


def assert_env_builds_a_config(start: Start, token_file: Path) -> None:
    """The settings and options parse and validate as the service's config (a filled-in pod IP
    stands in, and ``token_file`` for the secret's)."""
    env = {k: v or "10.0.0.7" for k, v in start.env.items()}
    if TOKEN_FILE_VARIABLE in env:
        env[TOKEN_FILE_VARIABLE] = str(token_file)
    parser = argparse.ArgumentParser(exit_on_error=False)
    flags.add_arguments(parser, CONFIGS[start.service], env)
    try:
        args = parser.parse_args(start.argv[2:])
    except argparse.ArgumentError as exc:
        raise AssertionError(f"{start.name}: `{' '.join(start.argv)}`: {exc}") from exc
    flags.build(CONFIGS[start.service], args)


# --- Kubernetes ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def overlays() -> dict[str, list[dict[str, Any]]]:
    return {name: deploy_tools.kustomize(OVERLAYS / name) for name in VARIANTS}


def k8s_starts(resources: list[dict[str, Any]]) -> list[Start]:
    starts = []
    for res in resources:
        if res["kind"] not in ("Deployment", "StatefulSet"):
            continue
        name = res["metadata"]["name"]
        pod = res["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert "command" not in container, f"{name}: the image's entrypoint (tini) stays"
        reach = f"{name}-0.{res['spec']['serviceName']}" if res["kind"] == "StatefulSet" else name
        env = {e["name"]: str(e.get("value", "")) for e in container["env"]}
        port = container["readinessProbe"]["grpc"]["port"]
        health = ["pdserve", "health", f"127.0.0.1:{port}"]
        aliases = (res["spec"]["serviceName"],) if res["kind"] == "StatefulSet" else ()
        grace = pod["terminationGracePeriodSeconds"]
        starts.append(Start(name, reach, list(container["args"]), env, health, grace, res, aliases))
    return starts


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", list(VARIANTS))
def test_k8s_overlays_validate_against_the_schemas(
    overlays: dict[str, list[dict[str, Any]]], overlay: str, version: str
) -> None:
    for res in overlays[overlay]:
        kubernetes_validate.validate(res, version, strict=True)


@pytest.mark.parametrize("overlay", list(VARIANTS))
def test_k8s_workloads(overlays: dict[str, list[dict[str, Any]]], overlay: str, token_file: Path) -> None:
    resources = overlays[overlay]
    services = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Service"}
    starts = {s.service: s for s in k8s_starts(resources)}
    read = read_variables()
    assert sorted(starts) == ["decode", "gateway", "prefill"]
    for start in starts.values():
        assert start.argv[:2] == ["pdserve", start.service] and start.ep >= 1, start.name
        unknown = set(start.env) - read[start.service] - LIBRARY_VARIABLES
        assert not unknown, f"{start.name} sets variables that {start.service} does not read: {unknown}"
        assert_env_builds_a_config(start, token_file)
        pod = start.extra["spec"]["template"]["spec"]
        container = pod["containers"][0]
        port = int(start.env["PDSERVE_PORT"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == port, f"{start.name} {probe}"
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        assert start.grace_s >= float(pre_stop[1]) + float(start.env["PDSERVE_GRACE_S"]) + 5, start.name
        assert pod["securityContext"]["runAsNonRoot"] is True
        advertise = [e for e in container["env"] if e["name"] == "PDSERVE_ADVERTISE_HOST"]
        assert advertise == [
            {"name": "PDSERVE_ADVERTISE_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        ]
    for name in ("prefill", "decode"):
        sts = starts[name].extra
        assert sts["kind"] == "StatefulSet"
        assert services[sts["spec"]["serviceName"]]["spec"]["clusterIP"] == "None", "a headless Service"
        mounts = {m["mountPath"] for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
        assert "/dev/shm" in mounts
    # The gateway tokenizes for the model the engines run.
    assert len({s.env["PDSERVE_MODEL"] for s in starts.values()}) == 1
    if overlay == "gpu-ep":
        claims = {r["metadata"]["name"] for r in resources if r["kind"] == "PersistentVolumeClaim"}
        for start in starts.values():
            pod = start.extra["spec"]["template"]["spec"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            by_path = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
            assert by_path["/models"]["readOnly"] is True, start.name
            claim = volumes[by_path["/models"]["name"]]["persistentVolumeClaim"]["claimName"]
            assert claim in claims, f"{start.name}: no PersistentVolumeClaim {claim}"
            assert start.env["PDSERVE_MODEL"].startswith("/models/"), start.name
    rendezvous = starts["prefill"].extra["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert {
        "name": "kv-rendezvous",
        "containerPort": int(starts["prefill"].env["PDSERVE_KV_PORT"]),
    } in rendezvous
    decode_pod = starts["decode"].extra["spec"]["template"]["spec"]
    if overlay != "cpu":
        for name in ("prefill", "decode"):
            start = starts[name]
            pod = start.extra["spec"]["template"]["spec"]
            resources_ = pod["containers"][0]["resources"]
            # One rank per GPU of the pod: --ep and nvidia.com/gpu are the same number.
            assert resources_["limits"]["nvidia.com/gpu"] == start.ep, start.name
            assert resources_["requests"]["nvidia.com/gpu"] == start.ep, start.name
            assert start.env["PDSERVE_DEVICE"] == ("cuda" if start.ep > 1 else "cuda:0"), start.name
            (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
            assert dshm["emptyDir"]["medium"] == "Memory", start.name
            assert parse_bytes(dshm["emptyDir"]["sizeLimit"].removesuffix("i")) >= (4 << 30) * start.ep
        if overlay == "gpu-ep":
            assert {starts[name].ep for name in ("prefill", "decode")} == {2}
        (term,) = decode_pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert (
            term["labelSelector"]["matchLabels"] == starts["prefill"].extra["spec"]["selector"]["matchLabels"]
        )


def ports_of(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def allows(rule_ports: list[dict[str, Any]], name: str, number: int) -> bool:
    """Whether a NetworkPolicy rule's ports take the container port ``name``/``number``."""
    return any(
        p["port"] == name
        or (isinstance(p["port"], int) and p["port"] <= number <= p.get("endPort", p["port"]))
        for p in rule_ports
    )


@pytest.mark.parametrize("overlay", list(VARIANTS))
def test_k8s_gateway_serves_http_and_finds_the_engines_by_dns(
    overlays: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    resources = overlays[overlay]
    services = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Service"}
    starts = {s.service: s for s in k8s_starts(resources)}
    gateway = starts["gateway"]
    (container,) = gateway.extra["spec"]["template"]["spec"]["containers"]
    assert ports_of(container)["http"] == int(gateway.env["PDSERVE_HTTP_PORT"]) == 8000
    by_name = {p["name"]: p for p in services["pdserve-gateway"]["spec"]["ports"]}
    assert (by_name["http"]["port"], by_name["grpc"]["port"]) == (8000, 50051)
    # Every ready pod of each StatefulSet, by its headless Service's name: scaling needs no edit.
    for role, variable in (("prefill", "PDSERVE_PREFILL"), ("decode", "PDSERVE_DECODE")):
        sts = starts[role].extra
        service = services[sts["spec"]["serviceName"]]
        assert service["spec"]["clusterIP"] == "None" and not service["spec"].get("publishNotReadyAddresses")
        port = int(starts[role].env["PDSERVE_PORT"])
        assert gateway.env[variable] == f"dns:///{service['metadata']['name']}:{port}"


@pytest.mark.parametrize("overlay", list(VARIANTS))
def test_k8s_network_policies_open_internal_ports_to_pdserve_pods_only(
    overlays: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    resources = overlays[overlay]
    policies = [r for r in resources if r["kind"] == "NetworkPolicy"]
    pdserve_pods = [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pdserve"}}}]
    for start in k8s_starts(resources):
        template = start.extra["spec"]["template"]
        labels = template["metadata"]["labels"]
        (container,) = template["spec"]["containers"]
        (policy,) = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        assert policy["spec"]["policyTypes"] == ["Ingress"], start.name
        rules = policy["spec"]["ingress"]
        declared = ports_of(container)
        if start.service == "gateway":
            # The public face: anyone, on its gRPC, HTTP and metrics ports.
            (rule,) = rules
            assert "from" not in rule and all(allows(rule["ports"], n, p) for n, p in declared.items())
            continue
        internal = {n: p for n, p in declared.items() if "metrics" not in n}
        expected = {"grpc", "kv-rendezvous"} if start.service == "prefill" else {"grpc"}
        if start.ep > 1:  # the ranks' fixed ports, from the base every rank derives them from
            base = int(start.env["PDSERVE_EP_PORT_BASE"])
            expected |= {"ep0-grpc", "ep-store", "ep1-grpc"} | (
                {"ep1-kv"} if start.service == "prefill" else set()
            )
            block = ep_rank_ports(base, 1)
            assert declared["ep0-grpc"] == base and declared["ep-store"] == ep_rank_ports(base, 0).group_store
            assert (declared["ep1-grpc"], declared["ep1-metrics"]) == (block.grpc, block.metrics)
            assert set(declared.values()) - {
                declared[n] for n in ("grpc", "metrics", "kv-rendezvous") if n in declared
            } <= set(ep_port_range(base, start.ep))
        assert set(internal) == expected, start.name
        for name, number in internal.items():
            opened = [r for r in rules if allows(r["ports"], name, number)]
            assert opened and all(r["from"] == pdserve_pods for r in opened), f"{start.name} {name}"
        # gloo and NCCL listen on ephemeral ports after the rendezvous: open to pdserve pods only.
        (transport,) = [r for r in rules if r["from"] == pdserve_pods]
        assert allows(transport["ports"], "", 32768) and allows(transport["ports"], "", 60999)
        # Metrics for Prometheus from any namespace; nothing else is open to it.
        (scrape_rule,) = [r for r in rules if r["from"] != pdserve_pods]
        assert scrape_rule["from"] == [{"namespaceSelector": {}}]
        assert {p["port"] for p in scrape_rule["ports"]} == {n for n in declared if "metrics" in n}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    match = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    expressions = all(
        labels.get(e["key"]) in e["values"]
        for e in selector.get("matchExpressions", [])
        if e["operator"] == "In"
    )
    return match and expressions


AUTOSCALING = REPO_ROOT / "deploy" / "k8s" / "examples" / "autoscaling"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_autoscaling_example_scales_the_engines_on_their_queues(
    overlays: dict[str, list[dict[str, Any]]], version: str
) -> None:
    hpas = deploy_tools.kustomize(AUTOSCALING)
    for hpa in hpas:
        kubernetes_validate.validate(hpa, version, strict=True)
    targets = {r["metadata"]["name"] for r in overlays["gpu"] if r["kind"] == "StatefulSet"}
    queues = {}
    for hpa in hpas:
        target = hpa["spec"]["scaleTargetRef"]
        assert target["kind"] == "StatefulSet" and target["name"] in targets
        ((metric,),) = [[m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]]
        queues[target["name"]] = metric
    assert queues == {
        "pdserve-prefill": "pdserve_prefill_waiting",
        "pdserve-decode": "pdserve_decode_waiting",
    }
    assert set(queues.values()) <= exported_families()
    # The adapter serves exactly those series; the prerequisites are written down with the example.
    import yaml

    rules = yaml.safe_load((AUTOSCALING / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    assert {r["name"]["as"] for r in rules} == set(queues.values())
    notes = (AUTOSCALING / "kustomization.yaml").read_text()
    assert "Prerequisites" in notes and "prometheus-adapter" in notes and "custom.metrics.k8s.io" in notes


def exported_families() -> set[str]:
    """The metric names (as scraped) of the gateway, prefill and decode registries."""
    from prometheus_client import CollectorRegistry

    from decode_service.metrics import DecodeMetrics
    from gateway.metrics import GatewayMetrics
    from prefill_service.metrics import PrefillMetrics

    names = set()
    registries = [CollectorRegistry() for _ in range(3)]
    GatewayMetrics(registries[0], "m", 2048)
    PrefillMetrics(registries[1])
    DecodeMetrics(registries[2])
    for registry in registries:
        for family in registry.collect():
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
            if family.type == "histogram":
                names.update(f"{family.name}_{suffix}" for suffix in ("bucket", "sum", "count"))
            if family.type == "counter":
                names.add(f"{family.name}_total")
    return names


def test_grafana_dashboard_reads_only_metrics_pdserve_exports() -> None:
    dashboard = json.loads((REPO_ROOT / "deploy" / "grafana" / "pdserve-dashboard.json").read_text())
    exported = exported_families()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    used = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bpdserve_[a-z0-9_]+", target["expr"]))
            assert names and names <= exported, (panel["title"], names - exported)
            used |= names
    request_level = {
        "pdserve_e2e_request_latency_seconds_bucket",
        "pdserve_time_to_first_token_seconds_bucket",
        "pdserve_inter_token_latency_seconds_bucket",
        "pdserve_request_time_per_output_token_seconds_bucket",
        "pdserve_request_queue_time_seconds_bucket",
        "pdserve_request_prompt_tokens_bucket",
        "pdserve_request_generation_tokens_bucket",
        "pdserve_request_success_total",
        "pdserve_decode_kv_cache_usage_ratio",
        "pdserve_prefill_waiting",
    }
    assert request_level <= used, request_level - used
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "model_name"}


# --- Dockerfile ----------------------------------------------------------------------------------


def test_dockerfile_lints_and_builds_both_targets_as_a_non_root_user(
    tools: Path, compose: dict[str, Any], overlays: dict[str, list[dict[str, Any]]]
) -> None:
    lint = deploy_tools.hadolint(tools, REPO_ROOT / "Dockerfile")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    commands = dockerfile.parse_file(str(REPO_ROOT / "Dockerfile"))
    defaults = dict(c.value[0].split("=", 1) for c in commands if c.cmd == "ARG" and "=" in c.value[0])
    stages: dict[str, list[Any]] = {}
    current: list[Any] = []
    for command in commands:
        if command.cmd == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], command.value[0])
            assert re.search(r":\d[\w.-]*$", image), f"base image {image} is not pinned to a version"
            current = stages.setdefault(command.value[2], [])
        current.append(command)
    for target in ("cpu", "gpu"):
        entrypoints = [list(c.value) for c in stages[target] if c.cmd == "ENTRYPOINT"]
        assert entrypoints[-1] == ["tini", "--"], f"{target}: an init process forwards the signals"
        users = [c.value[0] for c in stages[target] if c.cmd == "USER"]
        assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0", target
        volumes = [v for c in stages[target] if c.cmd == "VOLUME" for v in c.value]
        assert "/var/cache/pdserve" in volumes
    for command in commands:
        if command.cmd == "COPY" and not any(f.startswith("--from") for f in command.flags):
            for source in command.value[:-1]:
                assert (REPO_ROOT / source).exists(), source
                assert not re.search(r"safetensors|gguf|models?/", source), f"{source}: no model in the image"
    # Each build stage copies every package the project installs (pyproject's package list).
    packages = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["packages"])
    for target in ("cpu-build", "gpu-build"):
        copied = {c.value[0] for c in stages[target] if c.cmd == "COPY"}
        assert packages <= copied, f"{target} does not copy {sorted(packages - copied)}"
    # compose builds these targets; the overlays run the images tagged by them.
    assert {svc["build"]["target"] for svc in compose["services"].values()} == {"cpu", "gpu"}
    assert all(svc["image"] == f"pdserve:{svc['build']['target']}" for svc in compose["services"].values())
    for overlay, resources in overlays.items():
        images = {
            c["image"]
            for r in resources
            if "template" in r.get("spec", {})
            for c in r["spec"]["template"]["spec"]["containers"]
        }
        assert images == {f"pdserve:{VARIANTS[overlay]}"}


# --- the start commands as processes --------------------------------------------------------------


def localize(
    starts: list[Start], cache_dir: Path, model: str, token_file: Path
) -> list[tuple[Start, dict[str, str], list[str]]]:
    """Each start with its addresses on 127.0.0.1 (fresh ports, a fresh block for the ranks of an
    expert-parallel group), ``model``, the test cache and ``token_file`` for its secret; GPU
    settings swapped for the CPU and gloo (NCCL's own variables dropped)."""
    ports: dict[tuple[str, int], int] = {}
    for start in starts:
        for key in PORT_VARIABLES:
            if key in start.env:
                port = free_port()
                for name in (start.reach, *start.aliases):
                    ports[(name, int(start.env[key]))] = port

    def local(address: str, reach: str | None = None) -> str:
        by_name = address.startswith("dns:///")
        host, _, port = address.removeprefix("dns:///").rpartition(":")
        key = (reach or host, int(port))
        assert key in ports, f"{address}: no service of this file is reached there ({sorted(ports)})"
        # A name resolves for real: localhost is 127.0.0.1 here.
        return f"dns:///localhost:{ports[key]}" if by_name else f"127.0.0.1:{ports[key]}"

    runs = []
    for start in starts:
        env = {k: v for k, v in start.env.items() if k not in LIBRARY_VARIABLES}
        env.update(PDSERVE_HOST="127.0.0.1", PDSERVE_ADVERTISE_HOST="127.0.0.1")
        env.update(PDSERVE_MODEL=model, PDSERVE_CACHE_DIR=str(cache_dir))
        assert TOKEN_FILE_VARIABLE in env, f"{start.name}: no internal token"
        env.update({TOKEN_FILE_VARIABLE: str(token_file), "PDSERVE_INTERNAL_TOKEN": ""})
        if "PDSERVE_DEVICE" in env:
            env.update(PDSERVE_DEVICE="cpu", PDSERVE_KV_BACKEND="gloo", PDSERVE_THREADS="1")
        for key in PORT_VARIABLES:
            if key in env:
                env[key] = str(ports[(start.reach, int(env[key]))])
        if int(env.get("PDSERVE_EP_PORT_BASE", 0)):
            env["PDSERVE_EP_PORT_BASE"] = str(free_port_block(len(ep_port_range(1, start.ep))))
        for key in ("PDSERVE_PREFILL", "PDSERVE_DECODE"):
            if key in env:
                env[key] = ",".join(local(a) for a in env[key].split(","))
        health = [*start.health[:-1], local(start.health[-1], start.reach)]
        runs.append((start, env, health))
    return runs


def free_port_block(size: int) -> int:
    """The first of ``size`` consecutive ports of 127.0.0.1 that nothing listens on right now."""
    for _ in range(50):
        base = free_port()
        if base + size > 65535:
            continue
        socks = []
        try:
            for port in range(base, base + size):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise AssertionError("no block of free ports")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("source", "variant"), [("compose", "cpu"), ("k8s", "cpu"), ("compose", "gpu-ep")])
def test_start_commands_run_as_plain_processes(
    source: str,
    variant: str,
    request: pytest.FixtureRequest,
    cache_dir: Path,
    tmp_path: Path,
    processes: list[subprocess.Popen[str]],
    token_file: Path,
) -> None:
    if source == "compose":
        starts = compose_starts(request.getfixturevalue("compose"), variant)
    else:
        starts = k8s_starts(request.getfixturevalue("overlays")[variant])
    runs = localize(starts, cache_dir, LOCAL_MODELS[variant], token_file)
    for start, env, _ in runs:
        assert start.argv[0] == "pdserve"
        log = (tmp_path / f"{start.name}.log").open("w")
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "pdserve", *start.argv[1:]],
                env={**service_env(cache_dir), **env},
                stdout=subprocess.DEVNULL,
                stderr=log,
                text=True,
                cwd=REPO_ROOT,
            )
        )
    by_service = {}
    for (start, env, health), proc in zip(runs, processes, strict=True):
        status = poll_until_serving(health[-1], timeout_s=180)
        assert status == "SERVING", (
            f"{start.name}: {status}\n{(tmp_path / f'{start.name}.log').read_text()[-3000:]}"
        )
        assert proc.poll() is None
        done = subprocess.run([sys.executable, "-m", *health], capture_output=True, text=True, cwd=REPO_ROOT)
        assert (done.returncode, done.stdout.strip()) == (0, "SERVING"), f"{start.name}: {health}"
        by_service[start.service] = env

    # An expert-parallel service is its command's process and the ranks it started, each serving
    # on the fixed ports of its block.
    ranks: dict[str, list[psutil.Process]] = {}
    for (start, env, _), proc in zip(runs, processes, strict=True):
        if start.ep > 1:
            ranks[start.name] = psutil.Process(proc.pid).children(recursive=True)
            assert len(ranks[start.name]) >= start.ep - 1, f"{start.name}: ranks {ranks[start.name]}"
            base = int(env["PDSERVE_EP_PORT_BASE"])
            for rank in range(start.ep):
                block = ep_rank_ports(base, rank)
                assert poll_until_serving(f"127.0.0.1:{block.grpc}", timeout_s=10) == "SERVING", (start, rank)
                if rank:
                    assert (
                        "pdserve_decode_running" in scrape(f"127.0.0.1:{block.metrics}")
                        or start.service != "decode"
                    )
                    if start.service == "prefill":  # no rendezvous store: pairs meet over gRPC
                        with pytest.raises(OSError):
                            socket.create_connection(("127.0.0.1", block.kv), timeout=5).close()

    gateway = f"127.0.0.1:{by_service['gateway']['PDSERVE_PORT']}"
    http = f"http://127.0.0.1:{by_service['gateway']['PDSERVE_HTTP_PORT']}"
    with urllib.request.urlopen(f"{http}/health", timeout=10) as answer:
        assert answer.status == 200, "the gateway serves HTTP"
    requests = [
        make_request(prompt_token_ids=[5 + i, 6, 7 + 2 * i], max_tokens=8, temperature=0.0, ignore_eos=True)
        for i in range(4 if ranks else 1)
    ]
    for result in asyncio.run(generate_many(gateway, requests)):
        assert (len(result.token_ids), result.finish_reason) == (8, "length")
    prefill = scrape(f"127.0.0.1:{by_service['prefill']['PDSERVE_METRICS_PORT']}")
    assert prefill["pdserve_kv_parked_handles"] == 0
    decode = scrape(f"127.0.0.1:{by_service['decode']['PDSERVE_METRICS_PORT']}")
    assert decode["pdserve_decode_running"] == 0 and decode["pdserve_decode_waiting"] == 0

    for proc in reversed(processes):
        proc.send_signal(signal.SIGTERM)
    assert [proc.wait(30) for proc in processes] == [0] * len(processes)
    _, alive = psutil.wait_procs([c for children in ranks.values() for c in children], timeout=10)
    assert not alive, f"ranks outlived their service: {alive}"
