"""Configuration: the services' frozen config dataclasses, their checks, and the flags and
environment variables derived from them."""

from pdserve.config.request_limits import RequestLimits
from pdserve.config.security import InternalSecurity, PublicSecurity
from pdserve.config.services import (
    BACKENDS,
    CPU_BATCH_TOKENS,
    CUDA_BATCH_TOKENS,
    DEFAULT_MODEL,
    DTYPES,
    GPU_BACKENDS,
    HTTP_PORT,
    ColocatedConfig,
    DecodeConfig,
    EngineConfig,
    GatewayConfig,
    PrefillConfig,
    ServerConfig,
    TransferConfig,
)

__all__ = [
    "BACKENDS",
    "CPU_BATCH_TOKENS",
    "CUDA_BATCH_TOKENS",
    "DEFAULT_MODEL",
    "DTYPES",
    "GPU_BACKENDS",
    "HTTP_PORT",
    "ColocatedConfig",
    "DecodeConfig",
    "EngineConfig",
    "GatewayConfig",
    "InternalSecurity",
    "PrefillConfig",
    "PublicSecurity",
    "RequestLimits",
    "ServerConfig",
    "TransferConfig",
]
