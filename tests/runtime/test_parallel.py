"""Parallel layers (runtime/layers/parallel.py): shard layouts, and row-parallel, embedding and
LM-head collectives on a real two-rank gloo group."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.runtime.layers.parallel import (
    ShardLayout,
    TensorParallel,
    row_parallel_linear,
    shard_rows,
    vocab_parallel_embedding,
)


def config(heads: int, kv_heads: int, vocab: int = 100, intermediate: int = 96) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=intermediate,
                       num_hidden_layers=1, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=16, rms_norm_eps=1e-5,
                       rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_ids=(2,))


def test_heads_mlp_and_vocabulary_are_split_evenly() -> None:
    layouts = [ShardLayout.of(config(9, 3), TensorParallel(rank, 3)) for rank in range(3)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start) for s in layouts] == [
        (3, 1, 0), (3, 1, 1), (3, 1, 2)]
    assert [s.intermediate_size for s in layouts] == [32] * 3
    assert [(s.vocab_start, s.vocab_per_rank) for s in layouts] == [(0, 34), (34, 34), (68, 34)]


def test_kv_heads_are_replicated_when_ranks_outnumber_them() -> None:
    layouts = [ShardLayout.of(config(4, 2), TensorParallel(rank, 4)) for rank in range(4)]
    # Ranks 0-1 hold query heads 0-1, which share KV head 0; ranks 2-3 share KV head 1.
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start) for s in layouts] == [
        (1, 1, 0), (1, 1, 0), (1, 1, 1), (1, 1, 1)]


def test_kv_groups_split_whole_where_the_ranks_do_not_divide_them() -> None:
    """smollm2's shape over two ranks: KV heads 0-1 with query heads 0-5, then KV head 2 with
    query heads 6-8; every query head once, each beside its own KV head."""
    layouts = [ShardLayout.of(config(9, 3), TensorParallel(rank, 2)) for rank in range(2)]
    assert [(s.num_heads, s.q_head_start, s.num_kv_heads, s.kv_head_start) for s in layouts] == [
        (6, 0, 2, 0), (3, 6, 1, 2)]
    layouts = [ShardLayout.of(config(10, 5), TensorParallel(rank, 3)) for rank in range(3)]
    assert [(s.num_heads, s.q_head_start, s.num_kv_heads, s.kv_head_start) for s in layouts] == [
        (4, 0, 2, 0), (4, 4, 2, 2), (2, 8, 1, 4)]


@pytest.mark.parametrize(("heads", "kv_heads", "size", "what"), [
    (9, 3, 4, "attention heads"), (12, 4, 6, "key/value heads"), (8, 8, 8, None), (8, 4, 8, None),
    (9, 3, 2, None)])
def test_indivisible_layouts_are_refused(heads, kv_heads, size, what) -> None:
    if what is None:
        ShardLayout.of(config(heads, kv_heads, intermediate=96), TensorParallel(0, size))
    else:
        with pytest.raises(ValueError, match=what):
            ShardLayout.of(config(heads, kv_heads), TensorParallel(0, size))


def test_the_last_vocabulary_shard_is_zero_padded() -> None:
    weight = torch.arange(10.0).view(5, 2)
    assert torch.equal(shard_rows(weight, 3, 3), torch.tensor([[6.0, 7.0], [8.0, 9.0], [0, 0]]))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _collectives(rank: int, size: int, port: int, failures) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        torch.manual_seed(0)                       # the same full tensors on every rank
        weight = torch.randn(48, 64, dtype=torch.float64).float()
        bias = torch.randn(48)
        inputs = {"2d": torch.randn(40, 64), "3d-prefill": torch.randn(3, 20, 64),
                  "3d-decode": torch.randn(24, 1, 64)}
        columns = slice(rank * 32, rank * 32 + 32)
        for chunks in (2, 3, 8):
            chunked = TensorParallel(rank, size, row_parallel_chunks=chunks,
                                     row_parallel_chunk_threshold=1)
            plain = TensorParallel(rank, size)
            for name, x in inputs.items():
                expected = x @ weight.T + bias
                one_shot = row_parallel_linear(x[..., columns], weight[:, columns], bias, plain)
                pieces = row_parallel_linear(x[..., columns], weight[:, columns], bias, chunked)
                if not (torch.allclose(one_shot, expected, atol=1e-4)
                        and torch.allclose(pieces, one_shot, atol=1e-5)):
                    failures.put(f"rank {rank} {name} chunks={chunks}: "
                                 f"{(pieces - expected).abs().max().item()}")
        table = torch.randn(100, 8)
        ids = torch.tensor([0, 49, 50, 99, 7])
        shard = shard_rows(table, rank * 50, 50)
        embedded = vocab_parallel_embedding(ids, shard, rank * 50, TensorParallel(rank, size))
        if not torch.equal(embedded, table[ids]):
            failures.put(f"rank {rank} embedding")
        gathered = TensorParallel(rank, size).gather_last_dim(torch.full((2, 3), float(rank)))
        if not torch.equal(gathered, torch.tensor([[0.0] * 3 + [1.0] * 3] * 2)):
            failures.put(f"rank {rank} gather")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_row_parallel_chunked_equals_single_shot_and_the_full_layer() -> None:
    failures = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_collectives, args=(2, _free_port(), failures), nprocs=2,
                       start_method="spawn")
    found = []
    while not failures.empty():
        found.append(failures.get())
    assert not found, found
