"""The credential checks in one process: the metadata gate on a real in-process gRPC server (port 0),
the client side that adds the metadata, the security settings' validation, the env-only token and
what `pdserve up` hands its children."""

from __future__ import annotations

import argparse
import asyncio
import io
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.bench.config import BenchConfig
from pdserve.config import GatewayConfig, InternalSecurity, PrefillConfig, PublicSecurity, flags
from pdserve.config.security import TOKEN_ENV
from pdserve.launch.child_security import child_env
from pdserve.launch.spec import LaunchSpec, UpConfig, service_command
from pdserve.launch.supervisor import Supervisor
from pdserve.rpc.channel_security import INTERNAL_TOKEN_KEY, ChannelSecurity
from pdserve.rpc.metadata_gate import MetadataGate
from pdserve.rpc.server import ServiceServer
from pdserve.rpc.service_security import ServerSecurity
from pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

TOKEN = "unit-test-internal-token"


# --- the gate ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sent", "allowed"),
    [
        ([(INTERNAL_TOKEN_KEY, TOKEN)], True),
        ([(INTERNAL_TOKEN_KEY, TOKEN.encode())], True),
        ([], False),
        ([(INTERNAL_TOKEN_KEY, "")], False),
        ([(INTERNAL_TOKEN_KEY, TOKEN[:-1])], False),  # a prefix
        ([(INTERNAL_TOKEN_KEY, TOKEN + "x")], False),  # longer
        ([(INTERNAL_TOKEN_KEY, TOKEN.upper())], False),
        ([("authorization", TOKEN)], False),  # another key
        ([(INTERNAL_TOKEN_KEY, "wrong"), (INTERNAL_TOKEN_KEY, TOKEN)], False),  # only the first counts
    ],
)
def test_gate_lets_through_only_the_exact_value(sent: list[tuple[str, Any]], allowed: bool) -> None:
    gate = MetadataGate(INTERNAL_TOKEN_KEY, TOKEN, "refused")
    assert gate.allows("/pdserve.v1.Prefill/Prefill", sent) is allowed


def test_gate_leaves_health_open_and_wants_a_value() -> None:
    gate = MetadataGate(INTERNAL_TOKEN_KEY, TOKEN, "refused")
    assert gate.allows("/grpc.health.v1.Health/Check", [])
    assert gate.allows("/grpc.health.v1.Health/Watch", None)
    assert not gate.allows("/grpc.health.v1.HealthX/Check", [])
    with pytest.raises(ValueError, match="must not be empty"):
        MetadataGate(INTERNAL_TOKEN_KEY, "", "refused")


class _Prefill(prefill_pb2_grpc.PrefillServicer):
    async def ReleaseKv(self, request: Any, context: Any) -> prefill_pb2.ReleaseKvResponse:
        return prefill_pb2.ReleaseKvResponse(released=True)


class _Decode(decode_pb2_grpc.DecodeServicer):
    async def Decode(self, request: Any, context: Any) -> Any:
        yield decode_pb2.DecodeResponse(token_ids=[7])

    async def DecodeMany(self, request_iterator: Any, context: Any) -> Any:
        async for _ in request_iterator:
            yield decode_pb2.DecodeManyResponse()


def test_gated_server_refuses_every_kind_of_call_without_the_token() -> None:
    """Unary, server-streaming and bidirectional calls: UNAUTHENTICATED without or with a wrong
    token, served with it (the client side adds it to each kind of call); health stays open."""

    async def scenario() -> None:
        gate = MetadataGate(INTERNAL_TOKEN_KEY, TOKEN, "needs the token")
        server = ServiceServer("127.0.0.1", 0, ["pdserve.v1.Prefill"], security=ServerSecurity(gate))
        prefill_pb2_grpc.add_PrefillServicer_to_server(_Prefill(), server.server)
        decode_pb2_grpc.add_DecodeServicer_to_server(_Decode(), server.server)
        await server.start()
        try:
            for metadata, expected in (
                ((), False),
                (((INTERNAL_TOKEN_KEY, "x" * 24),), False),
                (((INTERNAL_TOKEN_KEY, TOKEN),), True),
            ):
                async with ChannelSecurity(metadata).aio_channel(server.address) as channel:
                    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                    assert health.status == health_pb2.HealthCheckResponse.SERVING
                    calls = [
                        prefill_pb2_grpc.PrefillStub(channel).ReleaseKv(prefill_pb2.ReleaseKvRequest()),
                        _collect(decode_pb2_grpc.DecodeStub(channel).Decode(decode_pb2.DecodeRequest())),
                        _collect(
                            decode_pb2_grpc.DecodeStub(channel).DecodeMany(
                                iter([decode_pb2.DecodeManyRequest()])
                            )
                        ),
                    ]
                    for call in calls:
                        if expected:
                            await call
                            continue
                        with pytest.raises(grpc.aio.AioRpcError) as refused:
                            await call
                        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                        assert refused.value.details() == "needs the token"
        finally:
            await server.server.stop(0)

    asyncio.run(scenario())


async def _collect(call: Any) -> list[Any]:
    return [r async for r in call]


