"""Sizing one worker's KV cache (worker_proc.kv_cache).

--num-kv-blocks is taken as given; --kv-cache-memory (bytes, or a size such as 4GiB) is divided
into whole blocks; otherwise a CPU worker takes 2 GiB, or a quarter of its share of the available
RAM where that is less, and a CUDA worker what gpu_memory_utilization x free memory leaves once
the activations of a profiling forward pass are set aside. All but the first are capped at the
blocks that max_num_seqs x max_model_len can use. The profiled path is checked with free memory
and the profile peak pinned to fixed numbers (no CUDA needed); the profiling pass itself runs
for real on a tiny model. The worker's build_runner turns --kv-swap-memory into CPU blocks of the
same size.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from spmd_runtime.protocol.config import EngineConfig
from spmd_runtime.worker_proc import kv_cache
from spmd_runtime.worker_proc.distributed import DistributedContext
from spmd_runtime.worker_proc.kv_cache import CacheSizing, bytes_per_block, size_kv_cache
from spmd_runtime.worker_proc.worker import build_runner
from test_model_runner import build_pair

CPU = torch.device("cpu")
CUDA = torch.device("cuda")      # only named: sizing with pinned numbers touches no device
GIB = 2**30


@pytest.fixture(scope="module")
def model():
    return build_pair(seed=5)[1]


def per_block(model, block_size: int = 16) -> int:
    config = model.config
    # K and V, every layer, block_size slots of kv_heads x head_dim float32 values.
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads \
        * config.head_dim * 4


def weights_bytes(model) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


@pytest.fixture
def no_profiling(monkeypatch):
    """Fail if the explicit sizes run the profiling pass or look at free memory."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("an explicit KV-cache size must not profile or measure memory")

    monkeypatch.setattr(kv_cache, "profile_forward_peak", refuse)
    monkeypatch.setattr(kv_cache, "free_memory", refuse)


def test_bytes_per_block(model) -> None:
    config = model.config
    assert bytes_per_block(config, 16, torch.float32) == per_block(model) == 2 * 2 * 16 * 2 * 16 * 4
    assert bytes_per_block(config, 4, torch.bfloat16) == per_block(model, 4) // 2


def test_a_rank_sizes_its_blocks_by_its_own_kv_heads(model, no_profiling) -> None:
    """Three KV heads over two ranks: rank 0 holds two, rank 1 one, and each rank's blocks (and
    the memory budget's count of them) are sized by its own."""
    from spmd_runtime.runtime.layers.parallel import TensorParallel
    from spmd_runtime.runtime.models.llama import LlamaForCausalLM

    config = dataclasses.replace(model.config, num_attention_heads=6, num_key_value_heads=3,
                                 hidden_size=96, head_dim=16)
    ranks = [LlamaForCausalLM(config, torch.float32, TensorParallel(rank, 2)) for rank in (0, 1)]
    one_head = 2 * config.num_hidden_layers * 16 * config.head_dim * 4
    sizings = [size_kv_cache(EngineConfig(kv_cache_memory=12 * one_head), rank, torch.float32,
                             CPU, max_useful_blocks=1000) for rank in ranks]
    assert [s.bytes_per_block for s in sizings] == [2 * one_head, one_head]
    assert [s.num_blocks for s in sizings] == [6, 12]
    caches = kv_cache.allocate_kv_cache(config, 4, 16, torch.float32, CPU, ranks[1].shards.num_kv_heads)
    assert caches[0][0].shape == (64, 1, 16)


