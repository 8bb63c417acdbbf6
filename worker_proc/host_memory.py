"""Zeroed host tensors on transparent huge pages, for a CPU worker's KV cache.

A decode step reads each running request's blocks of every layer, and the blocks lie anywhere
in the pool. On 4 KiB pages that walk misses the TLB block after block: SmolLM2's decode
attention at 64 requests x 100 tokens took 205 us a layer with its cache cold on 4 KiB pages,
146-163 us on 2 MiB ones, and W2 with --quantization int8 ran 8-11% faster
(docs/BENCHMARKS.md). Linux gives huge pages to anonymous private memory that asks for them
(madvise(MADV_HUGEPAGE)) where /sys/kernel/mm/transparent_hugepage/enabled is `madvise` or
`always`; torch's own allocations do not ask, and by the time a tensor is zeroed its pages
are 4 KiB ones. So the pool here gets a mapping of its own, asks before its pages are
touched, and is then zeroed (every page resident from the start, as torch.zeros would).
"""
from __future__ import annotations

import ctypes
import math
import mmap
import re
from pathlib import Path

import torch

HUGE_PAGE = 2 * 2**20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_mode(setting: Path = THP_SETTING) -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise" or "never"), or
    "unsupported" where there is no such setting or mmap cannot ask for them."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "unsupported"
    try:
        chosen = re.search(r"\[(\w+)\]", setting.read_text())
    except OSError:
        return "unsupported"
    return chosen.group(1) if chosen else "unsupported"


def zeroed(shapes: list[tuple[int, ...]], dtype: torch.dtype,
           huge_pages: bool) -> list[torch.Tensor]:
    """Zeroed CPU tensors of these shapes. With huge_pages, views of one mapping of their own
    that asked for transparent huge pages before any page was touched: it starts on a 2 MiB
    boundary, each tensor on a 64-byte line after the one before, and the tensors keep it
    alive. Where the kernel cannot give huge pages, torch.zeros each."""
    if not huge_pages or huge_pages_mode() not in ("always", "madvise"):
        return [torch.zeros(shape, dtype=dtype) for shape in shapes]
    element = torch.empty((), dtype=dtype).element_size()
    offsets, nbytes = [], 0
    for shape in shapes:
        offsets.append(nbytes)
        nbytes += -(-math.prod(shape) * element // 64) * 64
    if nbytes == 0:
        return [torch.zeros(shape, dtype=dtype) for shape in shapes]
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    first = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % HUGE_PAGE
    arena = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=first).zero_()
    return [arena[at:at + math.prod(shape) * element].view(dtype).view(shape)
            for at, shape in zip(offsets, shapes, strict=True)]


def huge_page_bytes(tensors: list[torch.Tensor], smaps: Path = Path("/proc/self/smaps")) -> int:
    """How many bytes of the mappings holding these tensors' first elements are huge pages
    (AnonHugePages in /proc/self/smaps); 0 where that cannot be read."""
    starts = {t.data_ptr() for t in tensors if t.numel()}
    total, inside = 0, False
    try:
        text = smaps.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = any(low <= s < high for s in starts)
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total
