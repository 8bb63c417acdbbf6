"""A worker's model: its shard of the checkpoint loaded, built on its device and its
projections in their serving form (packed for MKL, quantized, or left in GGUF blocks)."""
from __future__ import annotations

import ctypes
import gc
import logging
import time

import msgspec
import torch
from spmd_runtime.protocol.buckets import compiling
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.runtime.layers import cpu_ops, group_quant
from spmd_runtime.runtime.layers.attention_backend import CPP, AttentionBackend, choose_attention_backend
from spmd_runtime.runtime.layers.int8_blocks import int8_keeps_blocks
from spmd_runtime.runtime.layers.linear import can_pack, pack_linear_weights
from spmd_runtime.runtime.layers.parallel import TensorParallel
from spmd_runtime.runtime.layers.quantization import quantize_linear_weights
from spmd_runtime.runtime.loaders import ModelSource, load_model, resolve_model
from spmd_runtime.runtime.models import build_model, shard_spec
from spmd_runtime.worker_proc.chunk_tuning import tensor_parallel, tuned_if_asked
from spmd_runtime.worker_proc.distributed import DistributedContext

log = logging.getLogger("spmd.worker")


def load_worker_model(config: EngineConfig, ctx: DistributedContext, dtype: torch.dtype
                      ) -> tuple[ModelConfig, torch.nn.Module, TensorParallel, AttentionBackend]:
    """This rank's model with its weights in their serving form, and the attention backend
    it runs (chosen before the weights are built, so a backend that cannot run fails fast)."""
    started = time.perf_counter()
    tp = tensor_parallel(config, ctx)
    source = resolve_model(config.model)
    model_config, weights = load_model(
        source, dtype, seed=config.dummy_seed, shard_spec_for=lambda c:
        shard_spec(c, tp), keep_quantized=keeps_blocks(config.quantization, source))
    attention = choose_attention_backend(config.attention_backend, ctx.device, dtype, model_config.head_dim)
    if ctx.rank == 0:
        built = f" (C++ library built for {cpu_ops.loaded().level})" if attention is CPP else ""
        log.info("attention backend %s%s", attention.name, built)
    tp = tuned_if_asked(config, tp, model_config, dtype, ctx.device)
    model = build_model(model_config, dtype, tp)
    model.load_hf_state_dict(weights)
    del weights
    model.to(ctx.device).eval()
    group_quant.move_to(model, ctx.device)
    prepare_weights(config, model, ctx.device, dtype)
    release_free_memory()
    log.info("rank %d loaded %s (%s, %s, tensor-parallel rank %d of %d) in %.1fs", ctx.rank,
             config.model, dtype, ctx.device, tp.rank, tp.size, time.perf_counter() - started)
    shards = model.shards
    if tp.size > 1 and shards.num_heads * tp.size != model_config.num_attention_heads:
        log.info("rank %d holds %d of the %d query heads and %d of the %d key/value heads: the "
                 "ranks do not divide them, so their attention and KV cache are unequal",
                 ctx.rank, shards.num_heads, model_config.num_attention_heads,
                 shards.num_kv_heads, model_config.num_key_value_heads)
    return model_config, model, tp, attention


def keeps_blocks(quantization: str, source: ModelSource) -> bool:
    """Whether a GGUF file's projections load as its blocks: with gguf, and with int8 where
    every layer type is a block of 32 that the library multiplies by 8-bit activations (the
    file's weights unchanged); int8 otherwise quantizes the dequantized projections per output
    channel."""
    if quantization == "gguf":
        return True
    if quantization != "int8" or source.kind != "gguf":
        return False
    from spmd_runtime.runtime.loaders.gguf_file import quantized_layer_types

    keep = int8_keeps_blocks(quantized_layer_types(source.path))
    log.info("--quantization int8: %s", "the file's blocks times 8-bit activations (per block "
             "of 32)" if keep else "the dequantized projections as int8 per output channel")
    return keep


def release_free_memory() -> None:
    """Hand the freed checkpoint tensors' memory back to the OS: tcmalloc (preloaded in CPU
    workers, launch/engine.py) keeps freed pages for reuse, which would leave a worker resident
    at two copies of its weights after loading; glibc's trim does the same without it. A GGUF
    file's mapping goes with its reader, once collected."""
    gc.collect()    # a checkpoint reader in a reference cycle holds its file mapping resident
    process = ctypes.CDLL(None)
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None)
    if release is not None:
        release()
    elif hasattr(process, "malloc_trim"):
        process.malloc_trim(0)


def prepare_weights(config: EngineConfig, model: torch.nn.Module, device: torch.device,
                    dtype: torch.dtype) -> None:
    """Quantize the projections if asked (gguf: kept in the file's blocks at load); otherwise,
    on a CPU worker that does not compile, pack them: float32 for MKL (Intel) or oneDNN, bfloat16 for oneDNN
    (layers/linear.py)."""
    if config.quantization in ("none", "gguf"):
        if can_pack(device, dtype) and not compiling(config, device.type):
            pack_linear_weights(model)
        return
    if device.type != "cpu":
        raise ValueError(f"--quantization {config.quantization} needs a CPU worker, this one "
                         f"runs on {device}")
    quantize_linear_weights(model, config.quantization)


def load_draft_model(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                     vocab_size: int) -> tuple[ModelConfig, torch.nn.Module]:
    """--draft-model whole on this worker (no tensor parallelism: every rank drafts alike), in
    the target's dtype; its quantization as the target's where that is none or int8, else
    resolved for its own file (auto). ValueError when its vocabulary is not the target's."""
    from spmd_runtime.runtime.preflight import resolved_quantization

    started = time.perf_counter()
    quantization = config.quantization if config.quantization in ("none", "int8") else "auto"
    draft_config, _ = resolved_quantization(msgspec.structs.replace(
        config, model=config.draft_model, quantization=quantization, speculative="off",
        draft_model=""))
    source = resolve_model(draft_config.model)
    model_config, weights = load_model(source, dtype, seed=config.dummy_seed,
                                       keep_quantized=keeps_blocks(draft_config.quantization,
                                                                   source))
    if model_config.vocab_size != vocab_size:
        raise ValueError(f"--draft-model {config.draft_model} has a vocabulary of "
                         f"{model_config.vocab_size} tokens, --model {config.model} one of "
                         f"{vocab_size}: the draft must share the target's tokenizer")
    model = build_model(model_config, dtype, TensorParallel())
    model.load_hf_state_dict(weights)
    del weights
    model.to(device).eval()
    group_quant.move_to(model, device)
    prepare_weights(draft_config, model, device, dtype)
    release_free_memory()
    log.info("draft model %s loaded (%s, quantization %s) in %.1fs", config.draft_model, dtype,
             draft_config.quantization, time.perf_counter() - started)
    return model_config, model
