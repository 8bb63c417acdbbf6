"""Sliding-window attention: tiny random checkpoints of Gemma 2, Gemma 3, Mistral and Qwen2
(use_sliding_window), saved by transformers' own classes with a window of 16 tokens on some or
all of their layers, against sequences of 100 tokens and more. The context is the model's
full 256 positions (the window caps nothing), and the engine's logits and greedy tokens (one
and two ranks, the C++ and the torch attention, under prefix caching and chunked prefill
with a pool small enough to preempt) are transformers' own."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
from sharp_llama import FAMILY_SHAPE, VOCAB, ranks_on_one_host, save_sharp
from spmd_runtime.runtime import LLM, SamplingParams
from spmd_runtime.runtime.loaders.hf_dir import load_hf_weights, read_hf_config
from spmd_runtime.runtime.models import build_model

WINDOW = 16
SHAPE = FAMILY_SHAPE  # max_position_embeddings 256: the full context, 16 times the window


def hf_checkpoint(case: str):
    """(transformers model class, its config) of a tiny model of `case` with WINDOW on some
    or all of its layers."""
    import transformers

    if case == "gemma2":
        # As test_model_families' gemma2 (head_dim * heads != hidden_size, a query scale other
        # than head_dim's, soft-caps, eager attention: SDPA drops the soft-cap), the window on
        # every other layer (transformers' layer_types: layer 0 slides, layer 1 is full).
        # Untied head: Gemma scales its embeddings by sqrt(hidden_size), and with the head tied
        # to them a sharp random model's greedy token is the current one, again and again,
        # whatever the attention sees (window or not, the same tokens: no test at all).
        return transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
            **SHAPE, head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=10.0,
            final_logit_softcapping=15.0, sliding_window=WINDOW, tie_word_embeddings=False,
            attn_implementation="eager")
    if case == "gemma3":
        # Two sliding layers (their own rope base) then a full one (linear rope scaling); the
        # head untied as gemma2's.
        return transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
            **{**SHAPE, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=WINDOW, tie_word_embeddings=False,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    if case == "mistral":
        # The window on every layer (MistralConfig has no layer_types).
        return transformers.MistralForCausalLM, transformers.MistralConfig(
            **SHAPE, head_dim=24, sliding_window=WINDOW)
    if case in ("qwen2_all", "qwen2_mixed"):
        # Qwen2Config: layer i slides when use_sliding_window and i >= max_window_layers.
        return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
            **SHAPE, tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
            max_window_layers={"qwen2_all": 0, "qwen2_mixed": 1}[case])
    raise ValueError(case)


CASES = ["gemma2", "gemma3", "mistral", "qwen2_all", "qwen2_mixed"]
# The layers each case's window is on, as transformers builds them (test_transformers_layers).
SLIDING_LAYERS = {"gemma2": (0,), "gemma3": (0, 1), "mistral": (0, 1), "qwen2_all": (0, 1),
                  "qwen2_mixed": (1,)}
# Gemma's norms scale by 1 + weight: weights near 0 keep them near one, as other families'.
NORM_CENTER = {"gemma2": 0.0, "gemma3": 0.0}

GREEDY_50 = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
# Chunks of 16 tokens and a pool of 12 blocks of 16 (no admission watermark). Without the
# window freeing blocks, the four prompts need 4 + 7 + 8 + 9 blocks at the end of their
# generation (less the 2 full blocks of the shared prefix the last two find in the prefix cache):
# far more than 12, so the run preempts; each alone (9 blocks at most) fits.
ENGINE = dict(dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=True,
              max_model_len=256, num_kv_blocks=12, kv_admission_watermark=0.0)


def engine_prompts() -> list[list[int]]:
    """A 3-token prompt, and prompts of 60, 70 and 80 tokens sharing a 40-token prefix: with
    GREEDY_50's output the last three run to 110, 120 and 130 tokens, many windows long."""
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (3,), generator=g).tolist(),
            *(shared + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (20, 30, 40))]


def long_prompt() -> list[int]:
    """110 random token ids, for the prompt logits."""
    return torch.randint(0, VOCAB, (110,), generator=torch.Generator().manual_seed(3)).tolist()


