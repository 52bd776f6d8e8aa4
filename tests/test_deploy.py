"""The deployment files: Dockerfile, compose.yaml and the Kubernetes overlays.

Each is checked by a real implementation (hadolint and BuildKit's Dockerfile parser,
docker-compose, kustomize and the Kubernetes schemas), every environment variable they set is one
the services read, and the start commands of the cpu profile and the cpu overlay are run as plain
processes on 127.0.0.1 (addresses, model and cache swapped for local ones), become healthy and
serve a request end to end. The expert-parallel variants (compose profile ``gpu-ep``, overlay
``gpu-ep``) give each prefill and decode ``--ep N`` and exactly N GPUs; their compose start
commands run too, on the CPU over gloo with the tiny DeepSeekMoE.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dockerfile  # type: ignore[import-not-found]
import kubernetes_validate  # type: ignore[import-untyped]
import psutil
import pytest

from pdserve.config import DecodeConfig, GatewayConfig, PrefillConfig, flags
from pdserve.rpc.health_client import poll_until_serving
from tests import deploy_tools
from tests.grpc_client import generate_many, make_request
from tests.stack import REPO_ROOT, free_port, scrape, service_env

CONFIGS: dict[str, type] = {"prefill": PrefillConfig, "decode": DecodeConfig, "gateway": GatewayConfig}
# Read by the libraries the services run (NCCL), not by pdserve's own settings.
LIBRARY_VARIABLES = {"NCCL_SOCKET_IFNAME", "NCCL_DEBUG"}
PORT_VARIABLES = ("PDSERVE_PORT", "PDSERVE_METRICS_PORT", "PDSERVE_KV_PORT")
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
OVERLAYS = REPO_ROOT / "deploy" / "k8s" / "overlays"
# Compose profile or kustomize overlay -> the image target it runs.
VARIANTS = {"cpu": "cpu", "gpu": "gpu", "gpu-ep": "gpu"}
# What each variant's start commands run as on this machine: the model of its family.
LOCAL_MODELS = {"cpu": "tiny-llama", "gpu-ep": "tiny-deepseek-moe"}


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


def compose_starts(config: dict[str, Any], profile: str) -> list[Start]:
    starts = []
    for name, svc in sorted(config["services"].items()):
        if profile not in svc.get("profiles", []):
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


def test_compose_profiles_run_the_three_services(compose: dict[str, Any]) -> None:
    for profile in VARIANTS:
        starts = compose_starts(compose, profile)
        assert sorted(s.service for s in starts) == ["decode", "gateway", "prefill"]
        for start in starts:
            svc = start.extra
            # Only the gateway is published, on the port it serves.
            published = svc.get("ports", [])
            assert bool(published) == (start.service == "gateway"), start.name
            assert all(p["target"] == int(start.env["PDSERVE_PORT"]) for p in published), published
            if start.service == "gateway":
                assert {d: c["condition"] for d, c in svc["depends_on"].items()} == {
                    s.name: "service_healthy" for s in starts if s.service != "gateway"
                }
            assert start.grace_s > float(start.env["PDSERVE_GRACE_S"]), start.name
        # The gateway tokenizes for the model the engines run.
        assert len({s.env["PDSERVE_MODEL"] for s in starts}) == 1, profile


@pytest.mark.parametrize("profile", ["gpu", "gpu-ep"])
def test_compose_gpu_profiles_give_each_engine_its_own_gpus(compose: dict[str, Any], profile: str) -> None:
    starts = {s.service: s for s in compose_starts(compose, profile)}
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


def parse_bytes(text: str | int) -> int:
    units = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    match = re.fullmatch(r"(\d+)([bkmg]?)b?", str(text).lower())
    assert match, f"unreadable size {text!r}"
    return int(match.group(1)) * units[match.group(2)]


def test_compose_sets_only_variables_the_services_read(compose: dict[str, Any]) -> None:
    read = read_variables()
    for profile in VARIANTS:
        for start in compose_starts(compose, profile):
            assert start.argv[:2] == ["pdserve", start.service] and start.ep >= 1, start.name
            unknown = set(start.env) - read[start.service] - LIBRARY_VARIABLES
            assert not unknown, f"{start.name} sets variables that {start.service} does not read: {unknown}"
            assert_env_builds_a_config(start)


def assert_env_builds_a_config(start: Start) -> None:
    """The settings and options parse and validate as the service's config (a filled-in pod IP
    stands in)."""
    env = {k: v or "10.0.0.7" for k, v in start.env.items()}
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
        starts.append(
            Start(
                name, reach, list(container["args"]), env, health, pod["terminationGracePeriodSeconds"], res
            )
        )
    return starts


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", list(VARIANTS))
def test_k8s_overlays_validate_against_the_schemas(
    overlays: dict[str, list[dict[str, Any]]], overlay: str, version: str
) -> None:
    for res in overlays[overlay]:
        kubernetes_validate.validate(res, version, strict=True)


@pytest.mark.parametrize("overlay", list(VARIANTS))
def test_k8s_workloads(overlays: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    resources = overlays[overlay]
    services = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Service"}
    starts = {s.service: s for s in k8s_starts(resources)}
    read = read_variables()
    assert sorted(starts) == ["decode", "gateway", "prefill"]
    for start in starts.values():
        assert start.argv[:2] == ["pdserve", start.service] and start.ep >= 1, start.name
        unknown = set(start.env) - read[start.service] - LIBRARY_VARIABLES
        assert not unknown, f"{start.name} sets variables that {start.service} does not read: {unknown}"
        assert_env_builds_a_config(start)
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
    starts: list[Start], cache_dir: Path, model: str
) -> list[tuple[Start, dict[str, str], list[str]]]:
    """Each start with its addresses on 127.0.0.1 (fresh ports), ``model`` and the test cache; GPU
    settings swapped for the CPU and gloo (NCCL's own variables dropped)."""
    ports = {(s.reach, int(s.env[k])): free_port() for s in starts for k in PORT_VARIABLES if k in s.env}

    def local(address: str, reach: str | None = None) -> str:
        host, _, port = address.rpartition(":")
        key = (reach or host, int(port))
        assert key in ports, f"{address}: no service of this file is reached there ({sorted(ports)})"
        return f"127.0.0.1:{ports[key]}"

    runs = []
    for start in starts:
        env = {k: v for k, v in start.env.items() if k not in LIBRARY_VARIABLES}
        env.update(PDSERVE_HOST="127.0.0.1", PDSERVE_ADVERTISE_HOST="127.0.0.1")
        env.update(PDSERVE_MODEL=model, PDSERVE_CACHE_DIR=str(cache_dir))
        if "PDSERVE_DEVICE" in env:
            env.update(PDSERVE_DEVICE="cpu", PDSERVE_KV_BACKEND="gloo", PDSERVE_THREADS="1")
        for key in PORT_VARIABLES:
            if key in env:
                env[key] = str(ports[(start.reach, int(env[key]))])
        for key in ("PDSERVE_PREFILL", "PDSERVE_DECODE"):
            if key in env:
                env[key] = ",".join(local(a) for a in env[key].split(","))
        health = [*start.health[:-1], local(start.health[-1], start.reach)]
        runs.append((start, env, health))
    return runs


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
) -> None:
    if source == "compose":
        starts = compose_starts(request.getfixturevalue("compose"), variant)
    else:
        starts = k8s_starts(request.getfixturevalue("overlays")[variant])
    runs = localize(starts, cache_dir, LOCAL_MODELS[variant])
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

    # An expert-parallel service is its command's process and the ranks it started.
    ranks: dict[str, list[psutil.Process]] = {}
    for (start, _, _), proc in zip(runs, processes, strict=True):
        if start.ep > 1:
            ranks[start.name] = psutil.Process(proc.pid).children(recursive=True)
            assert len(ranks[start.name]) >= start.ep - 1, f"{start.name}: ranks {ranks[start.name]}"

    gateway = f"127.0.0.1:{by_service['gateway']['PDSERVE_PORT']}"
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
