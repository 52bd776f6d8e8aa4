"""How the gateway chooses a prefill for a request: prefix-aware (default) or least outstanding calls."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.config.checks import check_at_least, check_choice, check_positive

PREFILL_ROUTINGS = ("prefix", "least-load")
DEFAULT_PREFIX_BLOCK_SIZE = 16


@dataclass(frozen=True)
class PrefillRouting:
    prefill_routing: str = field(
        default="prefix",
        metadata={
            "help": "prefix: the prefill most likely to hold the prompt's longest cached prefix, "
            "balanced against load; least-load: the prefill with the fewest calls in flight"
        },
    )
    prefix_block_size: int = field(
        default=DEFAULT_PREFIX_BLOCK_SIZE,
        metadata={"help": "tokens per prefix block of the prefix routing index (the prefills' block size)"},
    )
    prefix_index_blocks: int = field(
        default=1 << 16,
        metadata={"help": "prefix blocks the routing index remembers (least recently used evicted)"},
    )
    prefix_balance_threshold: int = field(
        default=16,
        metadata={
            "help": "calls in flight the prefix-matched prefill may have beyond the least loaded one "
            "before the least loaded one takes the request"
        },
    )

    def __post_init__(self) -> None:
        check_choice("prefill_routing", self.prefill_routing, PREFILL_ROUTINGS)
        check_positive("prefix_block_size", self.prefix_block_size)
        check_positive("prefix_index_blocks", self.prefix_index_blocks)
        check_at_least("prefix_balance_threshold", self.prefix_balance_threshold, 0)