def transformers_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation of `prompt` (GREEDY_50's length, no end token)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=GREEDY_50.max_tokens, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@dataclass
class Checkpoint:
    case: str
    directory: str
    hf: object                      # the transformers model, window on
    _greedy: list[list[int]] | None = field(default=None, repr=False)

    def greedy(self) -> list[list[int]]:
        """transformers' greedy tokens for engine_prompts() (computed once)."""
        if self._greedy is None:
            self._greedy = [transformers_greedy(self.hf, p) for p in engine_prompts()]
        return self._greedy

    def without_window(self):
        """The same weights with the window longer than the context: full attention."""
        config = copy.deepcopy(self.hf.config)
        config.sliding_window = 4 * SHAPE["max_position_embeddings"]
        model = type(self.hf)(config).float().eval()
        model.load_state_dict(self.hf.state_dict())
        return model


@pytest.fixture(scope="module")
def built() -> dict[str, Checkpoint]:
    """The checkpoints saved so far, by case: each is built once whatever the order of tests
    (test_engine_greedy_equals_transformers names its cases itself)."""
    return {}


@pytest.fixture(scope="module", params=CASES)
def checkpoint(request, built, tmp_path_factory) -> Checkpoint:
    """One case's sharp tiny checkpoint: its directory and transformers model."""
    case = request.param
    if case not in built:
        model_class, config = hf_checkpoint(case)
        directory, hf = save_sharp(tmp_path_factory.mktemp(case), lambda: model_class(config),
                                   NORM_CENTER.get(case, 1.0))
        built[case] = Checkpoint(case, directory, hf)
    return built[case]


def test_transformers_layers(checkpoint) -> None:
    """transformers slides the layers SLIDING_LAYERS names (Mistral: every layer, it has no
    layer_types), with the window of WINDOW tokens."""
    config = checkpoint.hf.config
    assert config.sliding_window == WINDOW
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    assert tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention") == (
        SLIDING_LAYERS[checkpoint.case])


def test_window_changes_the_reference(checkpoint) -> None:
    """Guards the tests below: the window changes transformers' logits past its length (not
    before), and the greedy tokens of each long engine prompt. An engine attending to the
    whole context would fail them."""
    hf, full = checkpoint.hf, checkpoint.without_window()
    ids = torch.tensor([long_prompt()])
    with torch.inference_mode():
        diff = (hf(ids).logits[0] - full(ids).logits[0]).abs().amax(dim=-1)
    print(f"{checkpoint.case}: max |logit difference| with and without the window "
          f"{float(diff[:WINDOW].max()):.1e} before position {WINDOW}, "
          f"{float(diff[WINDOW:].max()):.2f} after")
    assert float(diff[:WINDOW].max()) < 1e-5
    assert float(diff[WINDOW:].max()) > 1e-2
    for prompt, tokens in zip(engine_prompts(), checkpoint.greedy(), strict=True):
        if len(prompt) + len(tokens) >= 100:
            assert tokens != transformers_greedy(full, prompt), len(prompt)


def test_config_reports_full_context(checkpoint) -> None:
    """The window caps nothing: the context is max_position_embeddings, and the window and
    the layers it is on are the config's."""
    config = read_hf_config(checkpoint.directory)
    assert config.max_position_embeddings == SHAPE["max_position_embeddings"]
    assert config.sliding_window == WINDOW
    assert config.sliding_layers == SLIDING_LAYERS[checkpoint.case]


def test_logits_equal_transformers(checkpoint) -> None:
    directory, hf = checkpoint.directory, checkpoint.hf
    config = read_hf_config(directory)
    model = build_model(config, torch.float32)
    model.load_hf_state_dict(load_hf_weights(directory, config, torch.float32))
    ids = long_prompt()
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    diff = float((model.eval().prompt_logits(ids) - expected).abs().max())
    print(f"{checkpoint.case}: max |logit difference| {diff:.2e}")
    assert diff < 1e-4


def engine_greedy_equals_transformers(checkpoint: Checkpoint, tp: int, **options):
    """Asserts the engine's greedy tokens are transformers'; returns its stats."""
    with LLM(checkpoint.directory, **ranks_on_one_host(tp), **ENGINE, **options) as llm:
        outputs = llm.generate(engine_prompts(), GREEDY_50)
        stats = llm.client.stats()
    # The window frees blocks, which may spare the run its preemptions: reported, not asserted.
    print(f"{checkpoint.case} tp={tp} {options}: {stats.num_preemptions} preemptions, "
          f"{stats.prefix_cache_hits} prefix-cache hits; {stats}")
    assert stats.prefix_cache_hits > 0, stats
    assert [o.token_ids for o in outputs] == checkpoint.greedy()
    return stats


# Two ranks for two cases only (each engine start costs seconds): Mistral's window on every
# layer, Gemma 3's on some.
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("checkpoint", "tp"), [*((case, 1) for case in CASES),
                                                ("mistral", 2), ("gemma3", 2)],
                         indirect=["checkpoint"])
def test_engine_greedy_equals_transformers(checkpoint, tp) -> None:
    engine_greedy_equals_transformers(checkpoint, tp)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpoint", ["mistral"], indirect=True)
def test_engine_torch_attention_equals_transformers(checkpoint) -> None:
    """The torch attention backend (its masks) as well as the C++ kernels, CPU's default."""
    engine_greedy_equals_transformers(checkpoint, 1, attention_backend="torch")


