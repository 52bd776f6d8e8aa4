"""CPU lists as Linux writes them (``0-3,6``): parsed for ``--cpus`` and written for the children of
``pdserve up``."""

from __future__ import annotations

from collections.abc import Iterable


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """The CPUs of ``text`` (``0``, ``2-3``, ``0-1,4``), sorted and each once; () for ''.
    ValueError when it is not such a list."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")) if text.strip() else ():
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"cpus must be a CPU list such as 0, 2-3 or 0-1,4; got {text!r}")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"cpus: the range {part!r} runs backwards")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """``cpus`` as a CPU list, consecutive ones as ranges: (0, 1, 2, 5) -> '0-2,5'."""
    ranges: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in ranges)
