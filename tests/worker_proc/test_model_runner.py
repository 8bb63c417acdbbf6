"""ModelRunner over the paged KV cache vs transformers' LlamaForCausalLM, in float32.

A tiny random Llama (weights scaled up so attention is sharp and position-sensitive) is loaded
into both; hand-built StepPlans drive ModelRunner.execute and the hidden states of every token
it computes are turned into logits and compared with the reference forward of the same tokens.
"""
from __future__ import annotations

import pytest
import torch
from spmd_runtime.protocol.messages import NewRequestData, StepPlan
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.protocol.sampling import SamplingParams
from spmd_runtime.runtime.models.llama import LlamaForCausalLM
from spmd_runtime.worker_proc.kv_cache import allocate_kv_cache
from spmd_runtime.worker_proc.model_runner import ModelRunner

BLOCK = 4
NUM_BLOCKS = 64
VOCAB = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=100)
ATOL = 1e-4


def build_pair(tie: bool = False, seed: int = 0):
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(seed)
    hf_config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256, rope_theta=1000.0, rms_norm_eps=1e-5,
                            tie_word_embeddings=tie)
    hf = HFLlama(hf_config).float().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.25 * torch.randn_like(param))
    config = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, rms_norm_eps=1e-5, rope_theta=1000.0,
                         max_position_embeddings=256, tie_word_embeddings=tie, bos_token_id=1,
                         eos_token_ids=(2,))
    model = LlamaForCausalLM(config, torch.float32)
    model.load_hf_state_dict(hf.state_dict())
    model.eval()
    return hf, model, config


# What earlier requests may have left in a block: any finite value.
STALE = 1e4


def test_kv_cache_is_allocated_zeroed(pair) -> None:
    """Never NaN or inf under the attention mask (0 x NaN is NaN), and every page resident
    from the start (no memory growth as blocks are first used)."""
    _, _, config = pair
    kv = allocate_kv_cache(config, NUM_BLOCKS, BLOCK, torch.float32, torch.device("cpu"))
    assert len(kv) == config.num_hidden_layers
    assert all(torch.count_nonzero(t) == 0 for cache in kv for t in cache)


class Harness:
    """A ModelRunner whose every forward pass is captured as per-token logits."""

    def __init__(self, model, config, fill: float = 0.0) -> None:
        self.model = model
        kv = allocate_kv_cache(config, NUM_BLOCKS, BLOCK, torch.float32, torch.device("cpu"))
        # allocate_kv_cache zeroes the cache, but a block handed to a request holds whatever
        # the requests before it wrote there. `fill` stands in for that content.
        for k, v in kv:
            k.fill_(fill)
            v.fill_(fill)
        self.runner = ModelRunner(model, kv, BLOCK, torch.device("cpu"), seed=0)
        self.steps = 0

    def run(self, new=(), cached=(), dropped=()):
        """new: (rid, tokens, blocks, computed, scheduled); cached: (rid, scheduled, blocks).

        Returns ({rid: logits of the tokens computed this step}, {rid: sampled token}).
        """
        plan = StepPlan(step_id=self.steps, new_requests=[
            NewRequestData(rid, list(tokens), list(blocks), computed, scheduled, GREEDY)
            for rid, tokens, blocks, computed, scheduled in new],
            cached_request_ids=[c[0] for c in cached],
            cached_num_scheduled_tokens=[c[1] for c in cached],
            cached_new_block_ids=[list(c[2]) for c in cached],
            dropped_request_ids=list(dropped))
        self.steps += 1
        hidden: list[torch.Tensor] = []
        layouts: list[list[tuple[int, int]]] = []
        runner = self.runner
        inputs = runner.inputs
        prepare = type(inputs).build

        def recording_prepare(scheduled, bucket=None, device=None):
            # The flattened batch holds each scheduled request's tokens, in this order.
            layouts.append([(rid, n) for rid, n in scheduled])
            return prepare(inputs, scheduled, bucket, device)

        inputs.build = recording_prepare
        # Every row's hidden state is read here: the last layer runs for all rows, not only
        # the sampled ones (test_the_last_layer_finishes_the_sampled_rows_alone covers those).
        runner._kept_rows = lambda *_: None
        hook = self.model.register_forward_hook(
            lambda _m, _i, out: hidden.append(out.detach().clone()))
        try:
            output = runner.execute(plan)
        finally:
            hook.remove()
            del inputs.build, runner._kept_rows
        if not new and not cached:
            assert hidden == [] and output.request_ids == []
            return {}, {}
        assert len(hidden) == 1 and len(layouts) == 1
        logits = self.model.compute_logits(hidden[0])
        expected = sorted([(n[0], n[4]) for n in new] + [(c[0], c[1]) for c in cached])
        assert sorted(layouts[0]) == expected
        rows, offset = {}, 0
        for rid, count in layouts[0]:
            rows[rid] = logits[offset:offset + count]
            offset += count
        assert offset == logits.shape[0]
        return rows, dict(zip(output.request_ids, output.sampled_token_ids, strict=False))


