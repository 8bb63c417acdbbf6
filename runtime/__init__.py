"""What users import: LLM, Client, SamplingParams, RequestOutput. Loads torch only when needed."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spmd_runtime.protocol.logprobs import TokenLogprobs
    from spmd_runtime.protocol.sampling import SamplingParams, StructuredOutput
    from spmd_runtime.runtime.client import Client, StreamDelta
    from spmd_runtime.runtime.llm import LLM
    from spmd_runtime.runtime.outputs import RequestOutput
    from spmd_runtime.runtime.rpc import EngineError

_LAZY = {
    "SamplingParams": "spmd_runtime.protocol.sampling",
    "StructuredOutput": "spmd_runtime.protocol.sampling",
    "TokenLogprobs": "spmd_runtime.protocol.logprobs",
    "Client": "spmd_runtime.runtime.client",
    "StreamDelta": "spmd_runtime.runtime.client",
    "LLM": "spmd_runtime.runtime.llm",
    "RequestOutput": "spmd_runtime.runtime.outputs",
    "EngineError": "spmd_runtime.runtime.rpc",
}

__all__ = ["LLM", "Client", "EngineError", "RequestOutput", "SamplingParams", "StreamDelta",
           "StructuredOutput", "TokenLogprobs"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spmd_runtime.runtime' has no attribute {name!r}")
