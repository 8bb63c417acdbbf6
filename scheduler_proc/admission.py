"""What the scheduler refuses at admission: prompts that could never run, bad ids and values."""
from __future__ import annotations

import math

from spmd_runtime.protocol.messages import AddRequest, ModelInfo
from spmd_runtime.scheduler_proc.scheduler import Scheduler


def refusal(message: AddRequest, prompt: list[int], info: ModelInfo,
            scheduler: Scheduler) -> str | None:
    """Why this request (with its prompt as token ids) cannot be served, or None."""
    if not prompt:
        return "prompt is empty: send at least one token"
    cache_tokens = scheduler.num_kv_blocks * info.block_size
    needed = -(-(len(prompt) + 1) // info.block_size)     # the prompt's and one more token's
    window = scheduler.kv.sliding_window
    if window:
        # A window on every layer: a step holds the blocks from its first query's window
        # through the last token of its chunk (the token budget at most), whatever the prompt.
        needed = min(needed, -(-(window - 1 + scheduler.max_num_batched_tokens)
                               // info.block_size) + 1)
    if needed > scheduler.num_kv_blocks:
        return (f"prompt has {len(prompt)} tokens but the whole KV cache holds only "
                f"{cache_tokens} tokens ({scheduler.num_kv_blocks} blocks of "
                f"{info.block_size}), so it could never run; shorten the prompt or give the "
                "cache more memory (--gpu-memory-utilization, --kv-cache-memory or "
                "--num-kv-blocks)")
    if len(prompt) >= info.max_model_len:
        return (f"prompt has {len(prompt)} tokens but this engine's context is "
                f"{info.max_model_len} tokens (prompt + output); shorten the prompt")
    if message.params.stop and not message.detokenize:
        return "stop strings are matched on the output's text: send detokenize=True or drop stop"
    if message.timeout_s is not None and not (
            math.isfinite(message.timeout_s) and message.timeout_s > 0):
        return f"timeout_s must be a number of seconds > 0, got {message.timeout_s}"
    bad = next((t for t in prompt if t < 0 or t >= info.vocab_size), None)
    if bad is not None:
        return f"prompt token id {bad} is outside the vocabulary [0, {info.vocab_size})"
    if message.request_id is not None:
        if message.request_id < 0:
            return f"request_id must be >= 0, got {message.request_id}"
        if scheduler.get(message.request_id) is not None:
            return f"request_id {message.request_id} is already in use; pick another or omit it"
    return None
