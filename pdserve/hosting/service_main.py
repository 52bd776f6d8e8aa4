"""Runs a prefill, decode or colocated service: one process, or an expert-parallel group (``--ep``).

Its threads run on ``--cpus`` first (``cpu_binding``). One process: load the model, build the
service's parts on one gRPC server, serve the metrics, warm up the compiled forwards (``--compile``;
then the process compiles nothing more unless ``--recompile-in-serving``), keep the start-up heap
out of the garbage collector, start the gRPC server, announce the ready line -> on SIGTERM/SIGINT
drain (NOT_SERVING, new work refused, work in flight and what the service still holds given
``--grace-s``), stop the background tasks, close the parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from pdserve.config.cpu_list import parse_cpu_list
from pdserve.core.heap import freeze_heap
from pdserve.hosting.cpu_binding import bind_process
from pdserve.hosting.ep_service import serve_group
from pdserve.hosting.service_kind import ServiceKind
from pdserve.model.engine_model import load_engine_model
from pdserve.rpc.server import announce_ready, wait_for_stop_signal

logger = logging.getLogger(__name__)


async def serve_service(kind: ServiceKind, config: Any) -> None:
    bind_process(parse_cpu_list(config.engine.cpus))
    if config.engine.ep > 1:
        await serve_group(kind, config)
        return
    server_config = config.server
    host = server_config.public_host
    engine_model = await asyncio.to_thread(load_engine_model, config.engine)
    server = kind.server(config, server_config.port)
    parts = kind.build(config, engine_model, server, 0)
    metrics_servers = parts.serve_metrics(server_config.host)
    await asyncio.to_thread(parts.warm_up)
    engine_model.end_warm_ups(config.engine.recompile_in_serving)
    freeze_heap(kind.command)
    await server.start()
    tasks = [asyncio.create_task(run()) for run in parts.background]
    announce_ready(
        kind.command,
        grpc=server.address,
        **{key: f"{host}:{metrics.port}" for key, metrics in metrics_servers.items()},
        **parts.ready,
    )
    await wait_for_stop_signal()
    logger.info("draining %s (grace %.1fs)", kind.command, server_config.grace_s)
    await server.drain(server_config.grace_s, busy=parts.busy)
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await parts.close()
    for metrics in metrics_servers.values():
        metrics.close()
    logger.info("%s stopped", kind.command)