def test_num_kv_blocks_is_taken_as_given(model, no_profiling) -> None:
    sizing = size_kv_cache(EngineConfig(num_kv_blocks=37), model, torch.float32, CPU,
                           max_useful_blocks=1000)
    assert sizing.how == "num_kv_blocks"
    assert sizing.num_blocks == 37
    assert sizing.bytes_per_block == per_block(model)
    assert sizing.kv_cache_bytes == 37 * per_block(model)
    assert sizing.weights_bytes == weights_bytes(model)
    # It wins over --kv-cache-memory.
    both = size_kv_cache(EngineConfig(num_kv_blocks=5, kv_cache_memory=100 * per_block(model)),
                         model, torch.float32, CPU, max_useful_blocks=1000)
    assert (both.how, both.num_blocks) == ("num_kv_blocks", 5)


@pytest.mark.parametrize(("memory_blocks", "extra_bytes", "max_useful", "blocks", "capped"), [
    (10, 0, 1000, 10, 0),
    (10, -1, 1000, 9, 0),          # whole blocks only
    (10, 1, 1000, 10, 0),
    (10, 0, 4, 4, 4),              # more than max_num_seqs x max_model_len can use
    (10, 0, 10, 10, 0),
    (0, 100, 1000, 0, 0),          # less than one block
])
def test_kv_cache_memory_is_divided_into_whole_blocks(model, no_profiling, memory_blocks,
                                                      extra_bytes, max_useful, blocks,
                                                      capped) -> None:
    memory = memory_blocks * per_block(model) + extra_bytes
    sizing = size_kv_cache(EngineConfig(kv_cache_memory=memory), model, torch.float32, CPU,
                           max_useful_blocks=max_useful)
    assert sizing.how == "kv_cache_memory"
    assert sizing.num_blocks == blocks
    assert sizing.capped_at == capped
    assert sizing.kv_cache_bytes == blocks * per_block(model) <= memory


def test_kv_cache_memory_takes_a_size_with_a_unit(model, no_profiling) -> None:
    sizing = size_kv_cache(EngineConfig(kv_cache_memory="1MiB"), model, torch.float32, CPU,
                           max_useful_blocks=10**6)
    assert sizing.num_blocks == 2**20 // per_block(model)


class Pinned:
    """free_memory and profile_forward_peak replaced by fixed numbers, calls recorded."""

    def __init__(self, monkeypatch, free: int, peak: int) -> None:
        self.free_calls: list[tuple] = []
        self.profile_calls: list[tuple] = []

        def free_memory(device, local_world_size):
            self.free_calls.append((device, local_world_size))
            return free

        def profile_forward_peak(model, num_tokens, num_logit_rows, block_size, dtype, device):
            self.profile_calls.append((num_tokens, num_logit_rows, block_size, dtype, device))
            return peak

        monkeypatch.setattr(kv_cache, "free_memory", free_memory)
        monkeypatch.setattr(kv_cache, "profile_forward_peak", profile_forward_peak)


@pytest.mark.parametrize(("free", "peak", "utilization", "max_useful"), [
    (8 * GIB, 300 * 2**20, 0.9, 10**9),
    (8 * GIB, 300 * 2**20, 0.5, 10**9),
    (8 * GIB, 300 * 2**20, 0.9, 1234),         # capped
    (2**20, 3 * 2**20, 0.9, 10**9),            # the activations alone exceed the budget
    (100 * 2**20 + 12345, 7 * 2**20 + 1, 1.0, 10**9),
])
def test_profiled_size_is_utilization_times_free_minus_the_peak(model, monkeypatch, free, peak,
                                                                 utilization, max_useful) -> None:
    pinned = Pinned(monkeypatch, free, peak)
    config = EngineConfig(gpu_memory_utilization=utilization, max_num_batched_tokens=96,
                          max_num_seqs=40, block_size=8)
    sizing = size_kv_cache(config, model, torch.float32, CUDA, max_useful_blocks=max_useful,
                           local_world_size=3)
    block_bytes = per_block(model, 8)
    usable = int(utilization * free)
    wanted = max(0, usable - peak) // block_bytes
    assert sizing.how == "profiled"
    assert sizing.num_blocks == min(wanted, max_useful)
    assert sizing.capped_at == (max_useful if wanted > max_useful else 0)
    assert (sizing.free_bytes, sizing.usable_bytes, sizing.profile_peak_bytes) == (
        free, usable, peak)
    assert sizing.bytes_per_block == block_bytes
    assert sizing.kv_cache_bytes + peak <= max(usable, peak)
    # The profile covers a full token budget, with logits for up to max_num_seqs rows.
    assert pinned.profile_calls == [(96, 40, 8, torch.float32, CUDA)]
    assert pinned.free_calls == [(CUDA, 3)]


