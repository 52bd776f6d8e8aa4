"""NCCL that fails like gloo: an error or a timeout fails the operation and aborts its communicator,
never the process.

torch's default (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) lets the NCCL watchdog take the whole
process down on any timeout or NCCL error, even one ``work.wait`` already reported; pdserve's pairs
are rebuilt under a new generation instead, and an expert-parallel group ends on its own terms.
The setting is read when a process group is built, so it is made before any group exists: at the
start of every pdserve process that may build one. Communicators are aborted or shut down
explicitly by their owners (``PairChannel``), never left to the watchdog or the garbage collector.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CLEAN_UP_ONLY = "2"  # abort the communicators of a failed operation; keep the process
KEEPS_THE_PROCESS = ("0", CLEAN_UP_ONLY)


def configure_error_handling(environ: MutableMapping[str, str] | None = None) -> str:
    """Sets NCCL's error handling to clean up without tearing the process down; returns the value.

    A value that keeps the process (0 or 2) is left as set; one that would end it is replaced."""
    environ = os.environ if environ is None else environ
    current = environ.get(ERROR_HANDLING_ENV)
    if current in KEEPS_THE_PROCESS:
        return current
    if current is not None:
        logger.warning(
            "%s=%s would end the process on any NCCL error; pdserve sets it to %s",
            ERROR_HANDLING_ENV,
            current,
            CLEAN_UP_ONLY,
        )
    environ[ERROR_HANDLING_ENV] = CLEAN_UP_ONLY
    return CLEAN_UP_ONLY
