"""The Phase enum and StepShape: their arithmetic, their wire form, and that phases are never
compared as strings anywhere else in the source."""
from __future__ import annotations

import re
from pathlib import Path

from spmd_runtime.protocol.messages import StepPlan, worker_inbound_decoder
from spmd_runtime.protocol.step_shape import Phase, StepShape
from spmd_runtime.protocol.transport import Encoder

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOMS = ("protocol", "scheduler_proc", "worker_proc", "runtime", "launch", "bench")
# A phase name as a string literal next to a comparison: == "prompt", "decode" in ..., etc.
STRING_COMPARISON = re.compile(
    r"""(==|!=|\bis\b|\bin\b)\s*[(\[{]?\s*["'](prompt|decode)["']"""
    r"""|["'](prompt|decode)["']\s*(==|!=|\bis\b|\bin\b|\bnot\b)""")


def test_phase_of_a_request_and_the_tokens_of_a_shape() -> None:
    assert Phase.of(1) is Phase.DECODE and Phase.of(2) is Phase.PROMPT and Phase.of(0) is Phase.PROMPT
    assert Phase.PROMPT.other is Phase.DECODE and Phase.DECODE.other is Phase.PROMPT
    assert StepShape(Phase.PROMPT, 4, 128).num_tokens == 512
    assert StepShape(Phase.DECODE, 4, 2048).num_tokens == 4      # one new token per sequence


def test_a_shape_travels_in_the_plan_as_its_phase_and_two_numbers() -> None:
    plan = StepPlan(step_id=3, new_requests=[], cached_request_ids=[],
                    cached_num_scheduled_tokens=[], cached_new_block_ids=[],
                    bucket=StepShape(Phase.DECODE, 8, 256))
    payload = Encoder().encode(plan)
    assert b"decode" in payload
    decoded = worker_inbound_decoder().decode(payload)
    assert decoded.bucket == StepShape(Phase.DECODE, 8, 256)
    assert decoded.bucket.phase is Phase.DECODE and decoded.bucket.length == 256


def test_no_phase_is_compared_as_a_string_outside_its_enum() -> None:
    found = []
    for room in SOURCE_ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            if path.name == "step_shape.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if STRING_COMPARISON.search(line.split("#")[0]):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "compare phases as Phase members:\n" + "\n".join(found)
