"""What users import: LLM, Client, SamplingParams, RequestOutput. Loads torch only when needed."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.sampling import SamplingParams
    from runtime.client import Client, StreamDelta
    from runtime.llm import LLM
    from runtime.outputs import RequestOutput

_LAZY = {
    "SamplingParams": "protocol.sampling",
    "Client": "runtime.client",
    "StreamDelta": "runtime.client",
    "LLM": "runtime.llm",
    "RequestOutput": "runtime.outputs",
}

__all__ = ["LLM", "Client", "RequestOutput", "SamplingParams", "StreamDelta"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
