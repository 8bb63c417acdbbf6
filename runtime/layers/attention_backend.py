"""The attention backend a worker runs, chosen once at start-up (--attention-backend): how a
step's new keys and values go into the paged cache, how single-token queries attend (reading the
cache in place, or over gathered copies through SDPA), how a fresh prompt attends, and whether
the layers' element-wise chains run as the C++ library's fused passes.

    torch   index_copy_ writes, gathered context and SDPA; the torch layer chains
    triton  the Triton decode kernel reading the cache in place (CUDA, or interpreted on CPU)
    cpp     the C++ CPU library (runtime/layers/cpu_ops.py): KV write, decode and fresh-prompt
            attention (and, bf16 on AVX512-BF16, prompt chunks over cached context), fused
            norms / rotary / SiLU x up and the one-call decode stack; float32 and bfloat16,
            reading and writing the cache in place with float32 accumulation
"""
from __future__ import annotations

import functools

import torch
from spmd_runtime.runtime import cpu_features
from spmd_runtime.runtime.layers import cpu_attention, cpu_ops, triton_attention


class AttentionBackend:
    """torch: the reference every other backend is tested against."""

    name = "torch"
    # Decode groups carry each row's context length and the kernel reads only that much of the
    # cache (no mask, no grouping by length).
    reads_cache_in_place = False
    # The C++ element-wise passes (FUSED_CPU) and, where a batch allows, the one-call decode
    # of every layer (runtime/models/llama.py).
    fused_layers = False
    # Whether that one-call decode stack takes a sliding window (per-row `starts`, the same for
    # every layer), so a model whose layers share a window may still run it.
    windowed_decode_stack = False

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
               scale: float, starts: torch.Tensor | None = None) -> torch.Tensor:
        """One query per row against its context read in place; with `starts` ([n] int32, a
        sliding window) row i attends its tokens starts[i] .. lengths[i] - 1 only."""
        raise NotImplementedError(f"the {self.name} backend gathers decode context for SDPA")

    def fresh_prompt(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor | None:
        """Causal attention of a prompt with no cached context, [T, heads, dim], each query
        over its last `window` positions where given; None: SDPA."""
        return None

    def cached_prompt(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      blocks: torch.Tensor, first_key: int, position: int, block_size: int,
                      scale: float, window: int | None = None) -> torch.Tensor | None:
        """Causal attention of a prompt chunk at positions position.. over its cached context
        and itself (its keys and values already in the caches; key first_key + j in block
        blocks[j // block_size]), [T, heads, dim]; None: SDPA over the gathered blocks."""
        return None

    def __repr__(self) -> str:
        return f"AttentionBackend({self.name})"


class TritonAttention(AttentionBackend):
    name = "triton"
    reads_cache_in_place = True

    def decode(self, q, k_cache, v_cache, block_tables, lengths, block_size, scale, starts=None):
        return triton_attention.paged_decode_attention(q, k_cache, v_cache, block_tables,
                                                       lengths, block_size, scale, starts)


class CppAttention(AttentionBackend):
    name = "cpp"
    reads_cache_in_place = True
    fused_layers = True
    windowed_decode_stack = True        # spmd_cpu::decode_layers takes `starts`
    dtypes = (torch.float32, torch.bfloat16)

    def write_kv(self, k, v, k_cache, v_cache, slots):
        torch.ops.spmd_cpu.write_kv(k, v, k_cache, v_cache, slots)

    def decode(self, q, k_cache, v_cache, block_tables, lengths, block_size, scale, starts=None):
        return cpu_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, lengths,
                                                    block_size, scale, starts)

    def fresh_prompt(self, q, k, v, scale, window=None):
        # MKL's sgemm multiplies its tiles (torch links it; the library finds it at load).
        if not torch.backends.mkl.is_available():
            return None
        return torch.ops.spmd_cpu.prefill_attention(q, k, v, scale, window or 0)

    def cached_prompt(self, q, k_cache, v_cache, blocks, first_key, position, block_size, scale,
                      window=None):
        # The bf16 tiles read the cache in place; other dtypes and builds gather for SDPA.
        if q.dtype != torch.bfloat16 or not paged_prompt_supported(q.shape[-1]):
            return None
        return torch.ops.spmd_cpu.prefill_attention_paged(
            q, k_cache, v_cache, blocks, block_size, first_key, position, scale, window or 0)


@functools.cache
def paged_prompt_supported(head_dim: int) -> bool:
    """Whether the loaded C++ library runs prompt chunks over cached context at this head
    size (a build with AVX512-BF16; head sizes 64 and 128)."""
    return bool(torch.ops.spmd_cpu.paged_prompt_supported(head_dim))


TORCH, TRITON, CPP = AttentionBackend(), TritonAttention(), CppAttention()


def choose_attention_backend(requested: str, device: torch.device, dtype: torch.dtype,
                             head_dim: int) -> AttentionBackend:
    """--attention-backend for a worker: auto is cpp on a CPU whose library is built, triton on
    CUDA where it runs this head size, torch otherwise; a backend asked for by name that cannot
    run here is an error saying what to change. On CUDA, SDPA is kept off cuDNN whichever
    backend is chosen (avoid_per_shape_sdpa_plans)."""
    if device.type == "cuda":
        avoid_per_shape_sdpa_plans()
    if requested == "torch":
        return TORCH
    if requested == "cpp" or (requested == "auto" and device.type == "cpu"):
        return _cpp_backend(requested, device, dtype)
    on_device = device.type == "cuda" or (requested == "triton" and triton_attention.interpreting())
    usable = triton_attention.available() and on_device and head_dim >= triton_attention.MIN_DOT \
        and head_dim & (head_dim - 1) == 0
    if requested == "triton" and not usable:
        raise ValueError(
            f"--attention-backend triton needs Triton installed, a CUDA device (or "
            f"TRITON_INTERPRET=1 on CPU) and a power-of-two head dim >= 16 (this model: "
            f"{head_dim}, device {device}); use --attention-backend torch or auto")
    return TRITON if usable else TORCH


def avoid_per_shape_sdpa_plans() -> None:
    """Keep torch's SDPA on its flash, memory-efficient and math kernels, off cuDNN's.

    Packed prompt steps attend each prompt with its own SDPA call, and prompt lengths vary
    from step to step. cuDNN's attention (which torch may pick on Hopper) builds an execution
    plan for every new shape, tens to hundreds of milliseconds each: on an H200 the 8,192-token
    prompt steps of the issue10 workload took 0.4-1.2 s each where the same step warmed up in
    48 ms (docs/BENCHMARKS.md). Flash attention has no per-shape set-up."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def _cpp_backend(requested: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    if device.type != "cpu" or dtype not in CppAttention.dtypes:
        if requested == "cpp":
            raise ValueError(f"--attention-backend cpp runs float32 or bfloat16 on the CPU (this "
                             f"worker: {dtype} on {device}); use --attention-backend torch or auto")
        return TORCH
    # A CPU below every build level (no AVX2) has no library to miss: auto serves without it.
    if requested == "auto" and not cpu_features.detect().kernel_levels:
        return TORCH
    if cpu_ops.load():
        return CPP
    raise ValueError(f"--attention-backend {requested}: {cpu_ops.loaded().missing}; or start "
                     f"with --attention-backend torch to serve without them")
