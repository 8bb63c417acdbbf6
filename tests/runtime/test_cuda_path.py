"""The CUDA path (bf16 or fp32 weights, CUDA graphs, the Triton decode kernel) against the CPU
path and transformers on SmolLM2. Needs a CUDA device: skipped without one (CI has none)."""
from __future__ import annotations

import pytest
import torch
from spmd_runtime.runtime import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(100, 49152, (n,), generator=g).tolist() for n in (7, 30, 64, 130, 200, 12)]


def generate(**options) -> list[list[int]]:
    with LLM("smollm2", **options) as llm:
        return [o.token_ids for o in llm.generate(prompts(), PARAMS)]


@pytest.mark.timeout(900)
def test_smollm2_on_cuda_equals_the_cpu_path_in_fp32_and_stays_near_it_in_bf16(
        hf_smollm2, greedy_reference) -> None:
    model, _ = hf_smollm2
    cpu = generate(device="cpu", dtype="float32")
    # fp32 on CUDA (graphs and the kernel by default): the same tokens, up to near-ties.
    cuda = generate(device="cuda", dtype="float32")
    greedy_reference.check(model, prompts(), cuda, cpu, min_exact=5)
    # bf16: rounding moves logits, so greedy paths may part at near-ties (a logit within
    # conftest.NEAR_TIE_MARGIN of the reference's max, both in its top 5), nowhere else.
    bf16 = generate(device="cuda", dtype="bfloat16")
    greedy_reference.check(model, prompts(), bf16, cpu, min_exact=3)
