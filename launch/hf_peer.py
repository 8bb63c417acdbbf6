"""Hugging Face transformers' continuous batching as the peer of our offline throughput run:
the same model and weights (a dummy model carries the very same random weights), the same
prompts and per-request output lengths, greedy with EOS ignored, the same dtype and device.
`spmdrun bench throughput --with-peer` runs it after its own run (`--peer-api`: through
generate_batch's manager, timed from the first request to the last result like ours, or one
generate_batch call timed whole; flash attention is never switched in: sdpa, as loaded)."""
from __future__ import annotations

import contextlib
import inspect
import logging
import time

from spmd_runtime.launch.bench import ThroughputReport
from spmd_runtime.protocol.config import EngineConfig, step_token_budget
from spmd_runtime.runtime.cpu_features import resolve_dtype_name
from spmd_runtime.runtime.loaders import load_model, resolve_model

# The row's label (the table's engine column is 24 characters wide).
ENGINE = "transformers (sdpa)"
# A prompt no benchmark prompt starts with (as our warm-up's), and too short to share a block.
WARMUP_PROMPT = [3] * 8
# The attention the peer runs (ENGINE's label): transformers_model() loads it.
ATTENTION = "sdpa"

log = logging.getLogger("spmd.launch")


def resolve_dtype_device(dtype: str = "auto", device: str = "auto"):
    """Our engine's rules: auto device is cuda when there is one; auto dtype as a worker
    resolves it (runtime/cpu_features.py resolve_dtype_name)."""
    import torch
    torch_device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto"
                                else device)
    return getattr(torch, resolve_dtype_name(dtype, torch_device.type)[0]), torch_device


def transformers_model(model: str, dtype: str = "auto", device: str = "auto", seed: int = 0):
    """transformers' LlamaForCausalLM (sdpa, eval mode) on `device` in `dtype`, holding exactly
    the weights our workers load for `model` (dummy models: the random weights of `seed`)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5
        from transformers.modeling_utils import no_init_weights

    torch_dtype, torch_device = resolve_dtype_device(dtype, device)
    config, weights = load_model(resolve_model(model), torch_dtype, seed)
    hf_config = LlamaConfig.from_dict({**config.to_hf_dict(), "attention_bias": any(
        name.endswith(".bias") for name in weights)})
    # Built on the device with uninitialised parameters: every one is loaded just below.
    with torch.device(torch_device), no_init_weights():
        hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch_dtype,
                                                    attn_implementation=ATTENTION)
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    hf_model.load_state_dict(weights, strict=True)
    return hf_model.eval()


def accepted_options(config_class) -> frozenset[str]:
    """The keyword arguments `config_class(...)` takes by name (a dataclass: its init fields)."""
    parameters = inspect.signature(config_class.__init__).parameters.values()
    return frozenset(p.name for p in parameters if p.name != "self"
                     and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def batching_config(max_batch_tokens: int | None = None, kv_tokens: int | None = None,
                    config_class=None):
    """transformers' ContinuousBatchingConfig (or `config_class`, one of its versions): sdpa
    kept, and where given, the step token budget and a KV cache of at least kv_tokens tokens
    (else sized from free memory, as generate_batch does; on CPU that takes ~15 s to set up,
    for a cache of gigabytes). Only the options this version takes are passed, each one left
    out is logged: 5.17 has no auto_switch_to_flash (sdpa_held() keeps sdpa there instead),
    and it counts its page in block_size where later versions have page_size."""
    if config_class is None:
        from transformers import ContinuousBatchingConfig as config_class
    wanted = {"auto_switch_to_flash": False}
    if max_batch_tokens is not None:
        wanted["max_batch_tokens"] = max_batch_tokens
    accepted = accepted_options(config_class)
    for name in sorted(wanted.keys() - accepted):
        log.info("this transformers' ContinuousBatchingConfig takes no %s: left at its default "
                 "(%s=%s not applied)", name, name, wanted[name])
    config = config_class(**{name: value for name, value in wanted.items() if name in accepted})
    if kv_tokens:
        page_tokens = getattr(config, "page_size", None) or config.block_size
        config.num_blocks = -(-kv_tokens // page_tokens)
    return config


@contextlib.contextmanager
def sdpa_held(hf_model, batching):
    """Keep the model on sdpa through a continuous-batching run. A config with
    auto_switch_to_flash (False, from batching_config()) does it. transformers 5.17 has none:
    its manager switches an sdpa model to flash attention wherever flash is installed, unless
    the model is on a paged implementation already; so the model is put on "paged|sdpa" for
    the run (what that manager itself sets when it does not switch), and back on sdpa after."""
    if hasattr(batching, "auto_switch_to_flash"):
        yield
        return
    log.info("no auto_switch_to_flash in this transformers: the peer sets paged|%s for the run, "
             "which its manager keeps", ATTENTION)
    hf_model.set_attn_implementation(f"paged|{ATTENTION}")
    try:
        yield
    finally:
        hf_model.set_attn_implementation(ATTENTION)


def same_sizes(config: EngineConfig) -> dict:
    """run_transformers() options giving transformers our engine's step token budget and, where
    --num-kv-blocks sets it, our KV cache capacity in tokens."""
    device = resolve_dtype_device(config.dtype, config.device)[1]
    return {"max_batch_tokens": step_token_budget(config, device.type),
            "kv_tokens": config.num_kv_blocks * config.block_size or None}


def generate_per_request(hf_model, prompts: list[list[int]], output_lens: list[int],
                         batching=None) -> tuple[list[list[int]], float]:
    """Greedy continuations (EOS ignored) of each prompt, output_lens[i] tokens for prompt i,
    through transformers' continuous batching (`batching`: a batching_config(), by default
    transformers' own sizes); and the seconds they took (see the module doc)."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    # An id no token has, so generation never stops early (our ignore_eos).
    config = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=-1,
                              pad_token_id=0)
    # What generate_batch hints for the same requests; it sizes the batch and the cache.
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)),
                          max_generated_length=max(output_lens), num_requests=len(prompts))
    batching = batching or batching_config()
    with sdpa_held(hf_model, batching), hf_model.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=5, workload_hints=hints,
            continuous_batching_config=batching,
    ) as manager:
        _finish(manager, [manager.add_request(WARMUP_PROMPT, max_new_tokens=2)])
        started = time.perf_counter()
        request_ids = [manager.add_request(prompt, max_new_tokens=n)
                       for prompt, n in zip(prompts, output_lens, strict=True)]
        results = _finish(manager, request_ids)
        elapsed = time.perf_counter() - started
    return [list(results[r].generated_tokens) for r in request_ids], elapsed


