"""The HTTP API's key: with ``--api-key`` set, every call under ``/v1`` must send
``Authorization: Bearer KEY`` or gets 401 in OpenAI's error shape (as vLLM's ``--api-key``);
``/health`` and ``/metrics`` stay open for probes and scrapers."""

from __future__ import annotations

import secrets
from typing import Any

from gateway.openai_errors import INVALID_REQUEST, OpenAIError

PROTECTED_PREFIX = "/v1"


class ApiKeyGate:
    """ASGI middleware in front of the app (streams pass through untouched)."""

    def __init__(self, app: Any, key: str) -> None:
        self._app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["path"].startswith(PROTECTED_PREFIX)
            and not self._allowed(scope)
        ):
            error = OpenAIError(401, "Incorrect API key provided.", INVALID_REQUEST, code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        await self._app(scope, receive, send)

    def _allowed(self, scope: dict[str, Any]) -> bool:
        headers = dict(scope.get("headers") or ())
        return secrets.compare_digest(headers.get(b"authorization", b""), self._expected)
