"""The start-up heap kept out of Python's cyclic garbage collector once a service is ready.

A service that has loaded its model and compiled its forwards holds hundreds of thousands of
objects that live as long as the process (modules, compiled graphs and their guards, tokenizer
tables). Each full collection walks them all: measured on the reference model, 0.5-0.8 s with the
GIL held, which stalls the event loop and the engine thread together and came once, at the first
burst of requests after start (TTFT p50 1.0 s against 0.25 s). ``freeze_heap``, called when the
start-up is done, collects once and moves every survivor to the permanent generation
(``gc.freeze``), so that later collections walk only what serving created.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_heap(service: str) -> int:
    """Collects, then keeps every object alive now out of later collections; returns how many
    objects the collector now leaves alone."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: %d start-up objects kept out of the garbage collector (%.2f s)",
        service,
        frozen,
        time.perf_counter() - start,
    )
    return frozen
