"""The checks every config dataclass shares: each raises ValueError naming the field and the value."""

from __future__ import annotations

import math
import os
import re

DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")
DNS_SCHEME = "dns:///"
MAX_PORT = 65535


def check_port(name: str, value: int, *, off: int | None = None) -> None:
    """A TCP port to bind: 0 picks a free one; ``off`` (e.g. -1) is also allowed and turns it off."""
    if off is not None and value == off:
        return
    if not 0 <= value <= MAX_PORT:
        if off is not None:
            raise ValueError(
                f"{name} must be {off} (off) or in [0, {MAX_PORT}] (0 picks a free port), got {value}"
            )
        raise ValueError(f"{name} must be in [0, {MAX_PORT}] (0 picks a free port), got {value}")


def check_address(name: str, value: str) -> None:
    """HOST:PORT of another process (the port must be a real one)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= MAX_PORT:
        raise ValueError(
            f"{name} addresses must look like HOST:PORT with a port in [1, {MAX_PORT}], got {value!r}"
        )


def check_backend_address(name: str, value: str) -> None:
    """A backend of the gateway: HOST:PORT, or ``dns:///HOST:PORT`` (every address the name resolves
    to, re-resolved while the gateway runs)."""
    if value.startswith("dns:") and not value.startswith(DNS_SCHEME):
        raise ValueError(
            f"{name} addresses by name must look like {DNS_SCHEME}HOST:PORT (no DNS authority), got {value!r}"
        )
    check_address(name, value.removeprefix(DNS_SCHEME))


def check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


def check_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def check_at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_device(name: str, value: str) -> None:
    """A torch device pdserve runs on: ``cpu``, ``cuda`` or ``cuda:N``."""
    if not DEVICE_PATTERN.fullmatch(value):
        raise ValueError(f"{name} must be cpu or cuda[:N], got {value!r}")


def device_at(device: str, offset: int = 0) -> str:
    """``device`` with its index made explicit, ``offset`` GPUs on: ``cuda`` is ``cuda:0``."""
    if not device.startswith("cuda"):
        return device
    _, _, index = device.partition(":")
    return f"cuda:{int(index or 0) + offset}"


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_file(flag: str, path: str) -> None:
    """A file to read at start-up ('' = none): it must exist and be a file."""
    if path and not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r} is not a readable file")


def check_chat_template(value: str) -> None:
    """A chat template flag ('' = the model's): a readable file, or text holding one of ``{``, ``}``
    or a newline (the template itself; the gateway compiles it at start-up)."""
    if value and not os.path.isfile(value) and not any(c in value for c in "{}\n"):
        raise ValueError(f"chat_template {value!r} looks like a file path, but it is not a readable file")


def check_file_pair(flag: str, path: str, other_flag: str, other_path: str) -> None:
    """Two files that go together (a certificate and its key): both or neither, each existing."""
    if bool(path) != bool(other_path):
        raise ValueError(f"{flag} and {other_flag} go together: set both or neither")
    check_file(flag, path)
    check_file(other_flag, other_path)
