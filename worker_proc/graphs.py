"""Captured graphs of bucket shapes: one forward pass per bucket recorded ahead, then replayed.

A graph replays the kernels it recorded on the tensors it recorded them with, so each bucket
keeps persistent (static) inputs: the token ids, positions, KV slots and attention tensors of a
batch of exactly that shape. Running a batch copies its prepared tensors into them (non-blocking,
from pinned host memory on CUDA) and replays; the output is the graph's own hidden-state buffer,
valid until the next replay. Every graph draws on one shared memory pool, captured largest
first, so the smaller ones reuse the larger ones' activations.

On CUDA the recording is a torch.cuda.CUDAGraph. Elsewhere `GraphCapturer(emulate=True)`
"replays" by calling the forward pass on the static tensors: the same staging code path, run
eagerly, which is how CPU tests check it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.layers.attention import AttentionBatch


@dataclass
class StaticInputs:
    """The tensors a bucket's graph reads; a batch of the same shape is copied into them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch

    def tensors(self) -> list[torch.Tensor]:
        return [self.input_ids, self.positions, *self.batch.tensors()]


class BucketGraph:
    def __init__(self, inputs: StaticInputs, replay: Callable[[], torch.Tensor]) -> None:
        self.inputs = inputs
        self.replay = replay
        # On CUDA, persistent page-locked host mirrors of the static inputs: a batch is
        # written into them, then copied to the device without blocking the host. The step
        # before has been sampled (synchronised) by then, so no copy is still reading them.
        self.staging = [torch.empty(t.shape, dtype=t.dtype).pin_memory()
                        if t.device.type == "cuda" else None for t in inputs.tensors()]

    def run(self, prepared: StaticInputs) -> torch.Tensor:
        """Hidden states of a batch prepared for this bucket (the graph's output buffer)."""
        destinations, sources = self.inputs.tensors(), prepared.tensors()
        if [t.shape for t in destinations] != [t.shape for t in sources]:
            raise RuntimeError(
                f"batch shapes {[tuple(t.shape) for t in sources]} differ from the captured "
                f"{[tuple(t.shape) for t in destinations]}")
        for destination, source, staging in zip(destinations, sources, self.staging, strict=True):
            if staging is not None and source.device.type == "cpu":
                source = staging.copy_(source)
            destination.copy_(source, non_blocking=True)
        return self.replay()


class GraphCapturer:
    """Records forward passes as CUDA graphs sharing one memory pool (or emulates that)."""

    def __init__(self, device: torch.device, emulate: bool = False) -> None:
        if device.type != "cuda" and not emulate:
            raise ValueError(f"graphs are captured on CUDA only, not on {device}")
        self.device = device
        self.emulate = emulate
        self.pool = None if emulate else torch.cuda.graph_pool_handle()

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
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        torch.cuda.synchronize(self.device)

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