def window_bound(chunk: int, block_size: int = 16) -> int:
    """The most blocks a windowed layer's table holds in a step of `chunk` tokens: those
    spanning the first query's window through the chunk's last token, across a block edge."""
    return -(-(WINDOW - 1 + chunk) // block_size) + 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpoint", ["mistral", "gemma3"], indirect=True)
def test_window_blocks_stay_bounded(checkpoint) -> None:
    """One 250-token sequence (a 200-token prompt, 50 outputs: 16 blocks) holds at most
    window_bound blocks of its windowed layers' pool at any time. Mistral's window is on every
    layer: a pool of 4 blocks (64 tokens) serves it, its full 256-token context reported.
    Gemma 3 mixes windowed and full layers: its full layers' pool holds the whole sequence,
    its windowed layers' pool a window's worth."""
    prompt = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    every_layer = checkpoint.case == "mistral"
    options = {**ENGINE, "num_kv_blocks": 4 if every_layer else 20}
    with LLM(checkpoint.directory, **options) as llm:
        (output,) = llm.generate([prompt], GREEDY_50)
        stats = llm.client.stats()
        assert llm.client.model_info().max_model_len == SHAPE["max_position_embeddings"]
    print(stats)
    assert stats.sliding_window == WINDOW
    assert 0 < stats.kv_window_blocks_peak <= window_bound(ENGINE["max_num_batched_tokens"])
    assert stats.kv_window_blocks_total == (4 if every_layer else 20)
    assert output.token_ids == transformers_greedy(checkpoint.hf, prompt)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("checkpoint", "mode"), [("mistral", "bucketed"), ("gemma3", "bucketed"),
                                                  ("gemma3", "compiled")],
                         indirect=["checkpoint"])
def test_bucketed_steps_equal_transformers(checkpoint, mode) -> None:
    """Steps padded to buckets: prompts one per row of the bucket's length, decodes in a
    bucket's batch over its context length, a window on every layer (Mistral) or on some,
    in block tables of their own (Gemma 3); compiled, from the static inputs a bucket graph
    reads (both KV groups' slots and tables among them)."""
    buckets = dict(execution_mode=mode, prompt_bs_bucket="1,1,1", prompt_seq_bucket="16,16,16",
                   decode_bs_bucket="4,4,4", decode_seq_bucket="256,256,256")
    with LLM(checkpoint.directory, **{**ENGINE, **buckets}) as llm:
        outputs = llm.generate(engine_prompts(), GREEDY_50)
        stats = llm.client.stats()
    assert stats.bucketing and stats.batches_outside_buckets == 0, stats
    assert stats.runtime_graph_compilations == 0, stats
    assert [o.token_ids for o in outputs] == checkpoint.greedy()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpoint", ["gemma3"], indirect=True)
def test_ngram_speculation_equals_transformers(checkpoint) -> None:
    """Proposals verified under windows: blocks for each request's proposals in both pools."""
    engine_greedy_equals_transformers(checkpoint, 1, speculative="ngram")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpoint", ["gemma3"], indirect=True)
@pytest.mark.parametrize("draft", ["llama", "itself"])
def test_draft_speculation_equals_transformers(checkpoint, draft, tmp_path) -> None:
    """A target mixing windowed and full layers, with a draft model: a full-attention tiny
    Llama, whose layers read the full layers' block tables, or the target itself, whose
    windowed layers read the windowed pool's tables (its KV cache has a pool of each)."""
    from sharp_llama import sharp_llama

    model = checkpoint.directory if draft == "itself" else sharp_llama(tmp_path)[0]
    stats = engine_greedy_equals_transformers(checkpoint, 1, speculative="draft",
                                              draft_model=model)
    assert stats.spec_decode_num_drafts > 0, stats
    if draft == "itself":
        assert stats.spec_decode_acceptance_rate > 0.9, stats


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpoint", ["gemma2", "gemma3"], indirect=True)
def test_swapped_requests_of_mixed_windows_equal_transformers(checkpoint) -> None:
    """Swap space for a model mixing full and windowed layers: a preempted request's context
    goes to CPU blocks from both pools (the windowed layers' blocks its window still reaches)
    and comes back into fresh blocks of each; the tokens are transformers'."""
    stats = engine_greedy_equals_transformers(checkpoint, 1, kv_swap_memory="4MiB")
    assert stats.num_swaps_out > 0 and stats.num_swaps_in > 0, stats


@pytest.mark.timeout(300)
@pytest.mark.parametrize("checkpoint", ["gemma3"], indirect=True)
def test_bucketed_verify_steps_equal_transformers(checkpoint) -> None:
    """Prompt lookup with buckets on a model mixing windowed and full layers: a verifying
    request's rows are decode rows of the bucket, each attending (in each KV group, the
    windowed one under its window) to its context up to itself."""
    buckets = dict(execution_mode="bucketed", prompt_bs_bucket="1,1,1", prompt_seq_bucket="16,16,16",
                   decode_bs_bucket="4,4,16", decode_seq_bucket="256,256,256")
    stats = engine_greedy_equals_transformers(checkpoint, 1, speculative="ngram", **buckets)
    assert stats.spec_decode_num_drafts > 0 and stats.batches_outside_buckets == 0, stats
