"""The Triton kernel behind runtime.layers.triton_attention (see its docstring). A module of its
own so that importing the model imports Triton only when the kernel is first used."""
import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, lengths_ptr,
                         out_ptr, scale, stride_qb, stride_qh, stride_cs, stride_ch,
                         stride_bt, stride_ob, stride_oh,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         TILE: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    length = tl.load(lengths_ptr + seq)
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for start in range(0, length, TILE):
        tokens = start + tl.arange(0, TILE)
        token_ok = tokens < length
        blocks = tl.load(block_tables_ptr + seq * stride_bt + tokens // BLOCK_SIZE,
                         mask=token_ok, other=0)
        slots = blocks.to(tl.int64) * BLOCK_SIZE + tokens % BLOCK_SIZE
        offsets = slots[:, None] * stride_cs + kv_head * stride_ch + dims[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=token_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(token_ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        weights = tl.exp(scores - new_max[:, None])
        rescale = tl.exp(running_max - new_max)
        running_sum = running_sum * rescale + tl.sum(weights, 1)
        v = tl.load(v_cache_ptr + offsets, mask=token_ok[:, None], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
    out = acc / running_sum[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