def test_blocking_channel_carries_the_metadata_too() -> None:
    async def scenario() -> None:
        gate = MetadataGate(INTERNAL_TOKEN_KEY, TOKEN, "needs the token")
        server = ServiceServer("127.0.0.1", 0, ["pdserve.v1.Prefill"], security=ServerSecurity(gate))
        prefill_pb2_grpc.add_PrefillServicer_to_server(_Prefill(), server.server)
        await server.start()

        def call(security: ChannelSecurity) -> bool:
            with security.channel(server.address) as channel:
                stub = prefill_pb2_grpc.PrefillStub(channel)
                return bool(stub.ReleaseKv(prefill_pb2.ReleaseKvRequest(), timeout=10).released)

        try:
            assert await asyncio.to_thread(call, ChannelSecurity(((INTERNAL_TOKEN_KEY, TOKEN),)))
            with pytest.raises(grpc.RpcError) as refused:
                await asyncio.to_thread(call, ChannelSecurity())
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            await server.server.stop(0)

    asyncio.run(scenario())


# --- settings ------------------------------------------------------------------------------------


def test_security_files_must_exist_and_go_together(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    present = tmp_path / "present"
    present.write_text("x")
    with pytest.raises(ValueError, match=r"--internal-token-file .* is not a readable file"):
        InternalSecurity(internal_token_file=missing)
    with pytest.raises(ValueError, match=r"--internal-tls-ca .* is not a readable file"):
        InternalSecurity(
            internal_tls_cert=str(present), internal_tls_key=str(present), internal_tls_ca=missing
        )
    with pytest.raises(ValueError, match="needs all of --internal-tls-cert, --internal-tls-key"):
        InternalSecurity(internal_tls_cert=str(present))
    with pytest.raises(ValueError, match=r"--tls-cert .* is not a readable file"):
        PublicSecurity(tls_cert=missing, tls_key=str(present))
    with pytest.raises(ValueError, match=r"--tls-key .* is not a readable file"):
        PublicSecurity(tls_cert=str(present), tls_key=missing)
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        PublicSecurity(tls_cert=str(present))
    with pytest.raises(ValueError, match=r"--tls-ca .* is not a readable file"):
        BenchConfig(tls_ca=missing)
    with pytest.raises(ValueError, match=r"--tls-ca .* is not a readable file"):
        UpConfig(tls_ca=missing)


def test_token_is_checked_and_read_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert InternalSecurity(internal_token_file=str(path)).token == TOKEN
    assert InternalSecurity(internal_token=TOKEN).token == TOKEN
    with pytest.raises(ValueError, match="not both"):
        InternalSecurity(internal_token=TOKEN, internal_token_file=str(path))
    with pytest.raises(ValueError, match="16 to 4096 characters"):
        InternalSecurity(internal_token="short")
    with pytest.raises(ValueError, match="printable ASCII"):
        InternalSecurity(internal_token="with a space in it, long enough")
    path.write_text("\n")
    with pytest.raises(ValueError, match=r"the token in --internal-token-file .* 16 to 4096"):
        InternalSecurity(internal_token_file=str(path))
    with pytest.raises(ValueError, match=f"set {TOKEN_ENV} or --internal-token-file"):
        InternalSecurity().require_token("pdserve prefill")


def test_internal_token_is_an_environment_variable_never_a_flag() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)  # as the CLI's
    flags.add_arguments(parser, PrefillConfig, {TOKEN_ENV: TOKEN})
    assert "--internal-token " not in parser.format_help() and "--internal-token-file" in parser.format_help()
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parser.parse_args(["--internal-token", TOKEN])
    config = flags.build(PrefillConfig, parser.parse_args([]))
    assert config.security.token == TOKEN
    assert TOKEN not in flags.to_args(PrefillConfig, config)
    gateway = argparse.ArgumentParser()
    flags.add_arguments(gateway, GatewayConfig, {"PDSERVE_API_KEY": "sk-secret"})
    assert "sk-secret" not in gateway.format_help()


def test_up_hands_its_children_a_token_through_the_environment(tmp_path: Path) -> None:
    config = UpConfig(public=PublicSecurity(api_key="sk-up"))
    env = {"PDSERVE_INTERNAL_TOKEN_FILE": "/elsewhere", "PATH": "/bin"}
    made = [Supervisor(config, env=env, stdout=io.StringIO())._env for _ in range(2)]
    tokens = [e[TOKEN_ENV] for e in made]
    assert tokens[0] != tokens[1] and all(len(t) >= 32 for t in tokens)  # a fresh one per run
    assert all("PDSERVE_INTERNAL_TOKEN_FILE" not in e and e["PDSERVE_API_KEY"] == "sk-up" for e in made)
    set_one = child_env(UpConfig(internal=InternalSecurity(internal_token=TOKEN)), TOKEN, {})
    assert set_one[TOKEN_ENV] == TOKEN
    for role in ("prefill", "decode", "gateway"):
        command = service_command(config, LaunchSpec(role))
        assert not any(t in " ".join(command) for t in (*tokens, "sk-up")), command