def reference_logits(hf, tokens) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([list(tokens)])).logits[0].float()


def prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


@pytest.fixture(scope="module")
def pair():
    return build_pair()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, what
    err = (ours - ref).abs().max().item()
    assert err < ATOL, f"{what}: max |logit difference| {err:.2e}"


def test_whole_prompt_matches_reference(pair) -> None:
    hf, model, config = pair
    h = Harness(model, config)
    tokens = prompt(0, 22)
    logits, sampled = h.run(new=[(0, tokens, [0, 1, 2, 3, 4, 5], 0, 22)])
    ref = reference_logits(hf, tokens)
    assert_close(logits[0], ref, "prompt logits")
    assert sampled == {0: int(ref[-1].argmax())}


def test_prompt_in_three_chunks_matches_whole_prompt(pair) -> None:
    hf, model, config = pair
    h = Harness(model, config)
    tokens = prompt(1, 23)
    ref = reference_logits(hf, tokens)
    # Blocks arrive with the chunks, as the scheduler sends them.
    logits, sampled = h.run(new=[(0, tokens, [9, 3], 0, 7)])
    assert_close(logits[0], ref[:7], "chunk 1")
    assert sampled == {}, "no sample before the end of the prompt"
    logits, sampled = h.run(cached=[(0, 9, [12, 4])])
    assert_close(logits[0], ref[7:16], "chunk 2")
    assert sampled == {}
    logits, sampled = h.run(cached=[(0, 7, [30, 31])])
    assert_close(logits[0], ref[16:], "chunk 3")
    assert sampled == {0: int(ref[-1].argmax())}


def test_single_token_chunk_of_a_prompt(pair) -> None:
    hf, model, config = pair
    h = Harness(model, config)
    tokens = prompt(2, 9)
    ref = reference_logits(hf, tokens)
    logits, _ = h.run(new=[(0, tokens, [5, 6], 0, 8)])
    assert_close(logits[0], ref[:8], "chunk of 8")
    logits, sampled = h.run(cached=[(0, 1, [7])])
    assert_close(logits[0], ref[8:], "last token alone")
    assert sampled == {0: int(ref[-1].argmax())}


