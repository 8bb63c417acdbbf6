"""The CPU swap space of one worker: KV blocks of preempted requests, copied out and back."""
from __future__ import annotations

import torch


class SwapSpace:
    """A CPU copy of the paged KV cache's layout with its own block ids (pinned on CUDA).

    Copies run on the current stream, before the forward pass of the same step, so a device
    block that is swapped out can be handed to another request in that very step.
    """

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int,
                 block_size: int) -> None:
        self.num_blocks = num_blocks
        self.device = kv_caches[0][0].device if kv_caches else torch.device("cpu")
        # Every K and V tensor of every layer, as rows of one block each.
        self.device_views = [tensor.view(-1, block_size * tensor.shape[1] * tensor.shape[2])
                             for cache in kv_caches for tensor in cache]
        pin = self.device.type == "cuda"
        self.cpu_views = [torch.empty((num_blocks, view.shape[1]), dtype=view.dtype,
                                      pin_memory=pin)
                          for view in (self.device_views if num_blocks else [])]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block, CPU block) pairs from the device cache to the swap space."""
        self._copy(pairs, to_cpu=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (device block, CPU block) pairs from the swap space back to the device cache."""
        self._copy(pairs, to_cpu=False)

    def _copy(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        if not pairs:
            return
        if self.device.type == "cpu":
            device_ids = torch.tensor([d for d, _ in pairs])
            cpu_ids = torch.tensor([c for _, c in pairs])
            for device_view, cpu_view in zip(self.device_views, self.cpu_views, strict=True):
                if to_cpu:
                    cpu_view.index_copy_(0, cpu_ids, device_view.index_select(0, device_ids))
                else:
                    device_view.index_copy_(0, device_ids, cpu_view.index_select(0, cpu_ids))
            return
        # Pinned host memory: one asynchronous copy per block, queued in stream order.
        for device_view, cpu_view in zip(self.device_views, self.cpu_views, strict=True):
            for device_block, cpu_block in pairs:
                if to_cpu:
                    cpu_view[cpu_block].copy_(device_view[device_block], non_blocking=True)
                else:
                    device_view[device_block].copy_(cpu_view[cpu_block], non_blocking=True)
