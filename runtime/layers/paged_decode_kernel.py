"""The Triton kernel behind runtime.layers.triton_attention (see its docstring). A module of its
own so that importing the model imports Triton only when the kernel is first used."""
import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, lengths_ptr,
                         starts_ptr, out_ptr, scale, stride_qb, stride_qh, stride_cs, stride_ch,
                         stride_bt, stride_ob, stride_oh,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         TILE: tl.constexpr, PRECISION: tl.constexpr,
                         WHILE_LOOP: tl.constexpr, HAS_STARTS: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    length = tl.load(lengths_ptr + seq)
    # A sliding window: the walk starts at the tile holding the first attended token, so the
    # tokens (and table entries) of earlier tiles are never read; earlier ones in it are masked.
    if HAS_STARTS:
        first = tl.load(starts_ptr + seq)
    else:
        first = 0
    begin = first - first % TILE
    table_ptr = block_tables_ptr + seq * stride_bt
    head_offsets = kv_head * stride_ch + dims[None, :]
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    if WHILE_LOOP:
        # Triton's interpreter up to 3.6 holds every scalar as a one-element array and gives
        # range() its bound with int(array), which NumPy >= 2.4 refuses (triton-lang/triton
        # issue 9171): a range() over the loaded length fails there. A while condition only
        # takes the scalar's truth value.
        start = begin
        while start < length:
            running_max, running_sum, acc = attend_tile(
                start, first, length, q, running_max, running_sum, acc, k_cache_ptr, v_cache_ptr,
                table_ptr, head_offsets, scale, stride_cs, BLOCK_SIZE, TILE, PRECISION)
            start += TILE
    else:
        # Compiled, a for loop: the compiler software-pipelines it (prefetching the next
        # tiles' K and V), which it does not do for a while loop.
        for start in range(begin, length, TILE):
            running_max, running_sum, acc = attend_tile(
                start, first, length, q, running_max, running_sum, acc, k_cache_ptr, v_cache_ptr,
                table_ptr, head_offsets, scale, stride_cs, BLOCK_SIZE, TILE, PRECISION)
    out = acc / running_sum[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def attend_tile(start, first, length, q, running_max, running_sum, acc, k_cache_ptr,
                v_cache_ptr, table_ptr, head_offsets, scale, stride_cs, BLOCK_SIZE: tl.constexpr,
                TILE: tl.constexpr, PRECISION: tl.constexpr):
    """One step of the online softmax over context tokens start .. start + TILE (those before
    `first` or past `length` masked, their table entries not read): their slots from the block
    table, then scores, rescale and accumulate. Every tile walked holds at least one attended
    token, so the running max is finite after the first."""
    tokens = start + tl.arange(0, TILE)
    token_ok = (tokens >= first) & (tokens < length)
    blocks = tl.load(table_ptr + tokens // BLOCK_SIZE, mask=token_ok, other=0)
    slots = blocks.to(tl.int64) * BLOCK_SIZE + tokens % BLOCK_SIZE
    offsets = slots[:, None] * stride_cs + head_offsets
    k = tl.load(k_cache_ptr + offsets, mask=token_ok[:, None], other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    scores = tl.where(token_ok[None, :], scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1))
    weights = tl.exp(scores - new_max[:, None])
    rescale = tl.exp(running_max - new_max)
    running_sum = running_sum * rescale + tl.sum(weights, 1)
    v = tl.load(v_cache_ptr + offsets, mask=token_ok[:, None], other=0.0)
    acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
    return new_max, running_sum, acc