def test_greedy_decode_matches_reference(pair) -> None:
    hf, model, config = pair
    h = Harness(model, config)
    tokens = prompt(3, 6)
    blocks = [40, 41, 17, 3, 8]                  # 20 slots: 6 prompt + 14 generated
    _, sampled = h.run(new=[(0, tokens, blocks[:2], 0, 6)])
    sequence = tokens + [sampled[0]]
    for step in range(13):
        # One new block each time the next token to compute starts a block beyond the first two.
        position = len(sequence) - 1
        new_blocks = [blocks[position // BLOCK]] if position % BLOCK == 0 and position // BLOCK >= 2 \
            else []
        logits, sampled = h.run(cached=[(0, 1, new_blocks)])
        ref = reference_logits(hf, sequence)
        assert_close(logits[0], ref[-1:], f"decode step {step}")
        assert sampled[0] == int(ref[-1].argmax())
        sequence.append(sampled[0])


def test_mixed_batch_of_decodes_and_prefill_chunks(pair) -> None:
    hf, model, config = pair
    h = Harness(model, config)
    a, b, c, d = prompt(10, 5), prompt(11, 13), prompt(12, 18), prompt(13, 10)
    # Step 1: A and B whole, C's first chunk.
    logits, sampled = h.run(new=[(0, a, [20, 2], 0, 5), (1, b, [7, 50, 1, 33], 0, 13),
                                 (2, c, [60, 61], 0, 6)])
    assert_close(logits[0], reference_logits(hf, a), "A prompt")
    assert_close(logits[1], reference_logits(hf, b), "B prompt")
    assert_close(logits[2], reference_logits(hf, c)[:6], "C chunk 1")
    assert set(sampled) == {0, 1}
    a.append(sampled[0])
    b.append(sampled[1])
    # Step 2: decodes of A and B, C's second chunk, D's first chunk (non-contiguous blocks).
    logits, sampled = h.run(new=[(3, d, [11, 44], 0, 7)],
                            cached=[(0, 1, []), (2, 9, [5, 58]), (1, 1, [])])
    assert_close(logits[0], reference_logits(hf, a)[-1:], "A decode")
    assert_close(logits[1], reference_logits(hf, b)[-1:], "B decode")
    assert_close(logits[2], reference_logits(hf, c)[6:15], "C chunk 2")
    assert_close(logits[3], reference_logits(hf, d)[:7], "D chunk 1")
    assert set(sampled) == {0, 1}
    a.append(sampled[0])
    b.append(sampled[1])
    # Step 3: C's and D's last chunks with the decodes of A and B; A crosses into a new block.
    logits, sampled = h.run(cached=[(2, 3, [9]), (3, 3, [27]), (1, 1, []), (0, 1, [])])
    ref_c, ref_d = reference_logits(hf, c), reference_logits(hf, d)
    assert_close(logits[2], ref_c[15:], "C chunk 3")
    assert_close(logits[3], ref_d[7:], "D chunk 2")
    assert_close(logits[0], reference_logits(hf, a)[-1:], "A decode 2")
    assert_close(logits[1], reference_logits(hf, b)[-1:], "B decode 2")
    assert sampled[2] == int(ref_c[-1].argmax()) and sampled[3] == int(ref_d[-1].argmax())
    # Step 4: four decodes of different context lengths in one batched call.
    for rid, seq in ((0, a), (1, b), (2, c), (3, d)):
        seq.append(sampled[rid])
    logits, sampled = h.run(cached=[(3, 1, []), (2, 1, []), (1, 1, []), (0, 1, [14])])
    for rid, seq in ((0, a), (1, b), (2, c), (3, d)):
        ref = reference_logits(hf, seq)
        assert_close(logits[rid], ref[-1:], f"request {rid} batched decode")
        assert sampled[rid] == int(ref[-1].argmax())


def test_dropped_request_state_is_forgotten_and_ids_can_be_reused(pair) -> None:
    hf, model, config = pair
    h = Harness(model, config)
    first, second = prompt(20, 8), prompt(21, 8)
    h.run(new=[(0, first, [0, 1], 0, 8)])
    assert 0 in h.runner.requests
    h.run(dropped=[0])
    assert h.runner.requests == {}
    # Same id, same blocks, different tokens: nothing of the old request may leak in.
    logits, sampled = h.run(new=[(0, second, [1, 0, 2], 0, 8)])
    ref = reference_logits(hf, second)
    assert_close(logits[0], ref, "reused id")
    logits, _ = h.run(cached=[(0, 1, [])])
    assert_close(logits[0], reference_logits(hf, second + [sampled[0]])[-1:], "reused id decode")


def test_resumed_request_recomputes_prompt_and_generated_tokens(pair) -> None:
    """Preemption by recompute: the request comes back with prompt + generated tokens."""
    hf, model, config = pair
    h = Harness(model, config)
    tokens = prompt(30, 10)
    _, sampled = h.run(new=[(5, tokens, [3, 4, 6], 0, 10)])
    tokens.append(sampled[5])
    _, sampled = h.run(cached=[(5, 1, [])])
    tokens.append(sampled[5])
    logits, sampled = h.run(new=[(5, tokens, [40, 39, 38], 0, 12)], dropped=[5])
    ref = reference_logits(hf, tokens)
    assert_close(logits[5], ref, "resumed")
    assert sampled == {5: int(ref[-1].argmax())}


def test_tied_embeddings(pair) -> None:
    hf, model, config = build_pair(tie=True, seed=1)
    h = Harness(model, config)
    tokens = prompt(40, 12)
    logits, _ = h.run(new=[(0, tokens, [2, 0, 1], 0, 12)])
    assert_close(logits[0], reference_logits(hf, tokens), "tied")


def test_never_written_cache_slots_do_not_leak_into_attention(pair) -> None:
    """Slots this request has not written hold what earlier requests left there (here a large
    value). Attention reads whole blocks (and pads decode groups with block 0) relying on the
    mask; none of that may reach the logits -- in decodes, chunked prefills and prefix hits."""
    hf, model, config = pair
    h = Harness(model, config, fill=STALE)
    a, b, c = prompt(50, 3), prompt(51, 9), prompt(52, 11)
    # Different context lengths in one decode group -> padding; C is chunked (7 + 4).
    _, sampled = h.run(new=[(0, a, [7], 0, 3), (1, b, [8, 9, 10], 0, 9),
                            (2, c, [20, 21], 0, 7)])
    a.append(sampled[0])
    b.append(sampled[1])
    logits, sampled = h.run(cached=[(0, 1, []), (1, 1, []), (2, 4, [22])])
    for rid, seq in ((0, a), (1, b)):
        assert torch.isfinite(logits[rid]).all(), f"request {rid}: non-finite logits"
        assert_close(logits[rid], reference_logits(hf, seq)[-1:], f"request {rid}")
    assert torch.isfinite(logits[2]).all(), "chunked prefill: non-finite logits"
    assert_close(logits[2], reference_logits(hf, c)[7:], "chunk 2 of C")
    # D shares C's first 8 tokens: blocks 20 and 21 are prefix-cache hits (not to be cleared),
    # block 30 is fresh.
    d = c[:8] + prompt(53, 5)
    logits, sampled = h.run(new=[(3, d, [20, 21, 30, 31], 8, 5)], dropped=[2])
    assert torch.isfinite(logits[3]).all(), "prefix hit: non-finite logits"
    assert_close(logits[3], reference_logits(hf, d)[8:], "after a prefix hit")
    d.append(sampled[3])
    logits, _ = h.run(cached=[(3, 1, [])])
    assert_close(logits[3], reference_logits(hf, d)[-1:], "decode after a prefix hit")


def test_the_last_layer_finishes_the_sampled_rows_alone(pair) -> None:
    """float32 (assertions on float32 logits within ATOL and on greedy tokens): the last layer's
    output projection and MLP run for the sampled rows only, so the model returns those rows
    (in the order the step samples them), each the reference's; the rows not finished still write the last
    layer's keys and values, which the next chunk of a prompt and the decodes read."""
    hf, model, config = pair
    h = Harness(model, config)
    a, b, c = prompt(30, 9), prompt(31, 18), prompt(32, 13)
    outputs: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach().clone()))

    def step(new=(), cached=()) -> dict[int, int]:
        plan = StepPlan(step_id=h.steps, new_requests=[
            NewRequestData(rid, list(tokens), list(blocks), 0, scheduled, GREEDY)
            for rid, tokens, blocks, scheduled in new],
            cached_request_ids=[r for r, _, _ in cached],
            cached_num_scheduled_tokens=[n for _, n, _ in cached],
            cached_new_block_ids=[list(blocks) for _, _, blocks in cached],
            dropped_request_ids=[])
        h.steps += 1
        output = h.runner.execute(plan)
        order[:] = output.request_ids      # the sampled rows' order, as the model returns them
        return dict(zip(output.request_ids, output.sampled_token_ids, strict=True))

    order: list[int] = []
    try:
        # A and C whole (sampled), B's first 6 tokens (not sampled): 28 rows, 2 finished.
        sampled = step(new=[(0, a, [0, 1, 2], 9), (1, b, [3, 4, 5, 6, 7], 6),
                            (2, c, [8, 9, 10, 11], 13)])
        assert outputs[-1].shape == (2, config.hidden_size) and order == [0, 2]
        logits = model.compute_logits(outputs[-1])
        for row, tokens in enumerate((a, c)):
            ref = reference_logits(hf, tokens)[-1]
            assert_close(logits[row], ref, f"row {row}")
        assert sampled == {0: int(reference_logits(hf, a)[-1].argmax()),
                           2: int(reference_logits(hf, c)[-1].argmax())}
        a.append(sampled[0])
        # B's last 12 tokens over the keys and values its first chunk left in the last layer,
        # with A's decode: 13 rows, 2 finished.
        sampled = step(cached=[(1, 12, []), (0, 1, [])])
        assert outputs[-1].shape == (2, config.hidden_size)
        logits = model.compute_logits(outputs[-1])
        assert order == [0, 1]         # the decode's row comes first in the step
        assert_close(logits[0], reference_logits(hf, a)[-1], "A's decode")
        assert_close(logits[1], reference_logits(hf, b)[-1], "B's last row")
        assert sampled == {1: int(reference_logits(hf, b)[-1].argmax()),
                           0: int(reference_logits(hf, a)[-1].argmax())}
    finally:
        hook.remove()
