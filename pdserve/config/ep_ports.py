"""The fixed internal ports of an expert-parallel group, derived from ``--ep-port-base``.

With a base B (``--ep-port-base``; 0 keeps every internal port free-chosen), rank r owns the block
``[B + 4r, B + 4r + 4)``:
- ``B + 4r``: the rank's internal gRPC server (Prefill/Decode calls handed over by rank 0, and the
  PullKvMany calls of decodes, which reach the rank holding the KV directly);
- ``B + 4r + 1``: the rank's KV rendezvous store (prefill and colocated ranks); on rank 0, which
  serves ``--kv-port``, the group's own store instead;
- ``B + 4r + 2``: the rank's metrics (rank 0 serves ``--metrics-port``);
- ``B + 4r + 3``: the prefill side's metrics of a colocated rank (rank 0 serves
  ``--prefill-metrics-port``).
A group of N ranks thus uses ``[B, B + 4N)``: the range to declare on a pod and in network policies.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config.checks import MAX_PORT

PORTS_PER_RANK = 4


@dataclass(frozen=True)
class EpRankPorts:
    grpc: int
    kv: int
    metrics: int
    prefill_metrics: int

    @property
    def group_store(self) -> int:
        """Rank 0's block only: the port of the group's store."""
        return self.kv


def ep_rank_ports(base: int, rank: int) -> EpRankPorts:
    start = base + PORTS_PER_RANK * rank
    return EpRankPorts(grpc=start, kv=start + 1, metrics=start + 2, prefill_metrics=start + 3)


def ep_port_range(base: int, num_ranks: int) -> range:
    """Every internal port of a group of ``num_ranks`` ranks."""
    return range(base, base + PORTS_PER_RANK * num_ranks)


def check_ep_port_base(base: int, num_ranks: int) -> None:
    if base == 0:
        return
    last = base + PORTS_PER_RANK * num_ranks - 1
    if base < 1 or last > MAX_PORT:
        raise ValueError(
            f"ep_port_base must be 0 (free ports) or a port whose block of {PORTS_PER_RANK} ports per "
            f"rank ends by {MAX_PORT}, got {base} (ranks: {num_ranks}, last port {last})"
        )
