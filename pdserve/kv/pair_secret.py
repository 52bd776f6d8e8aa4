"""Who owns a KV pair: the decode that made its secret.

A decode makes a random secret for its link to each prefill (``new_pair_secret``) and sends it in
its pull calls and pair-store calls over the internal gRPC channel; it is never written to any
store, log or handle. The prefill keys each pair by ``(decode instance id, digest of the secret)``
(``pair_key``): a caller presenting another secret, even under the same decode id, reaches a pair of
its own and never the decode's. Generations are positive integers up to ``MAX_PAIR_GENERATION``.
"""

from __future__ import annotations

import hashlib
import re
import secrets

PAIR_SECRET_BYTES = 32
MAX_PAIR_GENERATION = (1 << 31) - 1
MAX_DECODE_ID_CHARS = 128
_DECODE_ID = re.compile(r"[A-Za-z0-9._-]+")

PairKey = tuple[str, bytes]


def new_pair_secret() -> bytes:
    return secrets.token_bytes(PAIR_SECRET_BYTES)


def pair_key(decode_instance_id: str, secret: bytes) -> PairKey:
    """What a prefill keys a pair by: the decode's id and a digest of its secret (the secret itself
    is not kept)."""
    return decode_instance_id, hashlib.sha256(secret).digest()


def is_owner_id(instance_id: str) -> bool:
    """Whether ``instance_id`` can name a process in a pair: 1 to ``MAX_DECODE_ID_CHARS`` letters,
    digits, '.', '_' or '-'."""
    return len(instance_id) <= MAX_DECODE_ID_CHARS and bool(_DECODE_ID.fullmatch(instance_id))


def pull_problem(decode_instance_id: str, secret: bytes) -> str | None:
    """Why a pull's or pair-store call's owner fields are unusable, or None."""
    if not is_owner_id(decode_instance_id):
        return f"decode_instance_id must be 1 to {MAX_DECODE_ID_CHARS} letters, digits, '.', '_' or '-'"
    if len(secret) != PAIR_SECRET_BYTES:
        return f"pair_secret must be {PAIR_SECRET_BYTES} bytes"
    return None


def generation_problem(generation: int) -> str | None:
    """Why a pair generation is unusable, or None."""
    if not 1 <= generation <= MAX_PAIR_GENERATION:
        return f"pair_generation must be in [1, {MAX_PAIR_GENERATION}], got {generation}"
    return None
