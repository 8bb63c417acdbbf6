"""The CPU swap space of one worker: KV blocks of preempted requests, copied out and back."""
from __future__ import annotations

import torch


class SwapSpace:
    """A CPU copy of the paged KV cache's layout with its own block ids (pinned on CUDA).

    Copies run on the current stream, before the forward pass of the same step, so a device
    block that is swapped out can be handed to another request in that very step.

    A model mixing full and sliding-window layers keeps its windowed layers' KV in a pool of
    its own (`sliding_layers`): a CPU block holds one block of the request's context in every
    layer, copied from the full layers' pool by one list of pairs and from the windowed
    layers' pool by another.
    """

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int,
                 block_size: int, sliding_layers: tuple[int, ...] = ()) -> None:
        self.num_blocks = num_blocks
        self.device = kv_caches[0][0].device if kv_caches else torch.device("cpu")
        # Every K and V tensor of every layer, as rows of one block each, by pool.
        views = [(layer in sliding_layers,
                  tensor.view(-1, block_size * tensor.shape[1] * tensor.shape[2]))
                 for layer, cache in enumerate(kv_caches) for tensor in cache]
        pin = self.device.type == "cuda"
        # The swap space: every layer's K and V, in layer order.
        self.cpu_views = [torch.empty((num_blocks, view.shape[1]), dtype=view.dtype,
                                      pin_memory=pin) for _, view in (views if num_blocks else [])]
        self.pools = {sliding: ([v for (s, v) in views if s == sliding],
                                [c for (s, _), c in zip(views, self.cpu_views, strict=False)
                                 if s == sliding])
                      for sliding in (False, True)}

    def swap_out(self, pairs: list[tuple[int, int]],
                 sliding_pairs: list[tuple[int, int]] = ()) -> None:
        """Copy (device block, CPU block) pairs from the device cache to the swap space: the
        full layers' (every layer's, with one pool), and the windowed layers' from theirs."""
        self._copy(pairs, to_cpu=True)
        self._copy(sliding_pairs, to_cpu=True, sliding=True)

    def swap_in(self, pairs: list[tuple[int, int]],
                sliding_pairs: list[tuple[int, int]] = ()) -> None:
        """Copy (device block, CPU block) pairs from the swap space back to the device cache."""
        self._copy(pairs, to_cpu=False)
        self._copy(sliding_pairs, to_cpu=False, sliding=True)

    def _copy(self, pairs: list[tuple[int, int]], to_cpu: bool, sliding: bool = False) -> None:
        if not pairs:
            return
        device_views, cpu_views = self.pools[sliding]
        if self.device.type == "cpu":
            device_ids = torch.tensor([d for d, _ in pairs])
            cpu_ids = torch.tensor([c for _, c in pairs])
            for device_view, cpu_view in zip(device_views, cpu_views, strict=True):
                if to_cpu:
                    cpu_view.index_copy_(0, cpu_ids, device_view.index_select(0, device_ids))
                else:
                    device_view.index_copy_(0, device_ids, cpu_view.index_select(0, cpu_ids))
            return
        # Pinned host memory: one asynchronous copy per block, queued in stream order.
        for device_view, cpu_view in zip(device_views, cpu_views, strict=True):
            for device_block, cpu_block in pairs:
                if to_cpu:
                    cpu_view[cpu_block].copy_(device_view[device_block], non_blocking=True)
                else:
                    device_view[device_block].copy_(cpu_view[cpu_block], non_blocking=True)
