"""The gateway finds its backends by DNS name (``dns:///NAME:PORT``) and follows what the names
resolve to while it runs: real prefill, decode and gateway processes on 127.0.0.1, the gateway's
resolver answering from a file the test rewrites (``tests/dns_gateway.py``).

A decode listed before it runs is not routed to; it joins once it reports SERVING. A decode that
leaves DNS while a request runs on it gets no new request, the running one finishes there, and the
gateway then closes its connection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.discovery import BackendTarget, fixed_addresses, resolve_dns
from pdserve.v1 import gateway_pb2_grpc
from tests.dns_gateway import write_names
from tests.grpc_client import make_request, run
from tests.stack import ServiceProcess, free_port, scrape, service_env, wait_for

MODEL = "tiny-llama"
LONG = 1500  # tokens: still decoding while its decode leaves DNS


def decode_requests(decode: ServiceProcess) -> float:
    return scrape(decode.metrics)["pdserve_decode_requests_total"]


def test_the_gateway_follows_what_its_dns_names_resolve_to(
    stack_pool: Any, cache_dir: Path, tmp_path: Path
) -> None:
    stack = stack_pool.get(MODEL)
    (prefill,) = stack.prefills
    (first,) = stack.decodes
    env = service_env(cache_dir)
    names = tmp_path / "names.json"
    second_address = f"127.0.0.1:{free_port()}"
    write_names(names, prefills=[prefill.grpc], decodes=[first.grpc, second_address])
    gateway = ServiceProcess(
        "gateway",
        [
            *("--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--http-port", "-1"),
            *("--prefill", "dns:///prefills:50061", "--decode", "dns:///decodes:50062"),
            *("--resolve-interval-s", "0.2"),
        ],
        env,
        tmp_path / "gateway.log",
        launcher=("-m", "tests.dns_gateway", str(names)),
    )
    second = ServiceProcess(
        "decode",
        ["--model", MODEL, "--host", "127.0.0.1", "--port", second_address.rpartition(":")[2]],
        env,
        tmp_path / "decode.log",
    )
    gateway.start()
    try:
        gateway.wait_ready()

        def gauge(name: str) -> float:
            return scrape(gateway.metrics)[f"pdserve_gateway_{name}{{role=decode}}"]

        def request(max_tokens: int = 4) -> Any:
            return make_request(
                prompt_token_ids=[5, 6, 7], max_tokens=max_tokens, temperature=0.0, ignore_eos=True
            )

        # Listed, not running: known to the gateway, never routed to.
        assert wait_for(lambda: (gauge("backends"), gauge("backends_serving")) == (2, 1), 10)
        before = decode_requests(first)
        for _ in range(3):
            assert len(run(gateway.grpc, request()).token_ids) == 4
        assert decode_requests(first) == before + 3

        # It starts and reports SERVING: requests go to both.
        second.start()
        second.wait_ready()
        assert wait_for(lambda: gauge("backends_serving") == 2, 15), gateway.log_tail()
        counts = decode_requests(first), decode_requests(second)
        for _ in range(4):
            assert len(run(gateway.grpc, request()).token_ids) == 4
        assert decode_requests(first) > counts[0] and decode_requests(second) > counts[1]

        # The decode running a long request leaves DNS: drained, the request finishes there.
        channel = grpc.insecure_channel(gateway.grpc)
        stream = gateway_pb2_grpc.GatewayStub(channel).Generate(request(LONG), timeout=120)
        tokens = list(next(stream).token_ids)
        decodes = {first.grpc: first, second.grpc: second}
        assert wait_for(
            lambda: any(scrape(d.metrics)["pdserve_decode_running"] for d in decodes.values()), 10
        )
        (leaving,) = [a for a, d in decodes.items() if scrape(d.metrics)["pdserve_decode_running"]]
        (staying,) = set(decodes) - {leaving}
        write_names(names, prefills=[prefill.grpc], decodes=[staying])
        # Retired, not closed: the gateway still has the request running there.
        assert wait_for(lambda: (gauge("backends"), gauge("backends_retired")) == (1, 1), 10)
        for chunk in stream:
            tokens.extend(chunk.token_ids)
        channel.close()
        assert len(tokens) == LONG and chunk.finish_reason == "length"
        assert wait_for(lambda: gauge("backends_retired") == 0, 10), "the drained decode was not closed"
        left = decode_requests(decodes[leaving])
        for _ in range(3):
            assert len(run(gateway.grpc, request()).token_ids) == 4
        assert decode_requests(decodes[leaving]) == left, "a request went to a decode no longer in DNS"
        assert "left the pool" in gateway.log_tail(20000)
    finally:
        assert gateway.stop() == 0, gateway.log_tail()
        second.stop()


def test_backend_lists_keep_their_addresses_and_names_resolve_to_every_address() -> None:
    targets = ["10.0.0.1:50061", "dns:///pdserve-prefill:50061", "[::1]:50061"]
    assert fixed_addresses(targets) == ["10.0.0.1:50061", "[::1]:50061"]
    name = BackendTarget.parse("dns:///pdserve-prefill:50061")
    assert (name.host, name.port, name.by_name) == ("pdserve-prefill", 50061, True)
    assert "127.0.0.1:50061" in resolve_dns("localhost", 50061)


@pytest.mark.parametrize(
    "bad", ["dns://8.8.8.8/pdserve-prefill:50061", "dns:///pdserve-prefill", "dns:pdserve-prefill:1"]
)
def test_names_must_be_dns_triple_slash_name_and_port(bad: str) -> None:
    from pdserve.config import GatewayConfig

    with pytest.raises(ValueError, match="prefill addresses"):
        GatewayConfig(prefill=(bad,), decode=("h:2",))
    assert GatewayConfig(prefill=("dns:///pdserve-prefill:50061",), decode=("h:2",)).resolve_interval_s == 5.0
