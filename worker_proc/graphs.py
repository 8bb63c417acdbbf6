"""Captured graphs of bucket shapes: one forward pass per bucket recorded ahead, then replayed.

A graph replays the kernels it recorded on the tensors it recorded them with, so each bucket
keeps persistent (static) inputs: the token ids, positions, KV slots and attention tensors of a
batch of exactly that shape. Running a batch copies its prepared tensors into them (non-blocking,
from pinned host memory on CUDA) and replays; the output is the graph's own hidden-state buffer,
valid until the next replay. The graphs of one capturer draw on one shared memory pool, captured
largest first, so the smaller ones reuse the larger ones' activations.

On CUDA the recording is a torch.cuda.CUDAGraph. Elsewhere `GraphCapturer(emulate=True)`
"replays" by calling the forward pass on the static tensors: the same staging code path, run
eagerly, which is how CPU tests check it.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from spmd_runtime.runtime.layers.attention import AttentionBatch


@dataclass
class StaticInputs:
    """The tensors a bucket's graph reads; a batch of the same shape is copied into them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, *self.batch.tensors()]

    def to(self, device: torch.device) -> StaticInputs:
        """The same inputs on `device`, copied without blocking the host."""
        return StaticInputs(self.input_ids.to(device, non_blocking=True),
                            self.positions.to(device, non_blocking=True), self.batch.to(device))


class BucketGraph:
    def __init__(self, inputs: StaticInputs, replay: Callable[[], torch.Tensor]) -> None:
        self.inputs = inputs
        self.replay = replay
        # On CUDA, persistent page-locked host mirrors of the static inputs: a batch is
        # written into them, then copied to the device without blocking the host. Two sets,
        # used in turn: the worker launches a step while the one before it still runs, and
        # that one's copies may still be queued behind the step before it, reading its set.
        # The set used two launches ago is free: its step has been sampled (synchronised).
        self.staging = [[torch.empty(t.shape, dtype=t.dtype).pin_memory()
                         if t.device.type == "cuda" else None for t in inputs.tensors()]
                        for _ in range(2)]
        self.turn = 0

    def load(self, prepared: StaticInputs) -> None:
        """Copy a batch prepared for this bucket into the graph's static inputs."""
        destinations, sources = self.inputs.tensors(), prepared.tensors()
        if [t.shape for t in destinations] != [t.shape for t in sources]:
            raise RuntimeError(
                f"batch shapes {[tuple(t.shape) for t in sources]} differ from the captured "
                f"{[tuple(t.shape) for t in destinations]}")
        staging_set, self.turn = self.staging[self.turn], 1 - self.turn
        for destination, source, staging in zip(destinations, sources, staging_set, strict=True):
            if staging is not None and source.device.type == "cpu":
                source = staging.copy_(source)
            destination.copy_(source, non_blocking=True)


class GraphCapturer:
    """Records forward passes as CUDA graphs sharing one memory pool (or emulates that).

    The caching allocator keeps a pool for as long as a graph captured into it lives: it counts
    them, and once the last is destroyed it takes no more captures into that pool id (they fail
    with `it->second->use_count > 0 INTERNAL ASSERT FAILED`) and frees the pool when its memory
    is released. So the capturer keeps the pool while one of its graphs is alive, and starts a
    new one for a capture that follows the release of them all (a bench that captures one batch
    size's graphs, drops them and captures the next one's)."""

    def __init__(self, device: torch.device, emulate: bool = False) -> None:
        if device.type != "cuda" and not emulate:
            raise ValueError(f"graphs are captured on CUDA only, not on {device}")
        self.device = device
        self.emulate = emulate
        self.pool = None
        # The graphs captured into self.pool that are still alive.
        self.pool_graphs: weakref.WeakSet = weakref.WeakSet()

    def capture(self, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Run `forward` once to warm it up, record it, and return its replay."""
        if self.emulate:
            forward()
            return forward
        # Warm up on a side stream, as capture requires (lazy initialisations, autotuning).
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if not self.pool_graphs:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        self.pool_graphs.add(graph)
        torch.cuda.synchronize(self.device)

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay
