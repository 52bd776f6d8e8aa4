"""Whether a decode can use a KV handle: same model, backend and layout, checked before any byte moves."""

from __future__ import annotations

from pdserve.kv.layout import KvLayout, spec_from_proto
from pdserve.v1 import kv_pb2

MAX_CACHED_LAYOUTS = 4096


class KvCompatibility:
    """The checks of one decode; the expected tensors per token count are kept for the fast path."""

    def __init__(self, fingerprint: str, backend: str, layout: KvLayout) -> None:
        self._fingerprint = fingerprint
        self._backend = backend
        self._layout = layout
        self._expected: dict[int, list[kv_pb2.TensorSpec]] = {}

    def problem(self, handle: kv_pb2.KvHandle) -> str | None:
        """Why this decode cannot use the handle's KV, or None when it can."""
        if handle.model_fingerprint != self._fingerprint:
            return f"model fingerprint {handle.model_fingerprint!r} differs from this decode's {self._fingerprint!r}"
        if handle.backend != self._backend:
            return f"KV backend {handle.backend!r} differs from this decode's {self._backend!r}"
        if handle.num_tokens < 1:
            return "KV handle holds no tokens"
        if self._matches_exactly(handle):
            return None
        try:
            theirs = [spec_from_proto(t) for t in handle.tensors]
        except ValueError as exc:
            return str(exc)
        if theirs != self._layout.tensor_specs(handle.num_tokens):
            return "KV layout (tensor names, shapes or dtypes) differs from this decode's model"
        expected = self._layout.num_bytes(handle.num_tokens)
        if handle.num_bytes != expected:
            return f"KV size {handle.num_bytes} differs from the {expected} expected"
        return None

    def _matches_exactly(self, handle: kv_pb2.KvHandle) -> bool:
        expected = self._expected.get(handle.num_tokens)
        if expected is None:
            if len(self._expected) >= MAX_CACHED_LAYOUTS:
                self._expected.clear()
            expected = [spec.to_proto() for spec in self._layout.tensor_specs(handle.num_tokens)]
            self._expected[handle.num_tokens] = expected
        return (
            handle.num_bytes == self._layout.num_bytes(handle.num_tokens) and list(handle.tensors) == expected
        )
