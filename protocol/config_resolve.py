"""The option variables of the environment, read once, where the config is made: from the
command line (launch/options.py) or by LLM(...). An option given wins; else its variable, where
set; else the default. Every process started with the config reads its options from the config
alone, never from its environment, so what a node's launcher resolved is what every process of
the node runs (tests/launch/test_resolved_config.py starts an engine whose children see a
poisoned environment).

A bucket range may be set in part: each of SPMD_{PROMPT,DECODE}_{BS,SEQ}_BUCKET_{MIN,STEP,MAX}
sets that part of the option, written 'min,step,max' with the parts not set left empty
(',,16'); the scheduler fills those from the defaults it derives from the model."""
from __future__ import annotations

import os
from collections.abc import Collection, Mapping

from spmd_runtime.protocol.buckets import DIMENSIONS
from spmd_runtime.protocol.env_vars import (
    BUCKET_PARTS,
    SPMD_ROW_PARALLEL_CHUNK_THRESHOLD,
    SPMD_ROW_PARALLEL_CHUNKS,
    bucket_variable,
)
from spmd_runtime.protocol.step_shape import Phase

# Options whose value, when not given, is an integer variable's.
INTEGER_VARIABLES = {"row_parallel_chunks": SPMD_ROW_PARALLEL_CHUNKS,
                     "row_parallel_chunk_threshold": SPMD_ROW_PARALLEL_CHUNK_THRESHOLD}


def environment_options(given: Collection[str],
                        environ: Mapping[str, str] = os.environ) -> dict[str, object]:
    """The EngineConfig fields the environment sets among those not `given`. ValueError
    naming a variable that is not an integer."""
    options: dict[str, object] = {}
    for phase in Phase:
        for dimension in DIMENSIONS:
            field = f"{phase}_{dimension}_bucket"
            if field in given:
                continue
            parts = [_integer(environ, bucket_variable(phase, dimension, part))
                     for part in BUCKET_PARTS]
            if any(part is not None for part in parts):
                options[field] = ",".join("" if part is None else str(part) for part in parts)
    for field, variable in INTEGER_VARIABLES.items():
        value = _integer(environ, variable)
        if field not in given and value is not None:
            options[field] = value
    return options


def _integer(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
