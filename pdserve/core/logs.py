"""The one logging set-up of pdserve's processes: to stderr, level from ``PDSERVE_LOG_LEVEL``."""

from __future__ import annotations

import logging
import os
import sys

LEVEL_ENV = "PDSERVE_LOG_LEVEL"
FORMAT = "%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s"


def configure_logging(default_level: str = "INFO") -> None:
    """Logs go to stderr (stdout carries the ready line); ``PDSERVE_LOG_LEVEL`` overrides the level."""
    logging.basicConfig(level=os.environ.get(LEVEL_ENV, default_level), format=FORMAT, stream=sys.stderr)
