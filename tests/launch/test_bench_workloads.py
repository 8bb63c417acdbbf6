"""The named workloads of issue 18's CPU comparisons (bench/cpu_peers.py): their prompt counts,
prompt lengths and output lengths on SmolLM2's vocabulary."""
from __future__ import annotations

import pytest
from spmd_runtime.launch.bench import THROUGHPUT_WORKLOADS

SMOLLM2_VOCAB = 49152


@pytest.mark.parametrize(("name", "requests", "prompt_lens", "output_len"), [
    ("W1", 32, (32, 256), 64),
    ("W2", 64, (16, 64), 128),
    ("B1", 1, (512, 512), 128),
    ("W4", 32, (256, 768), 16),
])
def test_named_workload_shapes(name: str, requests: int, prompt_lens: tuple[int, int],
                               output_len: int) -> None:
    workload = THROUGHPUT_WORKLOADS[name]
    prompts = workload.prompts(SMOLLM2_VOCAB)
    assert len(prompts) == requests
    assert all(prompt_lens[0] <= len(p) <= prompt_lens[1] for p in prompts)
    assert all(0 <= t < SMOLLM2_VOCAB for p in prompts for t in p)
    if requests > 1:
        assert len({len(p) for p in prompts}) > 1, "prompt lengths should be spread"
    assert workload.output_lens() == [output_len] * requests


def test_existing_workloads_kept() -> None:
    assert {"default", "issue10"} <= set(THROUGHPUT_WORKLOADS)
