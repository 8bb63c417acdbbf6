"""The one log format of every process of the runtime, set from --log-level."""
from __future__ import annotations

import logging
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=LOG_FORMAT)
