"""An ASGI middleware bounding HTTP request bodies: beyond the bound, 413 in OpenAI's error shape.

A body beyond the bound (by its ``Content-Length``, or as it is read when sent without one) is
never handed to the app nor kept: the rest of it is read and dropped, up to ``DRAIN_FACTOR`` times
the bound, so that the client, still sending, can read the 413 (a connection closed with unread
bytes is reset); a body larger than that is answered at once. A body within the bound is handed to
the app as it came, and the messages after it (a client's disconnect) follow as they come.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.openai_errors import INVALID_REQUEST, OpenAIError

DRAIN_FACTOR = 4


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await self._refuse(scope, receive, send, drain=length <= DRAIN_FACTOR * self.max_bytes)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, drain=message.get("more_body", False), read=size)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            if messages:
                return messages.pop(0)
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, drain: bool, read: int = 0) -> None:
        while drain and read <= DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            read += len(message.get("body", b""))
            drain = message.get("more_body", False)
        error = OpenAIError(
            413,
            f"the request body is larger than {self.max_bytes} bytes (--max-body-bytes)",
            INVALID_REQUEST,
            code="request_too_large",
        )
        await error.response()(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
