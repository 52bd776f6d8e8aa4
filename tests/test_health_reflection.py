"""Every service answers grpc.health.v1; prefill and decode list their services through reflection
(to callers with the internal token), the gateway only with --reflection (tests/test_auth.py)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import StackPool
from tests.stack import internal_channel

MODEL = "tiny-llama"


def listed_services(address: str) -> set[str]:
    with internal_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        return {s.name for r in responses for s in r.list_services_response.service}


def health(address: str, service: str = "") -> int:
    with internal_channel(address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return int(response.status)


def test_health_and_reflection_on_every_service(stack_pool: StackPool) -> None:
    stack = stack_pool.get(MODEL)
    assert stack.gateway is not None
    for process, name in (
        (stack.gateway, "pdserve.v1.Gateway"),
        (stack.prefills[0], "pdserve.v1.Prefill"),
        (stack.decodes[0], "pdserve.v1.Decode"),
    ):
        assert health(process.grpc) == health_pb2.HealthCheckResponse.SERVING
        assert health(process.grpc, name) == health_pb2.HealthCheckResponse.SERVING
        if process is stack.gateway:
            with pytest.raises(grpc.RpcError) as off:
                listed_services(process.grpc)
            assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED  # no reflection by default
            continue
        services = listed_services(process.grpc)
        assert {name, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