def test_profile_logit_rows_are_capped_by_the_token_budget(model, monkeypatch) -> None:
    pinned = Pinned(monkeypatch, 8 * GIB, 0)
    size_kv_cache(EngineConfig(max_num_batched_tokens=32, max_num_seqs=64), model,
                  torch.float32, CUDA, max_useful_blocks=100)
    assert pinned.profile_calls[0][:2] == (32, 32)


def test_cpu_free_memory_is_a_share_of_available_ram(monkeypatch) -> None:
    class Memory:
        available = 12 * GIB + 3

    monkeypatch.setattr(kv_cache.psutil, "virtual_memory", lambda: Memory)
    assert kv_cache.free_memory(CPU, 1) == 12 * GIB + 3
    assert kv_cache.free_memory(CPU, 4) == (12 * GIB + 3) // 4
    assert kv_cache.free_memory(CPU, 0) == 12 * GIB + 3


def test_profile_forward_peak_measures_the_activations(model) -> None:
    num_tokens = 2048
    peak = kv_cache.profile_forward_peak(model, num_tokens, 64, 16, torch.float32, CPU)
    hidden_state = num_tokens * model.config.hidden_size * 4
    assert peak >= hidden_state, f"peak {peak} B is less than one hidden state ({hidden_state} B)"
    assert peak < GIB, f"peak {peak} B is implausible for a model with 64 hidden units"
    # The pass leaves the model usable and unchanged.
    before = [p.clone() for p in model.parameters()]
    kv_cache.profile_forward_peak(model, 16, 4, 16, torch.float32, CPU)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.parametrize(("free", "workers", "expected"), [
    (64 * GIB, 1, 2 * GIB),                 # a big machine: the 2 GiB bound
    (64 * GIB, 4, 2 * GIB),
    (6 * GIB, 1, 6 * GIB // 4),             # a small one: a quarter of the available RAM
    (16 * GIB, 4, 16 * GIB // 4 // 4),      # ... shared by the node's workers
])
def test_cpu_default_is_2gib_or_a_quarter_of_the_available_ram(model, monkeypatch, free, workers,
                                                               expected) -> None:
    """Not 0.9 x the free RAM: a CPU server would otherwise claim most of a shared machine."""
    class Memory:
        available = free

    monkeypatch.setattr(kv_cache.psutil, "virtual_memory", lambda: Memory)
    monkeypatch.setattr(kv_cache, "profile_forward_peak", None)      # CPU sizing never profiles
    sizing = size_kv_cache(EngineConfig(), model, torch.float32, CPU, max_useful_blocks=10**9,
                           local_world_size=workers)
    assert sizing.how == "cpu_default"
    assert sizing.num_blocks == expected // per_block(model)
    line = sizing.describe(16, 0.9, max_model_len=2048)
    assert "CPU default" in line and "--kv-cache-memory" in line, line
    tokens = sizing.num_blocks * 16
    assert f"holds {tokens} tokens, {tokens // 2048} requests of max_model_len 2048" in line


def test_cpu_default_runs_for_real(model) -> None:
    """No pinned numbers: this machine's RAM, capped at what max_useful_blocks can use."""
    sizing = size_kv_cache(EngineConfig(), model, torch.float32, CPU, max_useful_blocks=50)
    assert sizing.how == "cpu_default" and sizing.free_bytes > 0
    assert 0 < sizing.num_blocks <= 50


def test_describe_profiled() -> None:
    sizing = CacheSizing("profiled", weights_bytes=GIB // 2, bytes_per_block=720 * 1024,
                         num_blocks=1000, profile_peak_bytes=GIB // 4, free_bytes=20 * GIB,
                         usable_bytes=18 * GIB)
    line = sizing.describe(16, 0.9)
    for part in ("weights 0.50 GiB", "profile-run peak 0.25 GiB", "free 20.00 GiB x 0.9",
                 "usable 18.00 GiB", "KV cache 0.69 GiB", "1000 blocks of 16 tokens",
                 "720.0 KiB each"):
        assert part in line, f"{part!r} missing from: {line}"
    assert "capped" not in line


def test_describe_explicit_and_capped() -> None:
    by_blocks = CacheSizing("num_kv_blocks", GIB, 1024, 64).describe(16, 0.9)
    assert "weights 1.00 GiB" in by_blocks and "--num-kv-blocks" in by_blocks
    assert "64 blocks of 16 tokens" in by_blocks and "profile-run" not in by_blocks
    by_memory = CacheSizing("kv_cache_memory", GIB, 2048, 512, capped_at=512).describe(8, 0.9)
    assert "--kv-cache-memory" in by_memory and "512 blocks of 8 tokens" in by_memory
    assert "2.0 KiB each" in by_memory
    assert "capped" in by_memory


# ---------------------------------------------------------------------------- build_runner

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
              "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-5, "rope_theta": 1000.0, "hidden_act": "silu",
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4        # block_size 16, float32
CPU_CONTEXT = DistributedContext(rank=0, local_rank=0, world_size=1, device=CPU, backend="gloo")


@pytest.fixture
def tiny_model_name(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return f"dummy:{tmp_path / 'config.json'}"


def test_build_runner_sizes_the_swap_space_in_blocks(tiny_model_name) -> None:
    swap_bytes = 100 * TINY_BLOCK_BYTES + 1               # a hair more than 100 blocks
    config = EngineConfig(model=tiny_model_name, dtype="float32", num_kv_blocks=10,
                          kv_swap_memory=swap_bytes)
    runner, ready = build_runner(config, CPU_CONTEXT)
    assert ready.num_kv_blocks == 10
    assert ready.num_cpu_kv_blocks == runner.swap_space.num_blocks == 100
    assert runner.kv_caches[0][0].shape[0] == (10 + 1) * 16      # + the scratch block
    runner, ready = build_runner(EngineConfig(model=tiny_model_name, dtype="float32",
                                              num_kv_blocks=10), CPU_CONTEXT)
    assert ready.num_cpu_kv_blocks == runner.swap_space.num_blocks == 0


def test_build_runner_refuses_a_cache_of_no_blocks(tiny_model_name, monkeypatch) -> None:
    Pinned(monkeypatch, free=TINY_BLOCK_BYTES, peak=TINY_BLOCK_BYTES)
    with pytest.raises(RuntimeError, match="no memory left for the KV cache"):
        build_runner(EngineConfig(model=tiny_model_name, dtype="float32"), CPU_CONTEXT)


def test_cpu_swap_space_comes_out_of_the_same_ram_as_the_kv_cache(tiny_model_name,
                                                                   monkeypatch) -> None:
    """On CPU the KV cache and the swap space are the same RAM. The default pool must leave
    room for the swap space (or the engine refuse to start): otherwise filling the pool and
    then swapping out takes more RAM than there is available (here: half the available RAM as
    swap space)."""
    free = 4 * 2**20          # 460 blocks usable: below the 1024 that max_num_seqs can use
    Pinned(monkeypatch, free=free, peak=0)
    config = EngineConfig(model=tiny_model_name, dtype="float32", kv_swap_memory="2MiB",
                          gpu_memory_utilization=0.9)
    try:
        _, ready = build_runner(config, CPU_CONTEXT)
    except (RuntimeError, ValueError) as error:
        assert "swap" in str(error), error
        return
    total = (ready.num_kv_blocks + ready.num_cpu_kv_blocks) * TINY_BLOCK_BYTES
    assert total <= free, (
        f"KV cache {ready.num_kv_blocks} blocks + swap space {ready.num_cpu_kv_blocks} blocks "
        f"= {total / 2**20:.2f} MiB of RAM, more than the {free / 2**20:.2f} MiB available")


def windowed(model, layers: tuple[int, ...] = (0,)):
    """`model`'s config with a window of 64 tokens on those layers (by default the first only,
    a mix of full and windowed layers as Gemma's)."""
    return dataclasses.replace(model.config, sliding_window=64, sliding_layers=layers)


def test_windowed_layers_get_a_pool_of_what_running_requests_can_hold(model) -> None:
    """A model mixing full and windowed layers: the windowed layers' pool holds max_num_seqs
    windows and a token budget's blocks (64-token window, blocks of 16: 4 + 2 each, and 4 for
    the budget); the memory it leaves goes to the full layers' pool. A model with a window on
    every layer, or none, has one pool."""
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=16)
    mixed = windowed(model)
    assert kv_cache.sliding_pool_blocks(config, mixed, 1000) == 4 * (4 + 2) + 4
    assert kv_cache.sliding_pool_blocks(config, mixed, 10) == 10
    assert kv_cache.sliding_pool_blocks(config, model.config, 1000) == 0
    assert kv_cache.sliding_pool_blocks(config, windowed(model, (0, 1)), 1000) == 0
    sizing = CacheSizing("kv_cache_memory", 0, per_block(model), 1000)
    # 2 layers of 1000 blocks: the windowed layer's 28 leave 1972 to the full layer.
    assert kv_cache.split_for_windows(mixed, sizing, 28, max_useful_blocks=5000) == 1972
    assert kv_cache.split_for_windows(mixed, sizing, 28, max_useful_blocks=1500) == 1500
    given = CacheSizing("num_kv_blocks", 0, per_block(model), 1000)
    assert kv_cache.split_for_windows(mixed, given, 28, max_useful_blocks=5000) == 1000
    caches = kv_cache.allocate_kv_cache(mixed, 9, 16, torch.float32, CPU, num_sliding_blocks=3)
    assert [k.shape[0] for k, _ in caches] == [3 * 16, 9 * 16]


def test_a_draft_model_must_attend_as_the_target_does(model) -> None:
    """--speculative draft: the draft model reads the target's block tables, so each of its
    layers attends with the window (or none) of one of the target's KV groups: a full-attention
    draft, a draft windowed as the target, or mixing as it does, serves a target that mixes
    full and windowed layers; otherwise an error says what to use."""
    from types import SimpleNamespace

    from spmd_runtime.worker_proc.step_inputs import KVGroup
    from spmd_runtime.worker_proc.worker import check_draft_windows

    config = EngineConfig(model="target", draft_model="draft", speculative="draft")

    def runner(*windows):
        return SimpleNamespace(inputs=SimpleNamespace(
            groups=[KVGroup(None, 0, window) for window in windows]))

    check_draft_windows(config, model.config, runner(None))
    check_draft_windows(config, windowed(model, (0, 1)), runner(64))
    for draft in (model.config, windowed(model), windowed(model, (0, 1))):
        check_draft_windows(config, draft, runner(None, 64))
    other_window = dataclasses.replace(windowed(model), sliding_window=32)
    with pytest.raises(ValueError, match="layers with a window of 64: .*use --speculative ngram"):
        check_draft_windows(config, other_window, runner(None, 64))
    with pytest.raises(ValueError, match="window of 64 on every layer"):
        check_draft_windows(config, model.config, runner(64))
    with pytest.raises(ValueError, match="has no sliding window"):
        check_draft_windows(config, windowed(model), runner(None))
