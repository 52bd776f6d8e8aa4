"""Every service answers grpc.health.v1 and lists its services through reflection."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.conftest import StackPool

MODEL = "tiny-llama"


def listed_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        return {s.name for r in responses for s in r.list_services_response.service}


def health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
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
        services = listed_services(process.grpc)
        assert {name, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