def generate_batch_call(hf_model, prompts: list[list[int]], output_len: int
                        ) -> tuple[list[list[int]], float]:
    """The prompts through one `generate_batch` call, timed whole, as a user calls it (its
    manager's set-up included; one output length for all), after a 2-token warm-up call.
    Returns the outputs in no particular order, and the seconds."""
    from transformers import GenerationConfig

    def config(n: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=-1, pad_token_id=0)

    # No inference_mode here: generate_batch runs its loop on a thread of its own.
    hf_model.generate_batch(inputs=[WARMUP_PROMPT], generation_config=config(2))
    started = time.perf_counter()
    results = hf_model.generate_batch(inputs=prompts, generation_config=config(output_len))
    elapsed = time.perf_counter() - started
    errors = [r.error for r in results.values() if r.error]
    if errors or len(results) != len(prompts):
        raise RuntimeError(f"transformers generate_batch failed: {errors[:1]}")
    # Keyed by request id, not in prompt order: only their lengths are used.
    return [list(r.generated_tokens) for r in results.values()], elapsed


def _finish(manager, request_ids: list) -> dict:
    """Wait for every request's final result; RuntimeError if one fails or the loop stops."""
    if None in request_ids:
        raise RuntimeError("transformers' continuous batching manager refused a request")
    pending, results = set(request_ids), {}
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' generation thread stopped with requests pending")
            continue
        if not result.is_finished():
            continue
        if result.error:
            raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
        results[result.request_id] = result
        pending.discard(result.request_id)
    return results


def run_transformers(model: str, prompts: list[list[int]], output_lens: list[int],
                     dtype: str = "auto", device: str = "auto", seed: int = 0,
                     threads: int | None = None, max_batch_tokens: int | None = None,
                     kv_tokens: int | None = None, api: str = "manager") -> ThroughputReport:
    """The throughput row of transformers on `model` (our model name, e.g. dummy:llama-3.2-1b);
    max_batch_tokens and kv_tokens as in batching_config(). api "generate_batch": one timed
    generate_batch call instead (a fixed output length only)."""
    import torch
    if threads:
        torch.set_num_threads(threads)
    hf_model = transformers_model(model, dtype, device, seed)
    try:
        if api == "generate_batch":
            if len(set(output_lens)) != 1:
                raise ValueError("--peer-api generate_batch takes one output length for every "
                                 "request: use --output-len")
            outputs, elapsed = generate_batch_call(hf_model, prompts, output_lens[0])
        else:
            outputs, elapsed = generate_per_request(hf_model, prompts, output_lens,
                                                    batching_config(max_batch_tokens, kv_tokens))
    finally:
        del hf_model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return ThroughputReport(ENGINE, len(prompts), sum(map(len, prompts)), sum(map(len, outputs)),
                            elapsed)
