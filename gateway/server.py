"""Starts the gateway: tokenizer and limits of the model, then (``--backends-from-stdin``) the backend
addresses from stdin, backend pools (and the discovery of their ``dns:///`` names, called with the
internal credential), gRPC and HTTP servers (the API key and
TLS of ``--api-key``/``--tls-cert``), and the metrics server.

A port it cannot bind, or a ``--chat-template`` it cannot read or compile, ends it at start with one
error line (exit 1), nothing else started."""

from __future__ import annotations

import asyncio
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry
from transformers import AutoConfig, AutoTokenizer

from gateway.admission import Admission
from gateway.backends import decode_pool, prefill_pool
from gateway.chat_template import load_chat_template
from gateway.discovery import Discovery, Resolver, fixed_addresses, resolve_dns
from gateway.generation_defaults import generation_defaults
from gateway.http_api import OpenAIApi
from gateway.http_server import HttpServer
from gateway.input_limits import InputLimits
from gateway.metrics import GatewayMetrics
from gateway.prefix_router import PrefixRouter
from gateway.prompt_input import PromptInput
from gateway.request_flow import RequestFlow
from gateway.servicer import GatewayServicer
from pdserve.config import GatewayConfig
from pdserve.config.backend_line import read_backend_line
from pdserve.core.heap import freeze_heap
from pdserve.core.limits import ModelLimits
from pdserve.hosting.metrics_server import MetricsServer
from pdserve.model.eos_tokens import eos_token_ids
from pdserve.model.source import resolve_model_dir
from pdserve.rpc.server import ServiceServer, announce_ready, wait_for_stop_signal
from pdserve.rpc.service_security import internal_client, public_server_security
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


async def serve(config: GatewayConfig, resolver: Resolver = resolve_dns) -> None:
    """Runs the gateway until SIGTERM/SIGINT; ``resolver`` answers for its ``dns:///`` backends."""
    model_dir = await asyncio.to_thread(resolve_model_dir, config.model, config.cache_dir or None)
    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, model_dir)
    try:
        chat_template = await asyncio.to_thread(load_chat_template, config.chat_template)
    except ValueError as error:
        logger.error("gateway: --chat-template: %s", error)
        raise SystemExit(1) from None
    if chat_template is not None:
        tokenizer.chat_template = chat_template  # in place of the model's, for every chat request
    hf_config = await asyncio.to_thread(AutoConfig.from_pretrained, model_dir)
    limits = ModelLimits.from_config(hf_config, config.max_model_len, eos_token_ids(model_dir, hf_config))
    defaults = await asyncio.to_thread(generation_defaults, config.generation_config, str(model_dir))

    if config.backends_from_stdin:
        try:
            config = await read_backend_line(config, sys.stdin)
        except ValueError as error:
            logger.error("gateway: --backends-from-stdin: %s", error)
            raise SystemExit(1) from None
    metrics = GatewayMetrics(CollectorRegistry(), config.model_id, limits.max_model_len)
    internal = internal_client(config.internal)
    prefills = prefill_pool(fixed_addresses(config.prefill), security=internal)
    decodes = decode_pool(fixed_addresses(config.decode), security=internal)
    discoveries = [
        Discovery(pool, targets, resolver, config.resolve_interval_s)
        for pool, targets in ((prefills, config.prefill), (decodes, config.decode))
    ]
    tokenizing = ThreadPoolExecutor(config.limits.tokenizer_threads, thread_name_prefix="tokenizer")
    prompts = PromptInput(tokenizer, limits, tokenizing)
    router = PrefixRouter(config.routing) if config.routing.prefill_routing == "prefix" else None
    flow = RequestFlow(prompts, tokenizer, prefills, decodes, metrics, router)
    inputs = InputLimits(config.limits)
    admission = Admission(config.limits.max_in_flight, config.limits.retry_after_s, metrics)
    api = OpenAIApi(
        flow,
        metrics,
        prompts,
        limits,
        config.model_id,
        inputs,
        admission,
        config.public.api_key,
        defaults,
        model_root=config.model,
    )
    try:
        server = ServiceServer(
            config.server.host,
            config.server.port,
            [SERVICE_NAME],
            work_methods=[f"/{SERVICE_NAME}/Generate"],
            advertise_host=config.server.public_host,
            max_receive_bytes=config.limits.max_body_bytes,
            security=public_server_security(config.public),
        )
        http = None
        if config.http_port >= 0:
            http = HttpServer(
                api.app(),
                config.server.host,
                config.http_port,
                config.server.grace_s,
                tls=(config.public.tls_cert, config.public.tls_key) if config.public.tls_cert else None,
            )
        metrics_server = MetricsServer(config.server.host, config.server.metrics_port, metrics.registry)
    except OSError as error:
        logger.error(
            "gateway: cannot listen (%s); free the port or pick others (--port, --http-port: 0 a free "
            "port, -1 no HTTP; --metrics-port)",
            error,
        )
        raise SystemExit(1) from None
    gateway_pb2_grpc.add_GatewayServicer_to_server(
        GatewayServicer(flow, metrics, inputs, admission, defaults), server.server
    )
    for discovery in discoveries:
        await discovery.refresh()
    resolving = [asyncio.create_task(d.run()) for d in discoveries if d.by_name]
    await server.start()
    freeze_heap("gateway")
    metrics_address = f"{config.server.public_host}:{metrics_server.port}"
    if http is None:
        announce_ready("gateway", grpc=server.address, metrics=metrics_address)
    else:
        await http.start()
        http_address = f"{config.server.public_host}:{http.port}"
        announce_ready("gateway", grpc=server.address, metrics=metrics_address, http=http_address)
    await wait_for_stop_signal()
    logger.info("draining gateway (grace %.1fs)", config.server.grace_s)
    api.draining = True
    await asyncio.gather(server.drain(config.server.grace_s), *([http.stop()] if http else []))
    for task in resolving:
        task.cancel()
    await asyncio.gather(*resolving, return_exceptions=True)
    for discovery in discoveries:
        await discovery.close()
    await flow.close()
    await prefills.close()
    await decodes.close()
    metrics_server.close()
    tokenizing.shutdown(wait=False, cancel_futures=True)
    logger.info("gateway stopped")
