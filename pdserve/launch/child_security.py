"""The credentials ``pdserve up`` hands its children, and those of its own calls to them.

Every child gets the internal token (the one set, else a random one per run) and the gateway its
API key through the environment, never on a command line; certificate paths travel the same way.
The health checks and the demo call the services as their clients would.
"""

from __future__ import annotations

from collections.abc import Mapping

from pdserve.config.flags import ENV_PREFIX
from pdserve.config.security import TOKEN_ENV, TOKEN_FILE_ENV, InternalSecurity, new_token
from pdserve.launch.spec import GATEWAY, UpConfig
from pdserve.rpc.channel_security import ChannelSecurity, read_pem
from pdserve.rpc.service_security import internal_client


def run_token(config: UpConfig) -> str:
    """The internal token of this run: the one configured, else a fresh random one."""
    return config.internal.token or new_token()


def child_env(config: UpConfig, token: str, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with the security settings of every child (the gateway reads the public ones)."""
    settings = {
        TOKEN_ENV: token,
        "INTERNAL_TLS_CERT": config.internal.internal_tls_cert,
        "INTERNAL_TLS_KEY": config.internal.internal_tls_key,
        "INTERNAL_TLS_CA": config.internal.internal_tls_ca,
        "API_KEY": config.public.api_key,
        "TLS_CERT": config.public.tls_cert,
        "TLS_KEY": config.public.tls_key,
        "REFLECTION": "true" if config.public.reflection else "false",
    }
    result = {k: v for k, v in env.items() if k != TOKEN_FILE_ENV}
    for name, value in settings.items():
        result[name if name.startswith(ENV_PREFIX) else ENV_PREFIX + name] = value
    return result


def gateway_client(config: UpConfig) -> ChannelSecurity:
    """How ``pdserve up`` calls its gateway (health checks, the demo)."""
    if not config.public.tls_cert:
        return ChannelSecurity.public(config.public.api_key)
    trusted = read_pem(config.tls_ca or config.public.tls_cert)
    return ChannelSecurity(
        ChannelSecurity.public(config.public.api_key).metadata, tls=True, root_certificates=trusted
    )


def child_client(config: UpConfig, token: str, role: str) -> ChannelSecurity:
    """How ``pdserve up`` calls a child of ``role``."""
    if role == GATEWAY:
        return gateway_client(config)
    internal = config.internal
    return internal_client(
        InternalSecurity(
            internal_token=token,
            internal_tls_cert=internal.internal_tls_cert,
            internal_tls_key=internal.internal_tls_key,
            internal_tls_ca=internal.internal_tls_ca,
        )
    )
