"""Authentication and TLS through real processes.

- the internal token: every Prefill and Decode RPC of a real prefill and decode refuses a call
  without it or with a wrong one (UNAUTHENTICATED), health stays open; a service without a token
  refuses to start; a stack with mutual TLS serves and refuses a client without a certificate;
- the public API key and TLS: a gateway with ``--api-key``, ``--tls-cert``/``--tls-key`` and
  ``--reflection`` (certificate made at test time) in front of the shared stack's engines: gRPC and
  HTTP over TLS need the key, health stays open, a plaintext client fails, the CLI clients connect.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.rpc.channel_security import INTERNAL_TOKEN_KEY, ChannelSecurity
from pdserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2_grpc,
    kv_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
    sampling_pb2,
)
from tests import certificates
from tests.conftest import StackPool, assert_no_leaks
from tests.grpc_client import generate, make_request
from tests.stack import REPO_ROOT, TEST_TOKEN, ServiceProcess, Stack, service_env

MODEL = "tiny-llama"
GREEDY = sampling_pb2.SamplingParams(temperature=0.0, max_tokens=4)
API_KEY = "sk-auth-test"
REQUEST = make_request(prompt_token_ids=[5, 17, 99, 230], max_tokens=6, temperature=0.0, ignore_eos=True)


def _stack(stack_pool: StackPool) -> Stack:
    return stack_pool.get(MODEL)


# --- the internal token ----------------------------------------------------------------------------


def _internal_calls(stack: Stack, metadata: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """Every RPC of the Prefill and Decode services, made with ``metadata``: name -> its error."""
    handle = kv_pb2.KvHandle(id=b"\x01" * 16, prefill_address=stack.prefills[0].grpc)
    authorized = metadata == ((INTERNAL_TOKEN_KEY, TEST_TOKEN),)

    async def scenario() -> dict[str, Any]:
        errors: dict[str, Any] = {}
        security = ChannelSecurity(metadata)
        async with (
            security.aio_channel(stack.prefills[0].grpc) as p,
            security.aio_channel(stack.decodes[0].grpc) as d,
        ):
            prefill, decode = prefill_pb2_grpc.PrefillStub(p), decode_pb2_grpc.DecodeStub(d)
            calls = {
                "Prefill": lambda: prefill.Prefill(
                    prefill_pb2.PrefillRequest(request_id="t", prompt_token_ids=[1, 2, 3], sampling=GREEDY)
                ),
                "PullKv": lambda: prefill.PullKv(prefill_pb2.PullKvRequest(handle_id=handle.id)),
                "PullKvMany": lambda: prefill.PullKvMany(
                    prefill_pb2.PullKvManyRequest(handle_ids=[handle.id])
                ),
                "ReleaseKv": lambda: prefill.ReleaseKv(prefill_pb2.ReleaseKvRequest(handle_id=handle.id)),
                "Decode": lambda: _drain(decode.Decode(decode_pb2.DecodeRequest(kv_handle=handle))),
                # Refused on its metadata alone: a call that has not written yet reads the gate's
                # status (a write racing the refusal would end the client's call as INTERNAL).
                "DecodeMany": lambda: _drain(
                    decode.DecodeMany(
                        iter([decode_pb2.DecodeManyRequest(tag=1, start=decode_pb2.DecodeRequest())])
                    )
                    if authorized
                    else decode.DecodeMany()
                ),
            }
            for name, call in calls.items():
                try:
                    answer = await asyncio.wait_for(call(), 30)
                    errors[name] = None
                except grpc.aio.AioRpcError as exc:
                    errors[name] = exc
                if name == "Prefill" and errors[name] is None:  # served: give its KV back
                    released = await prefill.ReleaseKv(
                        prefill_pb2.ReleaseKvRequest(handle_id=answer.kv_handle.id)
                    )
                    assert released.released
            for channel in (p, d):
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert health.status == health_pb2.HealthCheckResponse.SERVING, "health stays open"
        return errors

    return asyncio.run(scenario())


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


@pytest.mark.parametrize(
    "metadata",
    [(), ((INTERNAL_TOKEN_KEY, "not-the-internal-token-at-all"),), ((INTERNAL_TOKEN_KEY, TEST_TOKEN[:-1]),)],
    ids=["missing", "wrong", "prefix"],
)
def test_every_internal_rpc_refuses_a_call_without_the_token(
    stack_pool: StackPool, metadata: tuple[tuple[str, str], ...]
) -> None:
    stack = _stack(stack_pool)
    errors = _internal_calls(stack, metadata)
    for name, error in errors.items():
        assert error is not None, f"{name} was served without the token"
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (name, error)
        assert TEST_TOKEN not in (error.details() or "")
    assert_no_leaks(stack)


def test_with_the_token_the_same_calls_reach_the_services(stack_pool: StackPool) -> None:
    """The gate lets them through to the servicers, which answer on their own terms; and the full
    stack (gateway -> prefill -> decode -> PullKv) serves."""
    stack = _stack(stack_pool)
    errors = _internal_calls(stack, ((INTERNAL_TOKEN_KEY, TEST_TOKEN),))
    assert errors["Prefill"] is None
    assert errors["ReleaseKv"] is None
    for name in ("PullKv", "PullKvMany", "Decode", "DecodeMany"):
        assert errors[name] is None or errors[name].code() != grpc.StatusCode.UNAUTHENTICATED, name
    result = asyncio.run(generate(stack.address, REQUEST))
    assert (len(result.token_ids), result.finish_reason) == (6, "length")
    assert_no_leaks(stack)


@pytest.mark.parametrize("service", ["prefill", "decode", "gateway", "colocated"])
def test_a_service_without_a_token_refuses_to_start(service: str, cache_dir: Path) -> None:
    env = {k: v for k, v in service_env(cache_dir).items() if k != "PDSERVE_INTERNAL_TOKEN"}
    args = (
        ["--model", MODEL, "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2"]
        if service == "gateway"
        else []
    )
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", service, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "needs an internal token" in done.stderr and "PDSERVE_INTERNAL_TOKEN" in done.stderr
    assert "--internal-token-file" in done.stderr


# --- mutual TLS between the services ----------------------------------------------------------------


@pytest.fixture(scope="module")
def mtls_stack(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Any]]:
    ca = certificates.authority(tmp_path_factory.mktemp("mtls"))
    tls = [
        *("--internal-tls-cert", str(ca.service.cert), "--internal-tls-key", str(ca.service.key)),
        *("--internal-tls-ca", str(ca.ca)),
    ]
    stack = Stack(
        MODEL,
        cache_dir,
        tmp_path_factory.mktemp("mtls-logs"),
        prefill_args=tls,
        decode_args=tls,
        gateway_args=tls,
    ).start()
    try:
        yield stack, ca
    finally:
        stack.stop()


def test_mutual_tls_stack_serves_and_refuses_a_client_without_a_certificate(
    mtls_stack: tuple[Stack, Any],
) -> None:
    stack, ca = mtls_stack
    result = asyncio.run(generate(stack.address, REQUEST))
    assert (len(result.token_ids), result.finish_reason) == (6, "length")
    token = ((INTERNAL_TOKEN_KEY, TEST_TOKEN),)
    trusted = ca.ca.read_bytes()
    no_cert = ChannelSecurity(token, tls=True, root_certificates=trusted)
    with_cert = ChannelSecurity(
        token,
        tls=True,
        root_certificates=trusted,
        private_key=ca.service.key.read_bytes(),
        certificate_chain=ca.service.cert.read_bytes(),
    )
    for service in (stack.prefills[0], stack.decodes[0]):
        for security in (ChannelSecurity(token), no_cert):  # plaintext, TLS without a certificate
            with security.channel(service.grpc) as channel, pytest.raises(grpc.RpcError) as refused:
                prefill_pb2_grpc.PrefillStub(channel).ReleaseKv(
                    prefill_pb2.ReleaseKvRequest(handle_id=b"\x00" * 16), timeout=10
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        with with_cert.channel(service.grpc) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    with with_cert.channel(stack.prefills[0].grpc) as channel:
        released = prefill_pb2_grpc.PrefillStub(channel).ReleaseKv(
            prefill_pb2.ReleaseKvRequest(handle_id=b"\x00" * 16), timeout=10
        )
        assert released.released is False  # served: an unknown handle, nothing to release
    assert_no_leaks(stack)


# --- the public API key, TLS and reflection ------------------------------------------------------------


@pytest.fixture(scope="module")
def secure_gateway(
    stack_pool: StackPool, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServiceProcess, certificates.Pem]]:
    stack = _stack(stack_pool)
    directory = tmp_path_factory.mktemp("public-tls")
    pem = certificates.self_signed(directory)
    gateway = ServiceProcess(
        "gateway",
        [
            *("--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--http-port", "0"),
            *("--prefill", stack.prefills[0].grpc, "--decode", stack.decodes[0].grpc),
            *("--tls-cert", str(pem.cert), "--tls-key", str(pem.key), "--reflection"),
        ],
        {**service_env(cache_dir), "PDSERVE_API_KEY": API_KEY},
        directory / "gateway.log",
    )
    gateway.start()
    gateway.wait_ready()
    try:
        yield gateway, pem
    finally:
        assert gateway.stop() == 0, gateway.log_tail()
        assert API_KEY not in gateway.log_tail(100_000)


def _public(pem: certificates.Pem, key: str = "") -> ChannelSecurity:
    return ChannelSecurity(
        ChannelSecurity.public(key).metadata, tls=True, root_certificates=pem.cert.read_bytes()
    )


def test_grpc_generate_needs_the_api_key(
    secure_gateway: tuple[ServiceProcess, certificates.Pem], stack_pool: StackPool
) -> None:
    gateway, pem = secure_gateway

    async def run(security: ChannelSecurity) -> list[int]:
        async with security.aio_channel(gateway.grpc) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(REQUEST, timeout=60)
            return [t async for chunk in call for t in chunk.token_ids]

    for key in ("", "sk-wrong", API_KEY[:-1]):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(run(_public(pem, key)))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, key
        assert API_KEY not in (refused.value.details() or "")
    # The right key streams, exactly as the shared stack's own gateway does.
    expected = asyncio.run(generate(_stack(stack_pool).address, REQUEST)).token_ids
    assert asyncio.run(run(_public(pem, API_KEY))) == expected
    with _public(pem).channel(gateway.grpc) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING, "health needs no key"
    assert_no_leaks(_stack(stack_pool))


def test_tls_gateway_refuses_a_plaintext_client_and_lists_services_with_reflection(
    secure_gateway: tuple[ServiceProcess, certificates.Pem],
) -> None:
    gateway, pem = secure_gateway
    with grpc.insecure_channel(gateway.grpc) as channel, pytest.raises(grpc.RpcError) as refused:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with _public(pem, API_KEY).channel(gateway.grpc) as channel:
        responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
        services = {s.name for r in responses for s in r.list_services_response.service}
    assert "pdserve.v1.Gateway" in services


def _https(
    address: str, path: str, pem: certificates.Pem, key: str = "", body: bytes | None = None
) -> tuple[int, Any]:
    request = urllib.request.Request(f"https://{address}{path}", data=body)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    context = ssl.create_default_context(cafile=str(pem.cert))
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as answer:
            text = answer.read()
            return answer.status, json.loads(text) if text else None
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_http_over_tls_needs_the_api_key(secure_gateway: tuple[ServiceProcess, certificates.Pem]) -> None:
    gateway, pem = secure_gateway
    http = str(gateway.ready["http"])
    assert _https(http, "/health", pem)[0] == 200, "/health needs no key"
    body = json.dumps({"prompt": [5, 17, 99], "max_tokens": 3, "temperature": 0.0}).encode()
    for key in ("", "sk-wrong"):
        for path, data in (("/v1/models", None), ("/v1/completions", body), ("/v1/models/x", None)):
            status, answer = _https(http, path, pem, key, data)
            assert status == 401, (path, key)
            assert answer["error"]["code"] == "invalid_api_key" and answer["error"]["type"], answer
    assert _https(http, "/v1/models", pem, API_KEY)[0] == 200
    status, answer = _https(http, "/v1/completions", pem, API_KEY, body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer
    with pytest.raises(OSError):  # plaintext HTTP to the TLS port: a TLS alert or a closed connection
        urllib.request.urlopen(f"http://{http}/health", timeout=10)


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in service_env(Path("/nonexistent")).items() if k != "PDSERVE_INTERNAL_TOKEN"}
    return subprocess.run(
        [sys.executable, "-m", "pdserve", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )


def test_cli_clients_connect_over_tls_with_the_key(
    secure_gateway: tuple[ServiceProcess, certificates.Pem],
) -> None:
    gateway, pem = secure_gateway
    generate_args = ["generate", "--address", gateway.grpc, "--prompt-ids", "5,17,99", "--max-tokens", "3"]
    done = _cli(*generate_args, "--json", "--tls-ca", str(pem.cert), "--api-key", API_KEY)
    assert done.returncode == 0, done.stderr
    assert sum(len(json.loads(line)["token_ids"]) for line in done.stdout.splitlines()) == 3
    assert "UNAUTHENTICATED" in _cli(*generate_args, "--tls-ca", str(pem.cert)).stderr
    assert _cli(*generate_args, "--api-key", API_KEY).returncode == 1, "plaintext to the TLS port fails"
    health = _cli("health", gateway.grpc, "--tls-ca", str(pem.cert))
    assert (health.returncode, health.stdout.strip()) == (0, "SERVING")
    assert _cli("health", gateway.grpc).returncode == 1
    bench = _cli(
        *("bench", "--base-url", f"https://{gateway.ready['http']}", "--tls-ca", str(pem.cert)),
        *("--api-key", API_KEY, "--model", MODEL, "--vocab-size", "200", "--input-len", "4"),
        *("--output-len", "2", "--num-prompts", "2", "--num-warmup", "0", "--json", "--progress", "false"),
    )
    assert bench.returncode == 0, bench.stderr + bench.stdout
    assert json.loads(bench.stdout)["completed"] == 2
