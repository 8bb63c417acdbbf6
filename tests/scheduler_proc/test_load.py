"""Load: 1,000 concurrent requests over RPC, from 10 clients at once, twice; every request
completes exactly once with the same greedy tokens as alone, and the second round leaves the
scheduler's memory where the first left it (nothing kept per request).

The model is a tiny sharp Llama (far from greedy ties) with smollm2's vocabulary and tokenizer:
the scheduler does everything it does for smollm2 (tokenizer, incremental detokenizing of every
request), while the workers' forward passes -- not what this test is about -- cost next to
nothing."""
from __future__ import annotations

import threading

import pytest
from sharp_llama import sharp_chat_llama
from spmd_runtime.runtime import Client, SamplingParams

CLIENTS = 10
PER_CLIENT = 100
SHORT = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)




@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_gguf) -> str:
    return sharp_chat_llama(tmp_path_factory.mktemp("load-llama"), smollm2_gguf)


@pytest.fixture(scope="module")
def server(spmd_serve, model_dir):
    srv = spmd_serve("--model", model_dir, "--max-model-len", "128", "--max-num-seqs", "256",
                     "--max-num-batched-tokens", "2048")
    with srv.serving():
        yield srv


def prompts(client_index: int) -> list[list[int]]:
    # Few distinct prompts (the reference below runs each once), but every request is its own.
    return [[1000 + client_index, 2000 + i % 7, 3000, 4000 + i % 3] for i in range(PER_CLIENT)]


def one_round(address: str) -> list[list[list[int]]]:
    results: list = [None] * CLIENTS
    errors: list = []

    def work(index: int) -> None:
        try:
            with Client(address, timeout_s=120) as client:
                results[index] = client.generate(prompts(index), SHORT)
        except Exception as error:  # noqa: BLE001 - re-raised below in the test thread
            errors.append(error)
    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    assert not errors, errors[:3]
    assert all(r is not None for r in results)
    for outputs in results:
        assert len({o.request_id for o in outputs}) == PER_CLIENT
        assert all(o.finish_reason == "length" for o in outputs)
    return [[o.token_ids for o in outputs] for outputs in results]


@pytest.mark.timeout(900)
def test_a_thousand_concurrent_requests_twice(server) -> None:
    scheduler = server.child("scheduler_proc")
    first = one_round(server.address)
    with Client(server.address, timeout_s=120) as client:
        after_first = client.stats()
        assert after_first.num_finished == CLIENTS * PER_CLIENT
        rss_first = scheduler.memory_info().rss
        second = one_round(server.address)
        after_second = client.stats()
        rss_second = scheduler.memory_info().rss
        assert after_second.num_finished == 2 * CLIENTS * PER_CLIENT
        assert after_second.num_running == after_second.num_waiting == 0
        assert after_second.kv_blocks_in_use == 0
        # Every request exactly once, and the same tokens as the prompt alone.
        assert first == second
        distinct = sorted({tuple(p) for i in range(CLIENTS) for p in prompts(i)})
        alone = dict(zip(distinct, (o.token_ids for o in client.generate(
            [list(p) for p in distinct], SHORT)), strict=True))
        for index, outputs in enumerate(first):
            assert outputs == [alone[tuple(p)] for p in prompts(index)]
    growth_mib = (rss_second - rss_first) / 2**20
    assert growth_mib < 8, f"scheduler grew {growth_mib:.1f} MiB over 1,000 more requests"
