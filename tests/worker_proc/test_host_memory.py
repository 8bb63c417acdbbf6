"""worker_proc/host_memory.py: the CPU KV cache on transparent huge pages (dtype-free: these
tests are about memory, every assertion holds for any dtype; float32 and bfloat16 both run)."""
import gc
import logging
from pathlib import Path

import pytest
import torch
from spmd_runtime.protocol.model_config import ModelConfig
from spmd_runtime.worker_proc import host_memory, kv_cache

SHAPES = [(4096, 3, 64), (4096, 3, 64), (1000, 3, 64), (7, 5, 3)]
THP_HERE = host_memory.huge_pages_mode() in ("always", "madvise")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("huge_pages", [False, True])
def test_zeroed_gives_separate_zeroed_tensors(dtype, huge_pages):
    tensors = host_memory.zeroed(SHAPES, dtype, huge_pages)
    assert [tuple(t.shape) for t in tensors] == SHAPES
    for t in tensors:
        assert t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
        assert not t.any()
    tensors[1].fill_(3)
    tensors[3][-1, -1, -1] = 5
    assert not tensors[0].any() and not tensors[2].any()
    assert int(tensors[1].sum()) == 3 * tensors[1].numel()
    assert int(tensors[3].sum()) == 5


@pytest.mark.skipif(not THP_HERE, reason="this kernel gives no transparent huge pages "
                    "(zeroed then falls back to torch.zeros: test_mode_never_falls_back)")
def test_huge_pages_are_given_and_the_pool_starts_on_a_boundary():
    fallbacks = thp_fallbacks()
    tensors = host_memory.zeroed([(16 * 2**20 // 4,)], torch.float32, True)
    assert tensors[0].data_ptr() % host_memory.HUGE_PAGE == 0
    if thp_fallbacks() > fallbacks:
        pytest.skip("the kernel fell back to 4 KiB pages just now (thp_fault_fallback rose in "
                    "/proc/vmstat): no free 2 MiB page to give")
    assert host_memory.huge_page_bytes(tensors) >= 8 * 2**20
    plain = host_memory.zeroed([(16 * 2**20 // 4,)], torch.float32, False)
    assert host_memory.huge_page_bytes(plain) < 8 * 2**20


def thp_fallbacks() -> int:
    """How often this kernel has declined a huge page at a fault (0 where it does not say)."""
    try:
        text = Path("/proc/vmstat").read_text()
    except OSError:
        return 0
    counts = dict(line.split() for line in text.splitlines() if line.count(" ") == 1)
    return int(counts.get("thp_fault_fallback", 0))


def test_views_are_line_aligned_and_keep_the_mapping_alive():
    tensors = host_memory.zeroed(SHAPES, torch.bfloat16, True)
    assert all(t.data_ptr() % 64 == 0 for t in tensors)
    last = tensors[-1]
    del tensors
    gc.collect()
    last.fill_(2)
    assert int(last.sum()) == 2 * last.numel()


def test_mode_is_read_from_the_kernel_setting(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert host_memory.huge_pages_mode(setting) == "madvise"
    setting.write_text("[always] madvise never\n")
    assert host_memory.huge_pages_mode(setting) == "always"
    assert host_memory.huge_pages_mode(tmp_path / "missing") == "unsupported"


def test_mode_never_falls_back_to_torch_zeros(monkeypatch):
    monkeypatch.setattr(host_memory, "huge_pages_mode", lambda *_: "never")
    made = []
    real = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: made.append(a) or real(*a, **k))
    tensors = host_memory.zeroed(SHAPES, torch.float32, True)
    assert len(made) == len(SHAPES) and not any(t.any() for t in tensors)


def test_huge_page_bytes_counts_the_mappings_holding_the_tensors(tmp_path):
    tensor = torch.zeros(16)
    start = tensor.data_ptr()
    smaps = tmp_path / "smaps"
    smaps.write_text(
        f"{start - 4096:x}-{start + 8192:x} rw-p 00000000 00:00 0\n"
        "Size:               12 kB\nAnonHugePages:      2048 kB\nVmFlags: rd wr\n"
        f"{start + 8192:x}-{start + 16384:x} rw-p 00000000 00:00 0\n"
        "AnonHugePages:      4096 kB\n")
    assert host_memory.huge_page_bytes([tensor], smaps) == 2048 * 1024
    assert host_memory.huge_page_bytes([tensor], tmp_path / "missing") == 0


def tiny_config() -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))


@pytest.mark.parametrize("huge_pages", [False, True])
def test_allocate_kv_cache_pairs_each_layer(huge_pages):
    caches = kv_cache.allocate_kv_cache(tiny_config(), 5, 16, torch.bfloat16,
                                        torch.device("cpu"), huge_pages=huge_pages)
    assert len(caches) == 3
    for keys, values in caches:
        assert keys.shape == values.shape == (80, 2, 8) and keys.dtype == torch.bfloat16
        assert not keys.any() and not values.any()
    caches[1][0].fill_(1)
    assert not caches[0][1].any() and not caches[1][1].any() and not caches[2][0].any()


def test_the_log_says_which_pages_and_why(caplog, monkeypatch):
    caches = kv_cache.allocate_kv_cache(tiny_config(), 5, 16, torch.float32,
                                        torch.device("cpu"), huge_pages=True)
    with caplog.at_level(logging.INFO, logger="spmd.worker"):
        kv_cache.log_huge_pages(caches, False, 0)
        monkeypatch.setattr(host_memory, "huge_pages_mode", lambda *_: "never")
        kv_cache.log_huge_pages(caches, True, 1)
        monkeypatch.setattr(host_memory, "huge_pages_mode", lambda *_: "madvise")
        kv_cache.log_huge_pages(caches, True, 2)
    lines = [r.getMessage() for r in caplog.records]
    assert "rank 0 KV cache on 4 KiB pages (--no-kv-cache-huge-pages)" in lines
    assert any(line.startswith("rank 1 KV cache on 4 KiB pages: transparent huge pages are "
                               "never here") for line in lines)
    assert any(line.startswith("rank 2 KV cache on transparent huge pages: ") and " of " in line
               for line in lines)


@pytest.mark.parametrize("huge_pages", [False, True])
def test_every_page_is_resident_from_the_start(huge_pages):
    """The pool is touched when made (resident memory flat from the start, as torch.zeros)."""
    import psutil

    before = psutil.Process().memory_info().rss
    tensors = host_memory.zeroed([(64 * 2**20 // 4,)], torch.float32, huge_pages)
    assert psutil.Process().memory_info().rss - before >= 48 * 2**20
    del tensors
